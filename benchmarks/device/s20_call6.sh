#!/usr/bin/env bash
# Session 20, call 6 (the last minutes of device time): s20_self_diag.py at 4096^2 M = 256.
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s20_call6.sh OUT_DIR
set -uo pipefail
out=$1
mkdir -p "$out/diag"
timeout 150 python benchmarks/device/s20_self_diag.py > "$out/diag/self_diag.txt" 2>&1
grep -v Warning "$out/diag/self_diag.txt" | grep us | tail -30
bash benchmarks/device/pack.sh "$out/diag"
