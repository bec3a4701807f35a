"""The int4 nibble packing of the "spear" layout (``quant/format.py`` describes the format).

A leaf: the references (``w4a16_ref``), the kernels' repacking and the quantizers all pack and unpack
through these two functions; ``spear_compile.quant`` re-exports them.
"""
from __future__ import annotations

import torch

from ..errors import QuantFormatError


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Pack integers 0..15 of shape [N, K] (K even) into uint8 [N, K // 2]."""
    if q.dim() != 2:
        raise QuantFormatError(f"pack_int4: expected a 2-D [N, K] tensor, got shape {tuple(q.shape)}")
    if q.shape[1] % 2:
        raise QuantFormatError(f"pack_int4: K={q.shape[1]} must be even to pack two nibbles per byte")
    if q.is_floating_point() or q.is_complex():
        raise QuantFormatError(f"pack_int4: expected an integer tensor, got {q.dtype}")
    if q.numel() and (int(q.min()) < 0 or int(q.max()) > 15):
        raise QuantFormatError(f"pack_int4: values must lie in [0, 15], got [{int(q.min())}, {int(q.max())}]")
    q = q.to(torch.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: uint8 [N, K // 2] -> uint8 [N, K]."""
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise QuantFormatError(
            f"unpack_int4: expected uint8 [N, K//2], got {packed.dtype} of shape {tuple(packed.shape)}"
        )
    lo = packed & 0xF
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).reshape(packed.shape[0], packed.shape[1] * 2)
