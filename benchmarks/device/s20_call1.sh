#!/usr/bin/env bash
# Session 20, call 1: GPU tests written in session 19 and not yet run there - the in-launch prefill EC with gate
# widths 5 / 8 and a K loop shorter than the ring; every in_launch test; the CUDA-core one-launch decode EC with
# its smaller slot read (T = max(R_P, warps x max(1, 64 / NC_P))) - its GPU tests and diagnostic 3.
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s20_call1.sh OUT_DIR
set -uo pipefail
out=$1
mkdir -p "$out/tests"
timeout 300 python -m pytest -q tests/lowering/test_gemm_wgmma.py -k "in_launch" \
  > "$out/tests/tests_in_launch.log" 2>&1
tail -n 8 "$out/tests/tests_in_launch.log"
timeout 100 python -m pytest -q tests/lowering/test_ec_self.py > "$out/tests/tests_ec_self.log" 2>&1
tail -n 3 "$out/tests/tests_ec_self.log"
timeout 90 python benchmarks/device/s18_ec_self_diag3.py > "$out/tests/diag3.txt" 2>&1
grep -E '^BAD|launches' "$out/tests/diag3.txt" | tail -5
nvidia-smi --query-gpu=name,driver_version --format=csv > "$out/tests/gpu.txt" 2>&1
python -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$out/tests/gpu.txt"
bash benchmarks/device/pack.sh "$out/tests"
