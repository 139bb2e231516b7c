#!/usr/bin/env bash
# Issue 24 on the H200, one device call of about 9.5 minutes: tests/gpu/test_engine_recovery_gpu.py first, then
# `northcode serve --backend megakernel` on the demo checkpoint with the DEFAULT --gpu-memory-fraction, driven by
# tests/soak_server.py: the extreme-value requests (each beside a greedy stream), a step failure injected with
# SIGUSR1 (serve_with_fault_switch: northcode has no fault hook), then 300 s of soak by 8 clients, all on one server.
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#         --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#         -d .whl starlette==1.10.0 uvicorn==0.54.0 platformdirs==4.14.9
#     run(command="bash lab/device_soak.sh", carry=[".whl"], timeout_s=600)
# The whole script ends within NC_SOAK_BUDGET_S (570 s): the soak is shortened to fit, and its table says how long it
# ran. A dry run on a CPU (NC_SOAK_DRY_RUN=1 leaves the Python installation alone; the GPU test then fails):
#     NC_SOAK_DRY_RUN=1 NC_SOAK_PYTHON=.venv/bin/python NC_SOAK_BACKEND=torch NC_SOAK_S=30 OUT=/tmp/soak-dry \
#         NC_SOAK_SERVER_ARGS="--server-arg=--device=cpu --server-arg=--num-pages=512 --server-arg=--max-model-len=1024" \
#         bash lab/device_soak.sh
# Logs come back as $OUT/logs.tgz; the soak's table is printed last.
set -u
OUT=${OUT:-/tmp/nc-out}
mkdir -p "$OUT"
PY=${NC_SOAK_PYTHON:-python3}
BACKEND=${NC_SOAK_BACKEND:-megakernel}
SOAK_S=${NC_SOAK_S:-300}
BUDGET_S=${NC_SOAK_BUDGET_S:-570}
SITE=/tmp/nc-site
"$PY" - "$SITE" .whl/*.whl <<'PY'
import sys, zipfile
for wheel in sys.argv[2:]:
    zipfile.ZipFile(wheel).extractall(sys.argv[1])
PY
# after site-packages, so that the device's own torch, jinja2 and typing_extensions stay the ones imported
if [ -z "${NC_SOAK_DRY_RUN:-}" ]; then
  "$PY" -c "import site, sys; print(sys.argv[1], file=open(site.getsitepackages()[0] + '/nc-wheels.pth', 'w'))" \
    "$SITE" 2>/dev/null || export PYTHONPATH="$SITE"
else
  export PYTHONPATH="$SITE"
fi
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} NORTHCODE_HOME=${NORTHCODE_HOME:-/tmp/nch} PYTHONUNBUFFERED=1
source lab/device_phase.sh
"$PY" -c "import torch, starlette, uvicorn, httpx; from importlib.metadata import version as v
print('cuda', torch.cuda.is_available(), *(f'{n} {v(n)}' for n in ('torch', 'starlette', 'uvicorn', 'anyio', 'h11', 'click')))" \
  2>&1 | tee "$OUT/versions.log"
phase gpu_recovery_test 240 env NORTHCODE_REQUIRE_GPU=1 "$PY" -m pytest -q -p no:cacheprovider \
  tests/gpu/test_engine_recovery_gpu.py
LEFT=$((BUDGET_S - SECONDS))
nvidia-smi --query-gpu=timestamp,memory.used,memory.total,utilization.gpu --format=csv -l 20 > "$OUT/gpu_samples.csv" 2>&1 &
SAMPLER=$!
# shellcheck disable=SC2086  # NC_SOAK_SERVER_ARGS is a list of options
phase soak $((LEFT + 15)) "$PY" -m tests.soak_server --backend "$BACKEND" --clients 8 --duration "$SOAK_S" \
  --budget-s "$LEFT" --extremes --inject-step-failure --server-log "$OUT/serve.log" \
  ${NC_SOAK_SERVER_ARGS:-}
kill "$SAMPLER" 2>/dev/null; wait "$SAMPLER" 2>/dev/null
echo "==== GPU recovery test ===="; tail -15 "$OUT/gpu_recovery_test.log" | cut -c1-200
echo "==== serve ===="; grep -E "backend:|ready at|injected step failure|restarted|Error|error:" "$OUT/serve.log" |
  cut -c1-200 | head -15
echo "==== GPU memory (MiB) ===="; head -2 "$OUT/gpu_samples.csv"; tail -1 "$OUT/gpu_samples.csv"
echo "==== phases ===="; cat "$OUT/phases.txt"
echo "==== soak ===="; grep -v "^soak: starting" "$OUT/soak.log" | tail -45 | cut -c1-2000
(cd "$OUT" && tar czf logs.tgz ./*.log ./*.csv phases.txt && rm -f ./*.log ./*.csv)
