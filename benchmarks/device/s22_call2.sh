#!/usr/bin/env bash
# Session 22, call 2: kernels.py at M = 1024 / 256 / 4096 with PF = 2 configs (row parameters through the TMA ring)
# searched beside PF = 0; every provider is checked against the reference there (incl. the EC structures on the
# register-operand GEMM with PF = 2). The tuned table is copied out. (Rows are written as they finish.)
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s22_call2.sh OUT_DIR
set -uo pipefail
out=$1
mkdir -p "$out/k"
timeout 560 python benchmarks/kernels.py --out "$out/k" --ms 1024 256 4096 > "$out/k/k.log" 2>&1
echo "rc $?"
grep -v Warning "$out/k/k.log" | tail -n 24
cp spear_compile/lowering/tuned/configs_NVIDIA_H200.json "$out/k/" 2>/dev/null
bash benchmarks/device/pack.sh "$out/k"
