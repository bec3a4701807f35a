"""Round-to-nearest (RTN) 4-bit quantization, per-channel or group-wise.

Asymmetric: per group, ``s = (max - min) / 15``, ``z = round(-min / s)`` clamped to
[0, 15], ``q = clamp(round(w / s) + z, 0, 15)``. Symmetric: ``s = max|w| / 7.5``-style
with the zero point fixed at 8 (``q - 8`` spans [-8, 7]); we use ``s = max|w| / 7`` so
the positive end is exactly representable. Statistics in fp32 regardless of the weight
dtype; scales and zeros are returned in ``out_dtype`` (the model's dtype).

Clipping (used by AWQ, ``quant/awq.py``): an optional ``clip`` tensor ``[N, K // G]`` of
ratios in (0, 1] shrinks each group's range before the parameters are computed
(``min * r``, ``max * r``, or ``max|w| * r`` when symmetric); weights outside the shrunk
range saturate at 0 / 15. ``clip=None`` (or all ones) is plain RTN, bit for bit.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..config import QuantConfig
from .format import QuantizedWeight, QuantFormatError, pack_int4


def rtn_params(w: torch.Tensor, symmetric: bool, out_dtype: torch.dtype,
               clip: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero), each ``[N, ng]`` fp32, for grouped fp32 weights ``w`` ``[N, ng, G]``.

    The scale is rounded to ``out_dtype`` (the storage dtype) and back, so rounding with
    it is optimal for the scale used at run time. ``clip`` ``[N, ng]`` shrinks the range.
    """
    if symmetric:
        amax = w.abs().amax(dim=-1)
        if clip is not None:
            amax = amax * clip
        s = (amax / 7.0).clamp_min(1e-8)
        z = torch.full_like(s, 8.0)
    else:
        wmin = w.amin(dim=-1).clamp_max(0.0)
        wmax = w.amax(dim=-1).clamp_min(0.0)
        if clip is not None:
            wmin, wmax = wmin * clip, wmax * clip
        s = ((wmax - wmin) / 15.0).clamp_min(1e-8)
        z = torch.round(-wmin / s).clamp(0, 15)
    return s.to(out_dtype).to(torch.float32), z


def rtn_round(w: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Integer codes 0..15 (as fp32) of grouped weights ``w`` [N, ng, G] for (s, z) [N, ng]."""
    return torch.clamp(torch.round(w / s.unsqueeze(-1)) + z.unsqueeze(-1), 0, 15)


def weight_groups(weight: torch.Tensor, cfg: QuantConfig, where: str = "weight") -> tuple[int, int, int]:
    """(N, K, G) of a [N, K] weight under ``cfg``'s group size; errors name ``where``."""
    if weight.dim() != 2:
        raise QuantFormatError(f"{where}: expected a 2-D weight [N, K], got shape {tuple(weight.shape)}")
    N, K = weight.shape
    G = cfg.group_size or K
    if K % G:
        raise QuantFormatError(f"{where}: in_features K={K} is not divisible by group_size={G}")
    return N, K, G


def quantize_rtn(
    weight: torch.Tensor, cfg: QuantConfig, out_dtype: Optional[torch.dtype] = None, where: str = "weight",
    clip: Optional[torch.Tensor] = None,
) -> QuantizedWeight:
    """Quantize a [N, K] weight with RTN; returns the packed "spear" format.

    ``clip``: optional per-group range ratios ``[N, K // G]`` in (0, 1] (see module docstring).
    """
    N, K, G = weight_groups(weight, cfg, where)
    if K % 2:
        raise QuantFormatError(f"{where}: in_features K={K} must be even to pack two int4 values per byte")
    if clip is not None:
        if tuple(clip.shape) != (N, K // G):
            raise QuantFormatError(f"{where}: clip has shape {tuple(clip.shape)}, expected [N, K/G] = [{N}, {K // G}]")
        if clip.numel() and not bool(((clip > 0) & (clip <= 1)).all()):
            raise QuantFormatError(f"{where}: clip ratios must lie in (0, 1]")
        clip = clip.detach().to(device=weight.device, dtype=torch.float32)
    w = weight.detach().to(torch.float32).reshape(N, K // G, G)
    out_dtype = out_dtype or weight.dtype
    # The scale is rounded to the storage dtype *before* computing q, so q is optimal for
    # the scale that will actually be used at run time.
    s, z = rtn_params(w, cfg.symmetric, out_dtype, clip)
    q = rtn_round(w, s, z).to(torch.uint8)
    return QuantizedWeight(
        qweight=pack_int4(q.reshape(N, K)),
        scales=s.to(out_dtype).contiguous(),
        zeros=z.to(out_dtype).contiguous(),
        group_size=G,
        in_features=K,
        out_features=N,
    )
