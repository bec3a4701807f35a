"""Pass (the last one): record what was compiled, for the runtime's latency model and scheduler.

Matches:     every spear linear node left in the graph after the other passes: ``spear::w4a16_linear``,
             ``spear::ec_linear``, and the decode fusions' ``*_linear_cat`` / ``*_linear_glu``.
Rewrites to: nothing (the graph is unchanged). Appends one record per node to ``ctx.plan_records``.

A record is plain JSON (the backend persists it beside Inductor's cache, so a cache hit, which skips
the passes, still knows its plan): the op, the weights it reads (module names), each part's rows, EC
rank and EC gate width, K, the group size, the lowering and crossover that ``phase_dispatch`` chose, the range of rows M
the graph runs it at, and the kernel ``dispatch.route`` gives it at every M bucket of that range
(``routes``: ``[[M, kernel description], ...]``). ``spear_compile.runtime.plan_of`` turns the records
of a model's graphs into a ``runtime.Plan``.

Example record (a Llama q/k/v concatenation at decode, on an H200):
    {"op": "w4a16_cat", "weights": ["layers.0.self_attn.q_proj", ...], "parts": [[4096, 0, 0], ...],
     "K": 4096, "G": 128, "lowering": "auto", "m_lo": 1, "m_hi": 1, "routes": [[1, "cat_tma[...]"]]}
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.fx as fx

from .base import SpearPass
from .common import EC_LINEAR, W4A16, bind, cat_route
from .phase_dispatch import m_range, node_route

CAT_OPS = {
    torch.ops.spear.w4a16_linear_cat.default: "w4a16_cat",
    torch.ops.spear.ec_linear_cat.default: "ec_cat",
    torch.ops.spear.w4a16_linear_glu.default: "w4a16_glu",
    torch.ops.spear.ec_linear_glu.default: "ec_glu",
}
ONE_OPS = {W4A16: "w4a16", EC_LINEAR: "ec"}
MAX_BUCKET = 4096  # routes are recorded at powers of two up to this (and the range's ends within it)


def buckets(lo: int, hi: float) -> list[int]:
    """The M buckets of ``[lo, hi]``: ``lo``, the powers of two inside, and ``hi`` when finite and at most
    ``MAX_BUCKET``."""
    lo = max(1, int(lo))
    top = min(hi, MAX_BUCKET)
    out = {lo} | {1 << i for i in range(13) if lo <= (1 << i) <= top}
    if hi != math.inf and hi <= MAX_BUCKET:
        out.add(int(hi))
    return sorted(out)


def _val(n):
    return getattr(n, "meta", {}).get("val") if n is not None else None


def _weight_name(ctx, node) -> str:
    if not isinstance(node, fx.Node):
        return "?"
    name = ctx.name_of(node)
    for suffix in (".qweight", ".weight", ".q"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def _record_one(ctx, node: fx.Node, op: str) -> Optional[dict]:
    kw = bind(node)
    x, q = _val(kw["x"]), _val(kw["qweight"])
    if x is None or q is None:
        return None
    _, lo, hi = m_range(x)
    N = int(node.meta["val"].shape[-1]) if _val(node) is not None else int(q.shape[0])
    rank = int(_val(kw["A"]).shape[0]) if op == "ec" and _val(kw.get("A")) is not None else 0
    gate = int(_val(kw["W1"]).shape[0]) if rank and _val(kw.get("W1")) is not None else 0
    routes = []
    for m in buckets(lo, hi):
        rt = node_route(kw, op, m)
        routes.append([m, rt.describe() if rt is not None else "unknown"])
    return {"op": op, "weights": [_weight_name(ctx, kw["qweight"])], "parts": [[N, rank, gate]], "K": int(x.shape[-1]),
            "G": int(kw["group_size"]), "layout": kw["layout"], "lowering": kw.get("lowering", "auto"),
            "crossover": int(kw.get("crossover", 16)), "norm": False, "act": kw.get("act", "silu"),
            "has_bias": kw.get("bias") is not None, "has_zeros": kw.get("zeros") is not None,
            "dtype": str(x.dtype).replace("torch.", ""), "m_lo": int(lo), "m_hi": None if hi == math.inf else int(hi),
            "routes": routes}


def _record_cat(ctx, node: fx.Node, op: str) -> Optional[dict]:
    kw = bind(node)
    x = _val(kw["x"])
    qs = [_val(n) for n in kw["qweights"]]
    if x is None or any(v is None for v in qs):
        return None
    _, lo, hi = m_range(x)
    ranks = [int(_val(a).shape[0]) if _val(a) is not None else 0 for a in kw.get("As") or ()] or [0] * len(qs)
    gates = [int(_val(w).shape[0]) if _val(w) is not None else 0 for w in kw.get("W1s") or ()] or [0] * len(qs)
    glu = op.endswith("glu")
    norm = kw.get("norm_weight") is not None
    rows = [int(v.shape[0]) for v in qs]
    if glu:  # the GLU op's output is F per half; its parts are gate and up of F rows each
        F = int(node.meta["val"].shape[-1]) if _val(node) is not None else rows[0]
        rows = [F] * len(qs)
    routes = []
    for m in buckets(lo, hi):
        rt = cat_route(kw, op, norm, M=m)
        routes.append([m, rt.describe() if rt is not None else "unknown"])
    return {"op": op, "weights": [_weight_name(ctx, n) for n in kw["qweights"]],
            "parts": [[r, k, d] for r, k, d in zip(rows, ranks, gates)], "K": int(x.shape[-1]), "G": int(kw["group_size"]),
            "layout": kw["layout"], "lowering": "auto", "crossover": 16, "norm": norm, "act": kw.get("act", "silu"),
            "has_bias": any(b is not None for b in kw.get("biases") or ()),
            "has_zeros": any(z is not None for z in kw["zeros"]), "dtype": str(x.dtype).replace("torch.", ""),
            "m_lo": int(lo), "m_hi": None if hi == math.inf else int(hi), "routes": routes}


class RecordPlan(SpearPass):
    name = "record_plan"

    def run(self, graph: fx.Graph) -> int:
        records = []
        for node in graph.nodes:
            if node.op != "call_function":
                continue
            if node.target in ONE_OPS:
                r = _record_one(self.ctx, node, ONE_OPS[node.target])
            elif node.target in CAT_OPS:
                r = _record_cat(self.ctx, node, CAT_OPS[node.target])
            else:
                continue
            if r is not None:
                records.append(r)
        self.ctx.plan_records = (self.ctx.plan_records or []) + records
        return len(records)
