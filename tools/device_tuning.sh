#!/usr/bin/env bash
# The decode step at B = 1 and 8 (8K, 50 steps, profiled) for each build in TUNINGS (NORTHCODE_MEGAKERNEL_TUNING
# values, space-separated; "-" is the default's build), one process each, on the H200:
#     run(command='TUNINGS="- NC_OPROJ_EARLY=2" bash tools/device_tuning.sh', timeout_s=300)
# Prints ms per step and the o_proj / MoE busy time (us summed over the step's tasks) per build; logs under $OUT.
set -u
OUT=${OUT:-/tmp/nc-out}
mkdir -p "$OUT"
export PYTHONPATH=. NORTHCODE_HOME=/tmp/nch NORTHCODE_REQUIRE_GPU=1 PYTHONUNBUFFERED=1
for tuning in ${TUNINGS:--}; do
  name=${tuning//[=,]/-}
  [ "$tuning" = - ] && tuning=""
  NORTHCODE_MEGAKERNEL_TUNING=$tuning timeout 150 python3 -m northcode.bench.decode_bench --backends megakernel \
    --batch 1 8 --context 8192 --steps ${STEPS:-50} --profile ${VARIANTS:+--variants $VARIANTS} --out "$OUT/step-$name" \
    > "$OUT/step-$name.log" 2>&1
  echo "== ${tuning:-default} (rc $?)"
  grep -E "^\| megakernel" "$OUT/step-$name.log" | cut -d'|' -f2-5
  grep -E "^  profile megakernel" "$OUT/step-$name.log" | sed -E 's/^  profile (megakernel[^:]*):.*median layer ([0-9.]+) us.*/\1 layer \2/' 
  grep -E "^  profile megakernel" "$OUT/step-$name.log" | grep -oE "(OPROJ|MOE_UP|MOE_DOWN|QKV) wait [0-9.]+ busy [0-9.]+" | \
    sed -E 's/ wait [0-9.]+ busy/ busy/' | paste -sd' ' | fold -w 200
  rm -rf "$OUT/step-$name"
done
(cd "$OUT" && tar czf logs.tgz *.log && rm -f *.log)
