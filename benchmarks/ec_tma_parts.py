"""Where the decode EC's time goes on the TMA GEMV: each part of the producer + PDL GEMV pair
timed alone in CUDA graphs, on the weight shapes the EC runs at M = 1.

Variants per shape (us per call, weights cycled over copies that exceed L2):
  w4        the TMA GEMV alone (no EC)
  prod      the EC's producer grid alone (h = A x, gate, publish g * h)
  ec_only   the TMA GEMV with the EC epilogue reading a g * h published before (no producer, no wait)
  pair_seq  producer, then the GEMV with the EC epilogue in plain stream order (no PDL)
  pair_pdl  the shipped path: the GEMV launched with PDL behind the producer, waiting before its epilogue
  v4_pdl    the CUDA-core GEMV's PDL pair (the path before the TMA epilogue)
If pair_pdl ~ pair_seq, PDL does not overlap the two grids; if ec_only >> w4, the epilogue itself costs.
``--profile``: also a torch.profiler trace of one graph of 8 PDL pairs per shape: each kernel's start and
end relative to the first (does the producer run beside the GEMV, and how long does it take there?).
Usage (GPU): python benchmarks/ec_tma_parts.py --out DIR [--profile]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from spear_compile.dispatch import keys as TK
from spear_compile.lowering import w4a16_gemv_tma as GT
from spear_compile.dispatch import route as RT
from spear_compile.lowering import w4a16_triton as T
from spear_compile.lowering.ec_decode_triton import ec_produce, w4a16_gemv1_ec_pdl
from spear_compile.ops.ec_ref import ec_linear_ref
from spear_compile.dispatch.tuning import bench_graph, capture_graph, copies_for
from spear_compile.lowering.w4a16_gemv_tma_ec import EcEpilogue

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernels import DT, G, make_ec, make_weights  # noqa: E402


def trace(fn, copies: int, calls: int = 8) -> list:
    """Kernels (name, start, end in us from the first kernel's start) of one replay of a graph of
    ``calls`` calls of fn, as torch.profiler (CUPTI) sees them."""
    from torch.profiler import ProfilerActivity, profile

    g = capture_graph(fn, copies, calls)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        g.replay()
        torch.cuda.synchronize()
    ks = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    ks.sort(key=lambda e: e.time_range.start)
    t0 = ks[0].time_range.start if ks else 0
    return [{"name": e.name, "start": e.time_range.start - t0, "end": e.time_range.end - t0} for e in ks]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--shapes", nargs="+", default=["8192x8192:64", "11008x4096:64", "12288x4096:192",
                                                    "28672x8192:64"])
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    res = {"gpu": torch.cuda.get_device_name(), "rows": []}
    for spec in args.shapes:
        shape, r = spec.split(":")
        N, K = (int(v) for v in shape.split("x"))
        r = int(r)
        cfg = tuple(TK.tuned_table().get(TK.tma_key(N, K, G)) or (4, 2, 2, 2, 2))
        copies = min(copies_for(N * K // 2), 8)
        ws = make_weights(N, K, copies)
        ec = make_ec(N, K, r)
        xs = [torch.randn(1, K, device="cuda", dtype=DT) for _ in range(copies)]
        w = lambda i: (ws[i]["qw"].qweight, ws[i]["qw"].scales, ws[i]["qw"].zeros)  # noqa: E731
        gh, _ = ec_produce(xs[0], ec)

        def epi(wait):
            return EcEpilogue(ec[1], None, gh, ec[6], r, T.GH_COPIES, wait=wait)

        def pair(i, wait):
            ec_produce(xs[i], ec)
            return GT.w4a16_gemv_tma(xs[i], *w(i), G, None, config=cfg, ec=epi(wait))

        ref = ec_linear_ref(xs[0], *w(0), G, None, *ec, "silu")
        err = {k: ((f().float() - ref.float()).norm() / ref.float().norm()).item()
               for k, f in (("pair_pdl", lambda: pair(0, True)), ("pair_seq", lambda: pair(0, False)))}
        row = {"N": N, "K": K, "r": r, "config": list(cfg), "err": err, "us": {}}
        fns = {
            "w4": lambda i: GT.w4a16_gemv_tma(xs[i], *w(i), G, None, config=cfg),
            "prod": lambda i: ec_produce(xs[i], ec),
            "ec_only": lambda i: GT.w4a16_gemv_tma(xs[i], *w(i), G, None, config=cfg, ec=epi(False)),
            "pair_seq": lambda i: pair(i, False),
            "pair_pdl": lambda i: pair(i, True),
            "v4_pdl": lambda i: w4a16_gemv1_ec_pdl(xs[i], *w(i), G, None, ec, config=RT.ec_pdl_config(N, K, G)),
        }
        for name, fn in fns.items():
            try:
                row["us"][name] = bench_graph(fn, copies)
            except Exception as e:  # noqa: BLE001
                row["us"][name] = None
                print(f"  {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
        if args.profile:
            row["trace"] = trace(lambda i: pair(i, True), copies)
            for k in row["trace"][:6]:
                print(f"   {k['name'][:40]:40s} start {k['start']:7.2f} end {k['end']:7.2f} us", flush=True)
        res["rows"].append(row)
        print(f"{N}x{K} r={r} cfg={cfg} " + " ".join(f"{k}={v:.1f}" for k, v in row["us"].items() if v)
              + f"  err={max(err.values()):.1e}", flush=True)
        with open(os.path.join(args.out, "ec_tma_parts.json"), "w") as f:
            json.dump(res, f, indent=1)
        ws.clear()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
