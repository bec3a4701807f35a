"""Pass: at decode, the residual add after a linear becomes that linear's bias (one kernel fewer).

Matches:     ``aten.add.Tensor(y, r)`` (either order, alpha 1) where ``y`` is a ``spear::w4a16_linear`` /
             ``spear::ec_linear`` node without a bias whose only user is the add, M is statically 1
             (decode), ``r`` has ``y``'s exact shape and dtype and is computed before the linear: a
             transformer block's ``x + o_proj(a)`` and ``x + down_proj(...)``.
Rewrites to: the same linear with ``bias = r.view(N)`` in place of the add.

Example graph:
    before: %y = spear.w4a16_linear(%h[1, 1, 64], %w, %s, %z, 32, None, 'spear', 'fused', 16)
            %out = aten.add.Tensor(%x[1, 1, 64], %y)
    after:  %r = aten.view.default(%x, [64])
            %out = spear.w4a16_linear(%h, %w, %s, %z, 32, %r, 'spear', 'fused', 16)

Why: at M = 1 the residual is one row, exactly what the GEMV's bias epilogue already adds before
its store, so the separate add kernel (about 1 us on an H200, once per residual) disappears, and
the sum is rounded once instead of twice. Why only M == 1: at M > 1 the residual is a matrix,
not a bias vector. Why only without a bias: adding two vectors would need a kernel of its own.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .base import SpearPass
from .common import SPEAR_OPS, bind, call, positional, record
from .phase_dispatch import static_m

ADD = torch.ops.aten.add.Tensor
VIEW = torch.ops.aten.view.default


def _residual_of(add: fx.Node, order: dict) -> tuple[fx.Node, fx.Node] | None:
    """(linear, residual) if ``add`` is ``linear(...) + residual`` in the form this pass folds."""
    if add.kwargs.get("alpha", 1) != 1 or len(add.args) != 2:
        return None
    for y, r in (add.args, add.args[::-1]):
        if not (isinstance(y, fx.Node) and isinstance(r, fx.Node) and y.op == "call_function"
                and y.target in SPEAR_OPS and len(y.users) == 1):
            continue
        yv, rv = y.meta.get("val"), r.meta.get("val")
        if yv is None or rv is None or order[r] >= order[y]:
            continue
        if tuple(rv.shape) != tuple(yv.shape) or rv.dtype != yv.dtype or rv.device != yv.device:
            continue
        kw = bind(y)
        if kw["bias"] is not None or static_m(kw["x"].meta["val"]) != 1:
            continue
        return y, r
    return None


class FoldResidualAdd(SpearPass):
    name = "fold_residual_add"

    def run(self, graph: fx.Graph) -> int:
        if not self.ctx.config.fold_residual_add:
            return 0
        order = {n: i for i, n in enumerate(graph.nodes)}
        count = 0
        for add in list(graph.nodes):
            if add.op != "call_function" or add.target is not ADD:
                continue
            found = _residual_of(add, order)
            if found is None:
                continue
            y, r = found
            N = int(y.meta["val"].shape[-1])
            with graph.inserting_before(y):
                bias = call(graph, VIEW, (r, [N]))
            y.args = positional(y.target, {**bind(y), "bias": bias})
            y.kwargs = {}
            add.replace_all_uses_with(y)
            graph.erase_node(add)
            record(y, residual=f"folded: {add.name} = {r.name} + this linear; the residual is the GEMV's bias")
            count += 1
        return count
