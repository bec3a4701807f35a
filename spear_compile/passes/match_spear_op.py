"""Pass: adopt linears that already are spear ops.

Matches:     ``spear::w4a16_linear`` and ``spear::ec_linear`` (what ``QuantLinear`` emits).
Rewrites to: itself, with all arguments as keywords; a ``w4a16_linear`` whose weight
             has an EC registered (``compensators.register_ec``) becomes ``ec_linear``
             with the EC baked in as constants.
Example graph:
    before: %y = spear.w4a16_linear(%x, %qweight, %scales, %zeros, 64, None)
    after:  %y = spear.w4a16_linear(x=%x, qweight=%qweight, ..., layout='spear', lowering='auto')
"""
from __future__ import annotations

import torch.fx as fx

from .base import SpearPass
from .common import EC_LINEAR, META_KEY, SPEAR_OPS, W4A16, bind, emit_spear_linear, record, replace_with_op


class MatchSpearOp(SpearPass):
    name = "match_spear_op"

    def run(self, graph: fx.Graph) -> int:
        count = 0
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in SPEAR_OPS or META_KEY in node.meta:
                continue
            kwargs = bind(node)
            count += 1
            if node.target is W4A16:
                emit_spear_linear(graph, node, self.ctx, kwargs, kwargs["qweight"], "spear_op")
                continue
            new = replace_with_op(graph, node, EC_LINEAR, kwargs)
            K = kwargs["x"].meta["val"].shape[-1]
            record(new, source_form="spear_op", weight=self.ctx.name_of(kwargs["qweight"]),
                   ec_rank=int(kwargs["A"].meta["val"].shape[0]), N=int(new.meta["val"].shape[-1]), K=int(K),
                   group_size=kwargs["group_size"], layout=kwargs["layout"])
        return count
