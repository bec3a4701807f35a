"""From a model compiled with ``backend="spear"`` to its plan, its latency model and its scheduler.

``plan_of(model)`` reads what the backend recorded for the graphs that read ``model``'s weights
(``passes/compiled_plans.py``): every spear op with its shapes, EC ranks, lowering and the kernel route
per M bucket. Ops that read the same weights are one ``PlannedLinear`` (a q / k / v group is one
concatenated op at decode and three ops at prefill); linears whose names differ only in layer numbers
and whose ops agree are counted together. Attention and head shapes come from the model's HF config
(``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``,
``hidden_size``, ``vocab_size``), or from keyword overrides for other models.

``scheduler_for(compiled, slo_itl_ms)`` builds the ``SloChunkPolicy`` from that plan's latency model,
read from the user cache (``<cache dir>/latency/``, keyed by GPU, model, plan hash and library
version), or measured on this device on first use (with a progress bar; it says so) and saved.

The model must have been compiled and run before: the backend compiles lazily, on the first call, and
a graph of each shape the server will run (a decode step, a prefill step) should have run once.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
from typing import Callable, Optional

from ..api import quantized_linears
from ..dispatch.route import problem_of, route
from ..passes import compiled_plans, record_plan
from .latency_cache import CacheKey, load_or_measure
from .measure import measure_and_fit
from .plan import Plan, PlannedLinear, PlannedOp, ops_at
from .policy import SloChunkPolicy

_LAYER = re.compile(r"(?<=\.)\d+(?=\.)")


class PlanError(RuntimeError):
    """The plan of a model cannot be built (nothing compiled, or a shape the config does not give)."""


def _dedup(records: list[dict]) -> list[dict]:
    seen, out = set(), []
    for r in records:
        k = (r["op"], tuple(r["weights"]), r["m_lo"], r["m_hi"])
        if k not in seen:
            seen.add(k)
            out.append(r)
    return out


def _groups(records: list[dict]) -> list[list[dict]]:
    """Records joined when they read a common weight (union-find over weight names), in first-seen order."""
    parent: dict[str, str] = {}

    def find(a):
        while parent.setdefault(a, a) != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    for r in records:
        ws = r["weights"]
        for w in ws[1:]:
            parent[find(w)] = find(ws[0])
        find(ws[0])
    by_root: dict[str, list[dict]] = {}
    for r in records:
        by_root.setdefault(find(r["weights"][0]), []).append(r)
    return list(by_root.values())


def _signature(ops: tuple) -> tuple:
    return tuple(sorted((o.op, o.parts, o.K, o.G, o.m_lo, o.m_hi, o.lowering, o.crossover, o.norm, o.routes)
                        for o in ops))


def _linear_routes(ops: tuple) -> tuple:
    """``(up_to_m, description)`` runs over every recorded bucket of the ops."""
    ms = sorted({m for o in ops for m, _ in o.routes} or {1})
    runs: list = []
    for m in ms:
        desc = " + ".join(o.route_at(m) for o in ops_at(ops, m))
        if runs and runs[-1][1] == desc:
            runs[-1] = (m, desc)
        else:
            runs.append((m, desc))
    return tuple(runs)


def planned_linears(records: list[dict]) -> tuple:
    """The ``PlannedLinear``s of a list of backend records (see the module docstring)."""
    kinds: dict[tuple, list] = {}
    for group in _groups(_dedup(records)):
        weights = sorted({w for r in group for w in r["weights"]})
        rows: dict[str, int] = {}
        ranks: dict[str, int] = {}
        for r in group:
            for w, (n, k, _) in zip(r["weights"], r["parts"]):
                rows[w], ranks[w] = n, max(k, ranks.get(w, 0))
        ops = tuple(PlannedOp.from_record(r) for r in group)
        pattern = "+".join(_LAYER.sub("*", w) for w in weights)
        key = (pattern, _signature(ops))
        if key in kinds:
            kinds[key][1] += 1
        else:
            kinds[key] = [dict(K=group[0]["K"], N=sum(rows.values()), rank=max(ranks.values()), ops=ops), 1]
    out, names = [], {}
    for (pattern, _), (info, count) in kinds.items():
        n = names[pattern] = names.get(pattern, 0) + 1
        name = pattern if n == 1 else f"{pattern}#{n}"  # the same linears with other ECs or routes
        out.append(PlannedLinear(name, info["K"], info["N"], ec_rank=info["rank"], count=count,
                                 routes=_linear_routes(info["ops"]), ops=info["ops"]))
    return tuple(out)


def _part(mod) -> tuple:
    """A quantized linear as a record's part: (rows, EC rank, EC gate width), zeros without an EC."""
    ec = mod.ec
    return (int(mod.out_features), int(ec.rank) if ec is not None else 0, int(ec.W1.shape[0]) if ec is not None else 0)


def eager_records(model, dtype=None) -> list[dict]:
    """Records of ``model``'s ``QuantLinear``s as they run eagerly (not compiled): one ``w4a16`` or ``ec``
    op each, at every M, routed by ``dispatch.route`` from the module's own tensors at the M buckets."""
    import torch

    out = []
    for fqn, mod in quantized_linears(model).items():
        ec = mod.ec
        x_dtype = dtype or mod.scales.dtype
        op = "ec" if ec is not None else "w4a16"
        ec_t = (ec.A, ec.B, ec.W1, ec.b1, ec.W2, ec.b2, ec.alpha) if ec is not None else None
        routes = []
        for m in record_plan.buckets(1, math.inf):
            x = torch.empty(m, mod.in_features, device=mod.qweight.device, dtype=x_dtype)
            rt = route(problem_of(op, x, mod.qweight, mod.scales, mod.zeros, mod.group_size, mod.bias, ec_t))
            routes.append([m, rt.describe()])
        out.append({"op": op, "weights": [fqn], "K": mod.in_features, "G": mod.group_size, "layout": "spear",
                    "parts": [list(_part(mod))],
                    "lowering": "auto", "crossover": 16, "norm": False, "act": ec.act if ec is not None else "silu",
                    "has_bias": mod.bias is not None, "has_zeros": mod.zeros is not None,
                    "dtype": str(x_dtype).replace("torch.", ""), "m_lo": 1, "m_hi": None, "routes": routes})
    return out


def _serves(records: list[dict], prefix: str, parts: dict) -> bool:
    """Whether every weight of ``records`` (names relative to a module) is a quantized linear under
    ``prefix`` with the record's rows, EC rank and gate width."""
    for r in records:
        for w, part in zip(r["weights"], r["parts"]):
            if parts.get(f"{prefix}.{w}" if prefix else w) != tuple(part):
                return False
    return True


def instance_records(graphs, model) -> list[dict]:
    """The records of ``graphs`` that ``model`` runs, with every weight named from ``model``'s root, one
    record per module instance it runs for.

    A graph whose weights are named from the model's root (one graph over the whole forward, or the eager
    records) keeps its records. Where the forward breaks its graph inside a layer (transformers' paged
    attention updates the cache outside the graph), Dynamo compiles the layer's frames (an attention
    module's forward, the rest of a decoder layer) and runs such code for every layer whose modules pass
    its guards: the graph's weights are then named from the frame's module (``q_proj``,
    ``mlp.gate_proj``). Such a graph is repeated for every module prefix under which each of its weights
    is a quantized linear with the rows, EC rank and EC gate width the graph compiled (a layer whose
    q_proj carries an EC runs another graph than one whose q_proj does not); ``planned_linears`` drops the
    repeats of layers that several graphs fit. Taken as they came, the 32 layers of a Llama-2-7B-shaped
    model planned as one and their ECs merged into every linear (the H200 serving records before
    2026-12-06's ``serving/2026-12-06_h200_plan_all_layers``).

    A graph that fits no module of the model (compiled before its ECs changed, or for another model of
    the same shapes, which ``compiled_plans.graphs_of`` also returns) is left out: Dynamo would not run it
    for this model. ``PlanError`` if every graph with records is left out."""
    parts = {fqn: _part(mod) for fqn, mod in quantized_linears(model).items()}
    out: list[dict] = []
    stale: list = []
    for g in graphs:
        names = sorted({w for r in g.records for w in r["weights"]})
        if not names:
            continue
        if all(w in parts for w in names):
            prefixes = [""] if _serves(g.records, "", parts) else []
        else:
            tail = "." + names[0]
            prefixes = [p for p in sorted({f[: -len(tail)] for f in parts if f.endswith(tail)})
                        if _serves(g.records, p, parts)]
        if not prefixes:
            stale.append(names)
        for p in prefixes:
            out.extend({**r, "weights": [f"{p}.{w}" if p else w for w in r["weights"]]} for r in g.records)
    if stale and not out:
        raise PlanError(f"plan_of: every compiled graph that reads this {type(model).__name__}'s quantized "
                        f"linears compiled other rows or EC ranks than its modules now have (first: {stale[0]}): "
                        f"the model changed after it compiled; recompile it (torch._dynamo.reset() and run it "
                        f"again)")
    return out


def _config_value(cfg, names, override, what):
    if override is not None:
        return int(override)
    for n in names:
        v = getattr(cfg, n, None) if cfg is not None else None
        if v is not None:
            return int(v)
    raise PlanError(f"plan_of: the model's config gives no {what} (looked for {', '.join(names)}); "
                    f"pass {what}=... ")


def plan_of(model, model_id: Optional[str] = None, n_layers: Optional[int] = None, n_heads: Optional[int] = None,
            n_kv_heads: Optional[int] = None, head_dim: Optional[int] = None, hidden_size: Optional[int] = None,
            vocab_size: Optional[int] = None, head_rows: str = "last", eager: bool = False, dtype=None) -> Plan:
    """The ``Plan`` of ``model`` (an ``nn.Module`` compiled with ``backend="spear"``, or its
    ``torch.compile`` wrapper) from what the backend recorded; ``PlanError`` if it has not compiled yet.
    ``eager=True``: the plan of the model run without compiling (``eager_records``; activations in
    ``dtype``, default the scales' dtype)."""
    inner = getattr(model, "_orig_mod", model)
    if eager:
        graphs, records = [], eager_records(inner, dtype)
    else:
        graphs = compiled_plans.graphs_of(inner)
        if not graphs:
            raise PlanError(f"plan_of: no graph compiled with backend='spear' reads the weights of this "
                            f"{type(inner).__name__}; compile it (torch.compile(model, backend='spear')) and run "
                            f"it once (a prefill and a decode step) first, or ask for the eager plan (eager=True)")
        records = instance_records(graphs, inner)
    if not records:
        raise PlanError(f"plan_of: the spear backend compiled {len(graphs)} graph(s) of this "
                        f"{type(inner).__name__} but found no quantized linear in them (quantize it with "
                        f"spear.quantize_ first)")
    cfg = getattr(inner, "config", None)
    heads = _config_value(cfg, ("num_attention_heads",), n_heads, "n_heads")
    hidden = _config_value(cfg, ("hidden_size",), hidden_size, "hidden_size")
    dim = head_dim if head_dim is not None else (getattr(cfg, "head_dim", None) or hidden // heads)
    h = hashlib.sha256(json.dumps(sorted(json.dumps(r, sort_keys=True) for r in records)).encode())
    h.update(b"eager" if eager else b"compiled")
    for g in graphs:
        h.update(g.config_fingerprint.encode())
    name = model_id or os.path.basename(str(getattr(cfg, "_name_or_path", "") or "").rstrip("/")) or type(inner).__name__
    return Plan(model_id=str(name), config_hash=h.hexdigest()[:16], linears=planned_linears(records),
                n_layers=_config_value(cfg, ("num_hidden_layers", "n_layer"), n_layers, "n_layers"), n_heads=heads,
                n_kv_heads=_config_value(cfg, ("num_key_value_heads", "num_attention_heads"), n_kv_heads,
                                         "n_kv_heads"),
                head_dim=int(dim), hidden_size=hidden,
                vocab_size=_config_value(cfg, ("vocab_size",), vocab_size, "vocab_size"),
                dtype=records[0].get("dtype", "bfloat16"), head_rows=head_rows)


def _device_of(model):
    inner = getattr(model, "_orig_mod", model)
    for t in list(inner.parameters()) + list(inner.buffers()):
        return t.device
    return "cpu"


def scheduler_for(compiled_model, slo_itl_ms: float, max_chunk: int = 2048, min_chunk: int = 32, device=None,
                  step_fn: Optional[Callable] = None, log: Callable[[str], None] = print, plan: Optional[Plan] = None,
                  eager: bool = False, token_pad: int = 1, correction=None, **measure_kw) -> SloChunkPolicy:
    """The SLO chunk policy for ``compiled_model``: its plan (``plan_of``, or ``plan``), the latency model
    of that plan on this device (cached; measured on first use up to ``max_chunk`` rows, whole steps
    by ``step_fn`` or a synthetic step of the same ops), and ``SloChunkPolicy(model, slo_itl_ms, ...)``.
    ``eager=True``: for the model run without compiling (its ``QuantLinear``s' ops as they are).
    ``token_pad``: the multiple the serving engine pads a step's tokens to (``Engine.token_pad``;
    ``LatencyModel.token_pad``); ``correction``: the policy's online correction (``SloChunkPolicy``)."""
    plan = plan or plan_of(compiled_model, eager=eager)
    device = device if device is not None else _device_of(compiled_model)
    key = CacheKey.for_plan(plan, device)

    def measure():
        model, _ = measure_and_fit(plan, step_fn=step_fn, device=device, max_m=max_chunk, **measure_kw)
        return model

    latency = load_or_measure(key, measure, log=log, meta={"linears": [lin.name for lin in plan.linears],
                                                           "routes": list(plan.routes)})
    return SloChunkPolicy(latency.with_token_pad(token_pad), slo_itl_ms, max_chunk=max_chunk, min_chunk=min_chunk,
                          correction=correction)
