#!/usr/bin/env bash
# Session 14, call 3: (0) the GPU tests of the TMA kernels in full (call 2's step stopped at 72 %); (1) which decode kernels are not bitwise deterministic run to run (benchmarks/determinism.py,
# fixed: call 1's run failed on numpy's missing bf16); (2) E2E batch 1 ours_w4 / spear_ec25 with the new TMA step
# (table from call 2's lab) against session 13's kernel (benchmarks/device/ab_old/ overlaid on a copy of the
# package with the table before call 2), new-old-new.
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s14_call3.sh OUT_DIR OLD_TABLE_JSON
set -uo pipefail
out=$1
oldtab=$2
root=$PWD
mkdir -p "$out/tests"
timeout 170 python -m pytest -q -x tests/lowering/test_gemv_tma.py tests/lowering/test_gemv_tma_ec.py \
  tests/lowering/test_ec_decode_pdl.py > "$out/tests/tests.log" 2>&1
tail -n 2 "$out/tests/tests.log"
bash benchmarks/device/pack.sh "$out/tests"
mkdir -p "$out/det"
timeout 150 python benchmarks/determinism.py --reps 20 --out "$out/det" > "$out/det/determinism.log" 2>&1
grep -v '"distinct": 1,' "$out/det/determinism.log" | tail -n 30
bash benchmarks/device/pack.sh "$out/det"
old=/tmp/oldpkg_e2e
if [ ! -d benchmarks/device/ab_old ]; then  # session 13's kernel files (commit e9abf29)
  mkdir -p benchmarks/device/ab_old
  for f in w4a16_gemv_tma.py w4a16_gemv_gluon.py; do
    git show e9abf29:spear_compile/lowering/$f > benchmarks/device/ab_old/$f
  done
fi
rm -rf $old && mkdir -p $old && cp -r spear_compile $old/ && cp benchmarks/device/ab_old/*.py $old/spear_compile/lowering/
cp "$oldtab" $old/spear_compile/lowering/tuned/configs_NVIDIA_H200.json
mkdir -p "$out/e2e"
for run in new1 old new2; do
  mkdir -p "$out/e2e/$run"
  if [ "$run" = old ]; then pp=$old; else pp=$root; fi
  PYTHONPATH=$pp timeout 55 python benchmarks/e2e_decode.py --batch 1 --variants ours_w4 spear_ec25 --out "$out/e2e/$run" \
    > "$out/e2e/$run.log" 2>&1
  echo "$run"; tail -n 2 "$out/e2e/$run.log"
done
bash benchmarks/device/pack.sh "$out/e2e"
