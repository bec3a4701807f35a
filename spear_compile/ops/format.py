"""The packed int4 weight format and its validation: the contract of the ops' weight operands (``schemas.py``
checks every call against it; ``quant/`` produces it and re-exports these names as ``quant.format``).

Layout ("spear"): ``qweight`` is ``uint8 [N, K // 2]``; byte ``j`` of row ``n`` holds
column ``2j`` in its low nibble and column ``2j + 1`` in its high nibble. Values are
unsigned 0..15. ``scales`` and ``zeros`` are ``[N, K // G]`` floating tensors
(``G = K`` for per-channel), and the weight is ``W[n, k] = (q[n, k] - z[n, k // G]) * s[n, k // G]``.

Zero points are stored as floats, not integers, because that one format then carries
RTN/GPTQ (integer zero points), AWQ (integer zero points after scale folding) and
tinygemm/HQQ-style fractional zeros without a conversion. Two nibbles per byte keeps
``K`` as the contiguous axis, which is what a GEMV kernel streams.

Other layouts the ops understand (produced by the compiler when it adopts foreign
graphs, never by ``quantize_``): ``"unpacked"`` (an integer tensor ``[N, K]``, one
value per element, as hand-written / HF-style dequantize-then-linear code holds it),
``"tinygemm_cpu"`` and ``"tinygemm_cuda"`` (``aten._weight_int4pack_mm[_for_cpu]``).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ..errors import QuantFormatError  # noqa: F401  (defined with the library's other errors)
from .packing import pack_int4, unpack_int4  # noqa: F401  (the packing lives with the references)
from .w4a16_ref import dequantize_ref

LAYOUTS = ("spear", "unpacked", "tinygemm_cpu", "tinygemm_cuda")
ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclasses.dataclass
class QuantizedWeight:
    """A quantized weight in the "spear" layout: what every quantizer returns."""

    qweight: torch.Tensor  # uint8 [N, K // 2]
    scales: torch.Tensor  # [N, K // G]
    zeros: torch.Tensor  # [N, K // G]
    group_size: int  # G; equals K for per-channel
    in_features: int
    out_features: int

    def __post_init__(self) -> None:
        check_spear_weight(self.qweight, self.scales, self.zeros, self.group_size, self.in_features, "QuantizedWeight")

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        w = dequantize_ref(self.qweight, self.scales, self.zeros, self.group_size, "spear")
        return w if dtype is None else w.to(dtype)


def check_spear_weight(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: Optional[torch.Tensor],
    group_size: int,
    in_features: int,
    where: str,
) -> None:
    """Validate a "spear"-layout weight; raise :class:`QuantFormatError` naming ``where``."""
    K = in_features
    if group_size <= 0 or K % group_size:
        raise QuantFormatError(f"{where}: in_features K={K} is not divisible by group_size={group_size}")
    if qweight.dtype != torch.uint8:
        raise QuantFormatError(f"{where}: packed qweight must be uint8, got {qweight.dtype}")
    N = qweight.shape[0] if qweight.dim() == 2 else -1
    if qweight.dim() != 2 or qweight.shape[1] * 2 != K:
        raise QuantFormatError(
            f"{where}: packed qweight has shape {tuple(qweight.shape)}, expected [N, K/2] = [N, {K // 2}] for K={K}"
        )
    check_group_params(scales, zeros, N, K, group_size, where)


def check_group_params(scales: torch.Tensor, zeros: Optional[torch.Tensor], N, K: int, group_size: int,
                       where: str) -> None:
    """Scales and zero points of an [N, K] weight in groups of ``group_size``: floating point,
    [N, K/G] each (any layout)."""
    ng = K // group_size
    for name, t in (("scales", scales), ("zeros", zeros)):
        if t is None:
            continue
        if tuple(t.shape) != (N, ng):
            raise QuantFormatError(
                f"{where}: {name} has shape {tuple(t.shape)}, expected [N, K/G] = [{N}, {ng}] (K={K}, G={group_size})"
            )
        if not t.is_floating_point():
            raise QuantFormatError(f"{where}: {name} must be floating point, got {t.dtype}")
