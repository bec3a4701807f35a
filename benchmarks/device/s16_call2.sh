#!/usr/bin/env bash
# Session 16, call 2: where the register-operand wgmma GEMM's K step goes (call 1: ~1450 cycles per
# 128x256x64 step against ~1024 for its MMAs; the 128x128 tile ~1290 against ~512). (1) lab with its
# diagnostic variants (no MMA; no CTA barrier; no expansion) and a 4-warp tile for few-CTA shapes; (2) Nsight
# Compute on cuBLAS and the kernel, 8192x8192, M = 1024, with per-reason warp stalls and the tensor pipe.
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s16_call2.sh OUT_DIR
set -uo pipefail
out=$1
mkdir -p "$out/lab" "$out/ncu"
timeout 240 python benchmarks/lab_gemm.py --diag --configs --ra 128,256,3,8 128,128,5,8 64,256,4,4 \
  --shapes 8192x8192 4096x11008 --ms 1024 256 4096 --out "$out/lab" > "$out/lab/lab.log" 2>&1
tail -n 14 "$out/lab/lab.log"
bash benchmarks/device/pack.sh "$out/lab"
timeout 200 ncu --clock-control none --profile-from-start off --section SpeedOfLight --section WarpStateStats \
  --section SchedulerStats --section MemoryWorkloadAnalysis --section Occupancy --section SourceCounters \
  --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,regex:sm__pipe_tensor.*cycles_active\.avg\.pct_of_peak_sustained_active,smsp__inst_executed.sum" \
  python benchmarks/ncu_gemm.py --shape 8192x8192 --m 1024 --configs --ra 128,256,3,8 128,128,5,8 \
  > "$out/ncu/ncu.txt" 2>&1
grep -E "^  [a-zA-Z_]|Duration|Warp Cycles Per Issued|Issue Slots Busy|Achieved Active Warps|stalled_(barrier|long|wait|math|mio|short|membar|sleeping|dispatch|lg_|no_inst|selected|not_sel|branch)|pipe_tensor" "$out/ncu/ncu.txt" | head -80
bash benchmarks/device/pack.sh "$out/ncu"
