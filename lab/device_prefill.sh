#!/usr/bin/env bash
# The prefill's device call, ~3 minutes: TTFT cold and warm through the engine's torch prefill (North Mini Code
# geometry, random weights), the prefill attention by kernel, and the GPU tests that prefill.
#     run(command="bash lab/device_prefill.sh", timeout_s=400)
# Phases (logs under $OUT, a short table last):
#   ttft       lab/prefill_profile.py: 4096 and 16384 tokens in chunks of 2048, three warm turns each, the
#              16K prompt's kernels by GPU time
#   warm       the same, one 4096-token prompt, with every chunk on the causal path (CAUSAL_MIN_QUERIES=1):
#              run 111's slow warm turns; a warm turn of 40 tokens on 4096 under the profiler
#   attention  lab/prefill_attention_bench.py: one layer's attention by kernel
#   tests      the GPU tests that prefill: engine eager parity, the megakernel engine
set -u
OUT=${OUT:-/tmp/nc-out}
mkdir -p "$OUT"
export PYTHONPATH=. NORTHCODE_HOME=/tmp/nch PYTHONUNBUFFERED=1
source lab/device_phase.sh
NORTHCODE_TORCH_COMPILE=0 phase ttft 150 python3 lab/prefill_profile.py --tokens 4096 16384 --chunk-sizes 2048 \
  --top 12
NORTHCODE_TORCH_COMPILE=0 phase warm 90 python3 lab/prefill_profile.py --tokens 4096 --chunk-sizes 2048 \
  --causal-min 1 --profile-warm --top 12
phase attention 200 python3 lab/prefill_attention_bench.py
NORTHCODE_REQUIRE_GPU=1 phase tests 160 python3 -m pytest -q -rf tests/gpu/test_engine_gpu.py \
  tests/gpu/test_megakernel_backend_gpu.py tests/gpu/test_engine_backend_choice_gpu.py \
  tests/gpu/test_megakernel_backend.py
for name in ttft warm attention; do
  echo "==== $name ===="
  grep -av "USDT\|Warning\|warn" "$OUT/$name.log" | tail -40 | cut -c1-170
done
echo "==== tests ===="; grep -aE "passed|failed|FAILED|Error" "$OUT/tests.log" | tail -6 | cut -c1-300
echo "==== phases ===="; cat "$OUT/phases.txt"
(cd "$OUT" && tar czf logs.tgz *.log phases.txt && rm -f *.log)
