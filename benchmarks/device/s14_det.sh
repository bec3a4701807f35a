#!/usr/bin/env bash
# Session 14, determinism calls: where the compiled SPEAR EC decode step first differs between reruns
# (benchmarks/determinism_e2e.py, 32 reruns, per-layer output hashes), with the decode EC's PDL launches and
# without them (SPEAR_NO_PDL=1; from the second run on: the same kernels in plain stream order).
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s14_det.sh OUT_DIR
set -uo pipefail
out=$1
mkdir -p "$out"
timeout 150 python benchmarks/determinism_e2e.py --variants spear_ec25 spear_ec10 ours_w4 --reruns 32 --out "$out" \
  > "$out/pdl.log" 2>&1
cut -c1-400 "$out/pdl.log" | tail -n 4
SPEAR_NO_PDL=1 timeout 110 python benchmarks/determinism_e2e.py --variants spear_ec25 spear_ec10 --reruns 32 \
  --out "$out" > "$out/nopdl.log" 2>&1
cut -c1-400 "$out/nopdl.log" | tail -n 3
bash benchmarks/device/pack.sh "$out"
