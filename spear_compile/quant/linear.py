"""``QuantLinear``: an ``nn.Linear`` replacement holding a packed int4 weight.

Its forward is a single registered op (``spear::w4a16_linear``, or ``spear::ec_linear``
once an error compensator is attached), so an eager model, a model compiled by any
backend, and one compiled by ``backend="spear"`` all compute the same function; the
``spear`` backend only chooses how to lower it.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..config import QuantConfig, check_group_size
from .format import ACT_DTYPES, QuantFormatError, QuantizedWeight, check_spear_weight
from .rtn import quantize_rtn


class QuantLinear(nn.Module):
    """Linear layer with a 4-bit weight in the "spear" layout (see ``quant/format.py``)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group_size: Optional[int] = None,
        bias: bool = True,
        dtype: torch.dtype = torch.float32,
        device=None,
        name: str = "QuantLinear",
    ) -> None:
        super().__init__()
        if type(group_size) is int and group_size == 0:  # 0 = per-channel, as in QuantConfig
            group_size = None
        self.check_args(in_features, group_size, dtype, name)
        if isinstance(out_features, bool) or not isinstance(out_features, int) or out_features < 1:
            raise QuantFormatError(f"{name}: out_features={out_features!r} must be a positive integer")
        G = group_size or in_features
        self.in_features, self.out_features, self.group_size, self.name = in_features, out_features, G, name
        ng = in_features // G
        self.register_buffer("qweight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device))
        self.register_buffer("scales", torch.ones(out_features, ng, dtype=dtype, device=device))
        self.register_buffer("zeros", torch.full((out_features, ng), 8.0, dtype=dtype, device=device))
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device) if bias else None)
        self.ec: Optional[nn.Module] = None

    @staticmethod
    def check_args(in_features: int, group_size: Optional[int], dtype: torch.dtype, name: str) -> None:
        """Raise ``QuantFormatError`` naming ``name`` unless a layer with these can be stored and run:
        ``in_features`` a positive even integer, ``group_size`` as ``config.check_group_size`` (the
        rule ``QuantConfig`` applies, plus ``group_size == in_features``), a floating ``dtype``."""
        if isinstance(in_features, bool) or not isinstance(in_features, int) or in_features < 2:
            raise QuantFormatError(f"{name}: in_features={in_features!r} must be a positive even integer")
        try:
            check_group_size(group_size, name, in_features)
        except ValueError as e:
            raise QuantFormatError(str(e)) from None
        if in_features % 2:
            raise QuantFormatError(f"{name}: in_features K={in_features} must be even to pack int4 pairs")
        if dtype not in ACT_DTYPES:
            raise QuantFormatError(f"{name}: dtype {dtype} is not supported; expected one of {ACT_DTYPES}")

    @classmethod
    def from_linear(cls, linear: nn.Linear, cfg: QuantConfig, name: str = "QuantLinear") -> "QuantLinear":
        """Quantize an ``nn.Linear`` with ``cfg`` (RTN now; GPTQ/AWQ fill the same format)."""
        w = linear.weight
        qw = quantize_rtn(w, cfg, out_dtype=w.dtype, where=name)
        return cls.from_quantized(qw, linear.bias, name=name)

    @classmethod
    def from_quantized(cls, qw: QuantizedWeight, bias: Optional[torch.Tensor], name: str = "QuantLinear") -> "QuantLinear":
        m = cls(qw.in_features, qw.out_features, qw.group_size, bias is not None, qw.scales.dtype,
                qw.qweight.device, name)
        check_spear_weight(qw.qweight, qw.scales, qw.zeros, qw.group_size, qw.in_features, name)
        m.qweight.copy_(qw.qweight)
        m.scales.copy_(qw.scales)
        m.zeros.copy_(qw.zeros)
        if bias is not None:
            m.bias.copy_(bias.detach())
        return m

    def quantized_weight(self) -> QuantizedWeight:
        return QuantizedWeight(self.qweight, self.scales, self.zeros, self.group_size, self.in_features,
                               self.out_features)

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        return self.quantized_weight().dequantize(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise QuantFormatError(f"{self.name}: input is a {type(x).__name__}, expected a tensor [..., {self.in_features}]")
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise QuantFormatError(
                f"{self.name}: input has shape {tuple(x.shape)}, expected [..., in_features={self.in_features}] "
                f"(at least 1-d, last dim {self.in_features})"
            )
        if x.dtype not in ACT_DTYPES:
            raise QuantFormatError(f"{self.name}: input dtype {x.dtype} is not supported; expected one of {ACT_DTYPES}")
        ec = self.ec
        # the weight is dequantized to x's dtype; the bias follows it (an fp32 layer under bf16 autocast)
        bias = self.bias if self.bias is None or self.bias.dtype == x.dtype else self.bias.to(x.dtype)
        if ec is None:
            return torch.ops.spear.w4a16_linear(x, self.qweight, self.scales, self.zeros, self.group_size, bias)
        return torch.ops.spear.ec_linear(
            x, self.qweight, self.scales, self.zeros, self.group_size, bias,
            ec.A, ec.B, ec.W1, ec.b1, ec.W2, ec.b2, ec.alpha, ec.act,
        )

    def extra_repr(self) -> str:
        ec = f", ec_rank={self.ec.rank}" if self.ec is not None else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"group_size={self.group_size}, bias={self.bias is not None}{ec}")
