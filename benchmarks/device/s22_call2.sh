#!/usr/bin/env bash
# Session 22, call 2: (1) GPU tests of the EC structures on the register-operand GEMM with PF = 2 configs (row
# parameters through the TMA ring); (2) kernels.py at M = 1024 / 256 with PF = 2 searched beside PF = 0 (every provider
# checked against the reference there; the tuned table copied out; rows written as they finish); (3) lab: 4-warp tiles
# with a 2- or 3-stage ring (two CTAs per SM) and the stream-K tail (SK = 1) against the 8-warp tile, PF = 2, M = 1024.
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s22_call2.sh OUT_DIR
set -uo pipefail
out=$1
mkdir -p "$out/k" "$out/lab"
timeout 140 python -m pytest -q -x tests/lowering/test_gemm_wgmma.py \
  -k "gpu and (in_launch_ec_matches or ec_step_behind or split_shrink)" > "$out/tests.txt" 2>&1
tail -n 3 "$out/tests.txt"
timeout 330 python benchmarks/kernels.py --out "$out/k" --ms 1024 256 > "$out/k/k.log" 2>&1
echo "rc $?"
grep -v Warning "$out/k/k.log" | tail -n 14
cp spear_compile/lowering/tuned/configs_NVIDIA_H200.json "$out/k/" 2>/dev/null
bash benchmarks/device/pack.sh "$out/k"
timeout 100 python benchmarks/lab_gemm.py --configs --ra 128,256,4,8,2 128,256,4,8,2,1 64,256,3,4,2 64,256,2,4,2 \
  --shapes 11008x4096 8192x8192 --ms 1024 --out "$out/lab" > "$out/lab/lab.log" 2>&1
grep -v Warning "$out/lab/lab.log" | tail -n 3
bash benchmarks/device/pack.sh "$out/lab"
