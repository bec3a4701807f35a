#!/usr/bin/env bash
# Session 18, call 10: the one-launch TMA EC with the slots read without replicated copies (each thread its own
# element) and the fallback computing every piece: diagnostic 2 (36 cases; calls 6-7: 6-8 wrong first launches)
# and the GPU tests of the file.
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s18_call10.sh OUT_DIR
set -uo pipefail
out=$1
mkdir -p "$out/diag"
timeout 120 python benchmarks/device/s18_tma_self_diag2.py > "$out/diag/diag2.txt" 2>&1
echo "launches with error > 0.005: $(grep -c '|' $out/diag/diag2.txt) of 36 cases"; grep '|' "$out/diag/diag2.txt" | cut -c1-300
timeout 150 python -m pytest -q tests/lowering/test_gemv_tma_self.py tests/lowering/test_ec_self.py > "$out/diag/tests.log" 2>&1
tail -n 3 "$out/diag/tests.log"
bash benchmarks/device/pack.sh "$out/diag"
