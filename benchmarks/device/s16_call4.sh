#!/usr/bin/env bash
# Session 16, call 4: (1) GPU tests of both wgmma GEMMs (the register-operand one also through the table
# dispatch) and of the tuning / dispatch; (2) lab A/B in one process: the register-operand kernel with its
# row-scale loads where used (PF 0) and one step ahead (PF 1), two tiles, three shapes, M = 256 and 1024.
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s16_call4.sh OUT_DIR
set -uo pipefail
out=$1
mkdir -p "$out/tests" "$out/lab"
timeout 200 python -m pytest -q -x tests/lowering/test_gemm_wgmma.py tests/lowering/test_tuning_and_dispatch.py \
  > "$out/tests/tests.log" 2>&1
tail -n 3 "$out/tests/tests.log"
bash benchmarks/device/pack.sh "$out/tests"
timeout 200 python benchmarks/lab_gemm.py --configs --ra 128,256,3,8,0 128,256,3,8,1 64,256,4,4,0 64,256,4,4,1 \
  128,256,3,8,0 --shapes 8192x8192 28672x8192 11008x4096 --ms 1024 256 --out "$out/lab" > "$out/lab/lab.log" 2>&1
tail -n 6 "$out/lab/lab.log"
bash benchmarks/device/pack.sh "$out/lab"
