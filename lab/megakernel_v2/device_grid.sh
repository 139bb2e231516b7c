#!/usr/bin/env bash
# One device call: the v2 prototype and v1 (northcode bench decode) over Cohere's grid (1K-128K x B 1-8), same call.
# Usage (device tool): bash lab/megakernel_v2/device_grid.sh
set -o pipefail
out=${OUT:-/tmp}
nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -o /tmp/ss lab/megakernel_v2/stream_step.cu 2>&1 | grep error
cfgs=()
for c in 1024 8192 32768 131072; do for b in 1 2 4 8; do cfgs+=("$b:$c:49:0:1:8:0:0:1:4:2:16:2"); done; done
timeout 200 /tmp/ss 20 "${cfgs[@]}" 2>&1 | grep -E "^\| [0-9]|bandwidth" | tee "$out/v2_grid.txt"
PYTHONPATH=. NORTHCODE_HOME=/tmp/nch timeout 300 python3 -m northcode.bench.decode_bench --backends megakernel \
  --batch 1 2 4 8 --context 1024 8192 32768 131072 --steps 20 --warmup 5 --out "$out/v1" > "$out/v1_grid.txt" 2>&1
echo "v1 rc=$?"
grep -E "megakernel|bandwidth|TB/s|Error|error" "$out/v1_grid.txt" | tail -25
