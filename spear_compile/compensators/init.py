"""Building ECs for a whole model: SVD-of-error from a full-precision reference, or
random (for exercising the compiler, never for quality)."""
from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn

from ..config import ECConfig
from ..quant.linear import QuantLinear
from .ec import ErrorCompensator


def svd_ecs(qmodel: nn.Module, ref: nn.Module, cfg: ECConfig = ECConfig(),
            names: Optional[Iterable[str]] = None) -> dict[str, ErrorCompensator]:
    """SVD-of-error ECs for the QuantLinears of ``qmodel`` (weights from ``ref`` by the same name)."""
    ref_mods = dict(ref.named_modules())
    out = {}
    for fqn, m in qmodel.named_modules():
        if not isinstance(m, QuantLinear) or (names is not None and fqn not in names):
            continue
        if fqn not in ref_mods or not hasattr(ref_mods[fqn], "weight"):
            raise KeyError(f"svd_ecs: reference model has no linear named {fqn!r}")
        out[fqn] = ErrorCompensator.from_weight_error(ref_mods[fqn].weight, m.dequantize(torch.float32), cfg)
    return out


def random_ecs(qmodel: nn.Module, cfg: ECConfig = ECConfig(), seed: int = 0) -> dict[str, ErrorCompensator]:
    """Random ECs on every QuantLinear, small enough to keep logits finite."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for fqn, m in qmodel.named_modules():
        if isinstance(m, QuantLinear):
            ec = ErrorCompensator(m.in_features, m.out_features, cfg)
            with torch.no_grad():
                ec.A.copy_(torch.randn(ec.A.shape, generator=gen) / m.in_features ** 0.5)
                ec.B.copy_(torch.randn(ec.B.shape, generator=gen) * 0.01)
                ec.W2.copy_(torch.randn(ec.W2.shape, generator=gen) * 0.1)
            out[fqn] = ec
    return out
