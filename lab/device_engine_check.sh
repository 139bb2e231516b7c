#!/usr/bin/env bash
# The torch backend's device call, in one command of under 5 minutes (typically ~4):
#     run(command="bash lab/device_engine_check.sh", timeout_s=330)
# Phases (logs under $OUT, figures first so that a time-out loses only tests; a short table last):
#   decode   bench decode, torch backend alone, B = 1 2 4 8 at 8K (prediction, lab/notebook.md "Torch
#            baseline", session 2 of day 1: ~6.8 ms at B=1, every batch captured in a graph, no note)
#   time     where the B=1 step's time goes: graph ms, kernel ms by part and the top kernels by time
#   ops      CUDA kernels per decode step at B = 1 and 8 (tiny widths, the full layer plan)
#   gpu      tests/gpu/test_engine_gpu.py (parity, batch-8 bf16 capture, the collector held off during
#            captures, a failed capture decoding eagerly) and the torch launches under sync-debug "error"
set -u
OUT=${OUT:-/tmp/nc-out}
mkdir -p "$OUT"
# the eager step's checks: its compiled form (the default on a GPU since day 3) has lab/device_torch_compile.sh
export PYTHONPATH=. NORTHCODE_HOME=/tmp/nch NORTHCODE_REQUIRE_GPU=1 PYTHONUNBUFFERED=1 NORTHCODE_TORCH_COMPILE=0
: > "$OUT/engine_phases.txt"

phase() {  # phase NAME LIMIT_S COMMAND...: run with a time limit, log to $OUT/NAME.log, record the outcome
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $((SECONDS - start))s" >> "$OUT/engine_phases.txt"
}

phase decode 100 python3 -m northcode.cli bench decode --backends torch --batch 1 2 4 8 --context 8192 --steps 20 \
  --out "$OUT/decode"
phase time 40 python3 -m northcode.torch_backend.op_count --time --batch 1 --context 8192
phase ops 30 bash -c 'python3 -m northcode.torch_backend.op_count --cuda --batch 1 && python3 -m northcode.torch_backend.op_count --cuda --batch 8'
phase gpu 140 python3 -m pytest -q -x -s -p no:cacheprovider tests/gpu/test_engine_gpu.py tests/gpu/test_torch_launch_gpu.py

echo "== phases"; cat "$OUT/engine_phases.txt"
echo "== gpu tests"; grep -E "cosine|capture failure|CUDA kernels per decode|passed|failed|Error" "$OUT/gpu.log" | tail -n 12
echo "== kernels per step"; grep -E "^decode step" "$OUT/ops.log"
echo "== where the B=1 step's time goes"; head -n 40 "$OUT/time.log"
echo "== torch decode, 8K"; grep -E "^\|| FAILED|failed|capture" "$OUT/decode.log" | tail -n 12
