#!/usr/bin/env bash
# One device call: where the prototype's warps stall, from Nsight Compute (one step of one config, application replay:
# the persistent kernel's counters and tickets must start from zero in every pass), plus the timing table with the
# SM clock read in the kernel.
# Usage (device tool): FLAGS="-DACC=2 -DRG=4" bash lab/megakernel_v2/device_ncu.sh CONFIG [TIMING_CONFIG...]
set -o pipefail
out=${OUT:-/tmp}
cfg=$1; shift
# shellcheck disable=SC2086  # FLAGS is a list of flags
nvcc -O3 ${FLAGS:--DACC=2 -DRG=4} -lineinfo -gencode=arch=compute_90a,code=sm_90a -o /tmp/ss lab/megakernel_v2/stream_step.cu \
  2>&1 | grep error
[ $# -gt 0 ] && timeout 120 /tmp/ss 20 "$@" | grep -E "^\| [0-9]|bandwidth"
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
echo "ncu: $NCU"
timeout 300 "$NCU" --clock-control none --replay-mode application -k step_kernel --launch-skip 3 --launch-count 1 \
  --section WarpStateStats --section SchedulerStats --section SourceCounters --section SpeedOfLight \
  --section LaunchStats --section Occupancy -o "$out/step" -f /tmp/ss 1 "$cfg" > "$out/ncu_run.txt" 2>&1
echo "ncu rc=$?"; tail -5 "$out/ncu_run.txt"
"$NCU" -i "$out/step.ncu-rep" --page details --print-details all > "$out/details.txt" 2>&1
"$NCU" -i "$out/step.ncu-rep" --page source --print-source sass --csv > "$out/source.csv" 2>&1
gzip -f "$out/source.csv"
grep -vE "^\s*$" "$out/details.txt" | grep -iE "stall|warp cycles|issued|eligible|active warps|no eligible|throughput|duration|SM Frequency|one or more" | head -70
