"""CUDA implementation of ``spear::ec_linear_cat`` / ``spear::ec_linear_glu``: EC-compensated linears sharing
one input as one GEMV with one EC.

Reference: the ops' bodies in ``quant/ops.py`` (``ec_linear_ref`` per part, concatenated; ``glu_of`` for
the GLU). Made at decode by ``passes/fuse_shared_input.py`` (``fuse_shared_input_ec``) and
``passes/fuse_glu.py``, with the RMSNorm in front moved in by ``passes/fuse_rmsnorm.py``.

The parts' ECs become one block-diagonal EC (``concatenated_ecs``) for the fused-EC kernels (the
producer grid + PDL-launched CUDA-core GEMV of ``ec_decode_triton``). Where the tuned table runs the
concatenated shape on the TMA kernel, that kernel adds each row's EC in its epilogue instead
(``w4a16_gemv_tma_ec``), reading only the row's own block of the block-diagonal B (``ec_rows``);
``ec_epilogue_ok`` says where (also asked by the passes). The plain concatenations (weights, scales,
TMA tiles, the GLU interleave) are ``w4a16_cat``'s.
"""
from __future__ import annotations

import torch

from .layout_cache import derived_cached
from .w4a16_gemv_tma import glu_interleave

_CAT_EC: dict = {}  # block-diagonal concatenations of ECs sharing an input
_EC_ROWS: dict = {}  # per-row EC columns of concatenated ECs (the TMA kernel's EC epilogue)
_EC_GLU_ROWS: dict = {}  # per GLU half-block: those rows interleaved like the gate / up weights


def _present(vals) -> list:
    return [v for v in vals if v is not None]


def concatenated_ecs(As, Bs, W1s, b1s, W2s, b2s, alphas, qweights) -> tuple:
    """One EC equal to several ECs that share an input, for one GEMV over their concatenated weights:
    ``(A, B, W1, b1, W2, b2, alpha)`` with A stacked ([sum R, K]), the gate block-diagonal (W1 [sum D,
    sum R], W2 [sum R, sum D], biases stacked: each part's gate sees only its own h), B block-diagonal
    ([sum N, sum R]: part i's rows read only part i's g * h) with each part's alpha folded into its
    rows (in fp32, then B's dtype), and alpha = 1. A part without an EC (its entries None: a plain linear
    fused beside EC ones) adds no A rows and no gate, and zero rows to B (as many as its packed weight in
    ``qweights``, every part's, has). Through ``ec_linear_ref`` or the fused
    EC kernels it computes what the parts compute separately (up to the rounding of alpha * B). Cached while
    every part lives and is unchanged, like ``concatenated``.

    Used by ``spear::ec_linear_cat`` (``fuse_shared_input`` with ``CompileConfig.fuse_shared_input_ec``:
    q/k/v or gate/up with ECs as one GEMV + one EC; on by default since it measured 2.731 -> 2.691 ms
    per E2E step, docs/kernels.md)."""
    def make() -> tuple:
        A = torch.cat(_present(As))
        R = [a.shape[0] if a is not None else 0 for a in As]
        N = [q.shape[0] for q in qweights]
        B0 = _present(Bs)[0]
        B = B0.new_zeros(sum(N), sum(R))
        r0 = n0 = 0
        for b, al, r, n in zip(Bs, alphas, R, N):
            if b is not None:
                B[n0:n0 + n, r0:r0 + r] = (al.float() * b.float()).to(B.dtype)
            r0, n0 = r0 + r, n0 + n
        W1 = torch.block_diag(*_present(W1s))
        W2 = torch.block_diag(*_present(W2s))
        al0 = _present(alphas)[0]
        alpha = torch.ones((), dtype=al0.dtype, device=al0.device)
        return A, B, W1, torch.cat(_present(b1s)), W2, torch.cat(_present(b2s)), alpha

    return derived_cached(_CAT_EC, [*As, *Bs, *W1s, *b1s, *W2s, *b2s, *alphas, *_plain(qweights, As)], make)


def _plain(qweights, As) -> list:
    """The packed weights of the parts without an EC: in the cache keys, which their row counts shape."""
    return [q for q, a in zip(qweights, As) if a is None]


def ec_rows(Bs, alphas, qweights) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [sum N, RC], offsets [sum N] int32) of ECs sharing an input, for the TMA kernel's EC epilogue
    (``w4a16_gemv_tma_ec._ec_rows``): row n of part i holds ``alpha_i * B_i[n]`` (in fp32, then B's dtype,
    as ``concatenated_ecs`` rounds it) padded to RC = max rank with zeros, and its offset is part i's
    first column of the stacked g * h. ``sum_j rows[n, j] gh[off[n] + j]`` is then row n of the
    block-diagonal ``B gh`` of ``concatenated_ecs``, reading RC instead of sum R columns per row (a
    third of the bytes for q/k/v). A part without an EC has zero rows (its N from ``qweights``) and the
    offset sum R, past every column of g * h, so no g * h is read for it (a NaN there cannot reach a plain
    row); the kernel reads RC zeros per row of it (Llama-2-7B's q and k beside a v with a rank-64 EC: 1 MB, 4 % of
    the q/k/v GEMV's bytes). Cached like ``concatenated``."""
    def make() -> tuple:
        present = _present(Bs)
        rc = max(b.shape[1] for b in present)
        r_total = sum(b.shape[1] for b in present)
        rows, offs, r0 = [], [], 0
        for b, al, q in zip(Bs, alphas, qweights):
            n = q.shape[0]
            if b is None:  # offset past every rank: the epilogue's masked g * h loads read nothing for it
                rows.append(present[0].new_zeros(n, rc))
                offs.append(torch.full((n,), r_total, dtype=torch.int32, device=present[0].device))
                continue
            r = b.shape[1]
            rows.append(torch.nn.functional.pad((al.float() * b.float()).to(b.dtype), (0, rc - r)))
            offs.append(torch.full((n,), r0, dtype=torch.int32, device=b.device))
            r0 += r
        return torch.cat(rows).contiguous(), torch.cat(offs)

    return derived_cached(_EC_ROWS, [*Bs, *alphas, *_plain(qweights, Bs)], make)


def ec_rows_emulated(gh: torch.Tensor, rows: torch.Tensor, offs: torch.Tensor, R: int) -> torch.Tensor:
    """What the TMA kernel's EC epilogue adds per row, in PyTorch (fp32): the CPU check of ``ec_rows``."""
    cols = offs.long()[:, None] + torch.arange(rows.shape[1], device=rows.device)[None, :]
    g = torch.where(cols < R, gh.float()[cols.clamp_max(R - 1)], torch.zeros((), device=gh.device))
    return (rows.float() * g).sum(1)


def ec_glu_rows(Bs, alphas, half: int, qweights) -> tuple[torch.Tensor, torch.Tensor]:
    """``ec_rows`` of a gate / up pair, rows interleaved in blocks of ``half`` (``glu_interleave``) like
    the weights of ``concatenated_glu_tma``, so each GLU CTA's EC rows are its own. Cached."""
    def make() -> tuple:
        rows, offs = ec_rows(Bs, alphas, qweights)
        F = qweights[0].shape[0]
        return glu_interleave(rows, F, half).contiguous(), glu_interleave(offs, F, half).contiguous()

    return derived_cached(_EC_GLU_ROWS.setdefault(half, {}), [*Bs, *alphas, *_plain(qweights, Bs)], make)
