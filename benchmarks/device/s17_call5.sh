#!/usr/bin/env bash
# Session 17, call 5: GPU regression tests of what the session touched beyond the one-launch EC's own tests -
# the Triton kernels (the M = 1 kernel's EC modes changed), the fusion passes and the backend that route decode
# ECs, the QuantLinear op - on the shipped table (call 4's).
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s17_call5.sh OUT_DIR
set -uo pipefail
out=$1
mkdir -p "$out/tests"
timeout 280 python -m pytest -q tests/lowering/test_triton_kernels.py tests/passes/test_backend.py \
  tests/passes/test_fuse_glu.py tests/passes/test_fuse_rmsnorm.py tests/passes/test_fuse_shared_input.py \
  tests/quant/test_linear.py > "$out/tests/tests.log" 2>&1
tail -n 6 "$out/tests/tests.log"
bash benchmarks/device/pack.sh "$out/tests"
