"""Pass: adopt torchao / gpt-fast int4 matmuls.

Matches:     ``aten._weight_int4pack_mm(x, packed, G, scale_and_zeros)`` (CUDA tinygemm
             layout) and its CPU twin ``aten._weight_int4pack_mm_for_cpu``.
Rewrites to: ``spear::w4a16_linear(x, qweight=packed, scales=scale_and_zeros, zeros=None,
             group_size=G, layout="tinygemm_cuda" | "tinygemm_cpu")`` (or ``ec_linear``
             when an EC is registered for ``packed``). The layout keeps tinygemm's packing
             and its float zero points (``w = (q - 8) * s + z``), so no repacking runs.
Example graph:
    before: %y = aten._weight_int4pack_mm_for_cpu(%x, %packed, 32, %sz)
    after:  %y = spear.w4a16_linear(x=%x, qweight=%packed, scales=%sz, zeros=None, group_size=32,
                                    layout='tinygemm_cpu')
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .base import SpearPass
from .common import emit_spear_linear

aten = torch.ops.aten
_FORMS = {
    aten._weight_int4pack_mm.default: "tinygemm_cuda",
    aten._weight_int4pack_mm_for_cpu.default: "tinygemm_cpu",
}


class MatchInt4PackMM(SpearPass):
    name = "match_int4pack_mm"

    def run(self, graph: fx.Graph) -> int:
        if not self.ctx.config.enable_int4pack_match:
            return 0
        count = 0
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in _FORMS:
                continue
            x, packed, group_size, sz = node.args[:4]
            if not isinstance(group_size, int):
                continue
            kwargs = dict(x=x, qweight=packed, scales=sz, zeros=None, group_size=group_size, bias=None,
                          layout=_FORMS[node.target], lowering="auto", crossover=self.ctx.config.default_crossover_m)
            emit_spear_linear(graph, node, self.ctx, kwargs, packed, "int4pack_mm")
            count += 1
        return count
