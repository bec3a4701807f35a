#!/usr/bin/env bash
# Session 18, call 2: (a) GPU tests of the split-K shrink + gate and of "in_gemm_sk" (the register-operand GEMM
# launched by PDL behind it), and the one-launch TMA EC diagnostic; (b) ec_prefill_profile on call 1's cells:
# shrink_gate_sk alone, in_gemm against in_gemm_sk in one process.
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s18_call2.sh OUT_DIR
set -uo pipefail
out=$1
mkdir -p "$out/tests" "$out/profile"
timeout 150 python -m pytest -q tests/lowering/test_ec_shrink_splitk.py tests/lowering/test_gemm_wgmma.py \
  -k "splitk or in_gemm or ec_step" > "$out/tests/tests.log" 2>&1
tail -n 4 "$out/tests/tests.log"
timeout 100 python benchmarks/device/s18_tma_self_diag.py > "$out/tests/tma_self_diag.txt" 2>&1
tail -n 20 "$out/tests/tma_self_diag.txt"
timeout 300 python benchmarks/ec_prefill_profile.py --out "$out/profile" \
  --shapes 4096x4096 8192x8192 11008x4096 --ms 256 1024 > "$out/profile/log.txt" 2>&1
grep -E "ra |ra_ec|shrink|in_gemm" "$out/profile/log.txt"
bash benchmarks/device/pack.sh "$out/tests"
bash benchmarks/device/pack.sh "$out/profile"
