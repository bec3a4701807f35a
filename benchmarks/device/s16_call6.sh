#!/usr/bin/env bash
# Session 16, call 6: the prefill EC as one more K step of the register-operand GEMM, launched with PDL behind
# the gate kernel. (1) GPU tests of the wgmma GEMMs (incl. the new EC step, with and without PDL) and the
# tuning / dispatch; (2) kernels.py on the five shapes at M = 256 and 1024 (every EC structure timed; the
# table's entries for those M rewritten).
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s16_call6.sh OUT_DIR
set -uo pipefail
out=$1
mkdir -p "$out/tests" "$out/k"
timeout 160 python -m pytest -q tests/lowering/test_gemm_wgmma.py tests/lowering/test_tuning_and_dispatch.py \
  > "$out/tests/tests.log" 2>&1
tail -n 3 "$out/tests/tests.log"
bash benchmarks/device/pack.sh "$out/tests"
timeout 300 python benchmarks/kernels.py --shapes 4096x4096 11008x4096 4096x11008 8192x8192 28672x8192 \
  --ms 256 1024 --out "$out/k" > "$out/k/k.log" 2>&1
tail -n 14 "$out/k/k.log"
grep -h "in_gemm" "$out/k/kernels_"*.json | head -0
python - "$out/k" <<'PY'
import glob, json, sys
d = json.load(open(glob.glob(sys.argv[1] + "/kernels_*.json")[0]))
for r in d["rows"]:
    st = {k[len("ours_w4_ec_r64_"):]: round(v, 1) for k, v in r.items() if k.startswith("ours_w4_ec_r64_") and k != "ours_w4_ec_r64_overlapped"}
    print(r["N"], r["K"], r["M"], "W4", round(r["ours_w4"], 1), r.get("gemm_choice"), st, r.get("ec_structure"))
PY
bash benchmarks/device/pack.sh "$out/k"
