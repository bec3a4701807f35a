"""Pass: linears that read the same activation become one concatenated GEMV (decode) or GEMM (a static M of 2..256).

Matches:     two or more ``spear::w4a16_linear`` (with ``fuse_shared_input_ec`` also ``spear::ec_linear``) nodes
             with the same input node ``x``, the same group size and the "spear" layout, where M is statically
             1 (decode) or a static 2..256: a Llama layer's q/k/v and gate/up projections.
Rewrites to: one ``spear::w4a16_linear_cat`` (with ECs ``spear::ec_linear_cat``) over their weights, inserted
             before the first of them, and one ``aten.slice`` of its output per original node.

Example graph:
    before: %q = spear.w4a16_linear(%h[1, 1, 64], %wq, %sq, %zq, 64, None, 'spear', 'fused')
            %k = spear.w4a16_linear(%h, %wk, ...)  %v = spear.w4a16_linear(%h, %wv, ...)
    after:  %cat = spear.w4a16_linear_cat(%h, [%wq, %wk, %wv], [%sq, %sk, %sv], [%zq, %zk, %zv], 64,
                                          [None, None, None], 'spear')
            %q = aten.slice(%cat, 2, 0, 64)  %k = aten.slice(%cat, 2, 64, 128)  %v = aten.slice(%cat, 2, 128, 192)

At a static 2 <= M <= 256 (batched decode, or a prefill that short; ``CompileConfig.fuse_shared_input_gemm``,
on by default; on a GPU where the route runs it as one GEMM, ``cat_gemm``, with ECs ``ec_cat_gemm``: each EC
beside the GEMM as the side structure runs it, its expand added into its own rows) the same
rewrite runs one GEMM over the concatenated weights, and keeps a concatenated copy of them while they live:
in the serving regime the W4 GEMMs are latency-bound and a 4096-row output leaves SMs idle, and on one H200
the concatenation took Llama-2-7B's q/k/v to 0.43-0.66x and gate/up to 0.63-0.95x the parts' time
(``dispatch.route.CAT_GEMM_MAX_M``). A symbolic M (the serving engine's dynamic compile) is left alone:
above 256 rows it is not measured. The decode-only fusions after this pass (``fuse_glu``, ``fuse_rmsnorm``)
take M == 1 concatenations only.

With ``CompileConfig.fuse_shared_input_ec`` (on by default) linears with ECs sharing an input (same gate
activation) become one ``spear::ec_linear_cat``: at decode one GEMV with one block-diagonal EC
(``ec_cat.concatenated_ecs``), at 2 <= M <= 256 one GEMM with each EC beside it (not yet timed). With
``fuse_shared_input_mixed`` (on by default) the plain linears beside them join it as parts without an EC (None
in the EC lists; otherwise they group apart, and a mixed group that cannot fuse whole falls back to that).
Measured at decode (``CompileConfig.fuse_shared_input``, ``fuse_shared_input_ec``):
Llama-2-7B-shaped decode at batch 1 on one H200 went 2.82 -> 2.60 ms/token for plain W4 (predicted
~2.64) and 2.731 -> 2.691 ms/token with ECs on 25 % of linears (predicted ~2.64; docs/kernels.md).
"""
from __future__ import annotations

import collections

import torch
import torch.fx as fx

from ..dispatch.route import CAT_GEMM_MAX_M
from .base import SpearPass
from .common import EC_LINEAR, META_KEY, W4A16, bind, call, call_op, cat_route, copy_meta, record
from .phase_dispatch import static_m

W4A16_CAT = torch.ops.spear.w4a16_linear_cat.default
EC_CAT = torch.ops.spear.ec_linear_cat.default
SLICE = torch.ops.aten.slice.Tensor


class FuseSharedInput(SpearPass):
    name = "fuse_shared_input"

    def run(self, graph: fx.Graph) -> int:
        if not self.ctx.config.fuse_shared_input:
            return 0
        order = {n: i for i, n in enumerate(graph.nodes)}
        groups: dict[tuple, list[tuple[fx.Node, dict]]] = collections.defaultdict(list)
        with_ec = self.ctx.config.fuse_shared_input_ec
        gemm_on = self.ctx.config.fuse_shared_input_gemm
        for n in graph.nodes:
            if n.op != "call_function" or not (n.target is W4A16 or (with_ec and n.target is EC_LINEAR)):
                continue
            kw = bind(n)
            x = kw["x"]
            xv = x.meta.get("val") if isinstance(x, fx.Node) else None
            if xv is None or kw["layout"] != "spear":
                continue
            M = static_m(xv)
            gemm = gemm_on and M is not None and 2 <= M <= CAT_GEMM_MAX_M
            if M == 1 or gemm:
                groups[(x, kw["group_size"], tuple(xv.shape))].append((n, kw))
        count = 0
        for (x, G, _), group in groups.items():
            acts = {kw["act"] for n, kw in group if n.target is EC_LINEAR}  # (one: a mixed group can fuse)
            mixed = len(acts) == 1 and any(n.target is W4A16 for n, _ in group)
            if mixed and self.ctx.config.fuse_shared_input_mixed:
                done = self._try(graph, order, x, G, group)
                if done:
                    count += done
                    continue
            for members in self._split(group):  # (a mixed group that could not fuse: its plain / EC sets)
                count += self._try(graph, order, x, G, members)
        return count

    @staticmethod
    def _split(group: list[tuple[fx.Node, dict]]) -> list[list[tuple[fx.Node, dict]]]:
        """The plain linears of one input apart from the EC ones, and those by gate activation (graph order
        kept)."""
        sets: dict = collections.defaultdict(list)
        for n, kw in group:
            sets[kw["act"] if n.target is EC_LINEAR else None].append((n, kw))
        return list(sets.values())

    def _try(self, graph: fx.Graph, order: dict, x: fx.Node, G: int, members: list[tuple[fx.Node, dict]]) -> int:
        if len(members) < 2:
            return 0
        first = members[0][0]  # graph order
        # every weight tensor must exist before the first member, where the new node goes
        if any(order[a] >= order[first] for n, _ in members for a in n.all_input_nodes if a is not x):
            return 0
        if not self._pays(x, G, members):
            return 0
        return self._fuse(graph, x, G, members)

    @staticmethod
    def _pays(x: fx.Node, G: int, members: list[tuple[fx.Node, dict]]) -> bool:
        """Decode (M == 1) and CPU (the references either way): always. A batched concatenation on a GPU: where
        the route runs it as one GEMM (``cat_gemm``, with ECs ``ec_cat_gemm``); where it would run the parts
        (fractional zero points on some parts only, a dtype the kernels do not take), the rewrite would only add a
        copy."""
        xv = x.meta["val"]
        M = static_m(xv)
        if M == 1 or xv.device.type != "cuda":
            return True
        args, has_ec = _op_args(x, G, members)
        rt = cat_route(args, "ec_cat" if has_ec else "w4a16_cat", norm=False, M=M)
        return rt is not None and rt.kernel == ("ec_cat_gemm" if has_ec else "cat_gemm")

    def _fuse(self, graph: fx.Graph, x: fx.Node, G: int, members: list[tuple[fx.Node, dict]]) -> int:
        first = members[0][0]
        args, has_ec = _op_args(x, G, members)
        with graph.inserting_before(first):
            cat = call_op(graph, EC_CAT if has_ec else W4A16_CAT, args)
        copy_meta(first, cat)
        dim = cat.meta["val"].dim() - 1
        x_val = x.meta["val"]
        K = int(x_val.shape[-1])
        rt = cat_route(bind(cat), "ec_cat" if has_ec else "w4a16_cat", norm=False, M=static_m(x_val))
        kernel = rt.describe() if rt is not None else "unknown (no fake values)"
        reasons = rt.all_reasons() if rt is not None else []
        off, sizes, weights, members_info = 0, [], [], []
        for n, _ in members:
            N = int(n.meta["val"].shape[-1])
            with graph.inserting_after(cat):
                sl = call(graph, SLICE, (cat, dim, off, off + N))
            copy_meta(n, sl)
            info = dict(n.meta.get(META_KEY, {}))
            weights.append(info.get("weight", n.name))
            members_info.append({**info, "node": n.name, "op": str(n.target), "fused_into": cat.name, "kernel": kernel})
            n.replace_all_uses_with(sl)
            graph.erase_node(n)
            off += N
            sizes.append(N)
        # the inspection report lists each member linear from here (the nodes themselves are gone)
        record(cat, source_form="fused_shared_input", weights=weights, N=sizes, K=K,
               group_size=G, kernel=kernel, route_reasons=reasons, members=members_info)
        return len(members)


def _op_args(x: fx.Node, G: int, members: list[tuple[fx.Node, dict]]) -> tuple[dict, bool]:
    """(the concatenation op's arguments over ``members`` - their bound arguments, in order - reading ``x``,
    whether any member has an EC: then the op is ``ec_linear_cat``, a member without one None in each EC list)."""
    args = {"x": x, "qweights": [kw["qweight"] for _, kw in members], "scales": [kw["scales"] for _, kw in members],
            "zeros": [kw["zeros"] for _, kw in members], "group_size": G,
            "biases": [kw["bias"] for _, kw in members], "layout": "spear"}
    ecs = [kw for n, kw in members if n.target is EC_LINEAR]
    if ecs:
        for name, key in (("As", "A"), ("Bs", "B"), ("W1s", "W1"), ("b1s", "b1"), ("W2s", "W2"), ("b2s", "b2"),
                          ("alphas", "alpha")):
            args[name] = [kw[key] if n.target is EC_LINEAR else None for n, kw in members]
        args["act"] = ecs[0]["act"]
    return args, bool(ecs)
