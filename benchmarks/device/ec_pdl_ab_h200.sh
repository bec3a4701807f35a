#!/usr/bin/env bash
# Session 13, call 1: the tile search for the decode EC's PDL pair (session 12's ec_pdl_h200.sh) with an
# A/B in the same call: E2E with the shipped table (old), the labs, E2E with the shipped table plus only
# the labs' gemv1pdl keys (new: the labs also re-pick plain W4 tiles, which would confound ours_w4),
# then old again.
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/ec_pdl_ab_h200.sh OUT_DIR  (packed as OUT_DIR.tgz)
set -uo pipefail
out=$1
tuned=spear_compile/lowering/tuned/configs_NVIDIA_H200.json
mkdir -p "$out"
cp "$tuned" "$out/old_table.json"
e2e() {  # $1: run name
  mkdir -p "$out/$1"
  timeout 85 python benchmarks/e2e_decode.py --batch 1 --variants ours_w4 spear_ec25 --out "$out/$1" > "$out/$1.log" 2>&1
  echo "$1"; tail -n 2 "$out/$1.log"
}
e2e old1
for spec in "192 12288x4096" "128 22016x4096" "64 4096x4096 4096x11008"; do
  set -- $spec
  r=$1; shift
  mkdir -p "$out/lab$r"
  timeout 75 python benchmarks/kernels.py --lab gemv --nibs biased --ec-pdl "$r" --shapes "$@" --out "$out/lab$r" \
    > "$out/lab$r.log" 2>&1
  grep -h -E "pdl best|x[0-9]+: tinygemm" "$out/lab$r.log"
done
cp "$tuned" "$out/lab_table.json"
python - "$out/old_table.json" "$out/lab_table.json" "$tuned" <<'PY'
import json, sys
old, lab = (json.load(open(p)) for p in sys.argv[1:3])
new = dict(old, **{k: v for k, v in lab.items() if k.startswith("gemv1pdl|")})
json.dump(new, open(sys.argv[3], "w"), indent=1, sort_keys=True)
print("pdl keys:", {k: v for k, v in new.items() if k.startswith("gemv1pdl|")})
PY
cp "$tuned" "$out/new_table.json"
e2e new1
cp "$out/old_table.json" "$tuned"
e2e old2
cp "$out/new_table.json" "$tuned"
e2e new2
bash benchmarks/device/pack.sh "$out"
