#!/usr/bin/env bash
# Session 19, call 1: (a) GPU tests of the in-launch prefill EC ("in_gemm_self", ec_gemm_self.py) and of the
# register-operand GEMM around it, of the CUDA-core one-launch decode EC after its slot-read fix; (b) diagnostic 3
# on that decode EC (fresh workspaces, alternating x); (c) ec_prefill_profile: ra, ra_ec, ra_self and every
# structure (in_gemm_self among them) on the shapes and M of session 18 call 1.
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s19_call1.sh OUT_DIR
set -uo pipefail
out=$1
mkdir -p "$out/tests" "$out/profile"
timeout 150 python -m pytest -q tests/lowering/test_gemm_wgmma.py -k "(in_launch or in_gemm or ec_step or register_operand) and not compiles and not expansion and not inflight" \
  > "$out/tests/tests_gemm.log" 2>&1
tail -n 6 "$out/tests/tests_gemm.log"
timeout 100 python -m pytest -q tests/lowering/test_ec_self.py > "$out/tests/tests_ec_self.log" 2>&1
tail -n 3 "$out/tests/tests_ec_self.log"
timeout 90 python benchmarks/device/s18_ec_self_diag3.py > "$out/tests/diag3.txt" 2>&1
grep -E '^BAD|launches' "$out/tests/diag3.txt" | tail -5
bash benchmarks/device/pack.sh "$out/tests"
timeout 300 python benchmarks/ec_prefill_profile.py --out "$out/profile" \
  --shapes 4096x4096 8192x8192 11008x4096 --ms 256 1024 > "$out/profile/log.txt" 2>&1
grep -E "ra |ra_ec|ra_self|in_gemm |in_gemm_self|shrink_gate " "$out/profile/log.txt" | tail -40
bash benchmarks/device/pack.sh "$out/profile"
