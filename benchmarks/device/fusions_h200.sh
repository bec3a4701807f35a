#!/usr/bin/env bash
# Session 12: the decode epilogue fusions (fold_residual_add, fuse_glu) on one H200:
#   1. the GLU kernel's GPU tests (epilogue vs reference, the op's table-driven dispatch) + sm_90 compile;
#   2. e2e_decode.py batch 1: bf16, tinygemm, ours_w4 (defaults: both fusions) against ours_w4_s11 (both
#      off), _noglu, _nofold, and spear_ec25 / spear_ec25_s11, same run; logits compared within a model;
#   3. e2e_profile.py for ours_w4 and ours_w4_s11 (which kernels went).
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/fusions_h200.sh OUT_DIR  (packed as OUT_DIR.tgz)
set -uo pipefail
out=$1
mkdir -p "$out/e2e" "$out/profile"
timeout 150 python -m pytest -q -p no:logging tests/lowering/test_gemv_tma.py -k "glu or compiles" > "$out/tests_glu.txt" 2>&1
tail -n 3 "$out/tests_glu.txt"
timeout 330 python benchmarks/e2e_decode.py --batch 1 --variants bf16 int4_tinygemm ours_w4 ours_w4_s11 ours_w4_noglu \
  ours_w4_nofold spear_ec25 spear_ec25_s11 --out "$out/e2e" > "$out/e2e.log" 2>&1
tail -n 9 "$out/e2e.log"
timeout 100 python benchmarks/e2e_profile.py --variants ours_w4 ours_w4_s11 --out "$out/profile" > "$out/profile.log" 2>&1
grep -v Warn "$out/profile.log" | grep -E "kernels|x 32.0" | head -30
bash benchmarks/device/pack.sh "$out"
