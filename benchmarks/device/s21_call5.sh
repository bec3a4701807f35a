#!/usr/bin/env bash
# Session 21, call 5: where stream-K units lose time (forced unit counts on one-wave grids, s21_sk_diag.py), then
# kernels.py at M = 256 / 1024 on the refactored K loop (the plain tiles' run / ring split; stream-K not searched):
# a regression check of the shipped path against call 2, the tuned table copied out.
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s21_call5.sh OUT_DIR
set -uo pipefail
out=$1
mkdir -p "$out/diag" "$out/k"
timeout 120 python benchmarks/device/s21_sk_diag.py --out "$out/diag" > "$out/diag/log.txt" 2>&1
grep -v Warning "$out/diag/log.txt" | tail -6
bash benchmarks/device/pack.sh "$out/diag"
timeout 330 python benchmarks/kernels.py --out "$out/k" --ms 256 1024 > "$out/k/k.log" 2>&1
tail -n 14 "$out/k/k.log"
cp spear_compile/lowering/tuned/configs_NVIDIA_H200.json "$out/k/" 2>/dev/null
bash benchmarks/device/pack.sh "$out/k"
