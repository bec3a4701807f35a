#!/usr/bin/env bash
# Session 10: does SPEAR's input-adaptive gate matter with GPU_PRESET's data? (Session 8 found no
# measurable effect on the CPU preset.) One call on nvidia-h200-x2, after the GGUF halves:
#   1. development plays, 1 %, two sweep workers per GPU: gates frozen at their pass-through start
#      (lr=0) and gate_init_bias 4 on GPU 0; gate_init_bias 2 and 0 (less saturated starts) on GPU 1;
#   2. evaluation plays, 1 %: the frozen gates on GPU 0, the best trained-gate variant on GPU 1.
# The preset itself (gate_init_bias 6, trained gates) gave 80.4 % on the development plays in
# session 8 and again in session 10 (results/session10_randfirst, rf0), 78.4 % on the evaluation plays.
# Usage on the device: bash benchmarks/device/gate_x2.sh OUT_DIR   (ends packed as OUT_DIR.tgz)
set -uo pipefail
out=$1
mkdir -p "$out"
source benchmarks/device/sweep_x2.sh
gguf_setup
base=$GPU_BASE
sweep 0 330 --variant "nogate:$base,lr=0" --variant "gib4:$base,gate_init_bias=4" &
sweep 1 330 --variant "gib2:$base,gate_init_bias=2" --variant "gib0:$base,gate_init_bias=0" &
wait
tail -n 4 "$out/sweep0.log" "$out/sweep1.log"
pick_best nogate  # the best trained-gate variant; the frozen one is evaluated beside it
python3 -c "import json; json.dump(json.load(open('$out/sweep0/nogate.json'))['overrides'], open('$out/nogate.json', 'w'))"
for g in 0 1; do
  s=$([ $g = 0 ] && echo "$out/nogate.json" || echo "$out/best.json")
  [ -f "$s" ] || continue
  CUDA_VISIBLE_DEVICES=$g timeout 240 bash benchmarks/device/quality_h200.sh --set-json "$s" \
    --out "$out/eval$g" --bases rtn:0 --methods spear --budgets 0.01 > "$out/eval$g.log" 2>&1 &
done
wait
tail -n 3 "$out"/eval*.log
bash benchmarks/device/pack.sh "$out"
