#!/usr/bin/env bash
# Session 17, call 2: the one-launch decode EC after call 1 - the TMA form publishes its pieces after the first
# K step and reads the slots during the last one; waiting CTAs back off (nanosleep) between re-reads. (1) GPU
# tests (the TMA tests now on shapes whose A fits its CTAs); (2) the M = 1 lab as in call 1 (with the TMA form's
# parts timed); (3) kernels.py at M = 1; (4) the wgmma tests call 1 did not reach.
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s17_call2.sh OUT_DIR
set -uo pipefail
out=$1
mkdir -p "$out/tests" "$out/lab" "$out/k" "$out/tests2"
timeout 150 python -m pytest -q tests/lowering/test_ec_self.py tests/lowering/test_gemv_tma_self.py \
  tests/lowering/test_gemv_tma_ec.py tests/lowering/test_ec_decode_pdl.py > "$out/tests/tests.log" 2>&1
tail -n 4 "$out/tests/tests.log"
bash benchmarks/device/pack.sh "$out/tests"
timeout 220 python benchmarks/kernels.py --lab gemv --tma --nibs biased --ec-pdl 64 \
  --tma-configs 4,2,2,2,2 4,2,4,2,2 2,2,4,2,2 2,2,2,2,2 8,2,2,2,2 4,4,2,2,2 \
  --shapes 4096x4096 11008x4096 4096x11008 8192x8192 28672x8192 --out "$out/lab" > "$out/lab/lab.log" 2>&1
grep -E "x[0-9]+: tinygemm|best|tma ec pair|one-launch" "$out/lab/lab.log"
bash benchmarks/device/pack.sh "$out/lab"
timeout 110 python benchmarks/kernels.py --shapes 4096x4096 11008x4096 4096x11008 8192x8192 28672x8192 \
  --ms 1 --out "$out/k" > "$out/k/k.log" 2>&1
tail -n 12 "$out/k/k.log"
bash benchmarks/device/pack.sh "$out/k"
timeout 120 python -m pytest -q tests/lowering/test_tuning_and_dispatch.py tests/lowering/test_gemm_wgmma.py -k "dispatch or tuning or table or refuses_fractional or behind_the_gate" \
  > "$out/tests2/tests.log" 2>&1
tail -n 3 "$out/tests2/tests.log"
bash benchmarks/device/pack.sh "$out/tests2"
