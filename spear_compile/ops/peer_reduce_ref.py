"""Row-parallel EC linear: the references of its parts.

In a row-parallel linear rank ``i`` holds the K slice ``x_i`` of the input, the columns ``W_i`` of the
weight and the columns ``A_i`` of the EC's down-projection, so it can compute only partial sums:

    y_i = Q(W_i) x_i        (N values)        h_i = A_i x_i        (r values)

The layer's output needs the reduced ``y = sum_i y_i`` and ``h = sum_i h_i``:

    out = y + bias + alpha * B (g(h) * h),    g(h) = sigmoid(W2 act(W1 h + b1) + b2)

The gate is nonlinear, so ``sum_i g(h_i) * h_i != g(h) * h``: gating each rank's partial (what an
``ec_linear`` on the local shard followed by an all-reduce computes) is a different, wrong function.
Both partials are therefore reduced together, as one stacked fp32 vector ``[y_i | h_i]`` of ``N + r``
values per row, and the gate runs after the reduction.

``ec_partial_ref``       one rank's stacked partial ``[..., N + r]`` (fp32)
``ec_reduced_apply_ref`` the stacked sum -> the layer's output in the activation dtype
``peer_sum_ref``         the sum of the ranks' partials as staged ``[W, ..., N + r]`` (the post kernel's input)
``ec_linear_tp_ref``     the whole layer from every rank's shard, in one process (the tests' oracle)

The partials and their sum stay in fp32 and the output is rounded once, so a TP layer equals the
single-process ``ec_linear_ref`` within the activation dtype's rounding.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .ec_ref import _ACTS
from .w4a16_ref import dequantize_ref


def ec_partial_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
                   group_size: int, A: torch.Tensor, layout: str = "spear") -> torch.Tensor:
    """``[Q(W_i) x_i | A_i x_i]`` of one rank's shard, fp32 ``[..., N + r]`` (no bias: it is added once,
    after the reduction)."""
    xf = x.reshape(-1, x.shape[-1]).to(torch.float32)
    w = dequantize_ref(qweight, scales, zeros, group_size, layout, dtype=torch.float32)
    yh = torch.cat([xf @ w.t(), xf @ A.to(torch.float32).t()], dim=-1)
    return yh.reshape(*x.shape[:-1], yh.shape[-1])


def gated_delta(h: torch.Tensor, B, W1, b1, W2, b2, alpha, act: str) -> torch.Tensor:
    """``alpha * B (g(h) * h)`` in fp32 for a reduced ``h [..., r]``."""
    f = torch.float32
    z = _ACTS[act](h @ W1.to(f).t() + b1.to(f))
    g = torch.sigmoid(z @ W2.to(f).t() + b2.to(f))
    return alpha.to(f) * ((g * h) @ B.to(f).t())


def ec_reduced_apply_ref(yh: torch.Tensor, bias: Optional[torch.Tensor], B: torch.Tensor, W1: torch.Tensor,
                         b1: torch.Tensor, W2: torch.Tensor, b2: torch.Tensor, alpha: torch.Tensor, act: str,
                         dtype: torch.dtype) -> torch.Tensor:
    """The layer's output ``y + bias + alpha * B (g(h) * h)`` from the reduced stack ``yh = [y | h]``
    (``[..., N + r]``, N = B's rows), rounded once to ``dtype``."""
    N = B.shape[0]
    yh = yh.to(torch.float32)
    y, h = yh[..., :N], yh[..., N:]
    out = y + gated_delta(h, B, W1, b1, W2, b2, alpha, act)
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(dtype)


def peer_sum_ref(staged: torch.Tensor) -> torch.Tensor:
    """Sum over the leading rank dimension of the staged partials ``[W, ..., N + r]``, in rank order."""
    out = staged[0].to(torch.float32).clone()
    for i in range(1, staged.shape[0]):
        out += staged[i].to(torch.float32)
    return out


def ec_linear_tp_ref(xs: Sequence[torch.Tensor], shards: Sequence[tuple], bias: Optional[torch.Tensor], B, W1, b1,
                     W2, b2, alpha, act: str = "silu", layout: str = "spear") -> torch.Tensor:
    """The row-parallel layer computed in one process: ``xs[i]`` is rank i's K slice of x and ``shards[i]``
    its ``(qweight, scales, zeros, group_size, A)``."""
    if len(xs) != len(shards) or not xs:
        raise ValueError(f"ec_linear_tp_ref: {len(xs)} inputs for {len(shards)} shards")
    parts = torch.stack([ec_partial_ref(x, *s[:5], layout) for x, s in zip(xs, shards)])
    return ec_reduced_apply_ref(peer_sum_ref(parts), bias, B, W1, b1, W2, b2, alpha, act, xs[0].dtype)
