#!/usr/bin/env bash
# Session 18, call 3: (a) the one-launch TMA EC GPU tests three times over (call 1's sporadic failure: how
# often); (b) ec_prefill_profile with the split-K shrink at 1 and 4 programs per SM.
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s18_call3.sh OUT_DIR
set -uo pipefail
out=$1
mkdir -p "$out/tests" "$out/profile"
for i in 1 2 3; do
  timeout 60 python -m pytest -q tests/lowering/test_gemv_tma_self.py -k matches_reference > "$out/tests/tma_self_$i.log" 2>&1
  tail -n 2 "$out/tests/tma_self_$i.log"
done
timeout 300 python benchmarks/ec_prefill_profile.py --out "$out/profile" \
  --shapes 4096x4096 8192x8192 11008x4096 --ms 256 1024 > "$out/profile/log.txt" 2>&1
grep -E "ra |ra_ec|shrink|in_gemm" "$out/profile/log.txt"
bash benchmarks/device/pack.sh "$out/tests"
bash benchmarks/device/pack.sh "$out/profile"
