#!/usr/bin/env bash
# Issue 25's deciding call, ~4.5 minutes expected (phase caps 490 s; the benches print each row as it is done, so a
# phase cut at its cap keeps what it measured): the prefill kernels side by side, then where the product stands.
# North Mini Code geometry, random weights.
#     run(command="bash lab/device_prefill2.sh", timeout_s=540)
# Phases (logs under $OUT, a short table last), the decisive ones first:
#   attention  lab/prefill_attention_bench.py: one layer's attention for a chunk, by kernel: today's (the
#              memory-efficient kernel with a mask; causal without one, efficient and flash) and flex reading the
#              paged pool in place (lab/paged_prefill_flex.py) over a pool under 2^31 elements, also with its main
#              kernel forced for chunks of <= 16 tokens (the bench's contiguous flex way is left out: its
#              create_block_mask per call would be most of its time)
#   attention_big  flex-paged over a pool past 2^31 elements (the eager engine's pool is 68 GB), alone
#   moe        lab/moe_prefill_bench.py: the routed experts of one layer by part at T = 2048, 8192, 16384 against
#              plain bf16 GEMMs of the same FLOPs
#   engine16k  `bench engine` cold 16K prompt, torch backend (TTFT cold, +32 warm, decode at 8K, batch 1)
#   engine32k  the same at 32K. Both with NORTHCODE_TORCH_COMPILE=0: the compiled decode step's warm-up (~150 s of
#              bucket compiles) would not fit, and the prefill is not compiled either way
#   tests      the GPU tests that prefill (tests/gpu/test_engine_gpu.py: chunked paged prefill against the
#              reference) and the paged way's GPU test (bf16 against fp32, scrambled pages; flex's decoding kernel
#              where decoding_backend allows it, and the main kernel forced)
set -u
OUT=${OUT:-/tmp/nc-out}
mkdir -p "$OUT"
export PYTHONPATH=. NORTHCODE_HOME=/tmp/nch PYTHONUNBUFFERED=1
source lab/device_phase.sh
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', \
triton.__version__, torch.cuda.get_device_name())" > "$OUT/versions.txt" 2>&1
phase attention 150 python3 lab/prefill_attention_bench.py --repeats 10 --ways efficient-mask efficient-causal \
  flash-causal flex-paged flex-paged-triton
# the pool past 2^31 elements in a process of its own: a kernel that indexed it with 32-bit offsets would fault and
# take the CUDA context, and every row after it, with it
phase attention_big 70 python3 lab/prefill_attention_bench.py --repeats 10 --ways flex-paged-big
phase moe 30 python3 lab/moe_prefill_bench.py --repeats 10
for len in 16384 32768; do
  NORTHCODE_TORCH_COMPILE=0 phase engine$((len / 1024))k $((len == 16384 ? 70 : 80)) python3 -m northcode.cli \
    bench engine --preset north-mini-code --backend torch --prompt-len $len --batch-sizes 1
done
NORTHCODE_REQUIRE_GPU=1 phase tests 90 python3 -m pytest -q -rf -p no:cacheprovider tests/gpu/test_engine_gpu.py \
  "lab/test_prefill_attention_bench.py::test_on_the_gpu_the_compiled_paged_way_equals_fp32_attention"
cat "$OUT/versions.txt"
for name in attention attention_big moe; do
  echo "==== $name ===="
  grep -av "USDT\|Warning\|warn\|SOLUTION\|If you want\|_FLEX_ATTENTION\|This will allow\|^\s*$" "$OUT/$name.log" | tail -70 |
    cut -c1-160
done
for name in engine16k engine32k; do
  echo "==== $name ===="; grep -aE "TTFT|prefill|^ +1 |rror" "$OUT/$name.log" | tail -6 | cut -c1-200
done
echo "==== tests ===="; grep -aE "passed|failed|FAILED|Error" "$OUT/tests.log" | tail -8 | cut -c1-300
echo "==== phases ===="; cat "$OUT/phases.txt"
(cd "$OUT" && tar czf logs.tgz *.log phases.txt versions.txt && rm -f *.log)
