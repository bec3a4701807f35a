#!/usr/bin/env bash
# Written in session 12 for the next session (no device time was left): a tile search for the decode
# EC's PDL pair at the shapes the E2E model's EC layers run (q/k/v concatenation r = 3 x 64, gate/up
# r = 2 x 64, o and down r = 64) -> gemv1pdl entries of the tuned table on the device, then E2E
# spear_ec25 and ours_w4 with that table.
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/ec_pdl_h200.sh OUT_DIR  (packed as OUT_DIR.tgz)
set -uo pipefail
out=$1
mkdir -p "$out/lab192" "$out/lab128" "$out/lab64" "$out/e2e"
timeout 120 python benchmarks/kernels.py --lab gemv --nibs biased --ec-pdl 192 --shapes 12288x4096 --out "$out/lab192" \
  > "$out/lab192.log" 2>&1
timeout 120 python benchmarks/kernels.py --lab gemv --nibs biased --ec-pdl 128 --shapes 22016x4096 --out "$out/lab128" \
  > "$out/lab128.log" 2>&1
timeout 150 python benchmarks/kernels.py --lab gemv --nibs biased --ec-pdl 64 --shapes 4096x4096 4096x11008 \
  --out "$out/lab64" > "$out/lab64.log" 2>&1
grep -h -E "pdl best|x[0-9]+: tinygemm" "$out"/lab*.log
timeout 120 python benchmarks/e2e_decode.py --batch 1 --variants bf16 ours_w4 spear_ec25 --out "$out/e2e" \
  > "$out/e2e.log" 2>&1
tail -n 4 "$out/e2e.log"
bash benchmarks/device/pack.sh "$out"
