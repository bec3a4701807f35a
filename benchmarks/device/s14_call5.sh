#!/usr/bin/env bash
# Session 14, call 5: the TMA GEMV's nibble pairs as packed bf16x2 registers (_pairs_packed: no 16-bit split and
# re-pack; offline 490 -> 414 SASS instructions per (4, 2, 2, 2, 2) step). (1) GPU tests of the TMA kernels;
# (2) M = 1 lab: the previous kernel (commit 430fdf0, benchmarks/device/ab_old/, on a copy of the package) in its
# best configs, then the new one, with the decode EC pairs (--ec-pdl 64: which pair a single EC takes per
# shape, gemv1tmaec keys); (3) E2E batch 1 ours_w4 / spear_ec25 new and old.
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s14_call5.sh OUT_DIR
set -uo pipefail
out=$1
root=$PWD
old=/tmp/oldpkg
if [ ! -d benchmarks/device/ab_old ]; then  # the previous kernel files (commit 430fdf0)
  mkdir -p benchmarks/device/ab_old
  for f in w4a16_gemv_tma.py w4a16_gemv_gluon.py; do git show 430fdf0:spear_compile/lowering/$f > benchmarks/device/ab_old/$f; done
fi
for d in $old ${old}_e2e; do
  rm -rf $d && mkdir -p $d && cp -r spear_compile $d/ && cp benchmarks/device/ab_old/*.py $d/spear_compile/lowering/
done
mkdir -p "$out/tests"
timeout 125 python -m pytest -q -x tests/lowering/test_gemv_tma.py tests/lowering/test_gemv_tma_ec.py \
  > "$out/tests/tests.log" 2>&1
tail -n 2 "$out/tests/tests.log"
bash benchmarks/device/pack.sh "$out/tests"
mkdir -p "$out/lab_old"
PYTHONPATH=$old timeout 80 python benchmarks/kernels.py --lab gemv --tma --nibs biased \
  --tma-configs 4,2,2,2,2 4,2,4,2,2 2,2,4,2,2 --shapes 8192x8192 28672x8192 11008x4096 12288x4096 \
  --out "$out/lab_old" > "$out/lab_old/lab.log" 2>&1
grep -E "x[0-9]+: tinygemm|best" "$out/lab_old/lab.log"
bash benchmarks/device/pack.sh "$out/lab_old"
mkdir -p "$out/lab"
timeout 190 python benchmarks/kernels.py --lab gemv --tma --nibs biased --ec-pdl 64 \
  --tma-configs 4,2,2,2,2 4,2,4,2,2 2,2,4,2,2 2,2,2,2,2 4,2,2,3,2 8,2,2,2,2 4,2,4,2,2,1,2 \
  --shapes 8192x8192 28672x8192 11008x4096 4096x11008 4096x4096 12288x4096 22016x4096 \
  --out "$out/lab" > "$out/lab/lab.log" 2>&1
grep -E "x[0-9]+: tinygemm|best|tma ec pair" "$out/lab/lab.log"
bash benchmarks/device/pack.sh "$out/lab"
mkdir -p "$out/e2e"
for run in new old; do
  mkdir -p "$out/e2e/$run"
  if [ "$run" = old ]; then pp=${old}_e2e; else pp=$root; fi
  if [ "$run" = old ]; then vs="ours_w4 spear_ec25"; to=65; else vs="ours_w4 spear_ec25 bf16"; to=90; fi
  PYTHONPATH=$pp timeout $to python benchmarks/e2e_decode.py --batch 1 --variants $vs \
    --out "$out/e2e/$run" > "$out/e2e/$run.log" 2>&1
  echo "$run"; tail -n 3 "$out/e2e/$run.log"
done
bash benchmarks/device/pack.sh "$out/e2e"
