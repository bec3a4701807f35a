#!/usr/bin/env bash
# Session 23, call 6: the per-rank decode-EC choice remade with the review's rules (ranks 4..128, the pair the
# dispatch takes, a 0.3-us margin) into the tuned table, then the same run again reading that table.
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s23_call6.sh OUT_DIR
set -uo pipefail
out=$1
mkdir -p "$out/w" "$out/v"
timeout 200 python benchmarks/decode_ec_ranks.py --out "$out/w" --write-table > "$out/w/ranks.log" 2>&1
echo "rc $?"; grep -v Warning "$out/w/ranks.log" | tail -n 24
timeout 200 python benchmarks/decode_ec_ranks.py --out "$out/v" > "$out/v/ranks.log" 2>&1
echo "rc $?"; grep -v Warning "$out/v/ranks.log" | tail -n 24
