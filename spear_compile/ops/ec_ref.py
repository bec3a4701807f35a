"""Error-compensated linear: ``y = Q(W) x + alpha * B (g * h)``, ``h = A x``,
``g = sigmoid(W2 act(W1 h + b1) + b2)``.

``ec_delta_ref`` is the compensator alone (what calibration differentiates);
``ec_linear_ref`` adds it to the W4A16 reference. The gate acts on the r-vector ``h``
only, so on GPU it costs a few hundred FLOPs per token and can live in a GEMV epilogue
(decode) or in a side-stream kernel (prefill). The EC math runs in fp32 and is cast
back to the activation dtype once, so bf16 models do not lose the small correction to
rounding.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .w4a16_ref import w4a16_linear_ref

_ACTS = {"silu": F.silu, "relu": F.relu, "gelu": F.gelu}


def ec_delta_ref(
    x: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    W1: torch.Tensor,
    b1: torch.Tensor,
    W2: torch.Tensor,
    b2: torch.Tensor,
    alpha: torch.Tensor,
    act: str = "silu",
) -> torch.Tensor:
    """``alpha * B (g * A x)`` on ``x [..., K]`` -> ``[..., N]`` in x's dtype."""
    xf = x.to(torch.float32)
    h = xf @ A.to(torch.float32).t()
    z = _ACTS[act](h @ W1.to(torch.float32).t() + b1.to(torch.float32))
    g = torch.sigmoid(z @ W2.to(torch.float32).t() + b2.to(torch.float32))
    return (alpha.to(torch.float32) * ((g * h) @ B.to(torch.float32).t())).to(x.dtype)


def ec_linear_ref(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: Optional[torch.Tensor],
    group_size: int,
    bias: Optional[torch.Tensor],
    A: torch.Tensor,
    B: torch.Tensor,
    W1: torch.Tensor,
    b1: torch.Tensor,
    W2: torch.Tensor,
    b2: torch.Tensor,
    alpha: torch.Tensor,
    act: str = "silu",
    layout: str = "spear",
) -> torch.Tensor:
    base = w4a16_linear_ref(x, qweight, scales, zeros, group_size, bias, layout)
    return base + ec_delta_ref(x, A, B, W1, b1, W2, b2, alpha, act)
