#!/usr/bin/env bash
# Session 14, last determinism call: every kernel kind of the decode step (determinism.py, now also SDPA with
# e2e_decode's boolean mask) over 300 back-to-back runs at batch 1 and 16, to catch rare differences
# (determinism_e2e.py saw one ours_w4 rerun in 32 differ from layer 19 on).
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s14_det3.sh OUT_DIR
set -uo pipefail
out=$1
mkdir -p "$out"
timeout 200 python benchmarks/determinism.py --reps 300 --out "$out" > "$out/determinism.log" 2>&1
grep -v '"distinct": 1,' "$out/determinism.log" | cut -c1-300 | tail -n 20
bash benchmarks/device/pack.sh "$out"
