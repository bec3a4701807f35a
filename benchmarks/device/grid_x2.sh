#!/usr/bin/env bash
# The quality grid on a two-GPU machine (device kind nvidia-h200-x2), one process per GPU so that
# no run shares a GPU and the SPEAR calibration times are isolated ones:
#   GPU 0: RTN per-channel, SPEAR at 1 % (the target run, first), 0.5 % and 2 %;
#   GPU 1: RTN per-channel static methods and SERQ (W4A16) at the three budgets, the GPTQ (act-order) base with
#          SPEAR and QERA-exact at 1 %, then SERQ at 1 % as W4A8 and W4A4 (spear eval --act-bits).
# Every run writes its own JSON as it finishes, so a run cut off by the time limit loses only itself.
# Usage on the device: bash benchmarks/device/grid_x2.sh SETTINGS.json OUT_DIR
# The result folder ends packed as OUT_DIR.tgz (pack.sh): the device returns at most 8 files.
set -uo pipefail
settings=$1; out=$2
mkdir -p "$out/gpu0" "$out/gpu1"
bash benchmarks/device/quality_h200.sh --help > /dev/null 2>&1 || { echo "GGUF / sdist set-up failed"; exit 1; }
q() { bash benchmarks/device/quality_h200.sh --set-json "$settings" "$@"; }
kv=$(python3 -c "import json,sys; print(','.join(f'{k}={json.dumps(v)}' for k,v in json.load(open(sys.argv[1])).items()))" "$settings")
(
  export CUDA_VISIBLE_DEVICES=0
  q --out "$out/gpu0" --bases rtn:0 --methods spear --budgets 0.01 > "$out/gpu0/log_target.txt" 2>&1
  q --out "$out/gpu0" --bases rtn:0 --methods spear --budgets 0.005 0.02 > "$out/gpu0/log_budgets.txt" 2>&1
) & p=$!
(
  export CUDA_VISIBLE_DEVICES=1
  q --out "$out/gpu1" --bases rtn:0 --methods qera lqer lorc serq --budgets 0.005 0.01 0.02 > "$out/gpu1/log_static.txt" 2>&1
  q --out "$out/gpu1" --bases gptq:0 --methods spear qera --budgets 0.01 > "$out/gpu1/log_gptq.txt" 2>&1
  export PYTHONPATH=$PWD:/tmp/site SPEAR_CACHE=/tmp/spear_cache
  for a in 8 4; do
    python3 -m spear_compile.cli eval --quant rtn --group-size 0 --act-bits $a --method serq --budget 0.01 \
      --set "$kv" --json "$out/gpu1/serq_rtn0_a$a.json" > "$out/gpu1/log_serq_a$a.txt" 2>&1
  done
)
wait $p
bash benchmarks/device/pack.sh "$out"
