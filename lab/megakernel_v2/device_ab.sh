#!/usr/bin/env bash
# One device call: build the prototype once per flag set in $VARIANTS (";"-separated, e.g. "-DACC=1;-DACC=2") and run
# the same configs on each build.
# Usage (device tool): VARIANTS="-DACC=2;-DACC=2 -DSTALLS=1" bash lab/megakernel_v2/device_ab.sh STEPS CONFIG...
set -o pipefail
steps=${1:-20}; shift
IFS=';' read -r -a variants <<< "${VARIANTS:--DACC=2}"
for i in "${!variants[@]}"; do
  # shellcheck disable=SC2086  # a variant is a list of flags
  nvcc -O3 ${variants[$i]} -gencode=arch=compute_90a,code=sm_90a -o /tmp/stream_step_v$i lab/megakernel_v2/stream_step.cu \
    2>&1 | grep -E "error" &
done
wait
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
for i in "${!variants[@]}"; do
  echo "== ${variants[$i]}"
  timeout 200 /tmp/stream_step_v$i "$steps" "$@" 2>&1 | grep -v "^| ---\|^| B |"
done
