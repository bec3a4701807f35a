"""Pass: choose each spear linear's lowering from the symbolic row count M.

Matches:     every ``spear::w4a16_linear`` / ``spear::ec_linear`` node.
Rewrites to: the same node with ``lowering`` and ``crossover`` set:

* M static and below the crossover (Dynamo specialises decode to M == 1) -> "fused":
  the EC runs in the W4 GEMV epilogue, one launch.
* the ShapeEnv's value range puts M at or above the crossover -> "overlapped": the EC
  runs on a side stream beside the W4 GEMM.
* the range straddles the crossover (``M = s0*s1 in [2, oo)``) -> "dispatch": one op
  that branches on M at run time.

M is the product of the activation's leading dims. The range comes from
``bound_sympy`` over the ShapeEnv's ``var_to_range``, so ``mark_dynamic(x, 0, min=64)``
or a guard learnt during tracing narrows it. The decision and its reason are recorded
in ``node.meta["spear"]`` for the inspection report, with the kernel ``dispatch.route`` gives the node
(``kernel``) and the route's reasons (``route_reasons``).

Example graph:
    before: %y = spear.ec_linear(x=%x[s0, 576], ..., lowering='auto')
    after:  %y = spear.ec_linear(x=%x[s0, 576], ..., lowering='dispatch', crossover=2)
            meta: lowering='dispatch', reason='M in [2, oo] straddles crossover 2: runtime branch (default)'

The crossover is, in order: ``CompileConfig.crossover_m`` if set; the value measured for
this GPU and weight shape by ``benchmarks/kernels.py``; ``default_crossover_m``.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.fx as fx

from ..config import DEFAULT_CROSSOVER_M
from ..dispatch import table as _table
from ..dispatch.route import Problem, Route, problem_of, route
from .base import SpearPass
from .common import SPEAR_OPS, W4A16, bind, positional, record


def m_range(x_val: torch.Tensor) -> tuple[str, int, float]:
    """(expression, lower bound, upper bound) of the rows of ``x [..., K]``."""
    lead = list(x_val.shape[:-1])
    if all(isinstance(d, int) for d in lead):
        m = math.prod(lead)
        return str(m), m, m
    from torch.utils._sympy.value_ranges import bound_sympy

    expr = 1
    shape_env = None
    for d in lead:
        if isinstance(d, torch.SymInt):
            expr = expr * d.node.expr
            shape_env = d.node.shape_env
        else:
            expr = expr * d
    vr = bound_sympy(expr, shape_env.var_to_range if shape_env is not None else None)
    lo, hi = vr.lower, vr.upper
    hi_f = float(hi) if getattr(hi, "is_finite", True) and hi.is_number and hi.is_finite else math.inf
    return str(expr), int(lo), hi_f


def static_m(x_val: torch.Tensor) -> Optional[int]:
    """The rows of ``x [..., K]`` where the graph fixes them (its lower and upper bound agree), else None: the
    decode passes take ``static_m(x) == 1``."""
    _, lo, hi = m_range(x_val)
    return lo if lo == hi else None


def node_problem(kwargs: dict, op: str, M: int) -> Optional[Problem]:
    """The ``route`` problem of a spear linear node at M rows, from the graph's fake values (None where the
    graph carries none). Zero points are taken as integral (their values are not known at compile time)."""
    vals = {k: getattr(kwargs.get(k), "meta", {}).get("val") for k in
            ("x", "qweight", "scales", "zeros", "bias", "A", "B", "W1")}
    x, q, s = vals["x"], vals["qweight"], vals["scales"]
    if x is None or q is None or s is None:
        return None
    ec = (vals["A"], vals["B"], vals["W1"]) if op == "ec" and vals["A"] is not None else None
    p = problem_of(op, x, q, s, vals["zeros"], kwargs["group_size"], vals["bias"], ec, layout=kwargs["layout"],
                   lowering=kwargs.get("lowering", "auto"), crossover=kwargs.get("crossover", DEFAULT_CROSSOVER_M), M=M)
    return p.replace(zeros_probe=None)


def node_route(kwargs: dict, op: str, M: int) -> Optional[Route]:
    p = node_problem(kwargs, op, M)
    return route(p) if p is not None else None


def kernel_for(kwargs: dict, op: str, lowering: str, lo: int, hi: float, crossover: int) -> tuple[str, list]:
    """(which kernel runs the node, the route's reasons), for the inspection report: the route at the
    node's static M; for a runtime branch the routes below and at the crossover."""
    kw = {**kwargs, "lowering": lowering, "crossover": crossover}
    if lo == hi:
        rt = node_route(kw, op, max(1, int(lo)))
        return (rt.describe(), rt.all_reasons()) if rt else ("unknown (no fake values)", [])
    small = node_route(kw, op, max(1, int(lo)))
    big = node_route(kw, op, max(crossover, int(lo)))
    if small is None or big is None:
        return "unknown (no fake values)", []
    if lowering == "overlapped":
        return f"per M: {big.describe()} at M = {max(crossover, int(lo))}", big.all_reasons()
    return (f"runtime branch: {small.describe()} at M = {max(1, int(lo))} | {big.describe()} at M = "
            f"{max(crossover, int(lo))}", small.all_reasons() + big.all_reasons())


def decide(lo: int, hi: float, crossover: int) -> tuple[str, str]:
    """(lowering, reason) for rows M known to lie in [lo, hi]."""
    if lo == hi:
        m = lo
        if m < crossover:
            return "fused", "decode (M == 1)" if m == 1 else f"M = {m} < crossover {crossover}"
        return "overlapped", f"M = {m} >= crossover {crossover}"
    if hi < crossover:
        why = "decode (M == 1)" if hi == 1 else f"M <= {int(hi)} < crossover {crossover}"
        return "fused", why
    if lo >= crossover:
        return "overlapped", f"M >= {lo} >= crossover {crossover}"
    hi_s = "oo" if hi == math.inf else str(int(hi))
    return "dispatch", f"M in [{lo}, {hi_s}] straddles crossover {crossover}: runtime branch"


def _rows(kwargs: dict) -> Optional[int]:
    """The weight's rows N from its fake value, when the graph carries one."""
    val = getattr(kwargs.get("qweight"), "meta", {}).get("val")
    return int(val.shape[0]) if val is not None else None


def ec_rank(*As) -> Optional[int]:
    """The largest rank among EC ``A`` nodes (their fake values' rows); None if none is known."""
    vals = [getattr(a, "meta", {}).get("val") for a in As]
    ranks = [int(v.shape[0]) for v in vals if v is not None]
    return max(ranks) if ranks else None


def _dtypes(*nodes) -> tuple:
    """dtypes of the fake values of graph nodes (None and nodes without one are skipped)."""
    vals = [getattr(n, "meta", {}).get("val") for n in nodes]
    return tuple(v.dtype for v in vals if v is not None)


class PhaseDispatch(SpearPass):
    name = "phase_dispatch"

    def run(self, graph: fx.Graph) -> int:
        if not self.ctx.config.enable_phase_dispatch:
            return 0
        count = 0
        for node in graph.nodes:
            if node.op != "call_function" or node.target not in SPEAR_OPS:
                continue
            kwargs = bind(node)
            crossover, source = self._crossover(node, kwargs)
            expr, lo, hi = m_range(kwargs["x"].meta["val"])
            lowering, reason = decide(lo, hi, crossover)
            reason = f"{reason} ({source})"
            node.args = positional(node.target, {**kwargs, "lowering": lowering, "crossover": crossover})
            node.kwargs = {}
            record(node, M=expr, M_range=[lo, None if hi == math.inf else int(hi)], lowering=lowering, reason=reason,
                   crossover=crossover, crossover_source=source,
                   **dict(zip(("kernel", "route_reasons"),
                              kernel_for(kwargs, "w4a16" if node.target is W4A16 else "ec", lowering, lo, hi,
                                         crossover))))
            count += 1
        return count

    def _crossover(self, node, kwargs) -> tuple[int, str]:
        cfg = self.ctx.config
        if cfg.crossover_m is not None:
            return cfg.crossover_m, "configured"
        x = kwargs["x"].meta["val"]
        if x.device.type == "cuda":
            N = node.meta["val"].shape[-1]
            K = x.shape[-1]
            m = _table.crossover(int(N), int(K), x.device)
            if m is not None:
                return m, "measured"
        return cfg.default_crossover_m, "default"
