#!/usr/bin/env bash
# Session 12, third call: bias requested before the v4 GEMV's loop, RMSNorm prologue in one memory
# round trip; one H200:
#   1. GPU tests: the GLU / RMSNorm / TMA kernel paths, the v4 GEMV (bias) and the PDL EC pair;
#   2. e2e_decode.py batch 1: bf16, tinygemm, ours_w4, ours_w4_nonorm, ours_w4_s11, spear_ec25, same run;
#   3. e2e_profile.py for ours_w4.
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/fusions3_h200.sh OUT_DIR  (packed as OUT_DIR.tgz)
set -uo pipefail
out=$1
mkdir -p "$out/e2e" "$out/profile"
timeout 150 python -m pytest -q -p no:logging tests/lowering/test_gemv_tma.py -k "glu or rmsnorm or matches_reference" \
  tests/lowering/test_ec_decode_pdl.py > "$out/tests.txt" 2>&1
tail -n 3 "$out/tests.txt"
timeout 120 python -m pytest -q -p no:logging tests/lowering/test_triton_kernels.py -k "gemv" > "$out/tests_v4.txt" 2>&1
tail -n 3 "$out/tests_v4.txt"
timeout 200 python benchmarks/e2e_decode.py --batch 1 --variants bf16 int4_tinygemm ours_w4 ours_w4_nonorm ours_w4_s11 \
  spear_ec25 --out "$out/e2e" > "$out/e2e.log" 2>&1
tail -n 7 "$out/e2e.log"
timeout 80 python benchmarks/e2e_profile.py --variants ours_w4 --out "$out/profile" > "$out/profile.log" 2>&1
grep -v Warn "$out/profile.log" | grep -E "kernels|x 32.0|x 64.0" | head -12
bash benchmarks/device/pack.sh "$out"
