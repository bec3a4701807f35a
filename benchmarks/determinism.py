"""Which kernels of the decode step are not bitwise deterministic run to run (on the H200, 2026-11-30, the compiled
W4 step's logits differing between two runs on the same inputs, at batch 1 now and then and at batch 16
every time; ``e2e_decode.py``'s ``rerun_bitwise_equal``).

Each case calls one kernel kind of the Llama-2-7B-shaped decode step on fixed inputs ``--reps`` times,
eagerly and as CUDA-graph replays, and reports how many distinct outputs it produced and the largest
relative difference to the first. A deterministic kernel gives 1 distinct output.

    python benchmarks/determinism.py --out DIR [--reps 30]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e_decode import digest  # noqa: E402
from kernels import DT, G, make_ec, make_weights  # noqa: E402  (also registers the spear ops)


def distinct(fn, reps: int, graph: bool) -> dict:
    """Outputs of ``reps`` calls (eager or graph replays) compared bitwise with the first."""
    fn()
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = fn()
        outs = []
        for _ in range(reps):
            g.replay()
            outs.append(out.clone())
    else:
        outs = [fn().clone() for _ in range(reps)]
    torch.cuda.synchronize()
    first = outs[0].float()
    uniq = {digest(o) for o in outs}
    worst = max(((o.float() - first).norm() / first.norm()).item() for o in outs)
    return {"distinct": len(uniq), "max_rel_diff": worst}


def cases(M: int):
    """(name, fn) for each kernel kind at M rows (q/k/v, gate/up concatenations, single GEMVs, ECs, SDPA)."""
    K = 4096
    w4k = make_weights(4096, 4096, 1)[0]["qw"]
    w11 = make_weights(4096, 11008, 1)[0]["qw"]
    qkv = [make_weights(4096, K, 1)[0]["qw"] for _ in range(3)]
    gu = [make_weights(11008, K, 1)[0]["qw"] for _ in range(2)]
    x = torch.randn(M, K, device="cuda", dtype=DT)
    x11 = torch.randn(M, 11008, device="cuda", dtype=DT)
    res = torch.randn(4096, device="cuda", dtype=DT)
    nw = (torch.rand(K, device="cuda") + 0.5).to(DT)
    ec = make_ec(4096, K, 64)
    ecs = [make_ec(4096, K, 64) for _ in range(3)]
    yield "w4a16_linear 4096x4096", lambda: torch.ops.spear.w4a16_linear(x, w4k.qweight, w4k.scales, w4k.zeros, G, None)
    yield "w4a16_linear 4096x11008 + residual bias", lambda: torch.ops.spear.w4a16_linear(
        x11, w11.qweight, w11.scales, w11.zeros, G, res)
    yield "w4a16_linear_cat q/k/v + norm", lambda: torch.ops.spear.w4a16_linear_cat(
        x, [w.qweight for w in qkv], [w.scales for w in qkv], [w.zeros for w in qkv], G, [None] * 3, "spear", nw, 1e-5)
    yield "w4a16_linear_glu gate/up + norm", lambda: torch.ops.spear.w4a16_linear_glu(
        x, [w.qweight for w in gu], [w.scales for w in gu], [w.zeros for w in gu], G, "silu", "spear", nw, 1e-5)
    yield "ec_linear 4096x4096 r64", lambda: torch.ops.spear.ec_linear(x, w4k.qweight, w4k.scales, w4k.zeros, G, None,
                                                                       *ec)
    yield "ec_linear_cat q/k/v r3x64 + norm", lambda: torch.ops.spear.ec_linear_cat(
        x, [w.qweight for w in qkv], [w.scales for w in qkv], [w.zeros for w in qkv], G, [None] * 3,
        *[list(v) for v in zip(*ecs)], "silu", "spear", nw, 1e-5)
    q = torch.randn(M, 32, 1, 128, device="cuda", dtype=DT)
    kv = torch.randn(M, 32, 1024, 128, device="cuda", dtype=DT)
    yield "sdpa decode (1 query, 1024 keys)", lambda: F.scaled_dot_product_attention(q, kv, kv)
    mask = (torch.arange(1024, device="cuda") <= 512)[None, None, None, :]  # e2e_decode.py's call
    yield "sdpa decode + boolean mask (e2e_decode's call)", lambda: F.scaled_dot_product_attention(
        q, kv, kv, attn_mask=mask)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 16])
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for M in args.ms:
        for name, fn in cases(M):
            for graph in (False, True):
                try:
                    r = distinct(fn, args.reps, graph)
                except Exception as e:  # noqa: BLE001
                    r = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                rows.append({"case": name, "M": M, "graph": graph, **r})
                print(json.dumps(rows[-1]), flush=True)
    with open(os.path.join(args.out, "determinism.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
