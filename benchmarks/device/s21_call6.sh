#!/usr/bin/env bash
# Session 21, call 6 (the last device minutes): GPU tests of everything the session touched - stream-K (with the
# delayed partials that make the owners wait on their flags), the plain kernel after the K-loop refactor, and
# the in-launch EC / split roles (deep ring on) that run through the refactored tile code.
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s21_call6.sh OUT_DIR
set -uo pipefail
out=$1
mkdir -p "$out/tests"
timeout 270 python -m pytest -q tests/lowering/test_gemm_wgmma.py \
  -k "stream_k or register_operand_kernel_matches or in_launch or split" > "$out/tests/tests.log" 2>&1
tail -n 15 "$out/tests/tests.log"
bash benchmarks/device/pack.sh "$out/tests"
