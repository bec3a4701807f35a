#!/usr/bin/env bash
# Session 12, call 6: the persistent TMA GEMV on one H200 (little device time left: 4 shapes):
#   1. its GPU tests (several row blocks per program, GLU, RMSNorm) and the TMA kernel tests;
#   2. kernels.py --lab gemv --tma on the q/k/v, gate/up, 8192^2 and 28672x8192 shapes -> the tuned
#      table on the device (merged; persistent configs enter only where faster and correct);
#   3. e2e_decode.py batch 1 with that table: bf16, ours_w4, spear_ec25.
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/persist_h200.sh OUT_DIR  (packed as OUT_DIR.tgz)
set -uo pipefail
out=$1
mkdir -p "$out/e2e" "$out/lab"
timeout 100 python -m pytest -q -p no:logging tests/lowering/test_gemv_tma.py -k "persistent or glu or rmsnorm" \
  > "$out/tests.txt" 2>&1
tail -n 2 "$out/tests.txt"
timeout 140 python benchmarks/kernels.py --lab gemv --tma --nibs biased --out "$out/lab" \
  --shapes 12288x4096 22016x4096 8192x8192 28672x8192 > "$out/lab.log" 2>&1
grep -E "x[0-9]+: tinygemm|best" "$out/lab.log"
timeout 100 python benchmarks/e2e_decode.py --batch 1 --variants bf16 ours_w4 spear_ec25 --out "$out/e2e" \
  > "$out/e2e.log" 2>&1
tail -n 4 "$out/e2e.log"
bash benchmarks/device/pack.sh "$out"
