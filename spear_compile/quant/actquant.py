"""Activation fake quantization: per-token (optionally per-group) symmetric integer, straight-through gradient.

Used to evaluate weight-and-activation settings (W4A8, W4A4) in eager mode: by the SERQ
baseline (``compensators/serq.py``) inside its layer, and for any other method through
:func:`add_act_quant_` (a forward pre-hook on every ``QuantLinear``). "Per token" means
one scale per row of the last dimension (every position of every sequence gets its own
scale, computed on the fly, as dynamic-activation W4A8 / W4A4 kernels do); with
``group_size=G`` each token's K channels are split into K/G contiguous groups with one
scale each (what the SERQ release and MX formats do; then the channel order matters):

    s = max_k |x_k| / (2^(b-1) - 1),   q = clamp(round(x / s), -(2^(b-1) - 1), 2^(b-1) - 1),   x_hat = q s

The grid is the restricted symmetric one ([-127, 127] for int8, [-7, 7] for int4), so
zero is exact and the largest magnitude of each token (group) is represented exactly.
Statistics and rounding are done in float32 whatever the input dtype; the result is cast
back. The backward is the straight-through estimator: d x_hat / d x = I, so calibration
or training code can differentiate through a fake-quantized model. The forward value is
x_hat cast to the input dtype (the STE adds no rounding).

Rounding error bound (tested): |x_hat - x| <= s / 2 elementwise.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

MIN_BITS, MAX_BITS = 2, 16


def check_act_bits(bits: Optional[int], where: str = "fake_quant_activation") -> None:
    if bits is None:
        return
    if isinstance(bits, bool) or not isinstance(bits, int) or not MIN_BITS <= bits <= MAX_BITS:
        raise ValueError(f"{where}: activation bits must be None or an int in [{MIN_BITS}, {MAX_BITS}], got {bits!r}")


def check_act_group(group_size: Optional[int], K: Optional[int] = None, where: str = "fake_quant_activation") -> None:
    if group_size is None:
        return
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"{where}: activation group_size must be None or a positive int, got {group_size!r}")
    if K is not None and K % group_size:
        raise ValueError(f"{where}: K={K} channels are not divisible by activation group_size={group_size}")


def act_scale(x: torch.Tensor, bits: int, eps: float = 1e-8) -> torch.Tensor:
    """Per-row scale ``max|x| / (2^(b-1) - 1)`` over the last dim, shape ``[..., 1]``, float32."""
    qmax = 2 ** (bits - 1) - 1
    return (x.detach().to(torch.float32).abs().amax(dim=-1, keepdim=True) / qmax).clamp_min(eps)


def fake_quant_activation(x: torch.Tensor, bits: Optional[int], group_size: Optional[int] = None) -> torch.Tensor:
    """Quantize-dequantize ``x [..., K]`` per token (or per ``group_size`` channels of a
    token), symmetric, ``bits`` bits; STE backward. ``bits=None`` returns ``x`` (A16)."""
    check_act_bits(bits)
    if bits is None:
        return x
    if not x.is_floating_point():
        raise ValueError(f"fake_quant_activation: expected a floating tensor, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("fake_quant_activation: expected a tensor with a channel (last) dimension, got a scalar")
    K = x.shape[-1]
    check_act_group(group_size, K)
    xf = x.detach().to(torch.float32)
    if group_size is not None:
        xf = xf.reshape(*x.shape[:-1], K // group_size, group_size)
    qmax = 2 ** (bits - 1) - 1
    s = act_scale(xf, bits)
    xq = (torch.clamp(torch.round(xf / s), -qmax, qmax) * s).reshape(x.shape).to(x.dtype)
    # STE written so the forward value is exactly x_hat (x - x.detach() is exactly 0; the
    # textbook ``x + (x_hat - x).detach()`` is off the grid by a rounding step in fp16/bf16).
    return xq + (x - x.detach())


def add_act_quant_(model: nn.Module, bits: int, group_size: Optional[int] = None,
                   module_type: Optional[type] = None) -> list:
    """Fake-quantize the input of every ``module_type`` (default ``QuantLinear``) of ``model``.

    Forward pre-hooks, so it composes with whatever the layer does (W4 only, or W4 + an
    attached EC, whose path then also reads the quantized input). Returns the hook
    handles (``h.remove()`` undoes it). Layers that quantize their own activations
    (``SERQLinear``) are refused: use ``apply_serq_(act_bits=...)`` for them.
    """
    check_act_bits(bits, "add_act_quant_")
    check_act_group(group_size, where="add_act_quant_")
    if bits is None:
        raise ValueError("add_act_quant_: bits=None would do nothing; pass 8 or 4")
    if module_type is None:
        from .linear import QuantLinear

        module_type = QuantLinear
    mods = [(n, m) for n, m in model.named_modules() if isinstance(m, module_type)]
    for n, m in mods:
        if hasattr(m, "act_bits"):
            raise ValueError(f"add_act_quant_: {n} ({type(m).__name__}) quantizes its own activations")
        check_act_group(group_size, getattr(m, "in_features", None), f"add_act_quant_ {n}")

    def hook(mod, args):
        return (fake_quant_activation(args[0], bits, group_size),) + tuple(args[1:])

    return [m.register_forward_pre_hook(hook) for _, m in mods]


__all__ = ["act_scale", "add_act_quant_", "check_act_bits", "check_act_group", "fake_quant_activation"]
