#!/usr/bin/env bash
# Session 11, last call: four 128-column slices per warp and step (CH = 4) for the TMA GEMV, then the
# table and E2E batch 1 (ours_w4, spear_ec25) with whatever the lab picked. One H200.
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/tma_ch4_h200.sh OUT_DIR  (packed as OUT_DIR.tgz)
set -uo pipefail
out=$1
mkdir -p "$out"
timeout 90 python -m pytest -q tests/lowering/test_gemv_tma.py > "$out/tests_tma.txt" 2>&1
tail -n 2 "$out/tests_tma.txt"
timeout 150 python benchmarks/kernels.py --lab gemv --tma --nibs biased --out "$out/lab" \
  --shapes 4096x4096 11008x4096 4096x11008 8192x8192 28672x8192 12288x4096 22016x4096 32000x4096 \
  > "$out/lab.log" 2>&1
grep -E "x[0-9]+: tinygemm|best" "$out/lab.log"
mkdir -p "$out/e2e"
timeout 80 python benchmarks/e2e_decode.py --batch 1 --variants ours_w4 spear_ec25 --out "$out/e2e" > "$out/e2e.log" 2>&1
tail -n 3 "$out/e2e.log"
bash benchmarks/device/pack.sh "$out"
