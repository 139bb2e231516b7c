#!/usr/bin/env bash
# Issue 21 on the H200, one device call of ~7 minutes (caps 530 s): the megakernel's masked sampling and dormant rules (ABI 9) and
# the megakernel GPU tests the row and Params layouts touch, then `bench engine` through the megakernel, free and held
# to a schema (a constrained row within 5% of a free one).
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#         --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#         -d .whl llguidance==1.9.1
#     run(command="bash lab/device_grammar.sh", carry=[".whl"], timeout_s=600)
set -u
OUT=${OUT:-/tmp/nc-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/nc-grammar \
  .whl/llguidance-*.whl
export PYTHONPATH=.:/tmp/nc-grammar NORTHCODE_HOME=/tmp/nch NORTHCODE_REQUIRE_GPU=1 PYTHONUNBUFFERED=1
source lab/device_phase.sh
phase masked 180 python3 -m pytest -q -rf tests/gpu/test_megakernel_masked_sampling.py \
  tests/gpu/test_megakernel_sampling.py tests/gpu/test_megakernel_backend_gpu.py tests/gpu/test_megakernel_backend.py \
  tests/gpu/test_megakernel_kv_writes.py tests/gpu/test_engine_recovery_gpu.py
phase bench_engine 120 python3 -m northcode.cli bench engine --preset north-mini-code --backend megakernel \
  --batch-sizes 1,8 --schema '{"type": "array", "items": {"type": "integer"}, "minItems": 64}'
phase kernel 230 python3 -m pytest -q -rf tests/gpu/test_megakernel_tasks.py tests/gpu/test_megakernel_decode.py
for name in masked kernel; do
  echo "==== $name ===="; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/$name.log" | cut -c1-300 | tail -12
done
echo "==== bench engine ===="; tail -20 "$OUT/bench_engine.log" | cut -c1-200
echo "==== phases ===="; cat "$OUT/phases.txt"
(cd "$OUT" && tar czf logs.tgz ./*.log phases.txt && rm -f ./*.log)
