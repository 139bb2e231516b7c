#!/usr/bin/env bash
# Issue 21 on the H200, one device call of ~4 minutes: the megakernel's masked sampling (ABI 7) and the megakernel
# GPU tests the row layout touches, then `bench engine` through the megakernel (issue 19's last GPU check).
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#         --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#         -d .whl llguidance==1.9.1
#     run(command="bash lab/device_grammar.sh", carry=[".whl"], timeout_s=500)
set -u
OUT=${OUT:-/tmp/nc-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/nc-grammar \
  .whl/llguidance-*.whl
export PYTHONPATH=.:/tmp/nc-grammar NORTHCODE_HOME=/tmp/nch NORTHCODE_REQUIRE_GPU=1 PYTHONUNBUFFERED=1
source lab/device_phase.sh
phase masked 300 python3 -m pytest -q -rf tests/gpu/test_megakernel_masked_sampling.py \
  tests/gpu/test_megakernel_sampling.py tests/gpu/test_megakernel_backend_gpu.py tests/gpu/test_megakernel_tasks.py \
  tests/gpu/test_megakernel_decode.py
phase bench_engine 150 python3 -m northcode.cli bench engine --preset north-mini-code --backend megakernel \
  --batch-sizes 1,8
echo "==== tests ===="; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/masked.log" | cut -c1-300 | tail -15
echo "==== bench engine ===="; tail -20 "$OUT/bench_engine.log" | cut -c1-200
echo "==== phases ===="; cat "$OUT/phases.txt"
(cd "$OUT" && tar czf logs.tgz ./*.log phases.txt && rm -f ./*.log)
