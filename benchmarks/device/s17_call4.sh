#!/usr/bin/env bash
# Session 17, call 4: the one-launch decode EC with owners by ticket (the first programs to start own the pieces,
# not the lowest program ids), the gate layouts of call 2 back (call 3 measured its free-conversion layouts
# slower), back-off capped at 512 ns. (1) GPU tests; (2) the M = 1 lab as in calls 1-2 (writes the tuned table);
# (3) kernels.py at M = 1 on that table; (4) E2E decode, batch 1: ours W4 and SPEAR 25 % (on that table).
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s17_call4.sh OUT_DIR
set -uo pipefail
out=$1
mkdir -p "$out/tests" "$out/lab" "$out/k" "$out/e2e"
timeout 110 python -m pytest -q tests/lowering/test_ec_self.py tests/lowering/test_gemv_tma_self.py \
  tests/lowering/test_gemv_tma_ec.py tests/lowering/test_tuning_and_dispatch.py > "$out/tests/tests.log" 2>&1
tail -n 4 "$out/tests/tests.log"
bash benchmarks/device/pack.sh "$out/tests"
timeout 200 python benchmarks/kernels.py --lab gemv --tma --nibs biased --ec-pdl 64 \
  --tma-configs 4,2,2,2,2 4,2,4,2,2 2,2,4,2,2 2,2,2,2,2 8,2,2,2,2 4,4,2,2,2 \
  --shapes 4096x4096 11008x4096 4096x11008 8192x8192 28672x8192 --out "$out/lab" > "$out/lab/lab.log" 2>&1
grep -E "x[0-9]+: tinygemm|one-launch" "$out/lab/lab.log"
bash benchmarks/device/pack.sh "$out/lab"
timeout 100 python benchmarks/kernels.py --shapes 4096x4096 11008x4096 4096x11008 8192x8192 28672x8192 \
  --ms 1 --out "$out/k" > "$out/k/k.log" 2>&1
tail -n 9 "$out/k/k.log"
bash benchmarks/device/pack.sh "$out/k"
timeout 120 python benchmarks/e2e_decode.py --batch 1 --variants bf16 int4_tinygemm ours_w4 spear_ec25 \
  --out "$out/e2e" > "$out/e2e/e2e.log" 2>&1
tail -n 8 "$out/e2e/e2e.log"
bash benchmarks/device/pack.sh "$out/e2e"
