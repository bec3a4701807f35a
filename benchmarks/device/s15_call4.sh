#!/usr/bin/env bash
# Session 15, call 4: where the wgmma GEMM's K step goes (call 3: ~2.2x the MMA-bound time per step, 1.6-1.8x
# cuBLAS). (1) lab with the diagnostic variants (no expansion arithmetic; no expansion or stores; no MMAs), two
# configs, two shapes, M = 1024 and 4096; (2) Nsight Compute on cuBLAS, dequantize + cuBLAS and the kernel at
# 8192x8192, M = 1024.
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s15_call4.sh OUT_DIR
set -uo pipefail
out=$1
mkdir -p "$out/lab"
timeout 200 python benchmarks/lab_gemm.py --diag --configs 128,256,4,8 128,128,3,8 --shapes 8192x8192 4096x4096 \
  --ms 1024 4096 --out "$out/lab" > "$out/lab/lab.log" 2>&1
cat "$out/lab/lab.log" | tail -n 20
bash benchmarks/device/pack.sh "$out/lab"
mkdir -p "$out/ncu"
timeout 200 ncu --clock-control none --profile-from-start off --section SpeedOfLight --section WarpStateStats \
  --section SchedulerStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section Occupancy \
  --section LaunchStats python benchmarks/ncu_gemm.py --shape 8192x8192 --m 1024 --configs 128,256,4,8 128,128,3,8 \
  > "$out/ncu/ncu.txt" 2>&1
grep -E "^  [a-zA-Z_]|Duration|Compute \(SM\) Throughput|Memory Throughput|Warp Cycles Per Issued|Issue Slots Busy|No Eligible|Achieved Active Warps|Shared Memory|Registers Per|Stall" "$out/ncu/ncu.txt" | head -60
bash benchmarks/device/pack.sh "$out/ncu"
