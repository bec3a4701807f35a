#!/usr/bin/env bash
# Session 18, call 4: (1) GPU tests of the split-K shrink (4 programs per SM, at most 16 slices) and in_gemm_sk;
# (2) benchmarks/kernels.py, five shapes, M = 256 and 1024, all providers and every prefill EC structure (now with
# in_gemm_sk) in one run; writes the tuned table (ecstruct entries), copied into the output folder.
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s18_call4.sh OUT_DIR
set -uo pipefail
out=$1
mkdir -p "$out/tests" "$out/k"
timeout 100 python -m pytest -q tests/lowering/test_ec_shrink_splitk.py tests/lowering/test_gemm_wgmma.py \
  -k "splitk or in_gemm or ec_step" > "$out/tests/tests.log" 2>&1
tail -n 3 "$out/tests/tests.log"
bash benchmarks/device/pack.sh "$out/tests"
timeout 420 python benchmarks/kernels.py --shapes 4096x4096 11008x4096 4096x11008 8192x8192 28672x8192 \
  --ms 256 1024 --out "$out/k" > "$out/k/k.log" 2>&1
tail -n 20 "$out/k/k.log"
cp spear_compile/lowering/tuned/configs_NVIDIA_H200.json "$out/k/"
bash benchmarks/device/pack.sh "$out/k"
