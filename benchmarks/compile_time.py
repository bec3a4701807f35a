"""Compile time of quantized SmolLM2-135M: backend="spear" vs plain "inductor", one run.

Both compile the same W4 model (per-channel RTN) with Inductor's caches disabled, on the
same input (1 x 64 tokens). Compile time = first call - median of 3 warm calls. After one
discarded warm-up compile, runs alternate (inductor, spear, ...) so drift hits both equally.

    python benchmarks/compile_time.py --json benchmarks/results/compile_time/2026-11-29_cpu.json
"""
from __future__ import annotations

try:
    from _syspath import unshadow  # run as a script: benchmarks/ is first on sys.path
except ImportError:  # loaded from elsewhere (a test, benchmarks.<name>)
    from benchmarks._syspath import unshadow
unshadow()  # before transformers is imported (benchmarks/kernels.py would shadow its ``kernels`` probe)

import argparse
import datetime
import json
import platform
import statistics
import time

import torch

import spear_compile as spear
from spear_compile.models import load


def time_backend(model, ids, backend: str) -> dict:
    torch._dynamo.reset()
    with torch.no_grad():
        cm = torch.compile(model, backend=backend)
        t = time.perf_counter()
        cm(ids)
        first = time.perf_counter() - t
        warm = []
        for _ in range(3):
            t = time.perf_counter()
            cm(ids)
            warm.append(time.perf_counter() - t)
    return {"first_call_s": first, "warm_call_s": statistics.median(warm),
            "compile_s": first - statistics.median(warm)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch._inductor.config.force_disable_caches = True
    model, tok = load("smollm2-135m")
    spear.quantize_(model, spear.QuantConfig(group_size=None), progress=False)
    ids = torch.randint(0, model.config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    runs = {"inductor": [], "spear": []}
    warm = time_backend(model, ids, "inductor")  # discarded: first-ever compile pays imports and warm-up
    print(f"warm-up   compile {warm['compile_s']:6.1f}s (discarded)", flush=True)
    for _ in range(args.repeats):
        for backend in ("inductor", "spear"):
            r = time_backend(model, ids, backend)
            runs[backend].append(r)
            print(f"{backend:9s} compile {r['compile_s']:6.1f}s  (first call {r['first_call_s']:.1f}s, warm {r['warm_call_s'] * 1e3:.0f} ms)", flush=True)
    med = {b: statistics.median(x["compile_s"] for x in v) for b, v in runs.items()}
    out = {"benchmark": "compile_time", "model": "smollm2-135m W4 per-channel (210 QuantLinear)",
           "tokens": args.tokens, "runs": runs, "median_compile_s": med, "ratio_spear_over_inductor": med["spear"] / med["inductor"],
           "machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
           "torch": torch.__version__, "date": datetime.date.today().isoformat(), "device": "cpu"}
    print(f"\n| backend | compile (median of {args.repeats}) |\n|---|---|\n| inductor | {med['inductor']:.1f} s |\n"
          f"| spear | {med['spear']:.1f} s |\nratio spear/inductor = {out['ratio_spear_over_inductor']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
