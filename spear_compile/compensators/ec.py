"""The SPEAR error compensator (EC).

For a quantized layer ``y = Q(W) x`` (W: N x K) the EC adds

    h = A x                                   A: r x K
    g = sigmoid(W2 act(W1 h + b1) + b2)       gate MLP r -> d -> r
    y += alpha * B (g * h)                    B: N x r

Initialisation (``from_weight_error``): ``B A`` is the rank-r truncated SVD of the
weight error ``E = W - Q(W)``, optionally activation-scaled: with ``S = diag(s)``,
``s_k = sqrt(E[x_k^2])`` (QERA/LQER-style), we factor ``E S`` and undo the scaling on
``A``, which minimises the *output* error ``E[|(E - BA) x|^2]`` for a diagonal input
covariance instead of the weight error. The gate starts as a pass-through: ``W2 = 0``
makes ``g = sigmoid(b2)`` constant and ``alpha = 1 / sigmoid(b2)`` cancels it, so an
untrained EC equals the static SVD compensator exactly (up to float rounding) while
the gate still has a gradient through ``W2``.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from ..config import ECConfig
from ..ops.ec_ref import ec_delta_ref
from ..quant.ops import check_ec_shapes
from .static import qera_exact


class ErrorCompensator(nn.Module):
    def __init__(self, in_features: int, out_features: int, cfg: ECConfig = ECConfig(), device=None,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        r, d = cfg.rank, cfg.gate_hidden
        if r > min(in_features, out_features):
            raise ValueError(f"ErrorCompensator: rank {r} exceeds min(in_features={in_features}, out_features={out_features})")
        kw = dict(device=device, dtype=dtype)
        self.in_features, self.out_features, self.cfg = in_features, out_features, cfg
        self.A = nn.Parameter(torch.zeros(r, in_features, **kw))
        self.B = nn.Parameter(torch.zeros(out_features, r, **kw))
        self.W1 = nn.Parameter(torch.zeros(d, r, **kw))
        self.b1 = nn.Parameter(torch.zeros(d, **kw))
        self.W2 = nn.Parameter(torch.zeros(r, d, **kw))
        self.b2 = nn.Parameter(torch.full((r,), cfg.gate_init_bias, **kw))
        self.alpha = nn.Parameter(torch.tensor(1.0 / _sigmoid(cfg.gate_init_bias), **kw))
        with torch.no_grad():  # W1 small and random so the gate can learn input dependence.
            gen = torch.Generator().manual_seed(0)
            self.W1.copy_(torch.randn(d, r, generator=gen) / math.sqrt(r))

    @property
    def rank(self) -> int:
        return self.A.shape[0]

    @property
    def act(self) -> str:
        return self.cfg.act

    @classmethod
    def from_weight_error(cls, weight: torch.Tensor, dequantized: torch.Tensor, cfg: ECConfig = ECConfig(),
                          act_scale: Optional[torch.Tensor] = None,
                          rxx: Optional[torch.Tensor] = None) -> "ErrorCompensator":
        """SVD-of-error initialisation of ``B A``.

        ``rxx`` ([K, K] = E[x x^T]): QERA-exact whitening, the rank-r ``B A`` minimising the
        expected output error E||(E - BA) x||^2 (``compensators/static.qera_exact``).
        ``act_scale`` ([K] = sqrt(E[x^2])): its diagonal approximation. Neither: plain SVD.
        """
        if weight.shape != dequantized.shape:
            raise ValueError(f"from_weight_error: weight {tuple(weight.shape)} and dequantized "
                             f"{tuple(dequantized.shape)} differ in shape")
        N, K = weight.shape
        ec = cls(K, N, cfg, device=weight.device)
        err = weight.detach().to(torch.float32) - dequantized.detach().to(torch.float32)
        r = cfg.rank
        if rxx is not None:
            if rxx.shape != (K, K):
                raise ValueError(f"from_weight_error: rxx has shape {tuple(rxx.shape)}, expected ({K}, {K})")
            A, B = qera_exact(err, r, rxx)
        else:
            s = (torch.ones(K) if act_scale is None else act_scale.to(torch.float32).clamp_min(1e-6)).to(weight.device)
            if s.shape != (K,):
                raise ValueError(f"from_weight_error: act_scale has shape {tuple(s.shape)}, expected ({K},)")
            U, S, Vh = torch.linalg.svd(err * s, full_matrices=False)
            root = S[:r].sqrt()
            A, B = root[:, None] * Vh[:r] / s, U[:, :r] * root
        with torch.no_grad():
            ec.B.copy_(B)
            ec.A.copy_(A)
        return ec

    def check_fits(self, in_features: int, out_features: int, where: str) -> None:
        check_ec_shapes(in_features, out_features, self.A, self.B, self.W1, self.b1, self.W2, self.b2,
                        self.alpha, self.act, where)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The correction ``alpha * B (g * A x)`` alone."""
        return ec_delta_ref(x, self.A, self.B, self.W1, self.b1, self.W2, self.b2, self.alpha, self.act)

    def static_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The ungated static compensator ``B A x`` (what LoRC/LQER/QERA compute)."""
        return ((x.to(torch.float32) @ self.A.t()) @ self.B.t()).to(x.dtype)

    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, rank={self.rank}, gate_hidden={self.W1.shape[0]}, act={self.act}"


def _sigmoid(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v))
