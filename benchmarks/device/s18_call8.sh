#!/usr/bin/env bash
# Session 18, call 8 (and 11, with the fixed one-launch TMA EC dispatched again): the M = 1
# kernels table and the E2E decode step (batch 1) on the shipped table.
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s18_call8.sh OUT_DIR
set -uo pipefail
out=$1
mkdir -p "$out/k" "$out/e2e"
timeout 120 python benchmarks/kernels.py --shapes 4096x4096 11008x4096 4096x11008 8192x8192 28672x8192 \
  --ms 1 --out "$out/k" > "$out/k/k.log" 2>&1
tail -n 9 "$out/k/k.log"
bash benchmarks/device/pack.sh "$out/k"
timeout 150 python benchmarks/e2e_decode.py --batch 1 --variants bf16 int4_tinygemm ours_w4 spear_ec25 \
  --out "$out/e2e" > "$out/e2e/e2e.log" 2>&1
tail -n 8 "$out/e2e/e2e.log"
bash benchmarks/device/pack.sh "$out/e2e"
