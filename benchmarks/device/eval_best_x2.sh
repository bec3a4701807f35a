#!/usr/bin/env bash
# The evaluation step of the sweep-then-evaluate device scripts (quality_sweep_x2.sh) on
# nvidia-h200-x2: SPEAR with the sweep winner's settings on the evaluation plays, 1 % on GPU 0 and
# 0.5 % on GPU 1, one process per GPU (so each calibration time is an isolated one).
# Usage on the device: bash benchmarks/device/eval_best_x2.sh SETTINGS.json OUT_DIR [TIMEOUT_S]
# Writes OUT_DIR/eval0, OUT_DIR/eval1 and their logs.
set -uo pipefail
settings=$1; out=$2; limit=${3:-250}
for g in 0 1; do
  b=$([ $g = 0 ] && echo 0.01 || echo 0.005)
  CUDA_VISIBLE_DEVICES=$g timeout "$limit" bash benchmarks/device/quality.sh --set-json "$settings" \
    --out "$out/eval$g" --bases rtn:0 --methods spear --budgets $b > "$out/eval$g.log" 2>&1 &
done
wait
tail -n 3 "$out"/eval*.log
