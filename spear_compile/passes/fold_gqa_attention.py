"""Pass: grouped-query attention reads each KV head once, instead of a materialised repeat of the KV cache.

Runs on Dynamo's torch-level graph, before AOTAutograd (``backend.spear_backend``), unlike the other
passes (post-grad ATen graphs): there the attention is still one ``F.scaled_dot_product_attention`` call,
whatever SDPA backend it would dispatch to later.

Matches:     ``F.scaled_dot_product_attention(q, rep(k), rep(v), attn_mask=m, dropout_p=0, is_causal=False)``
             (not a batch-1 single-token query: see "Where it pays")
             where ``rep(t) = t[:, :, None, :, :].expand(b, kv, r, L, d).reshape(b, kv * r, L, d)`` (HF
             transformers' ``repeat_kv``, which it uses whenever a mask is given, e.g. decode with a
             ``StaticCache``), both with the same ``r > 1``, ``q`` of shape ``(b, kv * r, S, d)``, and ``m``
             absent or 4-d with one head (``(b | 1, 1, S | 1, L)``).
Rewrites to: the query's ``r`` heads of a group stacked as rows of one head, attention against the ``kv``
             heads themselves, and the output regrouped:
             ``o = sdpa(q.unflatten(1, (kv, r)).flatten(2, 3), k, v, attn_mask=m', scale=...).reshape_as(q)`` with
             ``m' = m.repeat(1, 1, r, 1)`` when ``m`` has ``S`` rows (row ``i * S + s`` of the group is query
             head ``g * r + i`` at position ``s``), ``m`` itself when it has one.

Example graph (a batch of 2, 2 KV heads, 4 query heads, one decode token, a cache of 32):
    before: %k5 = getitem(%cache_k, (:, :, None, :, :)); %ke = expand(%k5, 2, 2, 2, 32, 16)
            %key = reshape(%ke, 2, 4, 32, 16)      (and the same for %value)
            %o = scaled_dot_product_attention(%q, %key, %value, attn_mask=%m, scale=0.25)
    after:  %qg = flatten(unflatten(%q, 1, (2, 2)), 2, 3)
            %og = scaled_dot_product_attention(%qg, %cache_k, %cache_v, attn_mask=%m, scale=0.25)
            %o = reshape_as(%og, %q)

Why: the repeat writes and reads ``r`` copies of K and V (of the whole static cache, every layer, every
step) before the attention reads them again; folded, attention reads each KV head once. The softmax is
per row over the same keys, so the result is the same attention (exact in real arithmetic; the SDPA
kernel may round differently). ``enable_gqa=True`` would say the same, but SDPA's memory-efficient
backend, the one that takes a mask, does not implement it and falls back to the math path, which
repeats K and V itself. Why not when causal: ``is_causal`` masks by row index, and the stacked rows are
no longer positions. Why one mask head only: a per-head mask would need regrouping too (not seen in
HF's models).

Where it pays (HF Qwen2.5-7B, 28 query / 4 KV heads, a ``StaticCache`` decode step at position 512): folded, one
decode gives SDPA's kernel 4 heads of 7 stacked rows, so 4 programs per sequence walk the cache instead of 28; the
repeat it saves grows with the batch, and so does the folded grid. At batch 1 the step took 3.43 ms folded against
3.22 ms unfolded (H100, ``benchmarks/results/e2e_decode/2026-12-07_h100_hf_qwen2.5``); at batch 8 7.32 against
8.67 ms and at batch 16 6.94 against 10.12 ms (H200, ``.../2026-12-07_h200_hf_qwen2.5_batch8_16``). So a batch of
one sequence with one query token (both static in the graph) is left unfolded, and everything else is folded
(``CompileConfig.fold_gqa_attention`` turns the pass off).
"""
from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
_REPEAT_INDEX = (slice(None), slice(None), None, slice(None), slice(None))


def _val(n) -> Optional[torch.Tensor]:
    return n.meta.get("example_value", n.meta.get("val")) if isinstance(n, fx.Node) else None


def _is_sdpa(n: fx.Node) -> bool:
    return n.op == "call_function" and n.target in (F.scaled_dot_product_attention,
                                                    torch._C._nn.scaled_dot_product_attention)


def _is_method(n, *names) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_method" and n.target in names


def _unrepeated(n) -> Optional[tuple[fx.Node, int]]:
    """(t, r) when ``n`` is ``t[:, :, None, :, :].expand(b, kv, r, L, d).reshape(b, kv * r, L, d)``, r > 1."""
    if not (_is_method(n, "reshape", "view") or (isinstance(n, fx.Node) and n.op == "call_function"
                                                  and n.target is torch.reshape)):
        return None
    ex = n.args[0]
    if not _is_method(ex, "expand"):
        return None
    idx = ex.args[0]
    if not (isinstance(idx, fx.Node) and idx.op == "call_function" and idx.target is operator.getitem
            and idx.args[1] == _REPEAT_INDEX):
        return None
    t, tv, ev = idx.args[0], _val(idx.args[0]), _val(ex)
    if tv is None or ev is None or tv.dim() != 4 or ev.dim() != 5:
        return None
    r = ev.shape[2]
    if not isinstance(r, int) or r < 2 or tuple(ev.shape[:2]) != tuple(tv.shape[:2]) \
            or tuple(ev.shape[3:]) != tuple(tv.shape[2:]):
        return None
    return t, r


def _one_query_row(qv: torch.Tensor) -> bool:
    """A batch of one sequence with one query token (batch-1 decode), static in the graph: left unfolded."""
    b, s = qv.shape[0], qv.shape[2]
    return isinstance(b, int) and isinstance(s, int) and b == 1 and s == 1


def _bound(n: fx.Node) -> Optional[dict]:
    kw = dict(_SDPA_DEFAULTS)
    if len(n.args) > len(SDPA_ARGS) or set(n.kwargs) - set(SDPA_ARGS):
        return None
    kw.update(zip(SDPA_ARGS, n.args))
    kw.update(n.kwargs)
    return kw


def _fold(graph: fx.Graph, n: fx.Node, dry: bool = False) -> bool:
    kw = _bound(n)
    if kw is None or kw["dropout_p"] != 0.0 or kw["is_causal"] is not False or kw["enable_gqa"] is not False:
        return False
    rk, rv = _unrepeated(kw["key"]), _unrepeated(kw["value"])
    if rk is None or rv is None or rk[1] != rv[1]:
        return False
    (k, r), (v, _) = rk, rv
    q, qv, kv_heads = kw["query"], _val(kw["query"]), _val(k).shape[1]
    if qv is None or qv.dim() != 4 or not isinstance(kv_heads, int) or qv.shape[1] != kv_heads * r:
        return False
    if _one_query_row(qv):
        return False
    m, mv = kw["attn_mask"], _val(kw["attn_mask"])
    if m is not None and (mv is None or mv.dim() != 4 or mv.shape[1] != 1):
        return False
    one_row = m is None or (isinstance(mv.shape[2], int) and mv.shape[2] == 1)
    if not one_row and str(mv.shape[2]) != str(qv.shape[2]):  # rows neither broadcast nor one per query
        return False
    if dry:
        return True
    with graph.inserting_before(n):
        qg = graph.call_method("flatten", (graph.call_method("unflatten", (q, 1, (kv_heads, r))), 2, 3))
        mg = m
        if not one_row:
            mg = graph.call_method("repeat", (m, 1, 1, r, 1))
        og = graph.call_function(F.scaled_dot_product_attention, (qg, k, v),
                                 {"attn_mask": mg, "dropout_p": 0.0, "is_causal": False, "scale": kw["scale"]})
        o = graph.call_method("reshape_as", (og, q))
    o.meta.update(n.meta)
    n.replace_all_uses_with(o)
    graph.erase_node(n)
    for rep in (kw["key"], kw["value"]):  # the repeat chains, where nothing else reads them
        while isinstance(rep, fx.Node) and rep.op != "placeholder" and not rep.users:
            nxt = rep.args[0]
            graph.erase_node(rep)
            rep = nxt
    return True


class FoldGQAAttention:
    """Dynamo-graph pass (see the module docstring); ``matched_count`` attentions folded."""

    name = "fold_gqa_attention"

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.matched_count = 0

    def matches(self, gm: fx.GraphModule) -> int:
        """How many attentions of ``gm`` this pass would fold (``gm`` unchanged)."""
        if not self.enabled:
            return 0
        return sum(_fold(gm.graph, n, dry=True) for n in gm.graph.nodes if _is_sdpa(n))

    def __call__(self, gm: fx.GraphModule) -> int:
        """Fold every match in place; returns (and keeps as ``matched_count``) how many."""
        if not self.enabled:
            return 0
        count = 0
        for n in list(gm.graph.nodes):
            if _is_sdpa(n):
                count += _fold(gm.graph, n)
        if count:  # no eliminate_dead_code: Dynamo's graph holds in-place updates (a KV cache's) nothing reads
            gm.graph.lint()
            gm.recompile()
        self.matched_count = count
        return count
