#!/usr/bin/env bash
# Session 20, call 4: GPU tests of the register-operand GEMM (every RA_CONFIGS entry, the new 64 x 128 tile among
# them) and of split shrink roles on it; kernels.py at M = 256 / 1024 on the five issue shapes (re-tunes the table).
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s20_call4.sh OUT_DIR
set -uo pipefail
out=$1
mkdir -p "$out/tests" "$out/k"
timeout 200 python -m pytest -q tests/lowering/test_gemm_wgmma.py -k "register_operand_kernel_matches or split" \
  > "$out/tests/tests.log" 2>&1
tail -n 6 "$out/tests/tests.log"
bash benchmarks/device/pack.sh "$out/tests"
timeout 360 python benchmarks/kernels.py --out "$out/k" --ms 256 1024 > "$out/k/k.log" 2>&1
tail -n 14 "$out/k/k.log"
cp spear_compile/lowering/tuned/configs_NVIDIA_H200.json "$out/k/" 2>/dev/null
bash benchmarks/device/pack.sh "$out/k"
