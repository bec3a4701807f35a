#!/usr/bin/env bash
# Session 22, call 1: why the register-operand GEMM's K step is ~1.4x its MMAs at M = 1024 (W4 1.19-1.24x cuBLAS on
# 11008x4096 / 4096x11008 / 8192^2). (1) lab diagnostics incl. the new diag 4 (no row-parameter loads in the loop:
# step 0's scales throughout) and PF = 2 (row parameters through the TMA ring, ring_row_params) against PF = 0 in the
# same process; (2) Nsight Compute source-level stall sampling of the kernel, exported per SASS line. First the GPU
# tests of the register-operand kernel (PF = 2 must give PF = 0's bits).
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s22_call1.sh OUT_DIR
set -uo pipefail
out=$1
mkdir -p "$out/lab" "$out/ncu"
timeout 150 python -m pytest -q -x tests/lowering/test_gemm_wgmma.py -k "register_operand_kernel_matches or stream_k_matches" \
  > "$out/tests.txt" 2>&1; tail -n 3 "$out/tests.txt"
timeout 230 python benchmarks/lab_gemm.py --diag --configs --ra 128,256,3,8 128,256,3,8,2 128,256,4,8 128,256,4,8,2 \
  --shapes 11008x4096 4096x11008 8192x8192 --ms 1024 --out "$out/lab" > "$out/lab/lab.log" 2>&1
grep -v Warning "$out/lab/lab.log" | tail -n 16
bash benchmarks/device/pack.sh "$out/lab"
timeout 150 ncu --clock-control none --profile-from-start off -k regex:_w4a16_gemm_wgmma_ra_kernel \
  --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section SourceCounters \
  --import-source no -o "$out/ncu/rep" \
  python benchmarks/ncu_gemm.py --shape 11008x4096 --m 1024 --configs --ra 128,256,3,8 > "$out/ncu/ncu_run.txt" 2>&1
tail -3 "$out/ncu/ncu_run.txt"
ncu -i "$out/ncu/rep.ncu-rep" --page details > "$out/ncu/details.txt" 2>&1
grep -E "Duration|Warp Cycles Per Issued|Issue Slots Busy|Stall|stall" "$out/ncu/details.txt" | head -20
ncu -i "$out/ncu/rep.ncu-rep" --page source --csv --print-source sass > "$out/ncu/sass.csv" 2> "$out/ncu/sass_err.txt"
echo "sass.csv lines: $(wc -l < "$out/ncu/sass.csv")"; head -c 600 "$out/ncu/sass_err.txt"
head -2 "$out/ncu/sass.csv" | cut -c1-600
bash benchmarks/device/pack.sh "$out/ncu"
