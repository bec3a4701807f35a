#!/usr/bin/env bash
# Session 19, call 5: call 3's kernels.py run repeated (M = 256 / 1024, five shapes) on the shipped table, for the
# run-to-run spread of the prefill EC ratios with in_gemm_self.
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s19_call5.sh OUT_DIR
set -uo pipefail
out=$1
mkdir -p "$out/k"
timeout 240 python benchmarks/kernels.py --shapes 4096x4096 11008x4096 4096x11008 8192x8192 28672x8192 \
  --ms 256 1024 --out "$out/k" > "$out/k/k.log" 2>&1
tail -n 14 "$out/k/k.log"
cp spear_compile/lowering/tuned/configs_NVIDIA_H200.json "$out/k/"
bash benchmarks/device/pack.sh "$out/k"
