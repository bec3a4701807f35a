#!/usr/bin/env bash
# Session 15, call 6: (1) GPU tests of the wgmma GEMM (with the "in_gemm" EC structure) and of the tuning /
# dispatch; (2) benchmarks/kernels.py, five shapes, M = 1, 16, 256, 1024, 4096: every provider in one run, the
# config search now with the wgmma GEMM among the GEMM choices and "in_gemm" among the EC structures; writes the
# tuned tables (copied into the output folder).
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s15_call6.sh OUT_DIR
set -uo pipefail
out=$1
mkdir -p "$out/tests"
timeout 150 python -m pytest -q -x tests/lowering/test_gemm_wgmma.py tests/lowering/test_tuning_and_dispatch.py \
  > "$out/tests/tests.log" 2>&1
tail -n 5 "$out/tests/tests.log"
bash benchmarks/device/pack.sh "$out/tests"
mkdir -p "$out/k"
timeout 400 python benchmarks/kernels.py --shapes 4096x4096 11008x4096 4096x11008 8192x8192 28672x8192 \
  --ms 1 16 256 1024 4096 --out "$out/k" > "$out/k/k.log" 2>&1
tail -n 40 "$out/k/k.log"
bash benchmarks/device/pack.sh "$out/k"
