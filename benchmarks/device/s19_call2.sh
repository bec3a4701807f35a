#!/usr/bin/env bash
# Session 19, call 2: the in-launch prefill EC's wrong results (R = 20, 64) and its time (SELF_DIAG variants).
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s19_call2.sh OUT_DIR
set -uo pipefail
out=$1
mkdir -p "$out/diag"
timeout 240 python benchmarks/device/s19_self_diag.py --timing-only > "$out/diag/self_diag.txt" 2>&1
cat "$out/diag/self_diag.txt" | grep -v Warning | tail -40
bash benchmarks/device/pack.sh "$out/diag"
