#!/usr/bin/env bash
# Session 15, call 5: the wgmma GEMM with 128 rows of x per warpgroup (BM = 256: each expanded tile feeds twice
# the MMAs; call 4 found the expansion, not the MMAs, bounds a step) and the two-fma expansion for integer zero
# points. (1) GPU tests; (2) lab, every config, five shapes, M = 256, 1024, 4096; (3) the diagnostic split of the
# best new config at 8192x8192.
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s15_call5.sh OUT_DIR
set -uo pipefail
out=$1
mkdir -p "$out/tests"
timeout 200 python -m pytest -q -x tests/lowering/test_gemm_wgmma.py > "$out/tests/tests.log" 2>&1
tail -n 15 "$out/tests/tests.log"
bash benchmarks/device/pack.sh "$out/tests"
mkdir -p "$out/lab"
timeout 300 python benchmarks/lab_gemm.py --out "$out/lab" > "$out/lab/lab.log" 2>&1
cat "$out/lab/lab.log" | tail -n 20
bash benchmarks/device/pack.sh "$out/lab"
mkdir -p "$out/diag"
timeout 100 python benchmarks/lab_gemm.py --diag --configs 256,128,4,8 256,128,3,8 --shapes 8192x8192 --ms 1024 4096 \
  --out "$out/diag" > "$out/diag/lab.log" 2>&1
cat "$out/diag/lab.log" | tail -n 10
bash benchmarks/device/pack.sh "$out/diag"
