#!/usr/bin/env bash
# For session 14 (written in session 13, not run): which decode kernels are not bitwise deterministic.
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/determinism_h200.sh OUT_DIR  (packed as OUT_DIR.tgz)
set -uo pipefail
out=$1
mkdir -p "$out"
timeout 200 python benchmarks/determinism.py --out "$out" > "$out/determinism.log" 2>&1
grep -v '"distinct": 1,' "$out/determinism.log" | tail -n 20
bash benchmarks/device/pack.sh "$out"
