#!/usr/bin/env bash
# Session 21, call 4: the stream-K tail with only the last partial wave streamed: its GPU test on the natural plan,
# then the lab: SK against the plain tiles (each twice for the spread), cuBLAS and dequantize + cuBLAS in one
# process at M = 1024 / 4096.
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s21_call4.sh OUT_DIR
set -uo pipefail
out=$1
mkdir -p "$out/tests" "$out/lab"
timeout 150 python -m pytest -q -x tests/lowering/test_gemm_wgmma.py -k "stream_k and None" \
  > "$out/tests/tests.log" 2>&1
tail -n 15 "$out/tests/tests.log"
bash benchmarks/device/pack.sh "$out/tests"
timeout 300 python benchmarks/lab_gemm.py --out "$out/lab" --configs --ra 128,256,3,8 128,256,3,8,0,1 128,256,4,8 \
  128,256,4,8,0,1 128,256,3,8 128,256,3,8,0,1 --shapes 11008x4096 8192x8192 28672x8192 4096x11008 --ms 1024 4096 \
  > "$out/lab/log.txt" 2>&1
grep -v Warning "$out/lab/log.txt" | tail -20
bash benchmarks/device/pack.sh "$out/lab"
