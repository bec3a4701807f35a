#!/usr/bin/env bash
# Session 23, call 5 (run inline; kept as the record): the end-to-end decode step on the final tuned table.
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s23_call5.sh OUT_DIR
set -uo pipefail
out=$1
mkdir -p "$out/e2e"
timeout 300 python benchmarks/e2e_decode.py --batch 1 16 --variants bf16 int4_tinygemm ours_w4 spear_ec10 spear_ec25 \
  spear_ec100 unfused_ec25 --out "$out/e2e" > "$out/e2e/e2e.log" 2>&1
echo "rc $?"; grep -v Warning "$out/e2e/e2e.log" | tail -n 16
