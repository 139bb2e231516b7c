#!/usr/bin/env bash
# One device call: build the v2 prototype on the H200 and time it over a grid of (batch, context).
# Usage (device tool): bash lab/megakernel_v2/device.sh [STEPS] [B:CONTEXT ...]
set -o pipefail
out=${OUT:-/tmp}
steps=${1:-20}; shift || true
configs=${*:-"1:8192:49:0:1 1:8192:49:1:1 1:1024:49:0:1 1:131072:49:0:1 8:8192:49:0:1 8:8192:49:1:1"}
nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -Xptxas -v -o /tmp/stream_step lab/megakernel_v2/stream_step.cu \
  2>&1 | grep -A2 step_kernel | tee "$out/build.txt"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader | tee "$out/gpu.txt"
timeout 400 /tmp/stream_step "$steps" $configs 2>&1 | tee "$out/v2.txt"
