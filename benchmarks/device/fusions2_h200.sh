#!/usr/bin/env bash
# Session 12, second call: the RMSNorm prologue (fuse_rmsnorm) on top of the epilogue fusions, one H200:
#   1. GPU tests of the GLU and RMSNorm kernel paths (+ the sm_90 compile of every variant);
#   2. e2e_decode.py batch 1: bf16, tinygemm, ours_w4 (all fusions), ours_w4_nonorm, ours_w4_s11 (none of
#      this session's), spear_ec25, spear_ec25_nonorm, same run; logits compared within a model;
#   3. e2e_profile.py for ours_w4 (which kernels are left).
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/fusions2_h200.sh OUT_DIR  (packed as OUT_DIR.tgz)
set -uo pipefail
out=$1
mkdir -p "$out/e2e" "$out/profile"
timeout 200 python -m pytest -q -p no:logging tests/lowering/test_gemv_tma.py -k "glu or rmsnorm or compiles" \
  > "$out/tests.txt" 2>&1
tail -n 3 "$out/tests.txt"
timeout 300 python benchmarks/e2e_decode.py --batch 1 --variants bf16 int4_tinygemm ours_w4 ours_w4_nonorm ours_w4_s11 \
  spear_ec25 spear_ec25_nonorm --out "$out/e2e" > "$out/e2e.log" 2>&1
tail -n 8 "$out/e2e.log"
timeout 80 python benchmarks/e2e_profile.py --variants ours_w4 --out "$out/profile" > "$out/profile.log" 2>&1
grep -v Warn "$out/profile.log" | grep -E "kernels|x 32.0|x 64.0" | head -20
bash benchmarks/device/pack.sh "$out"
