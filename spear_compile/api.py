"""Public entry points: ``quantize_`` and ``attach_`` (re-exported at package level)."""
from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch

from torch import nn
from tqdm.auto import tqdm

from .compensators.registry import attach_, detach_  # noqa: F401  (public API)
from .config import QuantConfig
from .quant.linear import QuantLinear

FilterFn = Callable[[nn.Module, str], bool]


def default_filter(module: nn.Module, fqn: str) -> bool:
    """Every ``nn.Linear`` except the output head (``lm_head``); embeddings are not linears."""
    return isinstance(module, nn.Linear) and fqn.split(".")[-1] != "lm_head"


def quantize_(model: nn.Module, cfg: QuantConfig = QuantConfig(), filter_fn: Optional[FilterFn] = None,
              progress: bool = True, calib: Optional[Iterable[torch.Tensor]] = None) -> nn.Module:
    """Replace selected ``nn.Linear`` modules of ``model`` in place by :class:`QuantLinear`.

    ``filter_fn(module, fqn)`` picks the modules (default: :func:`default_filter`). Each
    chosen module must be an ``nn.Linear`` whose in_features is divisible by the group
    size; the error names the module otherwise. ``cfg.method == "gptq"`` needs ``calib``,
    input batches for ``model``: one pass collects every layer's Hessian 2 E[x x^T] from the
    full-precision inputs (not re-collected layer by layer). Returns ``model``.
    """
    filter_fn = filter_fn or default_filter
    targets = [(fqn, m) for fqn, m in model.named_modules() if fqn and filter_fn(m, fqn)]
    for fqn, m in targets:
        if not isinstance(m, nn.Linear):
            raise TypeError(f"quantize_: filter selected {fqn!r} of type {type(m).__name__}; only nn.Linear is supported")
    hessians = {}
    if cfg.method == "gptq":
        if calib is None:
            raise ValueError("quantize_: method='gptq' needs calib= (input batches for the model)")
        from .compensators.stats import collect_input_stats

        stats = collect_input_stats(model, calib, names=[f for f, _ in targets], full=True, module_type=nn.Linear)
        hessians = {f: 2 * st.rxx for f, st in stats.items()}
    for fqn, m in tqdm(targets, desc=f"quantize {cfg.method} w{cfg.bits} g{cfg.group_size or 'ch'}",
                       disable=not progress or len(targets) < 8, leave=False):
        parent_name, _, child = fqn.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if cfg.method == "gptq":
            from .quant.gptq import quantize_gptq

            qw = quantize_gptq(m.weight, hessians[fqn], cfg, cfg.damp, cfg.block_size, cfg.act_order, where=fqn)
            q = QuantLinear.from_quantized(qw, m.bias, name=fqn)
        else:
            q = QuantLinear.from_linear(m, cfg, name=fqn)
        setattr(parent, child, q)
    return model


def quantized_linears(model: nn.Module) -> dict[str, QuantLinear]:
    return {fqn: m for fqn, m in model.named_modules() if isinstance(m, QuantLinear)}
