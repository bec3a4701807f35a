#!/usr/bin/env bash
# Next session, call 1 (written in session 20): GPU tests of the split shrink roles with the deeper role ring
# (ec_gemm_self.ROLE_DEEP, off until these pass) and the sweep with /deep parts at the cells it is meant for.
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s21_call1.sh OUT_DIR
set -uo pipefail
out=$1
mkdir -p "$out/tests" "$out/sweep"
timeout 240 python -m pytest -q tests/lowering/test_gemm_wgmma.py -k "in_launch or split" \
  > "$out/tests/tests.log" 2>&1
tail -n 8 "$out/tests/tests.log"
bash benchmarks/device/pack.sh "$out/tests"
timeout 300 python benchmarks/ec_prefill_profile.py --ra-sweep --out "$out/sweep" \
  --shapes 4096x4096 4096x11008 11008x4096 --ms 256 > "$out/sweep/log.txt" 2>&1
grep -v Warning "$out/sweep/log.txt" | tail -60
bash benchmarks/device/pack.sh "$out/sweep"
