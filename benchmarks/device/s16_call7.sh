#!/usr/bin/env bash
# Session 16, call 7 (last): the register-operand GEMM's EC tile requested half-way through the K loop.
# (1) GPU tests of the wgmma GEMMs and the tuning / dispatch (call 6's step was cut by its time limit);
# (2) kernels.py on the five shapes at M = 256 and 1024 (EC structures; table entries for those M).
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s16_call7.sh OUT_DIR
set -uo pipefail
out=$1
mkdir -p "$out/tests" "$out/k"
timeout 240 python -m pytest -q -p no:cacheprovider tests/lowering/test_gemm_wgmma.py \
  tests/lowering/test_tuning_and_dispatch.py > "$out/tests/tests.log" 2>&1
tail -n 3 "$out/tests/tests.log"
bash benchmarks/device/pack.sh "$out/tests"
timeout 200 python benchmarks/kernels.py --shapes 4096x4096 11008x4096 4096x11008 8192x8192 28672x8192 \
  --ms 256 1024 --out "$out/k" > "$out/k/k.log" 2>&1
python - "$out/k" <<'PY'
import glob, json, sys
d = json.load(open(glob.glob(sys.argv[1] + "/kernels_*.json")[0]))
for r in d["rows"]:
    st = {k[len("ours_w4_ec_r64_"):]: round(v, 1) for k, v in r.items() if k.startswith("ours_w4_ec_r64_") and k != "ours_w4_ec_r64_overlapped"}
    print(r["N"], r["K"], r["M"], "W4", round(r["ours_w4"], 1), r.get("gemm_choice"), st, r.get("ec_structure"))
PY
bash benchmarks/device/pack.sh "$out/k"
