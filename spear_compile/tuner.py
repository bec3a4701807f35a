"""``spear_compile.tune(model)`` / ``spear tune``: tune the kernels for a model's own shapes on this GPU.

Which shapes: a model compiled with ``backend="spear"`` and run once gives exactly the ops the backend
compiled (``runtime.compiled.plan_of``: concatenations included, with the rows each runs at). Otherwise
its quantized linears, plus the decode concatenations the backend forms on a Llama-family model (q / k /
v and gate / up, which share their input; ``passes/fuse_shared_input.py``, ``fuse_glu.py``). Without
weights (``spear tune --config``), the same shapes from an HF config. The measuring is
``dispatch.autotune`` (what each job decides, the time budget, the table it writes).
"""
from __future__ import annotations

import json
import os
from typing import Optional, Sequence

import torch

from .dispatch import autotune as _at
from .dispatch.autotune import DEFAULT_MS, LinearShape, TuneReport

LLAMA_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def _cfg(config, *names, default=None):
    for n in names:
        v = config.get(n) if isinstance(config, dict) else getattr(config, n, None)
        if v is not None:
            return v
    return default


def shapes_from_config(config, group_size: int = 128) -> list:
    """The W4 linear shapes (per layer, deduplicated) of a Llama-family model (``model_type`` in
    ``LLAMA_TYPES``; an HF config object or its dict): q, k, v, o, gate, up, down, and the concatenations
    q+k+v and gate+up. ``group_size`` 0 / None: per channel."""
    hidden, q, k, inter = _llama_dims(config)
    g = lambda K: K if not group_size else group_size  # noqa: E731
    out = [LinearShape(q, hidden, g(hidden)),  # q
           LinearShape(k, hidden, g(hidden)),  # k, v
           LinearShape(hidden, q, g(q)),  # o
           LinearShape(inter, hidden, g(hidden)),  # gate, up
           LinearShape(hidden, inter, g(inter)),  # down
           *_concatenations(hidden, q, k, inter, g(hidden))]
    return list(dict.fromkeys(out))


def _llama_dims(config) -> tuple:
    """(hidden, q rows, k rows, intermediate) of a Llama-family config, checked."""
    mtype = _cfg(config, "model_type", default="")
    if mtype not in LLAMA_TYPES:
        raise ValueError(f"shapes_from_config: model_type {mtype!r}; shapes are known for {LLAMA_TYPES} "
                         "(quantize the model and pass it to spear_compile.tune instead)")
    hidden = _cfg(config, "hidden_size")
    heads = _cfg(config, "num_attention_heads")
    kv = _cfg(config, "num_key_value_heads", default=heads)
    dim = _cfg(config, "head_dim", default=None) or hidden // heads
    inter = _cfg(config, "intermediate_size")
    if not all(isinstance(v, int) and v > 0 for v in (hidden, heads, kv, dim, inter)):
        raise ValueError(f"shapes_from_config: hidden_size={hidden}, num_attention_heads={heads}, "
                         f"num_key_value_heads={kv}, head_dim={dim}, intermediate_size={inter} must be positive integers")
    return hidden, heads * dim, kv * dim, inter


def _concatenations(hidden: int, q: int, k: int, inter: int, G: int) -> list:
    """q / k / v and gate / up concatenated (``passes/fuse_shared_input.py``): one GEMV at decode and one GEMM
    at a static M of 2..256 (``dispatch.route.CAT_GEMM_MAX_M``), so both kinds of entry are wanted."""
    return [LinearShape(q + 2 * k, hidden, G), LinearShape(2 * inter, hidden, G)]


def shapes_of(model) -> list:
    """The shapes ``model`` runs: from its compiled plan when the spear backend compiled it, else from its
    quantized linears (plus the Llama-family concatenations when its config says so)."""
    from .api import quantized_linears
    from .runtime.compiled import PlanError, plan_of

    try:
        plan = plan_of(model)
    except PlanError:
        plan = None
    if plan is not None:
        out = []
        for lin in plan.linears:
            for op in lin.ops:
                n = sum(p[0] for p in op.parts)
                out.append(LinearShape(n, op.K, op.G, decode=op.m_lo <= 1, prefill=op.m_hi is None or op.m_hi > 1))
        return list(dict.fromkeys(out))
    lins = quantized_linears(getattr(model, "_orig_mod", model))
    if not lins:
        raise ValueError(f"spear_compile.tune: {type(model).__name__} has no quantized linear "
                         "(quantize it with spear.quantize_ first)")
    out = [LinearShape(m.out_features, m.in_features, m.group_size) for m in lins.values()]
    cfg = getattr(getattr(model, "_orig_mod", model), "config", None)
    if cfg is not None and _cfg(cfg, "model_type", default="") in LLAMA_TYPES:
        per_channel = all(m.group_size >= m.in_features for m in lins.values())
        gs = {m.group_size for m in lins.values()}
        if per_channel or len(gs) == 1:  # the concatenations read hidden, so they share q's group size
            hidden, q, k, inter = _llama_dims(cfg)
            out += _concatenations(hidden, q, k, inter, hidden if per_channel else gs.pop())
    return list(dict.fromkeys(out))


def load_config(path: str) -> dict:
    """An HF config from a model directory (its config.json) or a config.json path."""
    p = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(p) as f:
            return json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"no config at {p!r} (give a model directory or its config.json)") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{p!r} is not JSON ({e})") from None


def tune(model=None, shapes: Optional[Sequence[LinearShape]] = None, ms: Sequence[int] = DEFAULT_MS,
         budget_s: float = 300.0, save: bool = True, progress: bool = True) -> TuneReport:
    """Measure the kernels for ``model``'s shapes (``shapes_of``; or the given ``shapes``) at the M values
    ``ms`` on this GPU, within ``budget_s`` seconds, and save this GPU's user table (what the route reads
    from then on; shapes left for lack of time take the nearest tuned geometry). Returns the report."""
    if not torch.cuda.is_available():
        raise RuntimeError("spear_compile.tune measures kernels on a CUDA GPU; none is available here")
    if shapes is None:
        if model is None:
            raise ValueError("spear_compile.tune: give a model or shapes")
        shapes = shapes_of(model)
    jobs = _at.jobs_for(shapes, ms)
    return _at.run(jobs, budget_s=budget_s, progress=progress, save=save)
