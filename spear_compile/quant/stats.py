"""Input statistics of every QuantLinear, collected with forward hooks.

Per module (inputs flattened to rows x K, accumulated in float64 on the activations' device, moved to
the CPU once at the end: a copy and a CPU add per batch and module cost 50 s of a 135 s SPEAR fit on
an H200, 96 x 1024 tokens):
  mean_sq  E[x_k^2]        -> SPEAR / QERA-approx diagonal scaling sqrt(E[x^2])
  mean_abs E[|x_k|]        -> LQER scaling
  rxx      E[x x^T] (K x K) -> QERA-exact whitening (only when ``full=True``; K^2 doubles)
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Optional

import torch
from torch import nn

from .linear import QuantLinear


@dataclasses.dataclass
class InputStats:
    n: int = 0
    sum_sq: Optional[torch.Tensor] = None
    sum_abs: Optional[torch.Tensor] = None
    xtx: Optional[torch.Tensor] = None

    def update(self, x: torch.Tensor, full: bool) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).to(torch.float64)
        if self.sum_sq is None:
            self.sum_sq = x.new_zeros(x.shape[1])
            self.sum_abs = x.new_zeros(x.shape[1])
            if full:
                self.xtx = x.new_zeros(x.shape[1], x.shape[1])
        self.n += x.shape[0]
        self.sum_sq += (x * x).sum(0)
        self.sum_abs += x.abs().sum(0)
        if full:
            self.xtx.addmm_(x.t(), x)

    def to_cpu(self) -> "InputStats":
        """Every tensor field on the CPU (after collection; consumers expect CPU statistics)."""
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                setattr(self, f.name, v.cpu())
        return self

    @property
    def mean_sq(self) -> torch.Tensor:
        return (self.sum_sq / max(self.n, 1)).float()

    @property
    def mean_abs(self) -> torch.Tensor:
        return (self.sum_abs / max(self.n, 1)).float()

    @property
    def rxx(self) -> torch.Tensor:
        if self.xtx is None:
            raise ValueError("InputStats: collected without full=True, no E[x x^T]")
        return self.xtx / max(self.n, 1)


@torch.no_grad()
def collect_input_stats(model: nn.Module, batches: Iterable[torch.Tensor], names: Optional[list[str]] = None,
                        full: bool = False, module_type: type = QuantLinear,
                        stats_type: type = InputStats) -> dict[str, InputStats]:
    """Run ``batches`` through ``model`` and return input statistics of the chosen linears
    (``stats_type``: an ``InputStats`` subclass that accumulates more, e.g. SERQ's max |x|)."""
    mods = {n: m for n, m in model.named_modules() if isinstance(m, module_type) and (names is None or n in names)}
    stats = {n: stats_type() for n in mods}
    handles = [m.register_forward_hook(lambda mod, args, out, n=n: stats[n].update(args[0], full))
               for n, m in mods.items()]
    try:
        for b in batches:
            model(b)
    finally:
        for h in handles:
            h.remove()
    return {n: st.to_cpu() for n, st in stats.items()}
