#!/usr/bin/env bash
# Session 10: the prefill EC on one H200, in one call (run at commit 8918269 to test a split-K
# Triton shrink, since removed: results/raw/session10_shrink/):
#   1. the CUDA tests of the prefill EC kernels (every structure);
#   2. benchmarks/ec_prefill_profile.py: every part, all five shapes, M = 256 / 1024 / 4096;
#   3. benchmarks/kernels.py --quick on the same cells: re-times the structures and writes the
#      tuned table (ecstruct entries) it picked.
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/ec_shrink_h200.sh OUT_DIR  (packed as OUT_DIR.tgz)
set -uo pipefail
out=$1
mkdir -p "$out"
shapes="4096x4096 11008x4096 4096x11008 8192x8192 28672x8192"
python -m pytest -q tests/lowering/test_triton_kernels.py tests/lowering/test_tuning_and_dispatch.py \
  -k "shrink or c_operand or overlapped or structure or dispatch" > "$out/tests.txt" 2>&1
tail -n 2 "$out/tests.txt"
timeout 200 python benchmarks/ec_prefill_profile.py --out "$out/profile" --shapes $shapes --ms 256 1024 4096 \
  > "$out/profile.log" 2>&1
tail -n 3 "$out/profile.log"
timeout 300 python benchmarks/kernels.py --out "$out/kernels" --quick --shapes $shapes --ms 256 1024 4096 \
  > "$out/kernels.log" 2>&1
tail -n 3 "$out/kernels.log"
bash benchmarks/device/pack.sh "$out"
