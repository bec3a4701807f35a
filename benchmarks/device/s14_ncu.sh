#!/usr/bin/env bash
# Session 14, the last minutes of device time: Nsight Compute on the M = 1 TMA GEMV at 8192x8192 (the shape 0.6 us
# short of its target) in its two best configs, with warp-state, scheduler and source-level stall counters -
# what the next optimisation of its K step should target.
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s14_ncu.sh OUT_DIR
set -uo pipefail
out=$1
mkdir -p "$out"
timeout 150 ncu --clock-control none --profile-from-start off --section SpeedOfLight --section WarpStateStats \
  --section SchedulerStats --section SourceCounters --section MemoryWorkloadAnalysis --section Occupancy \
  --section LaunchStats python benchmarks/ncu_gemv1.py --shapes 8192x8192 --nibs biased --tma 4,2,4,2,2 4,2,2,2,2 \
  > "$out/ncu.txt" 2>&1
grep -E "profiling:|Duration|DRAM Throughput|Warp Cycles Per Issued|Issue Slots Busy|No Eligible|Achieved Active Warps" \
  "$out/ncu.txt" | head -40
bash benchmarks/device/pack.sh "$out"
