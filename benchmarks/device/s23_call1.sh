#!/usr/bin/env bash
# Session 23, call 1: kernels.py at M = 256 / 1024 on the five issue shapes with the in-launch EC's own launch config
# searched (the table's ``ecself`` keys, written in session 22 and never run on a GPU); every provider is checked
# against its PyTorch reference first; the tuned table is copied out.
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s23_call1.sh OUT_DIR
set -uo pipefail
out=$1
mkdir -p "$out/k"
timeout 500 python benchmarks/kernels.py --out "$out/k" --ms 256 1024 > "$out/k/k.log" 2>&1
echo "rc $?"
grep -v Warning "$out/k/k.log" | tail -n 14
cp spear_compile/lowering/tuned/configs_NVIDIA_H200.json "$out/k/" 2>/dev/null
bash benchmarks/device/pack.sh "$out/k"
