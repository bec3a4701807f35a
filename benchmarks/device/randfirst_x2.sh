#!/usr/bin/env bash
# Session 10: does self-sampled text that starts from a uniformly drawn first token
# (CalibConfig.random_first; LLM-QAT-style data-free generation) calibrate ECs that hold up on
# text of another domain? One call on nvidia-h200-x2, after the GGUF halves (quality_h200.sh):
#   1. development plays, GPU_PRESET at 1 %, two sweep workers per GPU: random_first 0 (the
#      preset, re-measured in the same run) and 0.25 on GPU 0, 0.5 and 1.0 on GPU 1;
#   2. the best non-zero fraction on the evaluation plays: 1 % on GPU 0, 0.5 % on GPU 1.
# Usage on the device: bash benchmarks/device/randfirst_x2.sh OUT_DIR   (ends packed as OUT_DIR.tgz)
set -uo pipefail
out=$1
mkdir -p "$out"
source benchmarks/device/sweep_x2.sh
gguf_setup
base=$GPU_BASE
sweep 0 330 --variant "rf0:$base,random_first=0" --variant "rf0.25:$base,random_first=0.25" &
sweep 1 330 --variant "rf0.5:$base,random_first=0.5" --variant "rf1:$base,random_first=1.0" &
wait
tail -n 4 "$out/sweep0.log" "$out/sweep1.log"
pick_best rf0  # the preset itself is not the question
[ -f "$out/best.json" ] || { bash benchmarks/device/pack.sh "$out"; exit 1; }
bash benchmarks/device/eval_best_x2.sh "$out/best.json" "$out" 240
bash benchmarks/device/pack.sh "$out"
