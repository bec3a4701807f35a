#!/usr/bin/env bash
# Session 12, call 7: E2E with the tuned table written by call 6's lab (new) against the one before it
# (old, kept under results/raw/session12/persist/old_table/), same call, new-old-new.
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/table_ab_h200.sh OUT_DIR  (packed as OUT_DIR.tgz)
set -uo pipefail
out=$1
tuned=spear_compile/lowering/tuned/configs_NVIDIA_H200.json
cp "$tuned" /tmp/new.json
for run in new1 old new2; do
  mkdir -p "$out/$run"
  if [ "$run" = old ]; then cp benchmarks/results/raw/session12/persist/old_table/configs_NVIDIA_H200.json "$tuned";
  else cp /tmp/new.json "$tuned"; fi
  timeout 80 python benchmarks/e2e_decode.py --batch 1 --variants ours_w4 spear_ec25 --out "$out/$run" > "$out/$run.log" 2>&1
  echo "$run"; tail -n 2 "$out/$run.log"
done
bash benchmarks/device/pack.sh "$out"
