#!/usr/bin/env bash
# Session 12, last call: the shipped code (two-pass RMSNorm prologue, bias requested early) on one H200:
#   1. GPU tests of the TMA kernel paths (plain, GLU, RMSNorm, dispatch);
#   2. the E2E table: batch 1 and 16, bf16, tinygemm, ours_w4, spear_ec10/25/100, unfused_ec25, and
#      ours_w4_s11 / spear_ec25_s11 (without this session's decode fusions), same run.
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/final_s12_h200.sh OUT_DIR  (packed as OUT_DIR.tgz)
set -uo pipefail
out=$1
mkdir -p "$out/e2e"
timeout 150 python -m pytest -q -p no:logging tests/lowering/test_gemv_tma.py > "$out/tests.txt" 2>&1
tail -n 2 "$out/tests.txt"
timeout 330 python benchmarks/e2e_decode.py --batch 1 16 --variants bf16 int4_tinygemm ours_w4 ours_w4_s11 spear_ec10 \
  spear_ec25 spear_ec25_s11 spear_ec100 unfused_ec25 --out "$out/e2e" > "$out/e2e.log" 2>&1
tail -n 19 "$out/e2e.log"
bash benchmarks/device/pack.sh "$out"
