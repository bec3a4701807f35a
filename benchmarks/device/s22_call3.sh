#!/usr/bin/env bash
# Session 22, call 3: (1) GPU tests of the register-operand GEMM and the EC structures on it, PF = 2 configs among
# them; (2) lab: 4-warp tiles with a 2- or 3-stage ring (two CTAs per SM: one expands while the other's MMAs run)
# against the shipped 8-warp tile, PF = 2, at M = 1024 (and 11008x4096 at 4096).
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s22_call3.sh OUT_DIR
set -uo pipefail
out=$1
mkdir -p "$out/lab"
timeout 300 python -m pytest -q tests/lowering/test_gemm_wgmma.py -k "gpu" > "$out/tests.txt" 2>&1
tail -n 4 "$out/tests.txt"
timeout 240 python benchmarks/lab_gemm.py --configs --ra 128,256,4,8,2 64,256,4,4,2 64,256,3,4,2 64,256,2,4,2 \
  128,256,4,8,2 --shapes 11008x4096 8192x8192 4096x11008 --ms 1024 --out "$out/lab" > "$out/lab/lab.log" 2>&1
grep -v Warning "$out/lab/lab.log" | tail -n 8
bash benchmarks/device/pack.sh "$out/lab"
