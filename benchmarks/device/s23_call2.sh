#!/usr/bin/env bash
# Session 23, call 2 (run inline on the warm machine; kept here as the record): the M = 1 kernels table and the
# end-to-end decode step at batch 1 and 16, every variant.
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s23_call2.sh OUT_DIR
set -uo pipefail
out=$1
mkdir -p "$out/k" "$out/e2e"
timeout 150 python benchmarks/kernels.py --ms 1 --out "$out/k" > "$out/k/k.log" 2>&1
grep -v Warning "$out/k/k.log" | tail -n 9
bash benchmarks/device/pack.sh "$out/k"
timeout 300 python benchmarks/e2e_decode.py --batch 1 16 --variants bf16 int4_tinygemm ours_w4 spear_ec10 spear_ec25 \
  spear_ec100 unfused_ec25 --out "$out/e2e" > "$out/e2e/e2e.log" 2>&1
echo "rc $?"; grep -v Warning "$out/e2e/e2e.log" | tail -n 20
bash benchmarks/device/pack.sh "$out/e2e"
