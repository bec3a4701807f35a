#!/usr/bin/env bash
# Session 19, call 4: the in-launch prefill EC's GPU tests that call 3's time limit cut (every "in_launch" test:
# ranks 16 / 20 / 64, two configs, three M; several waves and a CUDA graph; the rank-96 fallback).
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s19_call4.sh OUT_DIR
set -uo pipefail
out=$1
mkdir -p "$out/tests"
timeout 400 python -m pytest -q tests/lowering/test_gemm_wgmma.py -k "in_launch or in_gemm_structure" \
  > "$out/tests/tests_in_launch.log" 2>&1
tail -n 6 "$out/tests/tests_in_launch.log"
bash benchmarks/device/pack.sh "$out/tests"
