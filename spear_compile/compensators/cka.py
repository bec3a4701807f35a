"""Linear CKA between two activation sets, streamed and Gram-free.

For centred activations X (n x p) and Y (n x q), linear CKA is

    CKA(X, Y) = ||Y^T X||_F^2 / (||X^T X||_F ||Y^T Y||_F)

which equals the HSIC form tr(K H L H) / sqrt(tr(K H K H) tr(L H L H)) with Gram
matrices K = X X^T, L = Y Y^T and H the centring matrix, but needs only p x p, q x q and
q x p moments instead of n x n Grams. ``StreamingCKA`` accumulates those moments (and
the column sums used for centring) in float64 over any number of batches, so the
activations of a whole calibration set never have to be held at once.
"""
from __future__ import annotations

import torch


class StreamingCKA:
    def __init__(self) -> None:
        self.n = 0
        self.sx = self.sy = self.xx = self.yy = self.yx = None

    def update(self, X: torch.Tensor, Y: torch.Tensor) -> "StreamingCKA":
        """Add a batch; rows are samples (leading dims are flattened)."""
        X = X.reshape(-1, X.shape[-1]).to(torch.float64)
        Y = Y.reshape(-1, Y.shape[-1]).to(torch.float64)
        if X.shape[0] != Y.shape[0]:
            raise ValueError(f"StreamingCKA: X has {X.shape[0]} rows, Y has {Y.shape[0]}")
        if self.n == 0:
            p, q = X.shape[1], Y.shape[1]
            z = lambda *s: torch.zeros(*s, dtype=torch.float64, device=X.device)  # noqa: E731
            self.sx, self.sy, self.xx, self.yy, self.yx = z(p), z(q), z(p, p), z(q, q), z(q, p)
        self.n += X.shape[0]
        self.sx += X.sum(0)
        self.sy += Y.sum(0)
        self.xx += X.t() @ X
        self.yy += Y.t() @ Y
        self.yx += Y.t() @ X
        return self

    def value(self) -> float:
        if self.n < 2:
            raise ValueError("StreamingCKA: need at least two samples")
        n, mx, my = self.n, self.sx / self.n, self.sy / self.n
        cxx = self.xx - n * torch.outer(mx, mx)
        cyy = self.yy - n * torch.outer(my, my)
        cyx = self.yx - n * torch.outer(my, mx)
        denom = torch.linalg.norm(cxx) * torch.linalg.norm(cyy)
        if denom == 0:
            return 1.0 if torch.linalg.norm(cyx) == 0 else 0.0
        return float((cyx * cyx).sum() / denom)


def linear_cka(X: torch.Tensor, Y: torch.Tensor) -> float:
    """Linear CKA of two activation matrices (rows = samples)."""
    return StreamingCKA().update(X, Y).value()


def linear_cka_gram(X: torch.Tensor, Y: torch.Tensor) -> float:
    """Reference: the n x n Gram-matrix (HSIC) form. O(n^2) memory; for tests."""
    X = X.reshape(-1, X.shape[-1]).to(torch.float64)
    Y = Y.reshape(-1, Y.shape[-1]).to(torch.float64)
    n = X.shape[0]
    H = torch.eye(n, dtype=torch.float64) - 1.0 / n
    K, L = H @ (X @ X.t()) @ H, H @ (Y @ Y.t()) @ H
    return float((K * L).sum() / torch.sqrt((K * K).sum() * (L * L).sum()))
