"""The ``spear`` torch.compile backend.

``torch.compile(model, backend="spear", options={...})`` calls :func:`spear_backend`
with Dynamo's FX graph and the real example inputs. We record which input tensor is
which (for ECs registered against foreign weights) and hand the graph to Inductor's
``compile_fx`` with our pass manager as ``post_grad_custom_post_pass``; everything else
is Inductor's, so a graph with no quantized linear compiles exactly as
``backend="inductor"`` would.

``options`` are :class:`~spear_compile.config.CompileConfig` fields
(e.g. ``{"crossover_m": 32}``); a :func:`compile_config` context manager sets them too.
"""
from __future__ import annotations

import contextlib
import contextvars
import hashlib
from typing import Any, Callable, Optional

import torch

from ..config import CompileConfig
from .context import InputInfo, PassContext, fqn_from_source
from .manager import SpearPassManager

_CONFIG: contextvars.ContextVar[Optional[CompileConfig]] = contextvars.ContextVar("spear_config", default=None)
_OBSERVERS: list[Callable] = []  # inspect.capture pushes one while it compiles


@contextlib.contextmanager
def compile_config(cfg: CompileConfig):
    """Use ``cfg`` for every ``backend="spear"`` compilation inside the block."""
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


def _ec_fingerprint(infos: list[InputInfo]) -> str:
    from ..compensators.registry import lookup_ec

    h = hashlib.sha256()
    for info in infos:
        found = lookup_ec(info.tensor) if info.tensor is not None else None
        if found is not None:
            for p in found[0].parameters():
                h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def spear_backend(gm: torch.fx.GraphModule, example_inputs, options: Optional[dict] = None, **_: Any):
    """Dynamo backend: Inductor with the spear passes as its post-grad custom pass."""
    from torch._inductor.compile_fx import compile_fx

    infos = _input_infos(gm, example_inputs)
    ctx = PassContext(config=_resolve_config(options), inputs=infos,
                      observer=_OBSERVERS[-1] if _OBSERVERS else None)
    manager = SpearPassManager(ctx, _ec_fingerprint(infos))
    return compile_fx(gm, example_inputs, config_patches={"post_grad_custom_post_pass": manager})


def register() -> None:
    """Make ``backend="spear"`` resolvable even when the package's entry point is not installed."""
    from torch._dynamo.backends import registry

    if "spear" in registry._COMPILER_FNS:
        return
    registry._lazy_import()
    if registry._BACKENDS.get("spear") is not None:
        return  # installed: Dynamo loads the entry point (this function) on first use
    registry.register_backend(compiler_fn=spear_backend, name="spear")
