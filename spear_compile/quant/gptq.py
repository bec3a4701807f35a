"""GPTQ: column-by-column 4-bit rounding with second-order error feedback.

For a layer with inputs X (n x K) the proxy loss is ||W X^T - Q X^T||^2 with Hessian
H = 2 X^T X / n. Columns are quantized in order; each column's rounding error is spread
over the not-yet-quantized columns through the inverse Hessian (its upper Cholesky factor),
in blocks of ``block_size`` columns with lazy updates of the rest (the GPTQ paper's
"lazy batch" trick). ``damp`` adds ``damp * mean(diag H)`` to the diagonal.

Groups: without act-order, a group's scale and zero point are computed from the
already-updated weights when the first column of the group is reached (as in GPTQ).
With ``act_order`` (columns in order of decreasing H_kk) the group parameters are fixed
up front from the original weights ("static groups"), so column k still uses group k // G
and the result is stored in the plain "spear" format with no permutation index.
"""
from __future__ import annotations

import torch

from ..config import QuantConfig
from .format import QuantFormatError, QuantizedWeight, pack_int4


def minmax_params(w: torch.Tensor, symmetric: bool, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) per row of ``w`` [N, G], as RTN computes them (scale rounded to out_dtype)."""
    w = w.float()
    if symmetric:
        s = (w.abs().amax(-1) / 7.0).clamp_min(1e-8)
        z = torch.full_like(s, 8.0)
    else:
        wmin, wmax = w.amin(-1).clamp_max(0.0), w.amax(-1).clamp_min(0.0)
        s = ((wmax - wmin) / 15.0).clamp_min(1e-8)
        z = torch.round(-wmin / s).clamp(0, 15)
    return s.to(out_dtype).float(), z


@torch.no_grad()
def quantize_gptq(weight: torch.Tensor, H: torch.Tensor, cfg: QuantConfig, damp: float = 0.01,
                  block_size: int = 128, act_order: bool = False, out_dtype=None,
                  where: str = "weight") -> QuantizedWeight:
    N, K = weight.shape
    G = cfg.group_size or K
    if K % G or K % 2:
        raise QuantFormatError(f"{where}: in_features K={K} must be even and divisible by group_size={G}")
    if H.shape != (K, K):
        raise QuantFormatError(f"{where}: Hessian has shape {tuple(H.shape)}, expected ({K}, {K})")
    out_dtype = out_dtype or weight.dtype
    # On the CPU whatever the weight's device: the column loop is thousands of tiny ops, which a
    # GPU runs no faster, and the Hessian statistics are kept on the CPU anyway.
    W = weight.detach().to("cpu", torch.float64).clone()
    H = H.detach().to("cpu", torch.float64).clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    ng = K // G
    scales = torch.zeros(N, ng, dtype=torch.float64)
    zeros = torch.zeros(N, ng, dtype=torch.float64)
    if act_order:
        for g in range(ng):
            s, z = minmax_params(W[:, g * G:(g + 1) * G], cfg.symmetric, out_dtype)
            scales[:, g], zeros[:, g] = s.double(), z.double()
        perm = torch.argsort(torch.diag(H), descending=True)
    else:
        perm = torch.arange(K)
    W, H = W[:, perm], H[perm][:, perm]
    H += damp * torch.diag(H).mean() * torch.eye(K, dtype=torch.float64)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    Q = torch.zeros(N, K, dtype=torch.uint8)
    for i1 in range(0, K, block_size):
        i2 = min(i1 + block_size, K)
        W1 = W[:, i1:i2].clone()
        Err = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = int(perm[i1 + i])
            g = col // G
            if not act_order and col % G == 0:  # first column of a group: fix its parameters now
                s, z = minmax_params(torch.cat([W1[:, i:], W[:, i2:]], 1)[:, :G], cfg.symmetric, out_dtype)
                scales[:, g], zeros[:, g] = s.double(), z.double()
            s, z = scales[:, g], zeros[:, g]
            w = W1[:, i]
            q = torch.clamp(torch.round(w / s) + z, 0, 15)
            Q[:, col] = q.to(torch.uint8)
            err = (w - (q - z) * s) / Hinv1[i, i]
            W1[:, i:] -= err[:, None] * Hinv1[i, i:][None, :]
            Err[:, i] = err
        W[:, i2:] -= Err @ Hinv[i1:i2, i2:]
    dev = weight.device
    return QuantizedWeight(pack_int4(Q).to(dev), scales.to(dev, out_dtype).contiguous(),
                           zeros.to(dev, out_dtype).contiguous(), G, K, N)
