#!/usr/bin/env bash
# The o_proj tiles alone in the builds that ran them fast and slow in the decode step (docs/performance.md, day 3
# session 2), and the o_proj code moved by a few instructions, ~5 minutes on the H200:
#     run(command="bash tools/device_oproj.sh", timeout_s=420)
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
# Placement: the default's build with N zero-length sleeps ahead of the o_proj tiles (NC_OPROJ_PAD: the tile loop
# and all code after it move by 16 N bytes; run 43's slow build had moved it by 160 bytes). If the step's o_proj
# busy time (us, all blocks; fast ~30K, slow ~45K) jumps between these builds, the code's placement decides it.
for n in ${PADS:-0 4 10 16 24}; do
  NORTHCODE_MEGAKERNEL_TUNING="NC_OPROJ_PAD=$n" timeout 120 python3 -m northcode.bench.decode_bench --backends megakernel \
    --batch 1 --context 8192 --steps 50 --profile --out "$OUT/pad-$n" > "$OUT/pad-$n.log" 2>&1
  echo "pad $n: $(grep -E '^\| megakernel ' "$OUT/pad-$n.log" | cut -d'|' -f5) ms/step;" \
    "$(grep -E '^  profile megakernel B=1' "$OUT/pad-$n.log" | grep -oE 'OPROJ wait [0-9.]+ busy [0-9.]+')"
done
