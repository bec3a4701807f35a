#!/usr/bin/env bash
# Session 15, call 7 (final): shipped code and table. (1) GPU tests of the wgmma GEMM and the tuning / dispatch;
# (2) kernels.py at M = 1 on 8192x8192 (the TMA config entry back to (4, 2, 4, 2, 2): call 6 measured the decode
# EC 19.8 us with (4, 2, 2, 2, 2) against 15.2 in session 14); (3) E2E batch 1 (8 eager reruns each: distinct
# logits) and batch 16. Each stage packed when done.
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s15_call7.sh OUT_DIR
set -uo pipefail
out=$1
mkdir -p "$out/tests"
timeout 100 python -m pytest -q -x tests/lowering/test_gemm_wgmma.py tests/lowering/test_tuning_and_dispatch.py \
  > "$out/tests/tests.log" 2>&1
tail -n 3 "$out/tests/tests.log"
bash benchmarks/device/pack.sh "$out/tests"
mkdir -p "$out/k1"
timeout 60 python benchmarks/kernels.py --ms 1 --shapes 8192x8192 --out "$out/k1" > "$out/k1/k.log" 2>&1
tail -n 3 "$out/k1/k.log"
bash benchmarks/device/pack.sh "$out/k1"
mkdir -p "$out/e2e1"
timeout 190 python benchmarks/e2e_decode.py --batch 1 --reruns 8 --variants bf16 int4_tinygemm ours_w4 spear_ec10 \
  spear_ec25 spear_ec100 unfused_ec25 --out "$out/e2e1" > "$out/e2e1/e2e.log" 2>&1
tail -n 8 "$out/e2e1/e2e.log"
bash benchmarks/device/pack.sh "$out/e2e1"
mkdir -p "$out/e2e16"
timeout 150 python benchmarks/e2e_decode.py --batch 16 --variants bf16 int4_tinygemm ours_w4 spear_ec25 unfused_ec25 \
  --out "$out/e2e16" > "$out/e2e16/e2e.log" 2>&1
tail -n 6 "$out/e2e16/e2e.log"
bash benchmarks/device/pack.sh "$out/e2e16"
