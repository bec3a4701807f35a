#!/usr/bin/env bash
# Session 15, call 1: the TMA GEMV's x staged by one load and one store (commit 8f01ebf re-applied) against the
# shipped prologue (commit 16b3fc4, benchmarks/device/ab_old/, on a copy of the package). (1) GPU tests of the TMA
# kernels; (2) M = 1 lab, old then new, the two best configs, three shapes (the lab checks every variant against
# the reference before timing it); (3) E2E batch 1 ours_w4 / spear_ec25, old then new.
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s15_call1.sh OUT_DIR
set -uo pipefail
out=$1
old=/tmp/oldpkg
if [ ! -d benchmarks/device/ab_old ]; then
  mkdir -p benchmarks/device/ab_old
  for f in w4a16_gemv_tma.py w4a16_gemv_gluon.py; do git show 16b3fc4:spear_compile/lowering/$f > benchmarks/device/ab_old/$f; done
fi
rm -rf $old && mkdir -p $old && cp -r spear_compile $old/ && cp benchmarks/device/ab_old/*.py $old/spear_compile/lowering/
mkdir -p "$out/tests"
timeout 130 python -m pytest -q -x tests/lowering/test_gemv_tma.py tests/lowering/test_gemv_tma_ec.py \
  > "$out/tests/tests.log" 2>&1
tail -n 2 "$out/tests/tests.log"
bash benchmarks/device/pack.sh "$out/tests"
for run in old new; do
  if [ "$run" = old ]; then pp=$old; else pp=$PWD; fi
  mkdir -p "$out/lab_$run"
  PYTHONPATH=$pp timeout 80 python benchmarks/kernels.py --lab gemv --tma --nibs biased --tma-configs 4,2,4,2,2 4,2,2,2,2 \
    --shapes 8192x8192 28672x8192 11008x4096 --out "$out/lab_$run" > "$out/lab_$run/lab.log" 2>&1
  echo "lab $run"; grep -E "x[0-9]+: tinygemm|best" "$out/lab_$run/lab.log"
  bash benchmarks/device/pack.sh "$out/lab_$run"
done
for run in old new; do
  if [ "$run" = old ]; then pp=$old; else pp=$PWD; fi
  mkdir -p "$out/e2e_$run"
  PYTHONPATH=$pp timeout 100 python benchmarks/e2e_decode.py --batch 1 --variants bf16 int4_tinygemm ours_w4 spear_ec25 \
    --out "$out/e2e_$run" > "$out/e2e_$run/e2e.log" 2>&1
  echo "e2e $run"; tail -n 6 "$out/e2e_$run/e2e.log"
  bash benchmarks/device/pack.sh "$out/e2e_$run"
done
