"""Where the E2E decode step's time goes: every kernel of the graphed step, by name and by kind.

``e2e_decode.py`` times the whole batch-1 decode step of the Llama-2-7B-shaped model as one CUDA
graph. This captures the same step (same ``build``, same per-layer torch.compile) and profiles a few
replays with torch.profiler (CUPTI sees the kernels inside a graph), then reports per step: the number
of kernels, the GPU-busy time (sum of kernel durations), the span (first kernel start to last kernel
end: span - busy = the gaps between kernels), and the busy time by kind (quantized / dense linears,
attention, KV-cache writes, everything else Inductor emitted) with the top kernels by time. What it is
for: deciding whether the remaining E2E time is GEMV time or the other kernels and their gaps.

    python benchmarks/e2e_profile.py --out $OUT [--variants bf16 ours_w4 spear_ec25]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import e2e_decode as E  # noqa: E402

KINDS = (  # first match wins; names as CUPTI reports them
    ("linear", ("gemv", "w4a16", "int4pack", "gemm", "nvjet", "cutlass", "ec_", "_shrink", "gate")),
    ("attention", ("attention", "fmha", "flash", "efficient", "sdpa", "softmax")),
    ("kv_write", ("index_copy", "indexcopy", "index_put", "scatter")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def profile_variant(variant: str, base_state: dict, steps: int) -> dict:
    model, backend = E.build(variant, 1, base_state)
    suffix = variant.rsplit("_", 1)[-1]
    opts = {"options": E.OPTION_SUFFIXES[suffix]} if suffix in E.OPTION_SUFFIXES else {}
    for layer in model.layers:
        layer.forward = torch.compile(layer.forward, backend=backend, dynamic=False, **opts)
    ids = torch.randint(0, E.V, (1, 1), device="cuda")
    pos = torch.tensor([E.POS], device="cuda")
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        for _ in range(3):
            model(ids, pos)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            model(ids, pos)
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                g.replay()
            torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and e.name
               and not e.name.startswith(("Memcpy", "Memset", "cudaGraph"))]
    kernels.sort(key=lambda e: e.time_range.start)
    if not kernels:
        raise RuntimeError(f"{variant}: the profiler saw no kernels inside the CUDA graph (CUPTI too old?)")
    busy = sum(e.time_range.elapsed_us() for e in kernels) / steps
    span = (kernels[-1].time_range.end - kernels[0].time_range.start) / steps
    by_kind: dict = collections.defaultdict(float)
    by_name: dict = collections.defaultdict(lambda: [0, 0.0])
    for e in kernels:
        by_kind[kind_of(e.name)] += e.time_range.elapsed_us() / steps
        rec = by_name[e.name[:120]]
        rec[0] += 1
        rec[1] += e.time_range.elapsed_us()
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:25]
    del model, g
    torch.cuda.empty_cache()
    torch._dynamo.reset()
    return {"variant": variant, "kernels_per_step": len(kernels) / steps, "busy_us": busy, "span_us": span,
            "gaps_us": span - busy, "busy_by_kind_us": dict(by_kind),
            "top": [{"name": n, "per_step": c / steps, "us_per_step": t / steps, "kind": kind_of(n)}
                    for n, (c, t) in top]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--variants", nargs="+", default=["bf16", "ours_w4", "spear_ec25"])
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    with torch.device("cuda"):
        ref = E.Model(1)
    base_state = {k: v for k, v in ref.state_dict().items() if "cache" not in k}
    del ref
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    for v in args.variants:
        try:
            row = profile_variant(v, base_state, args.steps)
        except Exception as e:  # keep the other variants
            row = {"variant": v, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        res["rows"].append(row)
        with open(os.path.join(args.out, "e2e_profile.json"), "w") as f:
            json.dump(res, f, indent=1)
        if "error" in row:
            print(v, row["error"], flush=True)
            continue
        kinds = "  ".join(f"{k} {t:.0f}" for k, t in sorted(row["busy_by_kind_us"].items()))
        print(f"{v}: {row['kernels_per_step']:.0f} kernels, busy {row['busy_us']:.0f} us, span {row['span_us']:.0f} us "
              f"(gaps {row['gaps_us']:.0f}); {kinds}", flush=True)
        for t in row["top"][:12]:
            print(f"   {t['us_per_step']:8.1f} us  x{t['per_step']:5.1f}  [{t['kind']}] {t['name'][:90]}")


if __name__ == "__main__":
    main()
