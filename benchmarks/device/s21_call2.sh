#!/usr/bin/env bash
# Session 21, call 2: kernels.py at M = 256 / 1024 on the five issue shapes with the deep role ring on (ROLE_DEEP)
# (tuning.refine); the tuned table copied out.
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s21_call2.sh OUT_DIR
set -uo pipefail
out=$1
mkdir -p "$out/k"
timeout 420 python benchmarks/kernels.py --out "$out/k" --ms 256 1024 > "$out/k/k.log" 2>&1
tail -n 14 "$out/k/k.log"
cp spear_compile/lowering/tuned/configs_NVIDIA_H200.json "$out/k/" 2>/dev/null
bash benchmarks/device/pack.sh "$out/k"
