"""Pass: at decode, ``silu(gate(h)) * up(h)`` over one concatenated GEMV becomes one GLU GEMV.

Matches:     ``aten.mul(silu(slice(%cat, 0, F)), slice(%cat, F, 2F))`` (either order) where ``%cat`` is a
             ``spear::w4a16_linear_cat`` (or ``spear::ec_linear_cat``: gate and up with ECs) of exactly
             two parts of F rows each, without biases, made by ``fuse_shared_input`` (so M == 1), and
             nothing else reads the slices or the silu. silu is
             matched in the forms the post-grad graph has: ``aten.silu``, its decomposition
             ``x / (1 + exp(-x))`` and ``x * sigmoid(x)``, each possibly between dtype conversions.
Rewrites to: one ``spear::w4a16_linear_glu(h, [Wg, Wu], ...)`` (``spear::ec_linear_glu`` with the ECs) in
             place of the mul.

Example graph:
    before: %cat = spear.w4a16_linear_cat(%h, [%wg, %wu], [%sg, %su], [%zg, %zu], 128, [None, None], 'spear')
            %g = aten.slice(%cat, 2, 0, 11008)  %u = aten.slice(%cat, 2, 11008, 22016)
            %c = prims.convert_element_type(%g, f32)  %e = aten.exp(aten.neg(%c))
            %s = prims.convert_element_type(aten.div(%c, aten.add(%e, 1)), bf16)  %y = aten.mul(%s, %u)
    after:  %y = spear.w4a16_linear_glu(%h, [%wg, %wu], [%sg, %su], [%zg, %zu], 128, 'silu', 'spear')

Why: a Llama MLP at decode runs the gate / up GEMV, then a small kernel for silu(g) * u, then the down
GEMV. With the gate and up rows interleaved per CTA, the GEMV's epilogue holds both factors of its
outputs and stores only the product: the act-mul kernel (about 1.3 us on an H200) disappears and the
GEMV writes half the values. On a GPU the pass rewrites only where that epilogue runs (the tuned
table's TMA kernel for the concatenated shape, ``lowering.w4a16_cat.glu_config_for``); elsewhere
Inductor's fused act-mul kernel is at least as good. With ECs the same kernel adds each row's EC before
the product (``lowering/w4a16_gemv_tma_ec.py``), PDL-launched behind the ECs' producer grid, where that
runs ("ec_glu_tma"). On the CPU the op is the reference either way
(the same work as the unfused graph), so the rewrite is made there too, which keeps it tested.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx

from .base import SpearPass
from .common import bind, call_op, cat_route, copy_meta, record
from .phase_dispatch import static_m

W4A16_CAT = torch.ops.spear.w4a16_linear_cat.default
EC_CAT = torch.ops.spear.ec_linear_cat.default
GLU = torch.ops.spear.w4a16_linear_glu.default
EC_GLU = torch.ops.spear.ec_linear_glu.default
EC_ARGS = ("As", "Bs", "W1s", "b1s", "W2s", "b2s", "alphas")
SLICE = torch.ops.aten.slice.Tensor
MUL = torch.ops.aten.mul.Tensor
CONVERT = torch.ops.prims.convert_element_type.default
KERNEL = "gluon TMA-ring GEMV over the interleaved gate / up weights, silu(gate) * up in its epilogue (M = 1)"


def _strip_convert(n, to: Optional[torch.dtype] = None):
    """The input of ``n`` if ``n`` is one dtype conversion (to ``to``, when given) that loses nothing:
    an upcast to fp32, or the downcast of an fp32 value to ``to``; else ``n`` itself. One conversion
    only: a chain like fp32 -> bf16 -> fp32 rounds, and the fused ops would skip that rounding."""
    if not (isinstance(n, fx.Node) and n.op == "call_function" and n.target is CONVERT):
        return n
    src, dst = n.args[0], n.args[1]
    sv = src.meta.get("val") if isinstance(src, fx.Node) else None
    if sv is None or (to is not None and dst != to):
        return n
    if dst == torch.float32 or sv.dtype == torch.float32:  # an upcast, or fp32 rounded once to `to`
        return src
    return n


def _is(n, target) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target is target


def silu_input(n) -> Optional[fx.Node]:
    """``x`` if node ``n`` computes silu(x) in one of the post-grad forms (see module docstring): the
    silu in fp32, at most one upcast of x before it and one rounding after it."""
    aten = torch.ops.aten
    nv = n.meta.get("val") if isinstance(n, fx.Node) else None
    n = _strip_convert(n, nv.dtype if nv is not None else None)
    if _is(n, aten.silu.default):  # (PyTorch's silu computes in fp32 whatever the dtype)
        return _strip_convert(n.args[0])
    if not isinstance(n, fx.Node) or getattr(n.meta.get("val"), "dtype", None) != torch.float32:
        return None  # a silu decomposed in low precision rounds in between: not what the fused op computes
    if _is(n, aten.div.Tensor):  # x / (1 + exp(-x))
        x, den = n.args
        if (_is(den, aten.add.Tensor) and den.args[1] == 1 and den.kwargs.get("alpha", 1) == 1
                and _is(den.args[0], aten.exp.default)):
            neg = den.args[0].args[0]
            if _is(neg, aten.neg.default) and neg.args[0] is x:
                return _strip_convert(x)
    if _is(n, aten.mul.Tensor):  # x * sigmoid(x)
        for x, s in (n.args, n.args[::-1]):
            if _is(s, aten.sigmoid.default) and s.args[0] is x:
                return _strip_convert(x)
    return None


def _chain(out: fx.Node, stop: fx.Node) -> list[fx.Node]:
    """Nodes between ``stop`` (exclusive) and ``out`` (inclusive)."""
    seen, stack = [], [out]
    while stack:
        n = stack.pop()
        if n is stop or n in seen:
            continue
        seen.append(n)
        stack.extend(a for a in n.all_input_nodes)
    return seen


def _halves(cat: fx.Node) -> Optional[tuple[fx.Node, fx.Node, int]]:
    """(gate slice, up slice, F) of a two-part concatenation, when its only users are those slices."""
    kw = bind(cat)
    if len(kw["qweights"]) != 2 or any(b is not None for b in kw["biases"]):
        return None
    dim = cat.meta["val"].dim() - 1
    F2 = int(cat.meta["val"].shape[-1])
    parts = {}
    for s in cat.users:
        if (not _is(s, SLICE) or s.args[1] not in (dim, -1) or len(s.args) != 4
                or not all(isinstance(v, int) for v in s.args[2:])):
            return None
        parts[(s.args[2], min(s.args[3], F2))] = s  # (an open end, y[..., F:], is traced as 2^63 - 1)
    F = F2 // 2
    if set(parts) != {(0, F), (F, F2)}:
        return None
    return parts[(0, F)], parts[(F, F2)], F


class FuseGLU(SpearPass):
    name = "fuse_glu"

    def run(self, graph: fx.Graph) -> int:
        if not self.ctx.config.fuse_glu:
            return 0
        count = 0
        for mul in list(graph.nodes):
            if not _is(mul, MUL) or len(mul.args) != 2 or mul.kwargs:
                continue
            for a, b in (mul.args, mul.args[::-1]):
                if self._try(graph, mul, a, b):
                    count += 1
                    break
        return count

    def _try(self, graph: fx.Graph, mul: fx.Node, act_out, up) -> bool:
        if not (_is(up, SLICE) and (_is(up.args[0], W4A16_CAT) or _is(up.args[0], EC_CAT))):
            return False
        gate = silu_input(act_out)
        cat = up.args[0]
        halves = _halves(cat)
        if gate is None or halves is None or halves[0] is not gate or halves[1] is not up:
            return False
        chain = _chain(act_out, gate)
        # nothing outside the pattern may read the slices or the silu's intermediates
        if len(up.users) != 1 or any(u not in chain and u is not mul for n in (gate, *chain) for u in n.users):
            return False
        kw = bind(cat)
        if static_m(kw["x"].meta["val"]) != 1:  # a batched concatenation (one GEMM): not this epilogue's
            return False
        has_ec = cat.target is EC_CAT
        if mul.meta["val"].dtype != cat.meta["val"].dtype or not self._epilogue_runs(kw, halves[2], has_ec):
            return False
        args = {"x": kw["x"], "qweights": kw["qweights"], "scales": kw["scales"], "zeros": kw["zeros"],
                "group_size": kw["group_size"], **{k: kw[k] for k in EC_ARGS if has_ec},
                "act": kw["act"] if has_ec else "silu", "layout": kw["layout"],
                "norm_weight": kw["norm_weight"], "norm_eps": kw["norm_eps"]}  # (a norm fused before: kept)
        with graph.inserting_before(mul):
            glu = call_op(graph, EC_GLU if has_ec else GLU, args)
        copy_meta(mul, glu)
        info = dict(cat.meta.get("spear", {}))
        kernel = "pytorch reference"
        if kw["x"].meta["val"].device.type == "cuda":
            rt = cat_route({**kw, "norm_weight": None}, "ec_glu" if has_ec else "w4a16_glu", norm=False)
            kernel = rt.describe() if rt is not None else KERNEL
        info["members"] = [{**m, "fused_into": glu.name, "kernel": kernel, "glu": True}
                           for m in info.get("members", [])]
        record(glu, **{**info, "source_form": "fused_glu", "kernel": kernel})
        mul.replace_all_uses_with(glu)
        graph.erase_node(mul)
        return True

    def _epilogue_runs(self, kw: dict, F: int, has_ec: bool) -> bool:
        """CPU: always (the reference either way); GPU: where ``route`` runs the GLU op on the TMA kernel's
        GLU epilogue (with ECs, ``has_ec``: where that kernel also adds them). ``kw``: the concatenation's
        bound arguments."""
        if kw["x"].meta["val"].device.type != "cuda":
            return True
        rt = cat_route(kw, "ec_glu" if has_ec else "w4a16_glu", norm=kw["norm_weight"] is not None)
        return rt is not None and rt.kernel in ("glu_tma", "ec_glu_tma")
