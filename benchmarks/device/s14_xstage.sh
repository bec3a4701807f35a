#!/usr/bin/env bash
# Session 14, last call: x staged by one load and one store (no per-step CTA barriers between x's loads) against
# the previous prologue (commit 3c1e5f0, benchmarks/device/ab_old/, on a copy of the package), M = 1 lab, two shapes,
# the two best configs; the lab checks every variant against the reference before timing it.
# Usage on the device: PYTHONPATH=$PWD bash benchmarks/device/s14_xstage.sh OUT_DIR
set -uo pipefail
out=$1
old=/tmp/oldpkg
if [ ! -d benchmarks/device/ab_old ]; then
  mkdir -p benchmarks/device/ab_old
  for f in w4a16_gemv_tma.py w4a16_gemv_gluon.py; do git show 3c1e5f0:spear_compile/lowering/$f > benchmarks/device/ab_old/$f; done
fi
rm -rf $old && mkdir -p $old && cp -r spear_compile $old/ && cp benchmarks/device/ab_old/*.py $old/spear_compile/lowering/
for run in old new; do
  mkdir -p "$out/$run"
  if [ "$run" = old ]; then pp=$old; else pp=$PWD; fi
  PYTHONPATH=$pp timeout 75 python benchmarks/kernels.py --lab gemv --tma --nibs biased --tma-configs 4,2,4,2,2 4,2,2,2,2 \
    --shapes 8192x8192 11008x4096 --out "$out/$run" > "$out/$run/lab.log" 2>&1
  echo "$run"; grep -E "x[0-9]+: tinygemm|best" "$out/$run/lab.log"
done
bash benchmarks/device/pack.sh "$out"
