"""Round-to-nearest (RTN) 4-bit quantization, per-channel or group-wise.

Asymmetric: per group, ``s = (max - min) / 15``, ``z = round(-min / s)`` clamped to
[0, 15], ``q = clamp(round(w / s) + z, 0, 15)``. Symmetric: ``s = max|w| / 7.5``-style
with the zero point fixed at 8 (``q - 8`` spans [-8, 7]); we use ``s = max|w| / 7`` so
the positive end is exactly representable. Statistics in fp32 regardless of the weight
dtype; scales and zeros are returned in ``out_dtype`` (the model's dtype).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..config import QuantConfig
from .format import QuantizedWeight, QuantFormatError, pack_int4


def quantize_rtn(
    weight: torch.Tensor, cfg: QuantConfig, out_dtype: Optional[torch.dtype] = None, where: str = "weight"
) -> QuantizedWeight:
    """Quantize a [N, K] weight with RTN; returns the packed "spear" format."""
    if weight.dim() != 2:
        raise QuantFormatError(f"{where}: expected a 2-D weight [N, K], got shape {tuple(weight.shape)}")
    N, K = weight.shape
    G = cfg.group_size or K
    if K % G:
        raise QuantFormatError(f"{where}: in_features K={K} is not divisible by group_size={G}")
    if K % 2:
        raise QuantFormatError(f"{where}: in_features K={K} must be even to pack two int4 values per byte")
    w = weight.detach().to(torch.float32).reshape(N, K // G, G)
    if cfg.symmetric:
        amax = w.abs().amax(dim=-1)
        s = (amax / 7.0).clamp_min(1e-8)
        z = torch.full_like(s, 8.0)
    else:
        wmin = w.amin(dim=-1).clamp_max(0.0)
        wmax = w.amax(dim=-1).clamp_min(0.0)
        s = ((wmax - wmin) / 15.0).clamp_min(1e-8)
        z = torch.round(-wmin / s).clamp(0, 15)
    out_dtype = out_dtype or weight.dtype
    # Round the scale to the storage dtype *before* computing q, so q is optimal for
    # the scale that will actually be used at run time.
    s = s.to(out_dtype).to(torch.float32)
    q = torch.clamp(torch.round(w / s.unsqueeze(-1)) + z.unsqueeze(-1), 0, 15).to(torch.uint8)
    return QuantizedWeight(
        qweight=pack_int4(q.reshape(N, K)),
        scales=s.to(out_dtype).contiguous(),
        zeros=z.to(out_dtype).contiguous(),
        group_size=G,
        in_features=K,
        out_features=N,
    )
