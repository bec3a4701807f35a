#!/usr/bin/env bash
# Session 15, call 9: the warp-specialised wgmma GEMM (w4a16_gemm_wgmma_ws.py: 8 MMA warps + 4 expander warps,
# mbarrier hand-offs) against the plain (256, 128, 4, 8). (1) smoke: one small shape, checked against the
# reference, under a short timeout (a hand-off bug would hang); (2) GPU tests of the wgmma kernels; (3) lab, three
# shapes, M = 256, 1024, 4096.
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s15_call9.sh OUT_DIR
set -uo pipefail
out=$1
mkdir -p "$out/smoke"
timeout 60 python benchmarks/lab_gemm.py --configs 256,128,4,8,4 --shapes 4096x4096 --ms 1024 --out "$out/smoke" \
  > "$out/smoke/lab.log" 2>&1
echo "smoke rc=$?"; tail -n 3 "$out/smoke/lab.log"
bash benchmarks/device/pack.sh "$out/smoke"
mkdir -p "$out/tests"
timeout 120 python -m pytest -q -x tests/lowering/test_gemm_wgmma.py > "$out/tests/tests.log" 2>&1
tail -n 3 "$out/tests/tests.log"
bash benchmarks/device/pack.sh "$out/tests"
mkdir -p "$out/lab"
timeout 130 python benchmarks/lab_gemm.py --configs 256,128,4,8,4 256,128,4,8 --shapes 8192x8192 4096x4096 28672x8192 \
  --out "$out/lab" > "$out/lab/lab.log" 2>&1
cat "$out/lab/lab.log" | tail -n 10
bash benchmarks/device/pack.sh "$out/lab"
