#!/usr/bin/env bash
# Why some builds run the step's o_proj tiles at ~7 instead of ~4.4 us (docs/performance.md, day 3 session 2),
# on the H200:
#     run(command="PARTS=constants bash tools/device_oproj.sh", timeout_s=420)
# 1. northcode/bench/oproj_bench.py (stream, phased, after-moe; o_proj busy per task as the step profile has it)
#    in the default's build (fast in the step), lean-fused's and the 8-stage MoE ring's (slow in the step).
# 2. Placement: the default's build with the o_proj loop moved by 16 N bytes (NC_OPROJ_PAD=N).
# 3. The constant cache: the slow builds lose ~an L2 round trip per pass of mma_tiles' load loop, whose
#    activation address the compiler re-derives from the kernel parameter (an LDC) in every pass; NC_PIN_ACT=1
#    keeps it in registers (o_proj's LDCs 5 -> 2, no spill); NC_PARAMS_SMEM=1 reads every parameter from a
#    shared-memory copy instead. Slow builds fast with them: that was the cost.
# PARTS picks them (default "constants alone placement": ~9 minutes; constants ~4-5, the others ~2 each).
# Each build in its own process (NORTHCODE_MEGAKERNEL_TUNING, variant builds). Logs under $OUT.
set -u
OUT=${OUT:-/tmp/nc-out}
mkdir -p "$OUT"
export PYTHONPATH=. NORTHCODE_HOME=/tmp/nch NORTHCODE_REQUIRE_GPU=1 PYTHONUNBUFFERED=1
alone() {  # alone NAME VARIANT TUNING: the o_proj bench
  NORTHCODE_MEGAKERNEL_TUNING=$3 timeout 150 python3 -m northcode.bench.oproj_bench --variant "$2" \
    > "$OUT/oproj-$1.log" 2>&1
  echo "== alone: $1 (rc $?)"
  tail -n 7 "$OUT/oproj-$1.log"
}
step() {  # step NAME VARIANT TUNING: the decode step at B = 1, 8K, with its profile's o_proj busy time
  local variant_row="megakernel" more=()
  [ "$2" != default ] && variant_row="megakernel/$2" && more=(--variants "megakernel/$2")
  NORTHCODE_MEGAKERNEL_TUNING=$3 timeout 150 python3 -m northcode.bench.decode_bench --backends megakernel \
    --batch 1 --context 8192 --steps 50 --profile "${more[@]}" --out "$OUT/step-$1" > "$OUT/step-$1.log" 2>&1
  echo "step $1: $(grep -E "^\| $variant_row " "$OUT/step-$1.log" | cut -d'|' -f5) ms;" \
    "$(grep -E "^  profile $variant_row B=1" "$OUT/step-$1.log" | grep -oE 'OPROJ wait [0-9.]+ busy [0-9.]+')"
}
PARTS=${PARTS:-"constants alone placement"}  # the lead first; each part ~2-3.5 minutes
if [[ " $PARTS " == *" constants "* ]]; then
  step default default ""
  step pin default "NC_PIN_ACT=1"
  step params-smem default "NC_PARAMS_SMEM=1"  # every parameter from shared memory (20 bytes of spill)
  step stages-8 default "NC_MOE_STAGES=8"
  step stages-8-pin default "NC_MOE_STAGES=8,NC_PIN_ACT=1"
  step stages-8-params-smem default "NC_MOE_STAGES=8,NC_PARAMS_SMEM=1"
  step lean-fused lean-fused ""
  step lean-fused-pin lean-fused "NC_PIN_ACT=1"
fi
if [[ " $PARTS " == *" alone "* ]]; then
  alone default default ""
  alone lean-fused lean-fused ""
  alone stages-8 default "NC_MOE_STAGES=8"
fi
if [[ " $PARTS " == *" placement "* ]]; then
  for n in ${PADS:-4 10 16 24}; do step "pad-$n" default "NC_OPROJ_PAD=$n"; done
fi
