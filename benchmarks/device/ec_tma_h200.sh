#!/usr/bin/env bash
# Session 13, call 2: the decode EC in the TMA GEMV's epilogue and the RMSNorm fused into EC
# concatenations. (1) their GPU tests and the TMA / PDL kernel tests; (2) E2E batch 1 ours_w4 and
# spear_ec25 with SPEAR_NO_TMA_EC=1 (old: CUDA-core EC pair, norm kernels kept for EC layers) and
# without (new), old-new-old-new in one call; (3) kernels.py at M = 1 (W4+EC fused against our W4).
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/ec_tma_h200.sh OUT_DIR  (packed as OUT_DIR.tgz)
set -uo pipefail
out=$1
mkdir -p "$out"
timeout 230 python -m pytest -q -x tests/lowering/test_gemv_tma_ec.py tests/lowering/test_ec_decode_pdl.py \
  tests/lowering/test_gemv_tma.py > "$out/tests.log" 2>&1
tail -n 3 "$out/tests.log"
for run in old1 new1 old2 new2; do
  mkdir -p "$out/$run"
  if [ "${run#old}" != "$run" ]; then export SPEAR_NO_TMA_EC=1; else export SPEAR_NO_TMA_EC=0; fi
  timeout 70 python benchmarks/e2e_decode.py --batch 1 --variants ours_w4 spear_ec25 --out "$out/$run" \
    > "$out/$run.log" 2>&1
  echo "$run"; tail -n 2 "$out/$run.log"
done
export SPEAR_NO_TMA_EC=0
mkdir -p "$out/kernels"
timeout 140 python benchmarks/kernels.py --ms 1 --out "$out/kernels" > "$out/kernels.log" 2>&1
tail -n 9 "$out/kernels.log"
bash benchmarks/device/pack.sh "$out"
