#!/usr/bin/env bash
# Session 20, call 2: (a) GPU tests of the in-launch prefill EC with split shrink roles (and every in_launch /
# in_gemm structure test); (b) ec_prefill_profile --ra-sweep: the register-operand GEMM alone, with the EC step,
# and with 1 / 2 / 4 shrink roles per x block, every config, on the M = 256 cells and two M = 1024 ones.
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s20_call2.sh OUT_DIR
set -uo pipefail
out=$1
mkdir -p "$out/tests" "$out/sweep"
timeout 240 python -m pytest -q tests/lowering/test_gemm_wgmma.py -k "in_launch or in_gemm_structure or split" \
  > "$out/tests/tests_in_launch.log" 2>&1
tail -n 8 "$out/tests/tests_in_launch.log"
bash benchmarks/device/pack.sh "$out/tests"
timeout 300 python benchmarks/ec_prefill_profile.py --ra-sweep --out "$out/sweep" \
  --shapes 8192x8192 11008x4096 4096x4096 4096x11008 --ms 256 > "$out/sweep/log.txt" 2>&1
timeout 60 python benchmarks/ec_prefill_profile.py --ra-sweep --out "$out/sweep/m1024" \
  --shapes 4096x4096 --ms 1024 > "$out/sweep/log1024.txt" 2>&1
cat "$out/sweep/log.txt" "$out/sweep/log1024.txt" | grep -v Warning | tail -100
bash benchmarks/device/pack.sh "$out/sweep"
