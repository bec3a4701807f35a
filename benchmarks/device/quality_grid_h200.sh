#!/usr/bin/env bash
# The quality report's grid on the H200 with the SPEAR settings chosen on development plays
# (benchmarks/spear_sweep.py's best.json). One run after another: on 2026-11-29 five quality.py
# processes side by side each sampled text and evaluated the references, so the call ran out of
# time with most runs unfinished (and `timeout` left the background ones running). The target run
# (RTN per-channel, SPEAR, 1 %) goes first. Real-text statistics for the static methods use a play
# that is neither an evaluation nor a development play, in a separate folder (same run names).
# Usage on the device: bash benchmarks/device/quality_grid_h200.sh SETTINGS.json OUT_DIR
set -euo pipefail
settings=$1; out=$2
mkdir -p "$out" "$out/realtext"
q() { bash benchmarks/device/quality_h200.sh --set-json "$settings" "$@"; }
q --out "$out" --bases rtn:0 --methods spear --budgets 0.01 > "$out/log_target.txt" 2>&1
q --out "$out" --bases rtn:0 --methods spear qera lqer lorc --budgets 0.005 0.01 0.02 > "$out/log_rtn.txt" 2>&1
q --out "$out" --bases gptq:0 rtn:64 --methods qera spear --budgets 0.01 > "$out/log_bases.txt" 2>&1
q --out "$out" --bases rtn:0 --methods serq --budgets 0.01 > "$out/log_serq.txt" 2>&1
q --out "$out/realtext" --calib-text julius_caesar_gut --bases rtn:0 --methods lqer qera --budgets 0.01 \
  > "$out/log_realtext.txt" 2>&1
