#!/usr/bin/env bash
# Session 13, call 3: the TMA EC epilogue with its operands prefetched before the K loop. (1) its GPU
# tests; (2) E2E batch 1 old (SPEAR_NO_TMA_EC=1) / new, twice; (3) kernels.py at M = 1 new and old
# (fixed warm-up); (4) batch 16 ours_w4 / ours_w4_s11 with the run-to-run determinism probe.
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/ec_tma2_h200.sh OUT_DIR  (packed as OUT_DIR.tgz)
set -uo pipefail
out=$1
mkdir -p "$out"
timeout 120 python -m pytest -q -x tests/lowering/test_gemv_tma_ec.py tests/lowering/test_ec_decode_pdl.py \
  > "$out/tests.log" 2>&1
tail -n 2 "$out/tests.log"
for run in old1 new1 old2 new2; do
  mkdir -p "$out/$run"
  if [ "${run#old}" != "$run" ]; then export SPEAR_NO_TMA_EC=1; else export SPEAR_NO_TMA_EC=0; fi
  timeout 60 python benchmarks/e2e_decode.py --batch 1 --variants ours_w4 spear_ec25 --out "$out/$run" \
    > "$out/$run.log" 2>&1
  echo "$run"; tail -n 2 "$out/$run.log"
done
for run in knew kold; do
  mkdir -p "$out/$run"
  if [ "$run" = kold ]; then export SPEAR_NO_TMA_EC=1; else export SPEAR_NO_TMA_EC=0; fi
  timeout 100 python benchmarks/kernels.py --ms 1 --out "$out/$run" > "$out/$run.log" 2>&1
  echo "$run"; tail -n 7 "$out/$run.log"
done
export SPEAR_NO_TMA_EC=0
mkdir -p "$out/b16"
timeout 80 python benchmarks/e2e_decode.py --batch 16 --variants ours_w4 ours_w4_s11 --out "$out/b16" > "$out/b16.log" 2>&1
grep -o '"variant": "[a-z0-9_]*"\|"rerun_bitwise_equal": [a-z]*\|"value": [0-9.e-]*' "$out/b16/e2e_decode.json" | tr '\n' ' '; echo
bash benchmarks/device/pack.sh "$out"
