"""The ``spear`` torch.compile backend.

``torch.compile(model, backend="spear", options={...})`` calls :func:`spear_backend`
with Dynamo's FX graph and the real example inputs. We record which input tensor is
which (for ECs registered against foreign weights) and hand the graph to Inductor's
``compile_fx`` with our pass manager as ``post_grad_custom_post_pass``. One pass runs before that, on
Dynamo's own graph: ``fold_gqa_attention`` (grouped-query attention without the repeated KV cache).
Everything else is Inductor's, so a graph with no quantized linear and no repeated-KV attention
compiles exactly as ``backend="inductor"`` would.

``options`` are :class:`~spear_compile.config.CompileConfig` fields
(e.g. ``{"crossover_m": 32}``); a :func:`compile_config` context manager sets them too.

An EC registered for a foreign weight must end up in the compiled graph: after the passes ran,
:func:`check_ecs_applied` looks at each such EC's inputs, and if no rewritten linear reads them
(the module's dequantization was written in a form no pass adopts, or its weight could not be
traced to a graph input) compilation stops with :class:`~spear_compile.errors.UnmatchedECError`
naming the module and the ops that read its weight (``on_unmatched_ec="warn"``: a warning, and the
model compiles without the EC).

Every compilation leaves a record of its spear linears (``passes/record_plan.py``: shapes, EC ranks,
lowering, the kernel route per M bucket) in ``passes/compiled_plans.py``, which the runtime reads
(``spear_compile.runtime.plan_of`` / ``scheduler_for``). When Inductor's cache answers without running
the passes, the record saved when they last ran is read back; if there is none, the graph is compiled
once more with the caches off so that the passes run.
"""
from __future__ import annotations

import contextlib
import contextvars
import warnings
from typing import Any, Callable, Optional

import torch

from ..compensators.registry import lookup_ec
from ..config import CompileConfig
from ..errors import UnmatchedECError
from . import compiled_plans
from .common import EC_PARAMS
from .context import InputInfo, PassContext, fqn_from_source
from .fold_gqa_attention import FoldGQAAttention
from .manager import SpearPassManager

_CONFIG: contextvars.ContextVar[Optional[CompileConfig]] = contextvars.ContextVar("spear_config", default=None)
_OBSERVERS: list[Callable] = []  # inspect.capture pushes one while it compiles


@contextlib.contextmanager
def compile_config(cfg: CompileConfig):
    """Use ``cfg`` for every ``backend="spear"`` compilation inside the block."""
    if not isinstance(cfg, CompileConfig):
        raise TypeError(f"compile_config: expected a CompileConfig, got {type(cfg).__name__} "
                        f"(CompileConfig(**{cfg!r}) if it is a dict of options)")
    tok = _CONFIG.set(cfg)
    try:
        yield cfg
    finally:
        _CONFIG.reset(tok)


def _resolve_config(options: Optional[dict[str, Any]]) -> CompileConfig:
    base = _CONFIG.get() or CompileConfig()
    if not options:
        return base
    d = base.to_dict()
    unknown = set(options) - set(d)
    if unknown:
        raise ValueError(f"spear backend: unknown options {sorted(unknown)}; valid options are {sorted(d)}")
    d.update(options)
    return CompileConfig.from_dict(d)


def _input_infos(gm: torch.fx.GraphModule, example_inputs) -> list[InputInfo]:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    infos = []
    for node, t in zip(placeholders, example_inputs):
        ga = node.meta.get("grapharg")
        src = getattr(getattr(ga, "source", None), "name", node.name)
        if callable(src):  # torch 2.11: Source.name() is a method; 2.13: a property
            src = src()
        infos.append(InputInfo(t if isinstance(t, torch.Tensor) else None, fqn_from_source(str(src))))
    return infos


def _copy_dynamo_graph(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of Dynamo's graph module that we may add inputs to (Dynamo reads its own after we return)."""
    g = torch.fx.Graph()
    env: dict = {}
    g.output(g.graph_copy(gm.graph, env))
    for old in gm.graph.find_nodes(op="placeholder"):
        env[old]._dynamo_source = getattr(old, "_dynamo_source", None)
    out = torch.fx.GraphModule(gm, g)
    out.meta.update(gm.meta)
    if hasattr(gm, "_param_name_to_source"):
        out._param_name_to_source = gm._param_name_to_source
    return out


def _add_ec_inputs(gm: torch.fx.GraphModule, infos: list[InputInfo]):
    """Append the parameters of ECs registered for foreign weights as extra graph inputs.

    They stay live tensors (not constants): an EC trained after compilation is seen by
    the compiled code, and Inductor's cache key covers them as ordinary inputs.
    Returns (graph module to compile, extra tensors, {weight input: EC inputs}).
    """
    extra: list[torch.Tensor] = []
    ec_inputs: dict[int, tuple[dict[str, int], object, str]] = {}
    for i, info in enumerate(list(infos)):
        found = lookup_ec(info.tensor) if info.tensor is not None else None
        if found is None:
            continue
        ec, name = found
        index_of = {}
        for p in EC_PARAMS:
            index_of[p] = len(infos)
            t = getattr(ec, p).detach()
            extra.append(t)
            infos.append(InputInfo(t, f"{name or info.name}.ec.{p}"))
        ec_inputs[i] = (index_of, ec, name)
    if extra:
        gm = _copy_dynamo_graph(gm)
        last = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
        with gm.graph.inserting_after(last):
            for j in reversed(range(len(extra))):
                node = gm.graph.placeholder(f"spear_ec_input_{j}")
                node._dynamo_source = None  # type: ignore[attr-defined]  # AOT expects the attribute
                # static like a parameter: CUDA-graph trees need not copy it each replay
                node.meta["tensor_dict"] = {"_dynamo_static_input_type": "unguarded"}
        gm.recompile()
    return gm, extra, ec_inputs


def spear_backend(gm: torch.fx.GraphModule, example_inputs, options: Optional[dict] = None, **kw: Any):
    """Dynamo backend: Inductor with the spear passes as its post-grad custom pass.
    ``torch.compile``'s ``mode`` is not applied (Inductor runs with its defaults plus the spear
    passes); a mode other than the default warns rather than being dropped silently."""
    from torch._inductor.compile_fx import compile_fx

    if kw.get("mode") not in (None, "default"):
        warnings.warn(f"backend='spear' ignores torch.compile mode={kw['mode']!r}: Inductor runs with its defaults "
                      f"plus the spear passes", stacklevel=2)

    gm = _fold_gqa(gm, _resolve_config(options))
    infos = _input_infos(gm, example_inputs)
    gm, extra, ec_inputs = _add_ec_inputs(gm, infos)
    ctx = PassContext(config=_resolve_config(options), inputs=infos, ec_inputs=ec_inputs,
                      observer=_OBSERVERS[-1] if _OBSERVERS else None)
    manager = _CheckedPassManager(ctx)
    patches: dict[str, Any] = {"post_grad_custom_post_pass": manager}
    inputs = list(example_inputs) + extra
    key = compiled_plans.graph_key(manager.uuid(), gm)
    if ctx.observer is None:
        compiled = compile_fx(gm, inputs, config_patches=patches)
    else:  # inspection must see the passes run: a cache hit would skip them
        compiled = _compile_uncached(compile_fx, gm, inputs, patches)
    records, source = ctx.plan_records, "passes"
    if records is None:  # a cache hit skipped the passes: the records saved when they ran, else run them
        records, source = compiled_plans.load(key), "cache"
        if records is None:
            compiled = _compile_uncached(compile_fx, gm, inputs, patches)
            records, source = ctx.plan_records or [], "passes"
    fingerprint = ctx.config.fingerprint()
    if source == "passes":
        compiled_plans.save(key, records, fingerprint)
    compiled_plans.register(key, records, fingerprint, [(i.name, i.tensor) for i in ctx.inputs], source)
    return compiled if not extra else _with_extra_inputs(compiled, extra)


def _fold_gqa(gm: torch.fx.GraphModule, cfg: CompileConfig) -> torch.fx.GraphModule:
    """``passes/fold_gqa_attention.py`` on (a copy of) Dynamo's graph, before AOTAutograd."""
    p = FoldGQAAttention(cfg.fold_gqa_attention)
    if not p.matches(gm):
        return gm
    gm = _copy_dynamo_graph(gm)
    obs = _OBSERVERS[-1] if _OBSERVERS else None
    if obs is not None:
        obs("before", p.name, gm.graph, p)
    p(gm)
    if obs is not None:
        obs("after", p.name, gm.graph, p)
    return gm


def _compile_uncached(compile_fx, gm, inputs, patches):
    """``compile_fx`` with Inductor's FX graph cache and AOTAutograd's cache off, so the passes run."""
    with torch._functorch.config.patch(enable_autograd_cache=False):
        return compile_fx(gm, inputs, config_patches={**patches, "fx_graph_cache": False})


class _CheckedPassManager(SpearPassManager):
    """The pass manager, then :func:`check_ecs_applied` on the rewritten graph (same cache key:
    the check changes no graph, it only refuses one)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        super().__call__(graph)
        check_ecs_applied(graph, self.ctx)


def check_ecs_applied(graph: torch.fx.Graph, ctx: PassContext) -> None:
    """Raise :class:`UnmatchedECError` (or warn, per ``ctx.config.on_unmatched_ec``) for every EC the
    backend added as graph inputs that no node of the rewritten ``graph`` reads."""
    if not ctx.ec_inputs:
        return
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    lost = []
    for weight_index, (index_of, ec, name) in ctx.ec_inputs.items():
        a = placeholders[index_of["A"]] if index_of["A"] < len(placeholders) else None
        if a is not None and a.users:
            continue
        weight = placeholders[weight_index] if weight_index < len(placeholders) else None
        readers = sorted({str(u.target) for u in weight.users}) if weight is not None else []
        wname = ctx.inputs[weight_index].name if weight_index < len(ctx.inputs) else "?"
        lost.append(f"{name or wname} (weight {wname}, read by {', '.join(readers) or 'nothing'})")
    if not lost:
        return
    msg = (f"spear backend: {len(lost)} error compensator(s) registered with attach_ / register_ec would be "
           f"dropped: no pass rewrote the linear of {'; '.join(lost)}. The compiled model would differ from "
           f"eager + EC. Write the dequantization as (q.to(dtype) - z) * s -> linear (any op order; "
           f"passes/match_dequant_linear.py lists them), use QuantLinear (quantize_), or compile with "
           f"options={{'on_unmatched_ec': 'warn'}} to accept the model without these ECs.")
    if ctx.config.on_unmatched_ec == "warn":
        warnings.warn(msg, stacklevel=2)
    else:
        raise UnmatchedECError(msg)


def _with_extra_inputs(compiled, extra: list[torch.Tensor]):
    """Call ``compiled`` with the EC tensors appended to Dynamo's arguments."""

    def run(*args):
        return compiled(*args, *extra)

    return run


def register() -> None:
    """Make ``backend="spear"`` resolvable even when the package's entry point is not installed."""
    from torch._dynamo.backends import registry

    if "spear" in registry._COMPILER_FNS:
        return
    registry._lazy_import()
    if registry._BACKENDS.get("spear") is not None:
        return  # installed: Dynamo loads the entry point (spear_backend) on first use
    registry.register_backend(compiler_fn=spear_backend, name="spear")
