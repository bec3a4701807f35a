"""Pass: adopt hand-written / HF-style "dequantize, then linear" subgraphs.

Matches (post-grad ATen, after ``linear`` has become ``permute`` + ``mm``/``addmm``)::

    q   : integer tensor [N, K] (or [N, K/G, G] for groups), any producer
    w   = convert_element_type(q, dtype)           # dtype == activation dtype
    w   = sub(w, zero)                             # optional; tensor or number
    w   = mul(w, scale)                            # tensor or number
    w   = reshape(w, [N, K])                       # only for groups
    y   = mm(x, permute(w, [1, 0]))  |  addmm(bias, x, permute(w, [1, 0]))

where ``zero`` and ``scale`` broadcast as one value per (row, group): their last dim
is 1. Anything else (per-input-channel scales, extra casts, beta/alpha != 1) is left
alone, so the graph compiles exactly as Inductor would.

Rewrites to: ``spear::w4a16_linear(x, qweight=reshape(q, [N, K]), scales=[N, K/G],
zeros=[N, K/G], layout="unpacked")`` (or ``ec_linear`` when an EC is registered for
the integer weight input). The "unpacked" layout dequantizes in the same order,
``(q.to(dtype) - z) * s``, so the numbers are the original graph's.

Example graph:
    before: %c = convert_element_type(%q, f32); %s1 = sub(%c, %z); %m = mul(%s1, %s)
            %t = permute(%m, [1, 0]); %y = mm(%x, %t)
    after:  %y = spear.w4a16_linear(x=%x, qweight=%q, scales=%s', zeros=%z', group_size=K, layout='unpacked')
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx

from .base import SpearPass
from .common import call, emit_spear_linear, integer_source

aten, prims = torch.ops.aten, torch.ops.prims
_RESHAPES = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)
_TRANSPOSES = (aten.permute.default, aten.t.default)


def _is(node, targets) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def _val(node):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


class MatchDequantLinear(SpearPass):
    name = "match_dequant_linear"

    def run(self, graph: fx.Graph) -> int:
        if not self.ctx.config.enable_dequant_match:
            return 0
        count = 0
        for node in list(graph.nodes):
            if _is(node, (aten.mm.default,)):
                x, wt, bias = node.args[0], node.args[1], None
            elif _is(node, (aten.addmm.default,)) and node.kwargs.get("beta", 1) == 1 and node.kwargs.get("alpha", 1) == 1:
                bias, x, wt = node.args[0], node.args[1], node.args[2]
            else:
                continue
            m = self._match_weight(wt, x)
            if m is None:
                continue
            N, K = m["N"], m["K"]
            if bias is not None and (not isinstance(_val(bias), torch.Tensor) or tuple(_val(bias).shape) != (N,)):
                continue
            with graph.inserting_before(node):
                q2 = m["q"] if m["q_2d"] else call(graph, aten.reshape.default, (m["q"], [N, K]))
                scales = self._canon(graph, m["scale"], N, m["ng"], m["grouped"], m["dtype"], m["device"])
                zeros = None if m["zero"] is None else self._canon(graph, m["zero"], N, m["ng"], m["grouped"], m["dtype"], m["device"])
            kwargs = dict(x=x, qweight=q2, scales=scales, zeros=zeros, group_size=K // m["ng"], bias=bias,
                          layout="unpacked", lowering="auto", crossover=self.ctx.config.default_crossover_m)
            emit_spear_linear(graph, node, self.ctx, kwargs, integer_source(m["q"]), "dequant_linear")
            count += 1
        return count

    def _match_weight(self, wt, x) -> Optional[dict]:
        if not _is(wt, _TRANSPOSES):
            return None
        if wt.target is aten.permute.default and list(wt.args[1]) != [1, 0]:
            return None
        w = wt.args[0]
        grouped = _is(w, _RESHAPES)
        if grouped:
            w = w.args[0]
        if not _is(w, (aten.mul.Tensor,)) or len(w.users) != 1:
            return None
        for a, scale in (w.args, w.args[::-1]):
            zero = None
            c = a
            if _is(c, (aten.sub.Tensor,)) and c.kwargs.get("alpha", 1) == 1:
                c, zero = c.args
            if _is(c, (prims.convert_element_type.default,)):
                break
        else:
            return None
        q, dtype = c.args[0], c.args[1]
        qv, xv = _val(q), _val(x)
        if not isinstance(qv, torch.Tensor) or qv.is_floating_point() or not isinstance(xv, torch.Tensor):
            return None
        if dtype != xv.dtype or xv.dim() != 2:
            return None
        shape = tuple(qv.shape)
        if grouped and len(shape) == 3:
            N, ng, G = shape
        elif not grouped and len(shape) == 2:
            (N, K), ng = shape, 1
            G = K
        else:
            return None
        if not all(isinstance(v, int) for v in (N, ng, G)) or xv.shape[-1] != ng * G:
            return None
        for t in (scale, zero):
            if t is not None and not self._per_group(t, N, ng, grouped):
                return None
        return dict(q=q, q_2d=not grouped, grouped=grouped, scale=scale, zero=zero, N=N, K=ng * G, ng=ng, dtype=dtype,
                    device=qv.device)

    @staticmethod
    def _per_group(t, N: int, ng: int, grouped: bool) -> bool:
        if isinstance(t, (int, float)):
            return True
        v = _val(t)
        if not isinstance(v, torch.Tensor) or not v.is_floating_point():
            return False
        target = (N, ng, 1) if grouped else (N, 1)
        shape = (1,) * (len(target) - v.dim()) + tuple(v.shape)
        return len(shape) == len(target) and shape[-1] == 1 and all(s in (1, t_) for s, t_ in zip(shape, target))

    @staticmethod
    def _canon(graph: fx.Graph, t, N: int, ng: int, grouped: bool, dtype, device) -> fx.Node:
        """Scale/zero as a [N, ng] tensor node holding the values the original graph broadcast."""
        if isinstance(t, (int, float)):
            return call(graph, aten.full.default, ([N, ng], t), {"dtype": dtype, "device": device})
        e = call(graph, aten.expand.default, (t, [N, ng, 1] if grouped else [N, 1]))
        return call(graph, aten.reshape.default, (e, [N, ng]))
