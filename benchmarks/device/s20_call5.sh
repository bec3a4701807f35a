#!/usr/bin/env bash
# Session 20, call 5: kernels.py at M = 256 / 1024 on the five issue shapes with the GEMM finalists re-timed
# (tuning.refine); the tuned table copied out.
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s20_call5.sh OUT_DIR
set -uo pipefail
out=$1
mkdir -p "$out/k"
timeout 420 python benchmarks/kernels.py --out "$out/k" --ms 256 1024 > "$out/k/k.log" 2>&1
tail -n 14 "$out/k/k.log"
cp spear_compile/lowering/tuned/configs_NVIDIA_H200.json "$out/k/" 2>/dev/null
bash benchmarks/device/pack.sh "$out/k"
