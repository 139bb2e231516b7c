#!/usr/bin/env bash
# One device call: build the prototype with each ACC in $ACCS and run the same configs on each build.
# Usage (device tool): ACCS="1 2" bash lab/megakernel_v2/device_ab.sh STEPS CONFIG...
set -o pipefail
out=${OUT:-/tmp}
steps=${1:-20}; shift
for a in ${ACCS:-1}; do
  nvcc -O3 -DACC=$a -gencode=arch=compute_90a,code=sm_90a -o /tmp/stream_step_acc$a lab/megakernel_v2/stream_step.cu &
done
wait
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
for a in ${ACCS:-1}; do
  echo "== ACC=$a"
  timeout 200 /tmp/stream_step_acc$a "$steps" "$@" 2>&1 | grep -v "^| ---\|^| B |"
done
