#!/usr/bin/env bash
# The torch.compile'd decode step (torch_backend/compiled_step.py) on the H200, in one command of under 6 minutes:
#     run(command="bash lab/device_torch_compile.sh", timeout_s=370)
# Phases (logs under $OUT; PHASES="..." runs a subset, e.g. PHASES="gpu"; a short summary last). The figures
# come first so that a time-out loses only tests; the tests find the inductor caches the benches filled:
#   env        torch / triton versions, a C++ compiler (inductor's CPU code needs one; the GPU path does not)
#   bench-on   bench decode --quick --backends torch, compiled step (NORTHCODE_TORCH_COMPILE=1): B = 1, 8 at 8K;
#              the log has the compile time of each batch bucket ("compiled the decode step for batch N in S s")
#   bench-off  the same with the eager step (NORTHCODE_TORCH_COMPILE=0): the baseline of the same run
#   gpu        tests/gpu/test_torch_compile_gpu.py (compiled vs eager: tiny fp32 at B = 8; 5 layers bf16 at 8K, B = 1
#              and 8, each step's allocation next to the pool): three bucket compiles, ~20 + 60 + 20 s cold
#   time       (not by default) op_count --time --compiled at B = 1: the compiled step's kernels by device time
# Expected (lab/notebook.md, torch plan): bench-on B=1 ~4.6 ms (3.8-5.5), B=8 ~16.5 ms (14.5-18.5); bench-off
# as before (~7.7 / ~20 ms); no "torch.compile of the decode step failed" line; the gpu phase passes (3 tests).
# Time limits: 15 + 170 + 55 + 115 = 355 s for the default phases.
set -u
OUT=${OUT:-/tmp/nc-out}
mkdir -p "$OUT"
export PYTHONPATH=. NORTHCODE_HOME=/tmp/nch NORTHCODE_REQUIRE_GPU=1 PYTHONUNBUFFERED=1
PHASES=${PHASES:-env bench-on bench-off gpu}
: > "$OUT/compile_phases.txt"

phase() {  # phase NAME LIMIT_S COMMAND...: run with a time limit, log to $OUT/NAME.log, record the outcome
  local name=$1 limit=$2; shift 2
  case " $PHASES " in *" $name "*) ;; *) return ;; esac
  local start=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $((SECONDS - start))s" >> "$OUT/compile_phases.txt"
}

# the bench with northcode's INFO log (compile times, captures, a compile failure's warning)
BENCH='import logging, sys
logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
logging.getLogger("northcode").setLevel(logging.INFO)
from northcode.bench.decode_bench import main
sys.argv = ["decode_bench"] + sys.argv[1:]
raise SystemExit(main())'

phase env 15 bash -c 'python3 -c "import torch, triton; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"triton\", triton.__version__, torch.cuda.get_device_name())"; for c in gcc g++ cc; do printf "%s: " $c; command -v $c || echo missing; done'
phase bench-on 170 env NORTHCODE_TORCH_COMPILE=1 python3 -c "$BENCH" --quick --backends torch --out "$OUT/bench-on"
phase bench-off 55 env NORTHCODE_TORCH_COMPILE=0 python3 -c "$BENCH" --quick --backends torch --out "$OUT/bench-off"
phase gpu 115 python3 -m pytest -q -x -s -p no:cacheprovider tests/gpu/test_torch_compile_gpu.py
phase time 120 python3 -m northcode.torch_backend.op_count --time --compiled --batch 1 --context 8192

echo "== phases"; cat "$OUT/compile_phases.txt"
[ -f "$OUT/env.log" ] && { echo "== env"; cat "$OUT/env.log"; }
for run in bench-on bench-off; do
  [ -f "$OUT/$run.log" ] || continue
  echo "== $run (8K)"
  grep -E "compiled the decode step|torch.compile of the decode step failed|not captured|FAILED|Error" "$OUT/$run.log" | tail -n 8
  grep -E "^\|" "$OUT/$run.log" | tail -n 6
done
[ -f "$OUT/gpu.log" ] && { echo "== gpu tests"; grep -E "cosine|compile seconds|allocated|passed|failed|Error" "$OUT/gpu.log" | tail -n 30; }
[ -f "$OUT/time.log" ] && { echo "== compiled B=1 step, where the time goes"; head -n 40 "$OUT/time.log"; }
exit 0
