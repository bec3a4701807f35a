#!/usr/bin/env bash
# Session 15, call 11 (last device minutes): the register-operand wgmma GEMM (w4a16_gemm_wgmma_ra.py: Y^T = W X^T,
# the expanded weight never in shared memory). (1) its GPU test; (2) lab against the plain (256, 128, 4, 8),
# 8192x8192 and 4096x4096, M = 1024 and 4096 (every variant checked against the reference first).
# (The kernel and its test were reverted after this call measured wrong results: they are in commit 4289991.)
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s15_call11.sh OUT_DIR
set -uo pipefail
out=$1
mkdir -p "$out/tests"
timeout 60 python -m pytest -q -x tests/lowering/test_gemm_wgmma.py -k register_operand > "$out/tests/tests.log" 2>&1
tail -n 3 "$out/tests/tests.log"
bash benchmarks/device/pack.sh "$out/tests"
mkdir -p "$out/lab"
timeout 90 python benchmarks/lab_gemm.py --configs 256,128,4,8 --ra 128,256,4,8 128,128,5,8 \
  --shapes 8192x8192 4096x4096 --ms 1024 4096 --out "$out/lab" > "$out/lab/lab.log" 2>&1
tail -n 6 "$out/lab/lab.log"
bash benchmarks/device/pack.sh "$out/lab"
