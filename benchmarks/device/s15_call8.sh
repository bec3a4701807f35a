#!/usr/bin/env bash
# Session 15, call 8: the wgmma GEMM with 16 warps (4 warpgroups of 64 x rows, BM = 256: 4 warps per scheduler
# to hide the expansion's dependent chains, 2 words per thread) against the 8-warp (256, 128, 4, 8), three shapes,
# M = 256, 1024, 4096; then its diagnostic split at 8192x8192. GPU tests of the kernel first (every config).
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s15_call8.sh OUT_DIR
set -uo pipefail
out=$1
mkdir -p "$out/tests"
timeout 120 python -m pytest -q -x tests/lowering/test_gemm_wgmma.py > "$out/tests/tests.log" 2>&1
tail -n 3 "$out/tests/tests.log"
bash benchmarks/device/pack.sh "$out/tests"
mkdir -p "$out/lab"
timeout 150 python benchmarks/lab_gemm.py --configs 256,128,4,16 256,128,3,16 256,128,4,8 \
  --shapes 8192x8192 4096x4096 28672x8192 --out "$out/lab" > "$out/lab/lab.log" 2>&1
cat "$out/lab/lab.log" | tail -n 12
bash benchmarks/device/pack.sh "$out/lab"
mkdir -p "$out/diag"
timeout 60 python benchmarks/lab_gemm.py --diag --configs 256,128,4,16 --shapes 8192x8192 --ms 1024 4096 \
  --out "$out/diag" > "$out/diag/lab.log" 2>&1
cat "$out/diag/lab.log" | tail -n 6
bash benchmarks/device/pack.sh "$out/diag"
