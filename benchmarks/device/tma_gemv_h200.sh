#!/usr/bin/env bash
# Session 11: the TMA-ring M = 1 GEMV (lowering/w4a16_gemv_tma.py) on one H200, in one call:
#   1. its CUDA tests (kernel against fp64 and the reference, every config);
#   2. benchmarks/kernels.py --lab gemv --tma: tinygemm, the shipped CUDA-core kernel and the TMA
#      ring side by side, all five shapes (GLUON=1 adds the register-fed Gluon kernel);
#   3. benchmarks/read_floor.py: the same-run floor (a plain read of the weight's bytes);
#   4. NCU="cfg ..." : Nsight Compute counters (speed of light, memory, warp states, occupancy) of
#      tinygemm, the shipped kernel and those TMA configs at 8192^2 and 28672x8192 (Firecracker only);
#   5. the CUDA tests of session 10's robustness changes (lowering, passes, calibration; NO_SUITE=1 skips).
# SHAPES="NxK ..." limits the lab's shapes.
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/tma_gemv_h200.sh OUT_DIR  (packed as OUT_DIR.tgz)
set -uo pipefail
out=$1
mkdir -p "$out"
timeout 150 python -m pytest -q tests/lowering/test_gemv_tma.py > "$out/tests_tma.txt" 2>&1
tail -n 3 "$out/tests_tma.txt"
timeout 270 python benchmarks/kernels.py --lab gemv --tma ${GLUON:+--gluon} --nibs biased --out "$out/lab" ${SHAPES:+--shapes $SHAPES} \
  > "$out/lab.log" 2>&1
grep -E "x[0-9]+: tinygemm|best" "$out/lab.log"
if [ -n "${FLOOR:-}" ]; then
  mkdir -p "$out/floor"
  timeout 60 python benchmarks/read_floor.py --out "$out/floor" > "$out/floor.log" 2>&1
  tail -n 6 "$out/floor.log"
fi
if [ -n "${NCU:-}" ]; then
  timeout 200 ncu --clock-control none --profile-from-start off --section SpeedOfLight \
    --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats \
    python benchmarks/ncu_gemv1.py --nibs biased --tma $NCU > "$out/ncu.txt" 2>&1
  grep -E "Duration|DRAM Throughput|Achieved Occupancy|Theoretical Occupancy|Block Limit Shared|Block Limit Reg" "$out/ncu.txt" | head -60
fi
if [ -z "${NO_SUITE:-}" ]; then
  timeout 250 python -m pytest -q tests/lowering tests/passes tests/compensators/test_calibrate.py \
    --deselect tests/lowering/test_gemv_tma.py > "$out/tests_cuda.txt" 2>&1
  tail -n 3 "$out/tests_cuda.txt"
fi
bash benchmarks/device/pack.sh "$out"
