#!/usr/bin/env bash
# Session 15, call 10: the GPU tests of the shipped code after the last refactor (one epilogue helper for both
# wgmma kernels; offline SASS identical), with the TMA GEMV and tuning / dispatch tests.
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s15_call10.sh OUT_DIR
set -uo pipefail
out=$1
mkdir -p "$out/tests"
timeout 240 python -m pytest -q tests/lowering/test_gemm_wgmma.py tests/lowering/test_tuning_and_dispatch.py \
  tests/lowering/test_gemv_tma.py tests/lowering/test_gemv_tma_ec.py > "$out/tests/tests.log" 2>&1
tail -n 3 "$out/tests/tests.log"
bash benchmarks/device/pack.sh "$out/tests"
