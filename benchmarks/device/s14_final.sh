#!/usr/bin/env bash
# Session 14, final call (shipped code and table): (1) kernels.py at M = 1, every provider, five shapes; (2) the E2E
# table at batch 1 (every variant, 8 eager reruns each: distinct logits) and at batch 16 (bf16, tinygemm, ours_w4,
# spear_ec25, unfused_ec25). Each stage packed when done.
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s14_final.sh OUT_DIR
set -uo pipefail
out=$1
mkdir -p "$out/k1"
timeout 110 python benchmarks/kernels.py --ms 1 --out "$out/k1" > "$out/k1/k.log" 2>&1
tail -n 8 "$out/k1/k.log"
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
