#!/usr/bin/env bash
# The engine's device call (issue 3's GPU checks and figures), in one command of under 9 minutes:
#     run(command="bash tools/device_engine_check.sh", timeout_s=570)
# Run it after tools/device_next_session.sh. What it checks (logs under $OUT, a short table last):
#   gpu      tests/gpu/test_engine_gpu.py (fp32 full-width layers at 8K teacher-forced, batch == alone,
#            graphs == eager, bf16 per layer for both MoE paths, CUDA kernel count), the torch backend's
#            pipelined launches under sync-debug "error" (no host waits), and the megakernel
#            backend test through the engine (backend = megakernel, restart after an injected failure)
#   ops      kernels per decode step on the GPU (prediction: ~1,300 at B=1, ~1,450 at B=8)
#   decode   the torch decode step alone at B = 1, 8 and 8K, grouped and gathered MoE
#            (prediction: 5.8 +- 1 ms at B=1, ~17 ms at B=8; docs/performance.md, "Torch baseline")
#   engine   northcode bench engine on North Mini Code's geometry (random weights on the GPU): TTFT cold and
#            warm, prefill tokens/s, decode tokens/s at batch 1..8 (issue 3's figures for the note)
set -u
OUT=${OUT:-/tmp/nc-out}
mkdir -p "$OUT"
export PYTHONPATH=. NORTHCODE_HOME=/tmp/nch NORTHCODE_REQUIRE_GPU=1 PYTHONUNBUFFERED=1
: > "$OUT/engine_phases.txt"

phase() {  # phase NAME LIMIT_S COMMAND...: run with a time limit, log to $OUT/NAME.log, record the outcome
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $((SECONDS - start))s" >> "$OUT/engine_phases.txt"
}

phase gpu 200 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_engine_gpu.py \
  tests/gpu/test_torch_launch_gpu.py tests/gpu/test_engine_backend_choice_gpu.py
phase ops 40 bash -c 'python3 -m northcode.engine.op_count --cuda --batch 1 && python3 -m northcode.engine.op_count --cuda --batch 8'
phase decode 110 bash -c 'python3 -m northcode.cli bench decode --backends torch --batch 1 8 --context 8192 --steps 20 --out '"$OUT"'/decode_grouped \
  && NORTHCODE_TORCH_MOE=gathered python3 -m northcode.cli bench decode --backends torch --batch 1 8 --context 8192 --steps 20 --out '"$OUT"'/decode_gathered'
phase engine 170 python3 -m northcode.cli bench engine --preset north-mini-code --backend torch

echo "== phases"; cat "$OUT/engine_phases.txt"
echo "== gpu tests"; tail -n 3 "$OUT/gpu.log"
echo "== kernels per step"; grep -iE "kernel|ops" "$OUT/ops.log" | tail -n 4
echo "== torch decode (grouped, then gathered)"; grep -E "^\s*(torch|batch|[0-9])" "$OUT/decode.log" | tail -n 12
echo "== bench engine"; tail -n 12 "$OUT/engine.log"
