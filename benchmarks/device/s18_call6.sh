#!/usr/bin/env bash
# Session 18, call 6 (call 5 again, 12 repetitions, the wrong launches analysed): the one-launch TMA EC failure in the test order (s18_tma_self_diag2.py), then the test file.
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s18_call6.sh OUT_DIR
set -uo pipefail
out=$1
mkdir -p "$out/diag"
timeout 200 python benchmarks/device/s18_tma_self_diag2.py > "$out/diag/diag2.txt" 2>&1
cat "$out/diag/diag2.txt" | cut -c1-400
bash benchmarks/device/pack.sh "$out/diag"
