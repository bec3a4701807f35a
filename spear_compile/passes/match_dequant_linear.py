"""Pass: adopt hand-written / HF-style "dequantize, then linear" subgraphs.

Matches (post-grad ATen, after ``linear`` has become ``permute`` + ``mm``/``addmm``) the maths
``w = (q - z) * s`` written in any of its equivalent op orders::

    q   : integer tensor [N, K] or [N, K/G, G], any producer
    w   = chain of, in evaluation order:
            convert_element_type(., dtype)   exactly once, from the integer values to the
                                             activation dtype; or implicit, where ``sub`` /
                                             ``mul`` promote the integers to a float operand's dtype
            sub(., zero)                     optional, before the mul; an integer zero before the
                                             conversion (exact), a float one after it
            mul(., scale) | mul(scale, .)    once
            reshape / view                   anywhere, between [N, K] and [N, K/G, G]
    y   = mm(x, permute(w, [1, 0]))  |  addmm(bias, x, permute(w, [1, 0]))

``zero`` and ``scale`` are numbers or tensors that broadcast as one value per (row, group) at
the point they apply: ``[N, K/G, 1]`` against the 3-d form, ``[N, 1]`` against the 2-d one.
Every such order computes the same numbers as the "unpacked" layout's ``(q.to(dtype) - z) * s``
(integer codes and zeros are exact in every float dtype), so adoption is bit-exact. Anything
else (per-input-channel scales, a dequantization in another dtype followed by a cast, beta /
alpha != 1) is left alone and compiles exactly as Inductor would; an EC registered for such a
weight makes the backend refuse to compile (``passes/backend.py``) rather than drop it.

Rewrites to: ``spear::w4a16_linear(x, qweight=reshape(q, [N, K]), scales=[N, K/G],
zeros=[N, K/G], layout="unpacked")`` (or ``ec_linear`` when an EC is registered for
the integer weight input).

Example graph:
    before: %c = convert_element_type(%q, f32); %r = view(%c, [N, K/G, G]); %s1 = sub(%r, %z)
            %m = mul(%s1, %s); %w = view(%m, [N, K]); %t = permute(%w, [1, 0]); %y = mm(%x, %t)
    after:  %y = spear.w4a16_linear(x=%x, qweight=%q, scales=%s', zeros=%z', group_size=G, layout='unpacked')
"""
from __future__ import annotations

from typing import Any, Optional

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
                scales = self._canon(graph, m["scale"], N, m["ng"], m["dtype"], m["device"])
                zeros = None if m["zero"] is None else self._canon(graph, m["zero"], N, m["ng"], m["dtype"], m["device"])
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
        xv, wv = _val(x), _val(wt.args[0])
        if not isinstance(xv, torch.Tensor) or xv.dim() != 2 or not isinstance(wv, torch.Tensor) or wv.dim() != 2:
            return None
        N, K = wv.shape
        if not isinstance(N, int) or not isinstance(K, int) or xv.shape[-1] != K or wv.dtype != xv.dtype:
            return None
        chain = _chain(wt.args[0])
        return None if chain is None else _check_chain(chain, N, K, xv.dtype)

    @staticmethod
    def _canon(graph: fx.Graph, op: dict, N: int, ng: int, dtype, device) -> fx.Node:
        """A scale / zero as a [N, ng] tensor node holding the values the original graph broadcast."""
        t = op["operand"]
        if isinstance(t, (int, float)):
            return call(graph, aten.full.default, ([N, ng], t), {"dtype": dtype, "device": device})
        if op["rank"] == 3:
            e = call(graph, aten.reshape.default, (call(graph, aten.expand.default, (t, [N, ng, 1])), [N, ng]))
        else:
            e = call(graph, aten.expand.default, (call(graph, aten.expand.default, (t, [N, 1])), [N, ng]))
        return e if _val(t).dtype == dtype else call(graph, prims.convert_element_type.default, (e, dtype))


def _chain(w) -> Optional[list[tuple[str, fx.Node, Any]]]:
    """The dequantization ops from the integer source up to ``w``, in evaluation order, as
    (kind, node, operand) with kind in reshape / convert / sub / mul; None when ``w`` is not such a
    chain. ``mul`` may hold the chain in either argument: the one that leads to integers is it."""
    ops: list = []
    n = w
    while True:
        v = _val(n)
        if not isinstance(v, torch.Tensor):
            return None
        if not v.is_floating_point() and not (
                _is(n, _RESHAPES) or (_is(n, (aten.sub.Tensor,)) and n.kwargs.get("alpha", 1) == 1)):
            ops.append(("source", n, None))  # reached the integer codes
            return ops[::-1]
        if _is(n, _RESHAPES):
            ops.append(("reshape", n, None))
            n = n.args[0]
        elif _is(n, (prims.convert_element_type.default,)):
            ops.append(("convert", n, n.args[1]))
            n = n.args[0]
        elif _is(n, (aten.sub.Tensor,)) and n.kwargs.get("alpha", 1) == 1:
            ops.append(("sub", n, n.args[1]))
            n = n.args[0]
        elif _is(n, (aten.mul.Tensor,)):
            a, b = n.args
            for chain_arg, scale in ((a, b), (b, a)):  # the argument that leads to the integers is the chain
                inner = _chain(chain_arg)
                if inner is not None:
                    return inner + [("mul", n, scale)] + ops[::-1]
            return None
        else:
            return None


def _check_chain(chain: list, N: int, K: int, dtype) -> Optional[dict]:
    """Whether the chain computes ``(q - z) * s`` in ``dtype`` per (row, group); the match or None."""
    q = chain[0][1]
    shapes = [tuple(_val(q).shape)] + [tuple(_val(node).shape) for _, node, _ in chain[1:]]
    groups = {s[1] for s in shapes if len(s) == 3}
    if len(groups) > 1 or not all(_shape_ok(s, N, K) for s in shapes):
        return None
    ng = groups.pop() if groups else 1
    if not isinstance(ng, int) or ng < 1 or K % ng:
        return None
    converted = subbed = multiplied = False
    zero = scale = None
    for (kind, node, operand), before in zip(chain[1:], shapes[:-1]):
        if kind == "reshape":
            continue
        if kind == "convert":
            if converted or operand != dtype:
                return None
            converted = True
            continue
        out_float = _val(node).is_floating_point()
        if kind == "sub":
            if subbed or multiplied or not _operand_ok(operand, before, N, ng, integer=not out_float):
                return None
            if out_float and not converted:  # integers promoted to the zero's float dtype
                if _val(node).dtype != dtype:
                    return None
                converted = True
            subbed, zero = True, {"operand": operand, "rank": len(before)}
        else:  # mul
            if multiplied or not out_float or not _operand_ok(operand, before, N, ng, integer=False):
                return None
            if not converted:  # integers promoted to the scale's dtype
                if _val(node).dtype != dtype:
                    return None
                converted = True
            multiplied, scale = True, {"operand": operand, "rank": len(before)}
    if not (converted and multiplied) or _val(chain[-1][1]).dtype != dtype:
        return None
    return dict(q=q, q_2d=len(shapes[0]) == 2, scale=scale, zero=zero, N=N, K=K, ng=ng, dtype=dtype,
                device=_val(q).device)


def _shape_ok(shape: tuple, N: int, K: int) -> bool:
    if len(shape) == 2:
        return shape == (N, K)
    return len(shape) == 3 and shape[0] == N and all(isinstance(d, int) for d in shape) and shape[1] * shape[2] == K


def _operand_ok(t, at: tuple, N: int, ng: int, integer: bool) -> bool:
    """A zero / scale that broadcasts as one value per (row, group) against a tensor of shape ``at``;
    integer-valued when applied before the conversion (a zero), floating after it."""
    if isinstance(t, bool):
        return False
    if isinstance(t, (int, float)):
        return isinstance(t, int) or not integer
    v = _val(t)
    if not isinstance(v, torch.Tensor) or v.is_floating_point() == integer:
        return False
    target = (N, ng, 1) if len(at) == 3 else (N, 1)
    if v.dim() > len(target):
        return False
    shape = (1,) * (len(target) - v.dim()) + tuple(v.shape)
    return shape[-1] == 1 and all(s in (1, t_) for s, t_ in zip(shape, target))
