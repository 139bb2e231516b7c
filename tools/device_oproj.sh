#!/usr/bin/env bash
# The o_proj tiles alone in the builds that ran them fast and slow in the decode step (docs/performance.md, day 3
# session 2), ~2 minutes on the H200:
#     run(command="bash tools/device_oproj.sh", timeout_s=300)
# Builds: the default's; lean-fused's (variant, its own build); the default's with the MoE ring at 8 stages
# (NORTHCODE_MEGAKERNEL_TUNING). Each in its own process: northcode/bench/oproj_bench.py (stream, phased, and
# after-moe: the step's sequence, MoE shares before each tile; o_proj busy per task as the step profile has it).
# Logs under $OUT.
set -u
OUT=${OUT:-/tmp/nc-out}
mkdir -p "$OUT"
export PYTHONPATH=. NORTHCODE_HOME=/tmp/nch NORTHCODE_REQUIRE_GPU=1 PYTHONUNBUFFERED=1
bench() {  # bench NAME VARIANT TUNING
  NORTHCODE_MEGAKERNEL_TUNING=$3 timeout 150 python3 -m northcode.bench.oproj_bench --variant "$2" \
    > "$OUT/oproj-$1.log" 2>&1
  echo "== $1 (rc $?)"
  tail -n 8 "$OUT/oproj-$1.log"
}
bench default default ""
bench lean-fused lean-fused ""
bench stages-8 default "NC_MOE_STAGES=8"
