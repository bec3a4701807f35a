#!/usr/bin/env bash
# Session 19, call 3: the in-launch prefill EC with its gate weights staged in shared memory - (a) GPU tests;
# (b) SELF_DIAG timing (s19_self_diag.py); (c) benchmarks/kernels.py, five shapes, M = 256 and 1024, every prefill
# structure (in_gemm_self among them), writing the tuned table (copied into the output folder).
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s19_call3.sh OUT_DIR
set -uo pipefail
out=$1
mkdir -p "$out/tests" "$out/k"
timeout 150 python -m pytest -q tests/lowering/test_gemm_wgmma.py -k "(in_launch or in_gemm or ec_step or register_operand) and not compiles and not expansion and not inflight" \
  > "$out/tests/tests_gemm.log" 2>&1
tail -n 4 "$out/tests/tests_gemm.log"
timeout 90 python benchmarks/device/s19_self_diag.py --timing-only > "$out/tests/self_diag.txt" 2>&1
grep -v Warn "$out/tests/self_diag.txt" | tail -4
bash benchmarks/device/pack.sh "$out/tests"
timeout 240 python benchmarks/kernels.py --shapes 4096x4096 11008x4096 4096x11008 8192x8192 28672x8192 \
  --ms 256 1024 --out "$out/k" > "$out/k/k.log" 2>&1
tail -n 16 "$out/k/k.log"
cp spear_compile/lowering/tuned/configs_NVIDIA_H200.json "$out/k/"
bash benchmarks/device/pack.sh "$out/k"
