#!/usr/bin/env bash
# The MoE ring's depth (kMoeStages, a compile-time constant) on the H200, in one command of ~3-4 minutes:
#     run(command="bash tools/device_moe_stages.sh", timeout_s=400)
# For each STAGES value (default "6 8 10 12"; 6 is the .cu's default) a separate build via
# NORTHCODE_MEGAKERNEL_TUNING=NC_MOE_STAGES=N: the tiny geometry's teacher-forced and per-task tests (the ring's
# logic at a new depth), then `bench decode` of the default variant at B = 1 and 8, 8K, 100 steps. Builds differ,
# so the figures come from separate processes (run 32: two runs of one build agreed to 0.2% at 100 steps); and
# northcode/bench/moe_stream_bench.py: the MoE stream alone on every SM against the read bandwidth.
# Logs under $OUT; a short table last.
set -u
OUT=${OUT:-/tmp/nc-out}
mkdir -p "$OUT"
export PYTHONPATH=. NORTHCODE_HOME=/tmp/nch NORTHCODE_REQUIRE_GPU=1 PYTHONUNBUFFERED=1 NC_TINY_STEPS=${NC_TINY_STEPS:-32}
D=tests/gpu/test_megakernel_decode.py
T=tests/gpu/test_megakernel_tasks.py
for n in ${STAGES:-6 8 10 12}; do
  export NORTHCODE_MEGAKERNEL_TUNING="NC_MOE_STAGES=$n"
  timeout 90 python3 -m pytest -q -rf -k "tiny" $T "$D::test_tiny_teacher_forced" > "$OUT/tests-$n.log" 2>&1
  echo "stages $n tests rc=$? $(grep -hE 'passed|failed' "$OUT/tests-$n.log" | tail -1)"
  timeout 120 python3 -m northcode.bench.decode_bench --backends megakernel --batch 1 8 --context 8192 --steps 100 \
    --warmup 10 --profile --out "$OUT/bench-$n" > "$OUT/bench-$n.log" 2>&1
  grep -E "^\| megakernel" "$OUT/bench-$n.log" | sed "s/^/stages $n /"
  # per-type busy time (us summed over blocks) of the MoE and o_proj tasks: run 2 of day 3 session 2 found builds
  # whose o_proj tasks run at 7 instead of 4.4 us for no change of theirs; this tells such a build apart
  grep -E "^  profile megakernel B=1" "$OUT/bench-$n.log" | grep -oE "(OPROJ|MOE_UP|MOE_DOWN) wait [0-9.]+ busy [0-9.]+" \
    | tr '\n' ' ' | sed "s/^/stages $n B=1 /"; echo
  timeout 90 python3 -m northcode.bench.moe_stream_bench > "$OUT/stream-$n.log" 2>&1  # the stream alone
  grep -E "read bandwidth|up" "$OUT/stream-$n.log" | sed "s/^/stages $n stream /"
done
(cd "$OUT" && tar czf logs.tgz *.log && rm -f *.log)
