#!/usr/bin/env bash
# The RTN per-channel quality grid apart from SPEAR at 0.5 / 1 % (quality_sweep_x2.sh evaluates those), with
# GPU_PRESET's calibration data (192 x 1024 self-sampled tokens), so every method in the README table sees
# the same tokens. Two GPUs, one
# process each: GPU 0 SPEAR at 2 %; GPU 1 QERA-exact, SERQ, LQER, LoRC at 0.5 / 1 / 2 %.
# Usage on the device (nvidia-h200-x2, after the GGUF halves): bash benchmarks/device/quality_grid_x2.sh SETTINGS.json OUT
# The result folder ends packed as OUT_DIR.tgz (pack.sh): the device returns at most 8 files.
set -uo pipefail
settings=$1; out=$2
mkdir -p "$out"
bash benchmarks/device/quality.sh --help > /dev/null 2>&1 || { echo "GGUF / sdist set-up failed"; exit 1; }
q=(bash benchmarks/device/quality.sh --set-json "$settings" --out "$out" --bases rtn:0)
CUDA_VISIBLE_DEVICES=0 timeout 480 "${q[@]}" --methods spear --budgets 0.02 > "$out/log_gpu0.txt" 2>&1 &
CUDA_VISIBLE_DEVICES=1 timeout 480 "${q[@]}" --methods qera serq lqer lorc --budgets 0.01 0.005 0.02 > "$out/log_gpu1.txt" 2>&1 &
wait
ls "$out"
bash benchmarks/device/pack.sh "$out"
