#!/usr/bin/env bash
# The kernels a dispatch change launches, and their times, before and after it, on this GPU.
#
# Usage (GPU machine, repository root): BEFORE=.before OUT=out bash benchmarks/device/route_equivalence.sh
# where $BEFORE holds the older package and its benchmark scripts:
#   git archive <commit> spear_compile benchmarks/kernels.py benchmarks/e2e_decode.py | tar -x -C .before
# Steps (each bounded, each writing under $OUT; STEPS selects them, default all):
#   trace    every spear op on real shapes (Llama-2-7B: 4096 / 11008 / q,k,v / gate,up; M 1 .. 4096; EC ranks
#            8 .. 128; concatenations with and without the RMSNorm prologue), each run once under torch.profiler
#            with the old and the new package: the CUDA kernels launched, with grid and block, must be equal
#            ($OUT/trace_{before,after}.json, $OUT/compare.json)
#   tests    the GPU tests of the kernels, the route and the inspection report (new package; $OUT/tests.log)
#   e2e      benchmarks/e2e_decode.py (batch 1; W4 and W4 + EC on 25 % of linears), old and new
#   kernels  benchmarks/kernels.py (11008x4096, M 1 and 256), old and new
set -u
OUT=${OUT:-out}; BEFORE=${BEFORE:-.before}; STEPS=${STEPS:-"trace tests e2e kernels"}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 SPEAR_CACHE_DIR="$OUT/cache"  # (no user table: both read their shipped one)
python - "$OUT/meta.json" <<'PY'
import datetime, json, subprocess, sys, torch, triton
json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()},
          open(sys.argv[1], "w"), indent=1)
PY
cat > "$OUT/trace.py" <<'PY'
"""Run every case once under torch.profiler; record the CUDA kernels (name, grid, block) each launched."""
import json, os, sys, tempfile
import torch
import spear_compile as spear
from spear_compile import ECConfig, QuantConfig
from spear_compile.quant import quantize_rtn

torch.manual_seed(0)
dev, bf = "cuda", torch.bfloat16
G = 128


def weight(N, K, seed):
    g = torch.Generator().manual_seed(seed)
    w = quantize_rtn(torch.randn(N, K, generator=g) * 0.02, QuantConfig(group_size=G), out_dtype=bf)
    return w.qweight.to(dev), w.scales.to(dev), w.zeros.to(dev)


def ec(N, K, R, seed):
    g = torch.Generator().manual_seed(seed)
    t = [torch.randn(R, K, generator=g) / K ** 0.5, torch.randn(N, R, generator=g) * 0.1,
         torch.randn(16, R, generator=g) / R ** 0.5, torch.randn(16, generator=g) * 0.1,
         torch.randn(R, 16, generator=g) / 4, torch.randn(R, generator=g)]
    return [x.to(dev, bf) for x in t] + [torch.tensor(1.25, device=dev, dtype=bf)]


ops = torch.ops.spear
cases = {}
shapes = [(4096, 4096), (11008, 4096), (4096, 11008), (8192, 8192)]
for N, K in shapes:
    q, s, z = weight(N, K, N + K)
    for M in (1, 2, 16, 64, 256, 1024, 4096):
        x = torch.randn(M, K, device=dev, dtype=bf)
        cases[f"w4a16 {N}x{K} M={M}"] = lambda x=x, q=q, s=s, z=z: ops.w4a16_linear(x, q, s, z, G, None)
    for R in (8, 16, 32, 64, 128):
        e = ec(N, K, R, R)
        x = torch.randn(1, K, device=dev, dtype=bf)
        cases[f"ec {N}x{K} M=1 r={R}"] = lambda x=x, q=q, s=s, z=z, e=e: ops.ec_linear(
            x, q, s, z, G, None, *e, "silu", "spear", "fused", 16)
    e = ec(N, K, 64, 1)
    for M in (256, 1024):
        x = torch.randn(M, K, device=dev, dtype=bf)
        cases[f"ec {N}x{K} M={M} r=64"] = lambda x=x, q=q, s=s, z=z, e=e: ops.ec_linear(
            x, q, s, z, G, None, *e, "silu", "spear", "overlapped", 16)
K = 4096
parts = {"qkv": [weight(4096, K, i) for i in range(3)], "gateup": [weight(11008, K, 10 + i) for i in range(2)]}
nw = (torch.rand(K, device=dev) + 0.5).to(bf)
x1 = torch.randn(1, K, device=dev, dtype=bf)
for name, ws in parts.items():
    qs, ss, zs = [w[0] for w in ws], [w[1] for w in ws], [w[2] for w in ws]
    for norm in (None, nw):
        tag = " norm" if norm is not None else ""
        cases[f"cat {name}{tag}"] = lambda qs=qs, ss=ss, zs=zs, norm=norm: ops.w4a16_linear_cat(
            x1, qs, ss, zs, G, [None] * len(qs), "spear", norm, 1e-5)
        for R in (16, 64):
            es = [ec(w[0].shape[0], K, R, 100 + i) for i, w in enumerate(ws)]
            lists = [list(t) for t in zip(*es)]
            cases[f"ec_cat {name}{tag} r={R}"] = lambda qs=qs, ss=ss, zs=zs, lists=lists, norm=norm: (
                ops.ec_linear_cat(x1, qs, ss, zs, G, [None] * len(qs), *lists, "silu", "spear", norm, 1e-5))
            if name == "gateup":
                cases[f"ec_glu {name}{tag} r={R}"] = lambda qs=qs, ss=ss, zs=zs, lists=lists, norm=norm: (
                    ops.ec_linear_glu(x1, qs, ss, zs, G, *lists, "silu", "spear", norm, 1e-5))
        if name == "gateup":
            cases[f"glu {name}{tag}"] = lambda qs=qs, ss=ss, zs=zs, norm=norm: ops.w4a16_linear_glu(
                x1, qs, ss, zs, G, "silu", "spear", norm, 1e-5)

out = {}
for name, fn in cases.items():
    try:
        fn()  # compile, layouts, workspaces
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            y = fn()
            torch.cuda.synchronize()
        path = os.path.join(tempfile.mkdtemp(), "t.json")
        prof.export_chrome_trace(path)
        ev = [e for e in json.load(open(path))["traceEvents"] if e.get("cat") == "kernel"]
        ev.sort(key=lambda e: e["ts"])
        out[name] = {"kernels": [[e["name"], e["args"].get("grid"), e["args"].get("block")] for e in ev],
                     "sum": float(y.float().abs().sum())}
    except Exception as e:  # the record says what failed
        out[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    print(name, out[name].get("error") or [k[0] for k in out[name]["kernels"]], flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
PY
if [[ " $STEPS " == *" trace "* ]]; then
  PYTHONPATH="$BEFORE" timeout ${TRACE_S:-170} python "$OUT/trace.py" "$OUT/trace_before.json" > "$OUT/trace_before.log" 2>&1
  PYTHONPATH=. timeout ${TRACE_S:-170} python "$OUT/trace.py" "$OUT/trace_after.json" > "$OUT/trace_after.log" 2>&1
  python - "$OUT" <<'PY'
import json, sys
o = sys.argv[1]
b, a = (json.load(open(f"{o}/trace_{w}.json")) for w in ("before", "after"))
same = sorted(k for k in b if k in a and b[k].get("kernels") == a[k].get("kernels") and "error" not in a[k])
diff = {k: {"before": b.get(k), "after": a.get(k)} for k in sorted(set(b) | set(a)) if k not in same}
sums = {k: [b[k]["sum"], a[k]["sum"]] for k in same if b[k]["sum"] != a[k]["sum"]}
meta = json.load(open(f"{o}/meta.json"))
json.dump({**meta, "cases": len(set(b) | set(a)), "same_kernels_grids_blocks": len(same), "differ": diff,
           "output_sums_differ": sums, "all_match": not diff}, open(f"{o}/compare.json", "w"), indent=1)
print("cases", len(set(b) | set(a)), "same", len(same), "differ", len(diff), "sums differ", len(sums))
PY
fi
if [[ " $STEPS " == *" tests "* ]]; then
  timeout ${TESTS_S:-220} python -m pytest -q -p no:cacheprovider tests/inspect/test_report_routes.py tests/dispatch \
    tests/lowering/test_gemv_tma_ec.py tests/lowering/test_gemv_tma_self.py tests/lowering/test_ec_decode_pdl.py \
    tests/lowering/test_gemv_tma.py tests/lowering/test_wrapper_checks.py > "$OUT/tests.log" 2>&1
  echo "rc=$?" >> "$OUT/tests.log"; tail -3 "$OUT/tests.log"
fi
if [[ " $STEPS " == *" e2e "* ]]; then
  mkdir -p "$OUT/e2e_before" "$OUT/e2e_after"
  PYTHONPATH="$BEFORE" timeout ${BENCH_S:-135} python "$BEFORE/benchmarks/e2e_decode.py" --out "$OUT/e2e_before" --batch 1 \
    --variants ours_w4 spear_ec25 > "$OUT/e2e_before.log" 2>&1
  PYTHONPATH=. timeout ${BENCH_S:-135} python benchmarks/e2e_decode.py --out "$OUT/e2e_after" --batch 1 \
    --variants ours_w4 spear_ec25 > "$OUT/e2e_after.log" 2>&1
  tail -2 "$OUT/e2e_before.log" "$OUT/e2e_after.log"
fi
if [[ " $STEPS " == *" kernels "* ]]; then
  mkdir -p "$OUT/kernels_before" "$OUT/kernels_after"
  PYTHONPATH="$BEFORE" timeout ${BENCH_S:-135} python "$BEFORE/benchmarks/kernels.py" --out "$OUT/kernels_before" \
    --shapes 11008x4096 --ms 1 256 > "$OUT/kernels_before.log" 2>&1
  PYTHONPATH=. timeout ${BENCH_S:-135} python benchmarks/kernels.py --out "$OUT/kernels_after" --shapes 11008x4096 --ms 1 256 \
    > "$OUT/kernels_after.log" 2>&1
  tail -4 "$OUT/kernels_before.log" "$OUT/kernels_after.log"
fi
rm -rf "$OUT/cache"
python - "$OUT" <<'PY'
import glob, json, os, sys
o = sys.argv[1]
summary = json.load(open(f"{o}/meta.json"))
if os.path.exists(f"{o}/compare.json"):
    c = json.load(open(f"{o}/compare.json"))
    summary["trace"] = {k: c[k] for k in ("cases", "same_kernels_grids_blocks", "all_match")}
    summary["trace"]["differ"] = sorted(c["differ"])
def rows(path):
    try:
        return json.load(open(path))["rows"]
    except Exception as e:
        return None
for what, pat in (("e2e", "e2e_{}/e2e_decode.json"), ("kernels", "kernels_{}/kernels_*.json")):
    got = {}
    for side in ("before", "after"):
        files = glob.glob(os.path.join(o, pat.format(side)))
        got[side] = rows(files[0]) if files else None
    summary[what] = got
json.dump(summary, open(f"{o}/summary.json", "w"), indent=1)
PY
# at most a few files come back: the summaries, and everything else packed
(cd "$OUT" && tar czf raw.tgz --exclude=raw.tgz --exclude=summary.json --exclude=compare.json . \
  && find . -mindepth 1 ! -name raw.tgz ! -name summary.json ! -name compare.json -delete)
ls -la "$OUT"
