#!/usr/bin/env bash
# Session 9, second quality call on nvidia-h200-x2 (after the GGUF halves), one process per GPU:
#   GPU 0: scales and zeros trained alone (budget 0: what the ECs add on top), then SPEAR + scales at 2 %;
#   GPU 1: the GPTQ (act-order) per-channel base with plain SPEAR at 1 % (GPU_PRESET's settings).
# Usage on the device: bash benchmarks/device/ablate_x2.sh OUT_DIR   (ends packed as OUT_DIR.tgz)
set -uo pipefail
out=$1
mkdir -p "$out/scales" "$out/gptq"
bash benchmarks/device/quality_h200.sh --help > /dev/null 2>&1 || { echo "GGUF / sdist set-up failed"; exit 1; }
q=(bash benchmarks/device/quality_h200.sh)
CUDA_VISIBLE_DEVICES=0 timeout 530 "${q[@]}" --set-json benchmarks/results/session9_scales/best.json \
  --out "$out/scales" --bases rtn:0 --methods spear --budgets 0 0.02 > "$out/scales/log.txt" 2>&1 &
CUDA_VISIBLE_DEVICES=1 timeout 530 "${q[@]}" --set-json benchmarks/results/session8_tokens/best.json \
  --out "$out/gptq" --bases gptq:0 --methods spear --budgets 0.01 > "$out/gptq/log.txt" 2>&1 &
wait
tail -n 4 "$out"/*/log.txt
bash benchmarks/device/pack.sh "$out"
