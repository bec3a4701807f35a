#!/usr/bin/env bash
# Session 13, call 4: where the TMA EC pair's time goes (benchmarks/ec_tma_parts.py).
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/ec_parts_h200.sh OUT_DIR  (packed as OUT_DIR.tgz)
set -uo pipefail
out=$1
mkdir -p "$out"
timeout 200 python benchmarks/ec_tma_parts.py --out "$out" --profile --shapes 8192x8192:64 12288x4096:192 2>&1 | tee "$out/parts.log" | tail -n 20
bash benchmarks/device/pack.sh "$out"
