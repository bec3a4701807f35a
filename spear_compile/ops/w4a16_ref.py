"""W4A16 linear: ``y = x @ dequant(qweight, scales, zeros)^T + bias``.

References for every weight layout the ``spear::w4a16_linear`` op accepts (see
``quant/format.py``). The dequantization order ``(q.to(dtype) - z) * s`` is the same one
hand-written dequantize-then-linear code uses, so adopting such a graph (layout
"unpacked") reproduces its numbers bit for bit.

Lowering choice (``lowering`` argument: "fused", "overlapped", "dispatch", "auto") does
not change the numbers; on CPU every choice runs this reference. The GPU kernels that
honour it arrive with the GPU-lowering issue.
"""
from __future__ import annotations

from typing import Optional

import torch

from .packing import unpack_int4


def dequantize_ref(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: Optional[torch.Tensor],
    group_size: int,
    layout: str,
    dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Dequantize a "spear" or "unpacked" weight to [N, K] in ``dtype`` (default: scales' dtype)."""
    if layout == "spear":
        q = unpack_int4(qweight)
    elif layout == "unpacked":
        q = qweight
    else:
        raise ValueError(f"dequantize_ref: layout {layout!r} has no direct dequantization; use w4a16_linear_ref")
    dtype = dtype or scales.dtype
    N, K = q.shape
    ng = K // group_size
    w = q.reshape(N, ng, group_size).to(dtype)
    if zeros is not None:
        w = w - zeros.reshape(N, ng, 1)
    w = w * scales.reshape(N, ng, 1)
    return w.reshape(N, K).to(dtype)


def _tinygemm(x2: torch.Tensor, qweight, scales, group_size: int, layout: str) -> torch.Tensor:
    if layout == "tinygemm_cpu":
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x2, qweight, group_size, scales)
    return torch.ops.aten._weight_int4pack_mm(x2, qweight, group_size, scales)


def w4a16_linear_ref(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: Optional[torch.Tensor],
    group_size: int,
    bias: Optional[torch.Tensor],
    layout: str = "spear",
) -> torch.Tensor:
    """Reference W4A16 linear on ``x [..., K]`` -> ``[..., N]``."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if layout in ("tinygemm_cpu", "tinygemm_cuda"):
        y = _tinygemm(x2, qweight, scales, group_size, layout)
        if bias is not None:
            y = y + bias
    else:
        w = dequantize_ref(qweight, scales, zeros, group_size, layout, dtype=x.dtype)
        y = torch.addmm(bias, x2, w.t()) if bias is not None else torch.mm(x2, w.t())
    return y.reshape(*lead, y.shape[-1])
