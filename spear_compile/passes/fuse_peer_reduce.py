"""Pass: a row-parallel EC linear, its all-reduce and its gate become one ``spear::ec_linear_peer_reduce``.

Matches:     ``spear::ec_reduced_apply(yh, ...)`` where ``yh`` is ``_c10d_functional.wait_tensor`` of a sum
             ``_c10d_functional.all_reduce`` of a ``spear::ec_linear_partial`` (each node's only user is the
             next) - what ``parallel/layers.py:RowParallelLinear`` with an EC emits - and, at world size 1,
             ``ec_reduced_apply`` straight on the ``ec_linear_partial``.
Rewrites to: ``spear::ec_linear_peer_reduce(x, qweight, ..., A, B, gate, alpha, act, layout, group_name)``,
             with the all-reduce's group name (``""`` at world size 1).

Example graph (rank 0 of 2, o_proj of a Llama block, K slice 96 of 192, EC rank 8):
    before: %yh = spear.ec_linear_partial(%a[1, 4, 96], %qw, %s, %z, 32, %A, 'spear')      # [1, 4, 200] fp32
            %ar = _c10d_functional.all_reduce(%yh, 'sum', '0')
            %w  = _c10d_functional.wait_tensor(%ar)
            %o  = spear.ec_reduced_apply(%w, None, %B, %W1, %b1, %W2, %b2, %alpha, 'silu', torch.float32)
    after:  %o  = spear.ec_linear_peer_reduce(%a, %qw, %s, %z, 32, None, %A, %B, %W1, %b1, %W2, %b2, %alpha,
                                              'silu', 'spear', '0', 300.0)

Why: the fused op is what a GPU runs without a collective on the decode path - the GEMV's epilogue writes
its partial ``[y_i | A_i x_i]`` into every peer's staging buffer and a post kernel sums the partials, gates
the reduced ``A x`` and adds ``alpha * B (g * h)`` (``lowering/ec_peer_reduce.py``); on CPU it is the same
math around a gloo all-reduce that times out naming a missing rank (``ops/collective.py``). The unfused
graph is kept where the form differs (another reduce op, a second user of a partial): Inductor compiles it
as it would, collective included.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .base import SpearPass
from .common import bind, copy_meta, call_op, record

PARTIAL = torch.ops.spear.ec_linear_partial.default
APPLY = torch.ops.spear.ec_reduced_apply.default
PEER_REDUCE = torch.ops.spear.ec_linear_peer_reduce.default
try:  # a torch built without torch.distributed has no functional collectives: only the world-size-1 form
    ALL_REDUCE = torch.ops._c10d_functional.all_reduce.default
    WAIT = torch.ops._c10d_functional.wait_tensor.default
except (AttributeError, RuntimeError):  # pragma: no cover
    ALL_REDUCE = WAIT = None


def _only_user_is(node, user: fx.Node) -> bool:
    return isinstance(node, fx.Node) and len(node.users) == 1 and next(iter(node.users)) is user


def _chain(apply: fx.Node):
    """(partial, group name, nodes to erase) of the matched form ending in ``apply``, else None."""
    yh = bind(apply)["yh"]
    if not isinstance(yh, fx.Node) or not _only_user_is(yh, apply):
        return None
    if yh.op == "call_function" and yh.target is PARTIAL:
        return yh, "", [yh]
    if WAIT is None or not (yh.op == "call_function" and yh.target is WAIT):
        return None
    ar = yh.args[0]
    if not (isinstance(ar, fx.Node) and ar.op == "call_function" and ar.target is ALL_REDUCE and _only_user_is(ar, yh)):
        return None
    partial, op, group_name = ar.args[:3]
    if op != "sum" or not isinstance(group_name, str):
        return None
    if not (isinstance(partial, fx.Node) and partial.op == "call_function" and partial.target is PARTIAL
            and _only_user_is(partial, ar)):
        return None
    return partial, group_name, [yh, ar, partial]


class FusePeerReduce(SpearPass):
    name = "fuse_peer_reduce"

    def run(self, graph: fx.Graph) -> int:
        count = 0
        for apply in list(graph.nodes):
            if apply.op != "call_function" or apply.target is not APPLY:
                continue
            found = _chain(apply)
            if found is None:
                continue
            partial, group_name, dead = found
            p, a = bind(partial), bind(apply)
            x_val = p["x"].meta.get("val")
            if x_val is None or a["dtype"] != x_val.dtype:
                continue  # the fused op returns x's dtype
            kwargs = {"x": p["x"], "qweight": p["qweight"], "scales": p["scales"], "zeros": p["zeros"],
                      "group_size": p["group_size"], "bias": a["bias"], "A": p["A"], "B": a["B"], "W1": a["W1"],
                      "b1": a["b1"], "W2": a["W2"], "b2": a["b2"], "alpha": a["alpha"], "act": a["act"],
                      "layout": p["layout"], "group_name": group_name}
            with graph.inserting_before(apply):
                new = call_op(graph, PEER_REDUCE, kwargs)
            copy_meta(apply, new)
            apply.replace_all_uses_with(new)
            graph.erase_node(apply)
            for n in dead:
                graph.erase_node(n)
            record(new, source_form="row_parallel", weight=self.ctx.name_of(p["qweight"]),
                   ec_rank=int(p["A"].meta["val"].shape[0]), N=int(new.meta["val"].shape[-1]),
                   K=int(x_val.shape[-1]), group_size=p["group_size"], layout=p["layout"],
                   tp_group=group_name, lowering="peer_reduce",
                   reason=f"row-parallel EC over group {group_name!r}: partial [y | A x], reduced, gate on the sum",
                   kernel="peer-write GEMV epilogue + post kernel (CUDA, M <= 16), else partial + all-reduce + gate")
            count += 1
        return count
