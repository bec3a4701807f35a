"""The PyTorch references of the spear ops: the numerical contract every kernel is tested against.

``w4a16_ref`` (dequantize, W4A16 linear, every layout) and ``ec_ref`` (the compensator alone and added to
the W4A16 linear) hold the single-linear references; here are those of the fused forms the decode
passes make: the RMSNorm moved into a GEMV's x staging, the GLU epilogue, the parts of a concatenation.
"""
from __future__ import annotations

import torch

from .ec_ref import _ACTS, ec_delta_ref, ec_linear_ref  # noqa: F401
from .w4a16_ref import dequantize_ref, w4a16_linear_ref  # noqa: F401

GLU_ACTS = ("silu",)  # gate activations of spear::w4a16_linear_glu (the epilogue computes silu)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as Llama models compute it (and as ``fuse_rmsnorm`` matches it): in fp32, rounded to
    x's dtype, then times the weight (rounded again)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def glu_of(y2: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """``act(gate) * up`` of a gate / up concatenation ``y2 [..., 2F]``, rounded as the unfused graph
    rounds (what Inductor computes for ``F.silu(g) * u``): silu in fp32, rounded to y2's dtype, times up."""
    if act not in GLU_ACTS:
        raise ValueError(f"glu_of: unknown gate activation {act!r}; expected one of {GLU_ACTS}")
    g, u = y2.chunk(2, dim=-1)
    return torch.nn.functional.silu(g.float()).to(y2.dtype) * u


def ec_parts(qweights, scales, zeros, group_size, biases, As, Bs, W1s, b1s, W2s, b2s, alphas) -> list:
    """Per part of an ``ec_linear_cat``: the ``(qweight, scales, zeros, group_size, bias, A, B, W1, b1,
    W2, b2, alpha)`` arguments of its ``ec_linear`` (the op's checks, reference and fallback); a part
    without an EC (a plain linear fused beside EC ones) has None for all seven EC arguments."""
    return [(q, s, z, group_size, b, A, B, W1, b1, W2, b2, al)
            for q, s, z, b, A, B, W1, b1, W2, b2, al in zip(qweights, scales, zeros, biases, As, Bs, W1s, b1s,
                                                               W2s, b2s, alphas)]


def has_ec(part: tuple) -> bool:
    """Whether an ``ec_parts`` part carries an EC (its A is given)."""
    return part[5] is not None


def cat_part_ref(x: torch.Tensor, part: tuple, act: str, layout: str) -> torch.Tensor:
    """One part of an ``ec_linear_cat`` / ``ec_linear_glu``: ``ec_linear_ref``, or ``w4a16_linear_ref`` for a
    part without an EC."""
    if has_ec(part):
        return ec_linear_ref(x, *part, act, layout)
    return w4a16_linear_ref(x, *part[:5], layout)
