#!/usr/bin/env bash
# Session 13, final call: (1) GPU tests of the TMA EC epilogue (concatenated, GLU, norm, graphs), the
# producer and the TMA kernel's EC / GLU / norm configs; (2) E2E batch 1 A/B new-old-new
# (old: SPEAR_NO_TMA_EC=1, the CUDA-core EC pair and no EC norm / GLU fusions); (3) the E2E table at
# batch 1. Each stage is packed as soon as it ends (the device returns at most 8 files).
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/final_s13_h200.sh OUT_DIR
set -uo pipefail
out=$1
mkdir -p "$out/tests"
timeout 110 python -m pytest -q -x tests/lowering/test_gemv_tma_ec.py tests/lowering/test_ec_decode_pdl.py \
  tests/lowering/test_gemv_tma.py -k "ec or compiles or glu or rmsnorm" > "$out/tests/tests.log" 2>&1
tail -n 2 "$out/tests/tests.log"
bash benchmarks/device/pack.sh "$out/tests"
mkdir -p "$out/ab"
for run in new1 old new2; do
  mkdir -p "$out/ab/$run"
  if [ "$run" = old ]; then export SPEAR_NO_TMA_EC=1; else export SPEAR_NO_TMA_EC=0; fi
  timeout 50 python benchmarks/e2e_decode.py --batch 1 --variants ours_w4 spear_ec25 --out "$out/ab/$run" \
    > "$out/ab/$run.log" 2>&1
  echo "$run"; tail -n 2 "$out/ab/$run.log"
done
bash benchmarks/device/pack.sh "$out/ab"
export SPEAR_NO_TMA_EC=0
mkdir -p "$out/table"
timeout 170 python benchmarks/e2e_decode.py --batch 1 --variants bf16 int4_tinygemm ours_w4 spear_ec10 spear_ec25 \
  spear_ec100 unfused_ec25 --out "$out/table" > "$out/table/e2e.log" 2>&1
tail -n 8 "$out/table/e2e.log"
bash benchmarks/device/pack.sh "$out/table"
