#!/usr/bin/env bash
# Session 18, call 9: the CUDA-core one-launch EC under diagnostic 3 (fresh workspaces, alternating x).
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s18_call9.sh OUT_DIR
set -uo pipefail
out=$1
mkdir -p "$out/diag"
timeout 200 python benchmarks/device/s18_ec_self_diag3.py > "$out/diag/diag3.txt" 2>&1
grep -E '^BAD|launches' "$out/diag/diag3.txt" | tail -30; head -3 "$out/diag/diag3.txt"
bash benchmarks/device/pack.sh "$out/diag"
