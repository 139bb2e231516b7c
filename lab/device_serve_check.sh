#!/usr/bin/env bash
# A new user's path on the GPU, in one device call of ~3 minutes: `northcode doctor`, `northcode serve` (backend
# auto, which must pick the megakernel) answering the official openai client, and `northcode bench engine` on
# North Mini Code's geometry through the megakernel backend.
#     .venv/bin/python -m pip download -d .whl --python-version 3.12 --platform manylinux2014_x86_64 \
#         --only-binary=:all: starlette uvicorn httpx openai platformdirs prometheus_client jinja2
#     run(command="bash lab/device_serve_check.sh", carry=[".whl"], timeout_s=400)
# The device's Python has torch but not the server's packages: the wheels in .whl/ are unpacked to a folder that
# comes after the device's own site-packages on sys.path. Logs come back as $OUT/logs.tgz; a short table is last.
set -u
OUT=${OUT:-/tmp/nc-out}
mkdir -p "$OUT"
SITE=/tmp/nc-site
python3 - "$SITE" .whl/*.whl <<'PY'
import sys, zipfile
for wheel in sys.argv[2:]:
    zipfile.ZipFile(wheel).extractall(sys.argv[1])
PY
# after site-packages, so that the device's own torch, jinja2 and typing_extensions stay the ones imported
python3 -c "import site, sys; print(sys.argv[1], file=open(site.getsitepackages()[0] + '/nc-wheels.pth', 'w'))" \
  "$SITE" 2>/dev/null || export PYTHONPATH="$SITE"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} NORTHCODE_HOME=/tmp/nch PYTHONUNBUFFERED=1
source lab/device_phase.sh
phase doctor 60 python3 -m northcode.cli doctor
python3 -m northcode.cli serve --port 8123 > "$OUT/serve.log" 2>&1 &
SERVER=$!
for _ in $(seq 180); do curl -sf http://127.0.0.1:8123/health > /dev/null && break; sleep 1; done
phase client 120 python3 lab/serve_client_check.py http://127.0.0.1:8123/v1 --backend megakernel
kill $SERVER; wait $SERVER 2>/dev/null
phase bench_engine 240 python3 -m northcode.cli bench engine --preset north-mini-code --backend megakernel \
  --batch-sizes 1,8
echo "==== doctor ===="; cut -c1-160 "$OUT/doctor.log" | head -30
echo "==== serve (auto) ===="; grep -iE "backend|megakernel|ready|error" "$OUT/serve.log" | cut -c1-200 | head -12
echo "==== openai client ===="; cat "$OUT/client.log"
echo "==== bench engine (North Mini Code geometry, random weights) ===="; tail -25 "$OUT/bench_engine.log" | cut -c1-200
echo "==== phases ===="; cat "$OUT/phases.txt"
(cd "$OUT" && tar czf logs.tgz *.log phases.txt && rm -f *.log)
