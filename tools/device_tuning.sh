#!/usr/bin/env bash
# The decode step at B = 1 and 8 (8K, 50 steps, profiled) for each build in TUNINGS (NORTHCODE_MEGAKERNEL_TUNING
# values, space-separated; "-" is the default's build), one process each, on the H200:
#     run(command='TUNINGS="- NC_MOE_PACKED=1" TESTS=1 STREAM=1 bash tools/device_tuning.sh', timeout_s=420)
# TESTS=1: first, for each build but the default, the per-task tests (tiny and 5-layer geometries) and the tiny
# and 5-layer teacher-forced tests (the tiny geometry skips NC_MOE_ROWSEG's and NC_MOE_DOWNROWS' paths);
# STREAM=1: northcode/bench/moe_stream_bench.py (the MoE stream alone) for each build.
# STEPS: timed steps (50); VARIANTS: megakernel variants timed beside each build (as megakernel/<name>). The MoE
# ring's depths: TUNINGS="NC_MOE_STAGES=6 NC_MOE_STAGES=8" TESTS=1 STREAM=1 (what tools/device_moe_stages.sh did).
# KEEP_PROFILES=1: each build's profiles (every variant's at B = 1, the default's at B = 8) come back as
# $OUT/<build>-profile-*.pt.
# Prints ms per step and the QKV / o_proj / MoE busy times (us summed over the step's tasks); logs under $OUT.
set -u
OUT=${OUT:-/tmp/nc-out}
mkdir -p "$OUT"
export PYTHONPATH=. NORTHCODE_HOME=/tmp/nch NORTHCODE_REQUIRE_GPU=1 PYTHONUNBUFFERED=1 NC_TINY_STEPS=${NC_TINY_STEPS:-32}
for tuning in ${TUNINGS:--}; do
  name=${tuning//[=,]/-}
  [ "$tuning" = - ] && tuning=""
  export NORTHCODE_MEGAKERNEL_TUNING=$tuning
  if [ "${TESTS:-0}" = 1 ] && [ -n "$tuning" ]; then
    timeout 200 python3 -m pytest -q -rf tests/gpu/test_megakernel_tasks.py \
      "tests/gpu/test_megakernel_decode.py::test_tiny_teacher_forced" \
      "tests/gpu/test_megakernel_decode.py::test_full_shapes_shallow_teacher_forced" > "$OUT/tests-$name.log" 2>&1
    echo "== $tuning tests (rc $?): $(grep -hE 'passed|failed' "$OUT/tests-$name.log" | tail -1)"
    grep -hE "^FAILED" "$OUT/tests-$name.log" | cut -c1-200 | head -5
  fi
  if [ "${STREAM:-0}" = 1 ]; then
    timeout 90 python3 -m northcode.bench.moe_stream_bench > "$OUT/stream-$name.log" 2>&1
    grep -E "read bandwidth|^ +(8|128) " "$OUT/stream-$name.log" | sed "s/^/${tuning:-default} stream /"
  fi
  timeout 150 python3 -m northcode.bench.decode_bench --backends megakernel \
    --batch 1 8 --context 8192 --steps ${STEPS:-50} --profile ${VARIANTS:+--variants $VARIANTS} --out "$OUT/step-$name" \
    > "$OUT/step-$name.log" 2>&1
  echo "== ${tuning:-default} (rc $?)"
  grep -E "^\| megakernel" "$OUT/step-$name.log" | cut -d'|' -f2-5
  grep -E "^  profile megakernel" "$OUT/step-$name.log" | sed -E 's/^  profile (megakernel[^:]*):.*median layer ([0-9.]+) us.*/\1 layer \2/'
  grep -E "^  profile megakernel" "$OUT/step-$name.log" | grep -oE "(OPROJ|MOE_UP|MOE_DOWN|QKV) wait [0-9.]+ busy [0-9.]+" | \
    sed -E 's/ wait [0-9.]+ busy/ busy/' | paste -sd' ' | fold -w 200
  if [ "${KEEP_PROFILES:-0}" = 1 ]; then
    for f in "$OUT/step-$name"/profile-megakernel-b8-c8192.pt "$OUT/step-$name"/profile-*-b1-c8192.pt; do
      [ -e "$f" ] && cp "$f" "$OUT/${name}-$(basename "$f")"
    done
  fi
  rm -rf "$OUT/step-$name"
done
(cd "$OUT" && tar czf logs.tgz *.log && rm -f *.log)
