#!/usr/bin/env bash
# Session 23, call 3: (1) the M = 1 decode EC at r = 16 / 32 / 64, every route side by side (benchmarks/decode_ec_ranks.py);
# (2) the GPU tests of the lowering, the backend and the GPU calibration / sampling paths on the shipped table.
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s23_call3.sh OUT_DIR
set -uo pipefail
out=$1
mkdir -p "$out/ranks"
timeout 150 python benchmarks/decode_ec_ranks.py --out "$out/ranks" > "$out/ranks/ranks.log" 2>&1
echo "rc $?"; grep -v Warning "$out/ranks/ranks.log" | tail -n 14
timeout 380 python -m pytest -q -p no:cacheprovider tests/lowering tests/passes/test_backend.py \
  tests/compensators/test_sampling.py tests/compensators/test_calibrate.py -rf 2>&1 | grep -v Warning > "$out/gpu_tests.txt"
tail -n 15 "$out/gpu_tests.txt"
