#!/usr/bin/env bash
# Session 23, call 4: the per-rank decode-EC choice measured into the tuned table (decode_ec_ranks.py --write-table),
# the same run again reading that table (the dispatch should now take the fastest route at every rank), then the GPU
# tests of the one-launch EC, the dispatch and the in-launch prefill EC.
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s23_call4.sh OUT_DIR
set -uo pipefail
out=$1
mkdir -p "$out/w" "$out/v"
timeout 120 python benchmarks/decode_ec_ranks.py --out "$out/w" --write-table > "$out/w/ranks.log" 2>&1
echo "rc $?"; grep -v Warning "$out/w/ranks.log" | tail -n 12
timeout 120 python benchmarks/decode_ec_ranks.py --out "$out/v" > "$out/v/ranks.log" 2>&1
echo "rc $?"; grep -v Warning "$out/v/ranks.log" | tail -n 12
timeout 240 python -m pytest -q -p no:cacheprovider tests/lowering/test_gemv_tma_self.py tests/lowering/test_ec_self.py \
  tests/lowering/test_tuning_and_dispatch.py -rf 2>&1 | grep -v Warning > "$out/gpu_tests.txt"
tail -n 6 "$out/gpu_tests.txt"
