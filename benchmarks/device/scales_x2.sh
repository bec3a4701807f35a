#!/usr/bin/env bash
# Session 9: does training the base's scales and zero points with the KL (CalibConfig.train_quant;
# no extra bytes) close the rest of the gap? One call on nvidia-h200-x2, after the GGUF halves
# (quality_h200.sh), one process per GPU throughout:
#   1. development plays, GPU_PRESET + train_quant at 1 %: lr_quant 1e-3 on GPU 0, 3e-4 on GPU 1;
#   2. the better of the two on the evaluation plays: 1 % on GPU 0, 0.5 % on GPU 1.
# Usage on the device: bash benchmarks/device/scales_x2.sh OUT_DIR   (ends packed as OUT_DIR.tgz)
set -uo pipefail
out=$1
mkdir -p "$out"
source benchmarks/device/sweep_x2.sh
gguf_setup
base="$GPU_BASE,train_quant=true"
for g in 0 1; do
  lr=$([ $g = 0 ] && echo 1e-3 || echo 3e-4)
  CUDA_VISIBLE_DEVICES=$g timeout 260 bash benchmarks/device/quality_h200.sh benchmarks/spear_sweep.py \
    --out "$out/sweep$g" --variant "tq$lr:$base,lr_quant=$lr" > "$out/sweep$g.log" 2>&1 &
done
wait
tail -n 3 "$out"/sweep*.log
pick_best
[ -f "$out/best.json" ] || { bash benchmarks/device/pack.sh "$out"; exit 1; }
bash benchmarks/device/eval_best_x2.sh "$out/best.json" "$out" 250
bash benchmarks/device/pack.sh "$out"
