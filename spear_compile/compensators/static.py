"""Static (input-independent) error compensators at a given rank: W ≈ Q(W) + B A.

All three factor the weight error E = W - Q(W) (N x K) by a truncated SVD after a
right-scaling S, then undo the scaling on A:  E S ≈ U_r Σ_r V_r^T,  B = U_r Σ_r^½,
A = Σ_r^½ V_r^T S^{-1}.

* LoRC (ZeroQuant-V2): S = I, the best rank-r approximation of the weight error.
* LQER: S = diag(mean |x_k|), a heuristic activation scaling.
* QERA-exact: S = R_xx^{1/2} with R_xx = E[x x^T]; then ||(E - BA) S||_F^2 equals the
  expected output error E||(E - BA) x||^2, so the truncated SVD is its exact minimiser
  over rank-r corrections (Eckart-Young in the whitened space). Computed with the Cholesky
  factor of R_xx, which gives the same minimiser for less work (see ``_whitening``).

These are what SPEAR's ECs are initialised from and what they are measured against.
"""
from __future__ import annotations

from typing import Optional

import torch


def _factor(err: torch.Tensor, rank: int, S: Optional[torch.Tensor] = None,
            S_inv: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    E = err.to(torch.float64)
    S = None if S is None else S.to(E.device)  # statistics live on the CPU, weights maybe on a GPU
    S_inv = None if S_inv is None else S_inv.to(E.device)
    ES = E if S is None else E @ S
    U, sig, Vh = torch.linalg.svd(ES, full_matrices=False)
    root = sig[:rank].sqrt()
    B = U[:, :rank] * root
    A = root[:, None] * Vh[:rank]
    if S_inv is not None:
        A = A @ S_inv
    return A.to(torch.float32), B.to(torch.float32)


def lorc(err: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(A [r, K], B [N, r]): plain SVD of the weight error."""
    return _factor(err, rank)


def lqer(err: torch.Tensor, rank: int, mean_abs_x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) with the error scaled by mean |x| per input channel."""
    s = mean_abs_x.to(torch.float64).clamp_min(1e-8)
    return _factor(err, rank, torch.diag(s), torch.diag(1.0 / s))  # _factor moves them to err's device


def _whitening(rxx: torch.Tensor, eps: float = 1e-6, inverse: bool = True) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(L, L^-1) with L L^T = R + eps * mean(diag R) * I (Cholesky, fp64).

    Any factor S with S S^T = R gives the same minimiser: ||(E - BA) S||_F^2 = tr((E - BA) R
    (E - BA)^T) whatever S is, and the singular values of E S are those of E R^1/2 (S = R^1/2 Q
    for an orthogonal Q). Cholesky costs ~1/10 of the eigendecomposition R^1/2 needs, which
    matters when every linear of a model is whitened on a CPU.
    """
    R = rxx.to(torch.float64)
    R = 0.5 * (R + R.t())
    ridge = eps * R.diagonal().mean().clamp_min(1e-30)
    L = torch.linalg.cholesky(R + ridge * torch.eye(R.shape[0], dtype=R.dtype, device=R.device))
    if not inverse:
        return L, None
    L_inv = torch.linalg.solve_triangular(L, torch.eye(R.shape[0], dtype=R.dtype, device=R.device), upper=False)
    return L, L_inv


def qera_exact(err: torch.Tensor, rank: int, rxx: torch.Tensor, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) minimising E||(err - B A) x||^2 for input autocorrelation ``rxx`` = E[x x^T]."""
    S, S_inv = _whitening(rxx.to(err.device), eps)
    return _factor(err, rank, S, S_inv)


def output_error_spectrum(err: torch.Tensor, rxx: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Squared singular values of ``err R^1/2``, descending: their sum is the expected output
    error E||err x||^2, and the sum of all but the first r is what the best rank-r
    correction (QERA-exact) leaves. The currency rank allocation spends bytes on."""
    S, _ = _whitening(rxx.to(err.device), eps, inverse=False)
    M = err.to(torch.float64) @ S
    G = M.t() @ M if M.shape[1] <= M.shape[0] else M @ M.t()  # the smaller Gram: same nonzero spectrum
    return torch.linalg.eigvalsh(G).clamp_min(0).flip(0).float().cpu()
