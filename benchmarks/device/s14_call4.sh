#!/usr/bin/env bash
# Session 14, call 4 (final): (1) the M = 1 lab with the L2-prefetch configs (PF > 0) against their PF = 0 twins,
# on the shapes the TMA kernel serves (-> tuned table); (2) the E2E table at batch 1 (with 8 eager reruns of each
# compiled step: distinct logits) and at batch 16 for bf16 / ours_w4 / spear_ec25; (3) kernels.py at M = 1
# (all providers, five shapes). Each stage packed when done.
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s14_call4.sh OUT_DIR
set -uo pipefail
out=$1
mkdir -p "$out/lab"
timeout 170 python benchmarks/kernels.py --lab gemv --tma --nibs biased \
  --tma-configs 4,2,2,2,2 4,2,4,2,2 2,2,4,2,2 2,2,2,2,2 4,2,2,2,2,1,0,2 4,2,4,2,2,1,0,1 4,2,4,2,2,1,0,2 \
  2,2,4,2,2,1,0,2 4,2,2,2,2,1,0,4 2,2,2,2,2,1,0,2 \
  --shapes 8192x8192 28672x8192 11008x4096 4096x11008 12288x4096 22016x4096 --out "$out/lab" > "$out/lab/lab.log" 2>&1
grep -E "x[0-9]+: tinygemm|best" "$out/lab/lab.log"
bash benchmarks/device/pack.sh "$out/lab"
mkdir -p "$out/e2e1"
timeout 190 python benchmarks/e2e_decode.py --batch 1 --reruns 8 --variants bf16 int4_tinygemm ours_w4 spear_ec10 \
  spear_ec25 spear_ec100 unfused_ec25 --out "$out/e2e1" > "$out/e2e1/e2e.log" 2>&1
tail -n 8 "$out/e2e1/e2e.log"
grep -o '"variant": "[a-z0-9_]*"\|"distinct_logits_of_reruns": \[[0-9, ]*\]' "$out/e2e1/e2e_decode.json" | tr '\n' ' '; echo
bash benchmarks/device/pack.sh "$out/e2e1"
mkdir -p "$out/e2e16"
timeout 90 python benchmarks/e2e_decode.py --batch 16 --reruns 4 --variants bf16 ours_w4 spear_ec25 --out "$out/e2e16" \
  > "$out/e2e16/e2e.log" 2>&1
tail -n 4 "$out/e2e16/e2e.log"
bash benchmarks/device/pack.sh "$out/e2e16"
mkdir -p "$out/k1"
timeout 110 python benchmarks/kernels.py --ms 1 --out "$out/k1" > "$out/k1/k.log" 2>&1
tail -n 8 "$out/k1/k.log"
bash benchmarks/device/pack.sh "$out/k1"
