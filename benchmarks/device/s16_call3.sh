#!/usr/bin/env bash
# Session 16, call 3: the register-operand wgmma GEMM with its scale loads one step ahead. (1) GPU tests;
# (2) lab on the five issue shapes, M = 256, 1024, 4096, against the plain kernel, dequantize + cuBLAS, cuBLAS.
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s16_call3.sh OUT_DIR
set -uo pipefail
out=$1
mkdir -p "$out/tests" "$out/lab"
timeout 120 python -m pytest -q tests/lowering/test_gemm_wgmma.py -k "register_operand" > "$out/tests/tests.log" 2>&1
tail -n 3 "$out/tests/tests.log"
bash benchmarks/device/pack.sh "$out/tests"
timeout 400 python benchmarks/lab_gemm.py --configs 256,128,4,8 --ra 128,256,3,8 128,256,4,8 64,256,4,4 \
  --shapes 8192x8192 4096x4096 11008x4096 4096x11008 28672x8192 --ms 1024 4096 256 --out "$out/lab" \
  > "$out/lab/lab.log" 2>&1
tail -n 16 "$out/lab/lab.log"
bash benchmarks/device/pack.sh "$out/lab"
