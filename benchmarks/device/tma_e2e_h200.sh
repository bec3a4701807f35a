#!/usr/bin/env bash
# Session 11 final call (re-run in session 12 for the K-split configs and the EC concatenation): the TMA GEMV wired into the M = 1 dispatch, on one H200:
#   1. its CUDA tests (kernel, table-driven dispatch of w4a16_gemv and the concatenated GEMV);
#   2. kernels.py --lab gemv --tma on the decode shapes of the E2E model (its q/k/v and gate/up
#      concatenations and lm_head included): writes the tuned table's gemv1 / gemv1tma entries;
#   3. e2e_decode.py batch 1 with that table: bf16, tinygemm, ours_w4, spear_ec25, spear_ec25_ecfused
#      (EC linears sharing an input fused, CompileConfig.fuse_shared_input_ec), and ours_w4 /
#      spear_ec25 again with SPEAR_NO_TMA_GEMV=1 (the CUDA-core kernel), same run.
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/tma_e2e_h200.sh OUT_DIR  (packed as OUT_DIR.tgz)
set -uo pipefail
out=$1
mkdir -p "$out"
timeout 160 python -m pytest -q tests/lowering/test_gemv_tma.py tests/lowering/test_triton_kernels.py -k "tma or cat" > "$out/tests_tma.txt" 2>&1
tail -n 3 "$out/tests_tma.txt"
timeout 200 python benchmarks/kernels.py --lab gemv --tma --nibs biased --out "$out/lab" \
  --shapes 4096x4096 11008x4096 4096x11008 8192x8192 28672x8192 12288x4096 22016x4096 32000x4096 \
  > "$out/lab.log" 2>&1
grep -E "x[0-9]+: tinygemm|best" "$out/lab.log"
mkdir -p "$out/e2e_cuda_core" "$out/e2e"
SPEAR_NO_TMA_GEMV=1 timeout 120 python benchmarks/e2e_decode.py --batch 1 --variants ours_w4 spear_ec25 \
  --out "$out/e2e_cuda_core" > "$out/e2e_cuda_core.log" 2>&1
tail -n 4 "$out/e2e_cuda_core.log"
timeout 200 python benchmarks/e2e_decode.py --batch 1 --variants bf16 int4_tinygemm ours_w4 spear_ec25 spear_ec25_ecfused \
  --out "$out/e2e" > "$out/e2e.log" 2>&1
tail -n 6 "$out/e2e.log"
bash benchmarks/device/pack.sh "$out"
