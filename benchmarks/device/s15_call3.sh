#!/usr/bin/env bash
# Session 15, call 3: the warpgroup-MMA W4A16 GEMM with its MMAs left asynchronous by ptxas (call 2: serialised, C7515). (1) its GPU tests;
# (2) benchmarks/lab_gemm.py: every config checked against the reference, then timed against dequantize +
# cuBLAS and cuBLAS bf16, five shapes, M = 256, 1024, 4096.
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s15_call3.sh OUT_DIR
set -uo pipefail
out=$1
mkdir -p "$out/tests"
timeout 200 python -m pytest -q -x tests/lowering/test_gemm_wgmma.py > "$out/tests/tests.log" 2>&1
tail -n 15 "$out/tests/tests.log"
bash benchmarks/device/pack.sh "$out/tests"
mkdir -p "$out/lab"
timeout 330 python benchmarks/lab_gemm.py --out "$out/lab" > "$out/lab/lab.log" 2>&1
cat "$out/lab/lab.log" | tail -n 30
bash benchmarks/device/pack.sh "$out/lab"
