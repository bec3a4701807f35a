#!/usr/bin/env bash
# Session 13, call 6: the decode EC with producer CTAs in the TMA GEMV's grid. (1) GPU tests; (2) the
# pair's parts incl. the in-grid variant (benchmarks/ec_tma_parts.py); (3) E2E batch 1 old
# (SPEAR_NO_TMA_EC=1) / new, twice; (4) kernels.py at M = 1.
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/ec_grid_h200.sh OUT_DIR  (packed as OUT_DIR.tgz)
set -uo pipefail
out=$1
mkdir -p "$out"
timeout 150 python -m pytest -q -x tests/lowering/test_gemv_tma_ec.py tests/lowering/test_ec_decode_pdl.py \
  tests/lowering/test_gemv_tma.py -k "ec or compiles or rmsnorm or glu" > "$out/tests.log" 2>&1
tail -n 2 "$out/tests.log"
timeout 90 python benchmarks/ec_tma_parts.py --out "$out/parts" > "$out/parts.log" 2>&1
grep -E "^[0-9]+x" "$out/parts.log"
for run in old1 new1 old2 new2; do
  mkdir -p "$out/$run"
  if [ "${run#old}" != "$run" ]; then export SPEAR_NO_TMA_EC=1; else export SPEAR_NO_TMA_EC=0; fi
  timeout 60 python benchmarks/e2e_decode.py --batch 1 --variants ours_w4 spear_ec25 --out "$out/$run" \
    > "$out/$run.log" 2>&1
  echo "$run"; tail -n 2 "$out/$run.log"
done
export SPEAR_NO_TMA_EC=0
mkdir -p "$out/kernels"
timeout 100 python benchmarks/kernels.py --ms 1 --out "$out/kernels" > "$out/kernels.log" 2>&1
tail -n 7 "$out/kernels.log"
bash benchmarks/device/pack.sh "$out"
