#!/usr/bin/env bash
# One device call: a SPEAR settings sweep on the development plays (variants finished earlier are
# copied in from PREV_DIR and not rerun), then, if the sweep's winner is new, the RTN per-channel 1 %
# evaluation with it. Usage: bash benchmarks/device/sweep_then_eval.sh PREV_DIR OUT_DIR VARIANT...
set -euo pipefail
prev=$1; out=$2; shift 2
mkdir -p "$out/sweep"
cp "$prev"/*.json "$out/sweep/" 2>/dev/null || true
rm -f "$out/sweep/summary.json" "$out/sweep/best.json"
names=(); for f in "$prev"/*.json; do n=$(basename "$f" .json); [[ $n == summary || $n == best ]] || names+=("--variant" "$n:$(python3 -c "import json,sys; print(','.join(f'{k}={json.dumps(v)}' for k,v in json.load(open(sys.argv[1]))['overrides'].items()))" "$f")"); done
jobs=0; for v in "$@"; do [[ $v == --variant ]] || jobs=$((jobs+1)); done
timeout 360 bash benchmarks/device/quality_h200.sh benchmarks/spear_sweep.py --out "$out/sweep" "${names[@]}" "$@" \
  --jobs "$jobs" --deadline-s 330 2>&1 | tail -8
if ! cmp -s <(python3 -c "import json; print(json.load(open('$out/sweep/best.json')))") \
            <(python3 -c "import json; print(json.load(open('$prev/best.json')))"); then
  timeout 220 bash benchmarks/device/quality_h200.sh --set-json "$out/sweep/best.json" --out "$out/eval" --bases rtn:0 \
    --methods spear --budgets 0.01 > "$out/eval_log.txt" 2>&1 || true
  tail -3 "$out/eval_log.txt"
fi
