#!/usr/bin/env bash
# Session 14, call 2: the TMA GEMV step without the B operand's column mask and without the all-ones MMA
# (D_ones from x's sums staged once per CTA): 627 -> 490 SASS instructions per (4, 2, 2, 2, 2) step, 104 -> 80
# registers. (1) GPU tests of the TMA kernels; (2) the M = 1 lab (new code, all TMA configs) on the five
# benchmark shapes and the E2E's concatenated ones -> tuned table; (3) the same lab with session 13's kernel
# (benchmarks/device/ab_old/, overlaid on a copy of the package) in its two best configs: the same-run
# baseline (E2E A/B in call 3).
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s14_call2.sh OUT_DIR
set -uo pipefail
out=$1
root=$PWD
mkdir -p "$out/tests"
timeout 100 python -m pytest -q -x tests/lowering/test_gemv_tma.py tests/lowering/test_gemv_tma_ec.py \
  > "$out/tests/tests.log" 2>&1
tail -n 2 "$out/tests/tests.log"
bash benchmarks/device/pack.sh "$out/tests"
old=/tmp/oldpkg
if [ ! -d benchmarks/device/ab_old ]; then  # session 13's kernel files (commit e9abf29), untracked in the working tree
  mkdir -p benchmarks/device/ab_old
  for f in w4a16_gemv_tma.py w4a16_gemv_gluon.py; do
    git show e9abf29:spear_compile/lowering/$f > benchmarks/device/ab_old/$f
  done
fi
for d in $old ${old}_e2e; do  # session 13's kernel on a copy of the package with the shipped table (one per use)
  rm -rf $d && mkdir -p $d && cp -r spear_compile $d/ && cp benchmarks/device/ab_old/*.py $d/spear_compile/lowering/
done
mkdir -p "$out/lab_old"
PYTHONPATH=$old timeout 110 python benchmarks/kernels.py --lab gemv --tma --nibs biased --tma-configs 4,2,2,2,2 4,2,4,2,2 \
  --shapes 4096x4096 11008x4096 8192x8192 28672x8192 --out "$out/lab_old" > "$out/lab_old/lab.log" 2>&1
grep -E "x[0-9]+: tinygemm|best" "$out/lab_old/lab.log"
mkdir -p "$out/lab"
timeout 260 python benchmarks/kernels.py --lab gemv --tma --nibs biased \
  --shapes 4096x4096 11008x4096 4096x11008 8192x8192 28672x8192 12288x4096 22016x4096 \
  --out "$out/lab" > "$out/lab/lab.log" 2>&1
grep -E "x[0-9]+: tinygemm|best" "$out/lab/lab.log"
bash benchmarks/device/pack.sh "$out/lab_old"; bash benchmarks/device/pack.sh "$out/lab"
