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
in ``node.meta["spear"]`` for the inspection report.

Example graph:
    before: %y = spear.ec_linear(x=%x[s0, 576], ..., lowering='auto')
    after:  %y = spear.ec_linear(x=%x[s0, 576], ..., lowering='dispatch', crossover=16)
            meta: lowering='dispatch', reason='M in [2, oo] straddles crossover 16: runtime branch (default)'

The crossover is, in order: ``CompileConfig.crossover_m`` if set; the value measured for
this GPU and weight shape by ``benchmarks/kernels.py``; ``default_crossover_m``.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.fx as fx

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


def gemv_name(N: Optional[int], K: int, G: Optional[int], x_val: torch.Tensor, param_dtypes: tuple = ()) -> str:
    """The M = 1 GEMV that runs an [N, K] weight without an EC: the TMA-fed Gluon kernel where the
    tuned table measured it faster on this GPU (and the scales / zero points, ``param_dtypes``, are
    bf16), else the CUDA-core Triton kernel."""
    from ..lowering.w4a16_gemv_tma import HAS_GLUON, tma_config_for

    if (N is not None and G is not None and HAS_GLUON
            and tma_config_for(N, K, G, x_val.dtype, x_val.device, param_dtypes=param_dtypes)):
        return "gluon TMA-ring GEMV (M = 1; measured faster than the triton GEMV for this shape)"
    return "triton GEMV (M = 1)"


def ec_gemv_name(N: Optional[int], K: int, G: Optional[int], x_val: torch.Tensor, param_dtypes: tuple = (),
                 rc: Optional[int] = None, single: bool = False) -> str:
    """The M = 1 GEMV that runs an [N, K] weight with a decode EC (``rc``: its largest rank): the TMA-fed
    Gluon kernel with the EC in its epilogue where its config allows it and PDL runs
    (``ec_cat.ec_tma_config``) - for a ``single`` EC also unless the lab measured the CUDA-core pair
    faster for the shape (``w4a16_triton.tma_ec_measured_ok``) - else the CUDA-core Triton kernel."""
    from ..lowering.ec_cat import ec_epilogue_ok
    from ..lowering.w4a16_gemv_tma import HAS_GLUON, tma_config_for
    from ..lowering.w4a16_triton import tma_ec_measured_ok

    cfg = (tma_config_for(N, K, G, x_val.dtype, x_val.device, param_dtypes=param_dtypes)
           if N is not None and G is not None and HAS_GLUON else None)
    if ec_epilogue_ok(cfg, x_val.device, norm=False, rc=rc) and not (single and not tma_ec_measured_ok(N, K, G)):
        return "gluon TMA-ring GEMV"
    return "triton GEMV"


def kernel_for(x_val: torch.Tensor, layout: str, lowering: str, has_ec: bool, N: Optional[int] = None,
               G: Optional[int] = None, param_dtypes: tuple = (), rc: Optional[int] = None) -> str:
    """Which implementation will run this node (for the inspection report); N and G (the weight's
    rows and group size) name the M = 1 GEMV exactly."""
    from ..lowering._triton import HAS_TRITON

    if not (x_val.device.type == "cuda" and HAS_TRITON and layout == "spear"
            and x_val.dtype in (torch.float16, torch.bfloat16)):
        return "pytorch reference"
    from ..lowering.ec_decode_triton import pdl_ok

    gemm = ("triton GEMM (M < 256) / dequant + cuBLAS / wgmma in-loop-dequant GEMM (shared-memory or "
            "register-operand weight)")
    producers = "EC producer launch + PDL-launched" if pdl_ok(x_val.device) else "in-kernel EC producers +"
    K = int(x_val.shape[-1])
    fused = (f"{producers} {ec_gemv_name(N, K, G, x_val, param_dtypes, rc, single=True)} with EC epilogue" if has_ec
             else f"{gemv_name(N, K, G, x_val, param_dtypes)} / {gemm}")
    over = (f"{gemm} (per the tuned table) + EC in the structure measured per shape: shrink and gate on a "
            "side stream, or first and into the GEMM's C operand, or as one more K step of the wgmma GEMM "
            "(PDL-launched behind the gate on the register-operand one)"
            if has_ec else gemm)
    return {"fused": fused, "overlapped": over}.get(lowering, f"runtime branch: {fused} | {over}")


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
                   kernel=kernel_for(kwargs["x"].meta["val"], kwargs["layout"], lowering, node.target is not W4A16,
                                     N=_rows(kwargs), G=kwargs.get("group_size"),
                                     param_dtypes=_dtypes(kwargs.get("scales"), kwargs.get("zeros")),
                                     rc=ec_rank(kwargs.get("A"))))
            count += 1
        return count

    def _crossover(self, node, kwargs) -> tuple[int, str]:
        cfg = self.ctx.config
        if cfg.crossover_m is not None:
            return cfg.crossover_m, "configured"
        x = kwargs["x"].meta["val"]
        if x.device.type == "cuda":
            from ..lowering.tuning import measured_crossover

            N = node.meta["val"].shape[-1]
            K = x.shape[-1]
            m = measured_crossover(int(N), int(K), x.device)
            if m is not None:
                return m, "measured"
        return cfg.default_crossover_m, "default"
