"""The row-parallel quantized linear, with or without an EC.

Rank ``i`` holds the K slice ``Q(W_i)`` of the weight (a ``QuantLinear`` of ``K / world`` inputs, no
bias) and, with an EC, the K slice ``A_i`` of its down-projection (``RowShardEC``; ``B`` and the gate
whole, on every rank). The forward is written in the form the compiler sees and fuses:

    no EC:    y = all_reduce(w4a16_linear(x_i, W_i)) + bias
    with EC:  yh = ec_linear_partial(x_i, W_i, A_i)           # [y_i | A_i x_i], fp32
              yh = all_reduce(yh)                              # functional collective: all_reduce + wait
              out = ec_reduced_apply(yh, bias, B, gate)        # gate on the reduced A x

Eagerly this runs as written (any backend, and the ``spear`` backend's unmatched graphs, compute the
same); ``backend="spear"`` rewrites the EC form into one ``spear::ec_linear_peer_reduce`` node. Gating
each rank's partial instead (``ec_linear`` on the shard, then the all-reduce) would be wrong: the gate is
not linear in ``h``.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..quant.linear import QuantLinear


class RowShardEC(nn.Module):
    """One rank's share of a row-parallel layer's EC: ``A_i`` (r x K_i), and ``B`` (N x r), the gate and
    ``alpha`` whole. Not trainable here (calibration runs on the single-process model)."""

    def __init__(self, A: torch.Tensor, B: torch.Tensor, W1, b1, W2, b2, alpha, act: str) -> None:
        super().__init__()
        for name, t in (("A", A), ("B", B), ("W1", W1), ("b1", b1), ("W2", W2), ("b2", b2), ("alpha", alpha)):
            self.register_parameter(name, nn.Parameter(t.detach().clone(), requires_grad=False))
        self.act = act

    @property
    def rank(self) -> int:
        return self.A.shape[0]

    def extra_repr(self) -> str:
        return f"rank={self.rank}, k_slice={self.A.shape[1]}, out={self.B.shape[0]}, act={self.act}"


class RowParallelLinear(nn.Module):
    """A row-parallel quantized linear: ``local`` is this rank's K slice, ``bias`` (whole, or None) is
    added once after the reduction, ``ec`` this rank's ``RowShardEC`` or None; ``group_name`` the
    tensor-parallel process group's name (``""``: no process group, no collective), ``world`` its size (a
    group of one still reduces, so that one GPU runs the multi-GPU code path)."""

    def __init__(self, local: QuantLinear, bias: Optional[torch.Tensor], ec: Optional[RowShardEC],
                 group_name: str, world: int, rank: int, name: str = "RowParallelLinear") -> None:
        super().__init__()
        if local.bias is not None:
            raise ValueError(f"{name}: the local shard must have no bias (it is added once, after the reduction)")
        self.local, self.ec = local, ec
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.group_name, self.world, self.rank, self.name = group_name, world, rank, name
        self.in_features, self.out_features = local.in_features * world, local.out_features

    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if not self.group_name:  # no process group: the single-process model
            return t
        import torch.distributed._functional_collectives as funcol

        return funcol.all_reduce(t, "sum", self.group_name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        loc = self.local
        if x.dim() == 0 or x.shape[-1] != loc.in_features:
            raise ValueError(f"{self.name}: rank {self.rank} expects its K slice [..., {loc.in_features}] "
                             f"(in_features {self.in_features} / world {self.world}), got {tuple(x.shape)}")
        ec = self.ec
        bias = self.bias if self.bias is None or self.bias.dtype == x.dtype else self.bias.to(x.dtype)
        if ec is None:
            y = self._all_reduce(loc(x))
            return y if bias is None else y + bias
        yh = torch.ops.spear.ec_linear_partial(x, loc.qweight, loc.scales, loc.zeros, loc.group_size, ec.A)
        yh = self._all_reduce(yh)
        return torch.ops.spear.ec_reduced_apply(yh, bias, ec.B, ec.W1, ec.b1, ec.W2, ec.b2, ec.alpha, ec.act, x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (local {self.local.in_features}), out_features={self.out_features}, "
                f"world={self.world}, rank={self.rank}, ec={'none' if self.ec is None else self.ec.rank}")
