#!/usr/bin/env bash
# Session 16, call 5: (1) GPU tests of both wgmma GEMMs and the tuning / dispatch (call 4 stopped at a test
# that used CPU tensors on the GPU machine: fixed); (2) benchmarks/kernels.py, five shapes, M = 1, 16, 256,
# 1024, 4096, all providers in one run, the register-operand GEMM among the searched GEMMs; writes the tuned
# tables (copied into the output folder).
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s16_call5.sh OUT_DIR
set -uo pipefail
out=$1
mkdir -p "$out/tests" "$out/k"
timeout 140 python -m pytest -q tests/lowering/test_gemm_wgmma.py tests/lowering/test_tuning_and_dispatch.py \
  > "$out/tests/tests.log" 2>&1
tail -n 3 "$out/tests/tests.log"
bash benchmarks/device/pack.sh "$out/tests"
timeout 430 python benchmarks/kernels.py --shapes 4096x4096 11008x4096 4096x11008 8192x8192 28672x8192 \
  --ms 1 16 256 1024 4096 --out "$out/k" > "$out/k/k.log" 2>&1
tail -n 30 "$out/k/k.log"
bash benchmarks/device/pack.sh "$out/k"
