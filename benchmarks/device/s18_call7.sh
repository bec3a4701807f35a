#!/usr/bin/env bash
# Session 18, call 7: the one-launch TMA EC's wrong first launches - the same replay with the GPU idle before the
# first launch (DIAG_SYNC=1) and without, 12 repetitions each.
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s18_call7.sh OUT_DIR
set -uo pipefail
out=$1
mkdir -p "$out/diag"
DIAG_SYNC=1 timeout 120 python benchmarks/device/s18_tma_self_diag2.py > "$out/diag/sync.txt" 2>&1
DIAG_SYNC=0 timeout 120 python benchmarks/device/s18_tma_self_diag2.py > "$out/diag/nosync.txt" 2>&1
for f in sync nosync; do echo "== $f: launches with error > 0.005: $(grep -c '|' $out/diag/$f.txt) of 36 cases"; grep '|' $out/diag/$f.txt | cut -c1-20,150-400; done
bash benchmarks/device/pack.sh "$out/diag"
