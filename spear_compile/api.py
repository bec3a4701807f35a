"""Public entry points: ``quantize_`` and ``attach_`` (re-exported at package level)."""
from __future__ import annotations

import warnings
from typing import Callable, Iterable, Optional

import torch

from torch import nn
from tqdm.auto import tqdm

from .compensators.registry import attach_, detach_  # noqa: F401  (public API)
from .config import QuantConfig
from .quant.linear import QuantLinear
from .quant.rtn import quantize_rtn

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
    full-precision inputs (not re-collected layer by layer). ``cfg.method == "awq"`` also
    needs ``calib`` and a Llama-style model (``model.model.layers[i]`` with input_layernorm,
    self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.{gate,up,down}_proj): it searches
    per-input-channel scales and clipping (``quant/awq.py``), folds the scales into the
    norms / v_proj / up_proj of ``model`` itself (so keep a separate copy as the
    full-precision reference), then quantizes with RTN and the searched clipping. Selected
    linears outside the decoder layers get plain RTN. The search result is kept as
    ``model._spear_awq`` (``quant.awq.AWQResult``); ``quant.awq.fold_awq_(copy_of_ref,
    model._spear_awq.scales)`` gives the fp reference in the quantized model's coordinates,
    which weight-error based compensator initialisations need. Returns ``model``.
    """
    filter_fn = filter_fn or default_filter
    targets = [(fqn, m) for fqn, m in model.named_modules() if fqn and filter_fn(m, fqn)]
    # Every target is checked before any is replaced: an error leaves the model as it was.
    for fqn, m in targets:
        if not isinstance(m, nn.Linear):
            raise TypeError(f"quantize_: filter selected {fqn!r} of type {type(m).__name__}; only nn.Linear is supported")
        QuantLinear.check_args(m.in_features, cfg.group_size, m.weight.dtype, fqn)
        if not bool(torch.isfinite(m.weight).all()):
            raise ValueError(f"quantize_: {fqn}: the weight holds NaN or inf (its scales would be NaN, and so its outputs)")
        if m.bias is not None and not bool(torch.isfinite(m.bias).all()):
            raise ValueError(f"quantize_: {fqn}: the bias holds NaN or inf (every output of the layer would be non-finite)")
    if not targets:
        already = sum(isinstance(m, QuantLinear) for m in model.modules())
        if already:
            warnings.warn(f"quantize_: nothing selected; {type(model).__name__} already holds {already} QuantLinear "
                          f"modules, which keep their own quantization (quantize a fresh copy to change it)",
                          stacklevel=2)
        else:
            hint = (" (a bare nn.Linear: quantize_ replaces submodules, so wrap it in a container)"
                    if isinstance(model, nn.Linear) else "")
            warnings.warn(f"quantize_: no module selected; {type(model).__name__} is unchanged{hint}", stacklevel=2)
    hessians, clips = {}, {}
    if cfg.method in ("gptq", "awq"):
        given = calib is not None
        calib = list(calib) if given else []  # also lets a generator be read by every pass
        if not calib:
            raise ValueError(f"quantize_: method={cfg.method!r} needs calib= (input batches for the model); "
                             f"{'it is empty' if given else 'none was given'}")
    if cfg.method == "awq":
        from .quant.awq import apply_awq_

        awq = apply_awq_(model, calib, cfg, targets=[f for f, _ in targets], progress=progress)
        model._spear_awq = awq  # scales and clips, e.g. for quant.awq.fold_awq_ on the reference
        clips = awq.clips
    if cfg.method == "gptq":
        from .quant.stats import collect_input_stats

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
        elif fqn in clips:  # AWQ: the weight already carries the folded scale
            q = QuantLinear.from_quantized(quantize_rtn(m.weight, cfg, where=fqn, clip=clips[fqn]), m.bias, name=fqn)
        else:
            q = QuantLinear.from_linear(m, cfg, name=fqn)
        setattr(parent, child, q)
    return model


def quantized_linears(model: nn.Module) -> dict[str, QuantLinear]:
    return {fqn: m for fqn, m in model.named_modules() if isinstance(m, QuantLinear)}
