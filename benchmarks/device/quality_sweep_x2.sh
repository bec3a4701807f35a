#!/usr/bin/env bash
# A SPEAR settings sweep on the development plays, then the winner on the evaluation plays, on a two-GPU
# machine (device kind nvidia-h200-x2), after the GGUF halves are in place (quality.sh). As written it
# compares the amount of self-sampled calibration text (the sweep behind GPU_PRESET's 192 x 1024 tokens):
#   1. development plays, 1 %, two sweep workers per GPU: 96 / 192 x 1024 tokens (480 steps) on GPU 0,
#      192 x 1024 with 720 steps and 288 x 1024 with 720 steps on GPU 1;
#   2. the best of the variants predicted to fit the 3-minute budget (t96, t192, t192s720; t288s720
#      is there to show the trend) on the evaluation plays: SPEAR 1 % on GPU 0, 0.5 % on GPU 1, one
#      process per GPU, so each calibration time is an isolated one.
# Usage on the device: bash benchmarks/device/quality_sweep_x2.sh OUT_DIR
# The result folder ends packed as OUT_DIR.tgz (pack.sh): the device returns at most 8 files.
set -uo pipefail
out=$1
mkdir -p "$out"
source benchmarks/device/x2_lib.sh
gguf_setup
base=$GPU_BASE  # n_seqs is set per variant below (a later key wins)
sweep 0 340 --variant "t96:$base,n_seqs=96" --variant "t192:$base,n_seqs=192" &
sweep 1 340 --variant "t192s720:$base,n_seqs=192,steps=720" --variant "t288s720:$base,n_seqs=288,steps=720" &
wait
tail -n 4 "$out/sweep0.log" "$out/sweep1.log"
pick_best t288s720  # shows the trend; predicted not to fit the 3-minute budget
[ -f "$out/best.json" ] || exit 1
bash benchmarks/device/eval_best_x2.sh "$out/best.json" "$out" 240
bash benchmarks/device/pack.sh "$out"
