#!/usr/bin/env bash
# Session 14, call 1: (1) which decode kernels are not bitwise deterministic run to run
# (benchmarks/determinism.py, session 13's open question); (2) the GPU tests of session 13's changes made
# after its last GPU call (EC rank cap, ec_linear_cat checks, fuse_glu keeping a fused norm); (3) the M = 1
# lab on the TMA shapes with the decode EC pairs (--ec-pdl 64): which pair a single EC takes per shape
# (gemv1tmaec keys; session 13 saw the CUDA-core pair faster at 11008x4096). Each stage packed when done.
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s14_call1.sh OUT_DIR
set -uo pipefail
out=$1
mkdir -p "$out/det"
timeout 200 python benchmarks/determinism.py --out "$out/det" > "$out/det/determinism.log" 2>&1
grep -v '"distinct": 1,' "$out/det/determinism.log" | tail -n 30
bash benchmarks/device/pack.sh "$out/det"
mkdir -p "$out/tests"
timeout 120 python -m pytest -q -x tests/lowering/test_gemv_tma_ec.py tests/lowering/test_ec_decode_pdl.py \
  tests/lowering/test_gemv_tma.py tests/passes -k "ec or compiles or glu or rmsnorm or cat" > "$out/tests/tests.log" 2>&1
tail -n 3 "$out/tests/tests.log"
bash benchmarks/device/pack.sh "$out/tests"
mkdir -p "$out/lab"
timeout 200 python benchmarks/kernels.py --lab gemv --tma --ec-pdl 64 --nibs biased \
  --shapes 11008x4096 8192x8192 28672x8192 --out "$out/lab" > "$out/lab/lab.log" 2>&1
grep -E "x[0-9]+: tinygemm|best|tma ec pair" "$out/lab/lab.log"
bash benchmarks/device/pack.sh "$out/lab"
