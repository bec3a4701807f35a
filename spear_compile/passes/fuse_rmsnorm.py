"""Pass: at decode, the RMSNorm in front of a concatenated / GLU GEMV moves into the GEMV's x staging.

Matches:     the ``x`` of a ``spear::w4a16_linear_cat`` / ``w4a16_linear_glu`` / ``ec_linear_cat`` /
             ``ec_linear_glu`` node (made at M == 1 by ``fuse_shared_input`` / ``fuse_glu``) when it is an
             RMSNorm computed in fp32 and read by nothing else: ``mul(convert(mul(xf, rsqrt(add(mean(pow(xf, 2), [-1], True), eps))), dt), w)``
             with ``xf = convert(x, f32)`` (or x itself in an fp32 model) and ``w`` one weight per feature
             (the Llama / HF ``LlamaRMSNorm`` form, either operand order of the multiplies).
Rewrites to: the same op reading ``x`` with ``norm_weight = w, norm_eps = eps``.

Example graph:
    before: %xf = prims.convert_element_type(%x, f32)  %m = aten.mean.dim(aten.pow(%xf, 2), [-1], True)
            %h = prims.convert_element_type(aten.mul(%xf, aten.rsqrt(aten.add(%m, 1e-05))), bf16)
            %n = aten.mul(%h, %w)
            %cat = spear.w4a16_linear_cat(%n, [%wq, %wk, %wv], ...)
    after:  %cat = spear.w4a16_linear_cat(%x, [%wq, %wk, %wv], ..., norm_weight=%w, norm_eps=1e-05)

Why: at decode the RMSNorm is a one-CTA reduction kernel of ~2.2 us on an H200, twice per Llama layer,
in front of GEMVs whose CTAs each stage all of x in shared memory anyway (the TMA kernel, OPS = 2):
each CTA sums the squares of x as it reads it and stages the normalised values
(``lowering/w4a16_gemv_tma._stage_x``), and the norm kernel disappears. On a GPU the pass rewrites
only where ``dispatch.route`` runs the op with the norm on that kernel (the tuned table's TMA config for
the shape, x staged in shared memory, no K-split); elsewhere Inductor's norm kernel stays. For ``ec_linear_cat`` (q/k/v or gate/up with ECs)
both kernels of the decode EC normalise x themselves: the EC's producer grid and the TMA GEMV that
adds the EC in its epilogue (``lowering/ec_decode_triton.py``), so the GEMV still waits for the
producer only before its epilogue. On the CPU the op is the reference either way,
so the rewrite is made there too, which keeps it tested.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx

from .base import SpearPass
from .common import bind, positional, record
from .common import cat_route
from .fuse_glu import EC_CAT, EC_GLU, GLU, MUL, W4A16_CAT, _is, _strip_convert
from .phase_dispatch import static_m

ATEN = torch.ops.aten
TARGETS = (W4A16_CAT, GLU, EC_CAT, EC_GLU)


def rms_norm_of(out) -> Optional[tuple[fx.Node, fx.Node, float, list[fx.Node]]]:
    """(x, weight, eps, the norm's nodes) if ``out`` is the RMSNorm of x in the form above."""
    if not _is(out, MUL):
        return None
    for hc, w in (out.args, out.args[::-1]):
        wv = w.meta.get("val") if isinstance(w, fx.Node) else None
        hv = hc.meta.get("val") if isinstance(hc, fx.Node) else None
        h = _strip_convert(hc, hv.dtype if hv is not None else None)
        if wv is None or wv.dim() != 1 or not _is(h, MUL):
            continue
        for xf, r in (h.args, h.args[::-1]):
            if not (_is(r, ATEN.rsqrt.default) and _is(r.args[0], ATEN.add.Tensor)):
                continue
            add = r.args[0]
            mean, eps = add.args
            if not (_is(mean, ATEN.mean.dim) and isinstance(eps, float) and eps > 0
                    and add.kwargs.get("alpha", 1) == 1):
                continue
            nd = xf.meta["val"].dim() if isinstance(xf, fx.Node) and "val" in xf.meta else -1
            if list(mean.args[1]) not in ([-1], [nd - 1]) or not (len(mean.args) > 2 and mean.args[2]):
                continue
            p = mean.args[0]
            if not (_is(p, ATEN.pow.Tensor_Scalar) and p.args[0] is xf and p.args[1] == 2):
                continue
            if xf.meta["val"].dtype != torch.float32:  # a norm computed in low precision is not this form
                continue
            x = _strip_convert(xf)
            chain = [out, h, r, add, mean, p]
            chain += [n for n in (hc, xf) if n is not h and n is not x]  # the conversions, when present
            return x, w, eps, chain
    return None


class FuseRMSNorm(SpearPass):
    name = "fuse_rmsnorm"

    def run(self, graph: fx.Graph) -> int:
        if not self.ctx.config.fuse_rmsnorm:
            return 0
        count = 0
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in TARGETS:
                continue
            kw = bind(node)
            if kw["norm_weight"] is not None or static_m(kw["x"].meta["val"]) != 1:  # decode only
                continue
            found = rms_norm_of(kw["x"])
            if found is None:
                continue
            x, w, eps, chain = found
            xv, outv, wv = x.meta.get("val"), kw["x"].meta["val"], w.meta["val"]
            if xv is None or xv.dtype != outv.dtype or wv.dtype != outv.dtype or wv.shape[0] != outv.shape[-1]:
                continue
            inner = set(chain)  # every node of the norm feeds only the norm; its output only this op
            if set(kw["x"].users) != {node} or any(u not in inner for n in chain[1:] for u in n.users):
                continue
            if not self._prologue_runs(node, kw):
                continue
            node.args = positional(node.target, {**kw, "x": x, "norm_weight": w, "norm_eps": eps})
            node.kwargs = {}
            info = node.meta.get("spear", {})
            note = f"RMSNorm ({kw['x'].name}, eps {eps:g}) fused into the GEMV's x staging"
            for m in info.get("members", []):
                m["rms_norm"] = note
            record(node, rms_norm=note)
            count += 1
        return count

    def _prologue_runs(self, node: fx.Node, kw: dict) -> bool:
        """CPU: always (the reference either way); GPU: where ``route`` runs the op with the RMSNorm on the
        TMA kernel (x staged in shared memory; for an EC op, that kernel adding the EC behind a PDL producer)."""
        if kw["x"].meta["val"].device.type != "cuda":
            return True
        op = {W4A16_CAT: "w4a16_cat", GLU: "w4a16_glu", EC_CAT: "ec_cat", EC_GLU: "ec_glu"}[node.target]
        rt = cat_route(kw, op, norm=True)
        return rt is not None and rt.kernel in ("cat_tma", "glu_tma", "ec_cat_tma", "ec_glu_tma")
