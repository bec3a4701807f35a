#!/usr/bin/env bash
# Session 22, call 3 (the last device minutes): kernels.py at M = 256 on the two shapes whose in-launch EC lost in
# call 2 to a tile chosen for the plain W4 GEMM (11008x4096, 4096x4096), now with the EC's own launch config searched
# (the table's ``ecself`` keys); the tuned table (call 2's, shipped) is updated in those cells and copied out.
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s22_call3.sh OUT_DIR
set -uo pipefail
out=$1
mkdir -p "$out/k"
timeout 170 python benchmarks/kernels.py --out "$out/k" --shapes 11008x4096 4096x4096 --ms 256 > "$out/k/k.log" 2>&1
echo "rc $?"
grep -v Warning "$out/k/k.log" | tail -n 6
cp spear_compile/lowering/tuned/configs_NVIDIA_H200.json "$out/k/" 2>/dev/null
bash benchmarks/device/pack.sh "$out/k"
