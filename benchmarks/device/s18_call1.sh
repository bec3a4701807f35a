#!/usr/bin/env bash
# Session 18, call 1: (a) the GPU tests left unverified by session 17 - the fuse_glu / fuse_rmsnorm lossy
# round-trip checks rewritten for torch 2.11, and the one-launch EC after the a1f8723 refactor; (b) where the
# prefill EC's "in_gemm" overhead goes on the cells that miss 1.10x (ec_prefill_profile: ra, ra_ec, shrink_gate,
# in_gemm and the other structures, same process).
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s18_call1.sh OUT_DIR
set -uo pipefail
out=$1
mkdir -p "$out/tests" "$out/profile"
timeout 200 python -m pytest -q tests/passes/test_fuse_glu.py tests/passes/test_fuse_rmsnorm.py \
  tests/lowering/test_ec_self.py tests/lowering/test_gemv_tma_self.py > "$out/tests/tests.log" 2>&1
tail -n 8 "$out/tests/tests.log"
timeout 300 python benchmarks/ec_prefill_profile.py --out "$out/profile" \
  --shapes 4096x4096 8192x8192 11008x4096 --ms 256 1024 > "$out/profile/log.txt" 2>&1
tail -n 5 "$out/profile/log.txt"
bash benchmarks/device/pack.sh "$out/tests"
bash benchmarks/device/pack.sh "$out/profile"
