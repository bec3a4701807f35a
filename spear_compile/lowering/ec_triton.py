"""Triton kernels of the EC prefill path (large M), overlapped with the W4 GEMM.

Reference: ``lowering/ec_linear.py:ec_delta_ref``.

``ec_shrink_gate``: ``hg = g * h`` with ``h = x A^T`` ([M, r]) and the gate MLP on the
r-vector. It reads x once (M*K*2 bytes) and does M*K*r MACs, on a side stream while the
W4 GEMM (M*N*K MACs) runs; ``_ec_gate_kernel`` then gates BLOCK_M rows per program.
``h`` comes from one of two places (``shrink``):

* "splitk": ``_ec_shrink_splitk_kernel``, a grid of (row tiles x K slices) programs, each
  writing its fp32 partial ``x[tile, slice] A[:, slice]^T``; the gate kernel sums the
  partials in slice order (deterministic, no atomics, no memset). Why: h is a skinny
  [M, K] x [K, r] product, and cuBLAS ran it on a few output tiles with long K loops:
  the shrink + gate took 9.8 us at M = 256, K = 4096 for 2 MB of x (H200,
  ``benchmarks/results/raw/session10_ec_profile/``), longer than the 4096^2 GEMM it hides behind.
* "cublas": ``torch.mm`` (rounded to x's dtype). (The first version did the K loop in one
  Triton program per 64 rows: 16 programs at M = 1024, ~70 us at 8192^2: session 4.)
``_ec_expand_add_kernel``: ``y += alpha * hg B^T`` in place, after the join.
"""
from __future__ import annotations

import torch

from ._triton import ACT_CODES, HAS_TRITON, INTERPRET, next_pow2

if HAS_TRITON:
    import triton
    import triton.language as tl

    from ._triton import gate_act

    @triton.jit
    def _ec_shrink_splitk_kernel(
        X, A, HP, M, K, R, stride_xm, K_PER,
        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, R_P: tl.constexpr, IEEE: tl.constexpr,
    ):
        """HP[s, rows, :] = x[rows, s*K_PER:(s+1)*K_PER] A[:, same]^T in fp32 (columns >= R zero);
        IEEE: the products in full fp32 (fp32 x, not TF32; and under Triton's interpreter, whose
        bf16 dot is not a float dot)."""
        pid_m = tl.program_id(0)
        s = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < M
        offs_r = tl.arange(0, R_P)
        mask_r = offs_r < R
        acc = tl.zeros((BLOCK_M, R_P), dtype=tl.float32)
        for k0 in range(s * K_PER, tl.minimum(s * K_PER + K_PER, K), BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            x = tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                        other=0.0)
            a = tl.load(A + offs_r[:, None] * K + offs_k[None, :], mask=mask_r[:, None] & mask_k[None, :], other=0.0)
            if IEEE:
                acc += tl.dot(x.to(tl.float32), tl.trans(a.to(tl.float32)), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(a.to(x.dtype)))
        tl.store(HP + (s * M + offs_m[:, None]) * R_P + offs_r[None, :], acc, mask=mask_m[:, None])

    @triton.jit
    def _ec_gate_kernel(
        H, W1, B1, W2, B2, ALPHA, HG, M, R, D, stride_hm, SPLITS, stride_hs,
        BLOCK_M: tl.constexpr, R_P: tl.constexpr, D_P: tl.constexpr, ACT: tl.constexpr,
        HAS_ALPHA: tl.constexpr,
    ):
        """HG[rows] = (alpha *) g * h for BLOCK_M rows of h = sum over s < SPLITS of
        H[s * stride_hs:] ([M, R] each, any float dtype, summed in order), computed in fp32 and
        stored in HG's dtype."""
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < M
        offs_r = tl.arange(0, R_P)
        mask_r = offs_r < R
        offs_d = tl.arange(0, D_P)
        mask_d = offs_d < D
        h = tl.zeros((BLOCK_M, R_P), dtype=tl.float32)
        for s in range(SPLITS):
            h += tl.load(H + s * stride_hs + offs_m[:, None] * stride_hm + offs_r[None, :],
                         mask=mask_m[:, None] & mask_r[None, :], other=0.0).to(tl.float32)
        w1 = tl.load(W1 + offs_d[:, None] * R + offs_r[None, :], mask=mask_d[:, None] & mask_r[None, :], other=0.0)
        z = tl.dot(h, tl.trans(w1.to(tl.float32)))
        z = gate_act(z + tl.load(B1 + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :], ACT)
        w2 = tl.load(W2 + offs_r[:, None] * D + offs_d[None, :], mask=mask_r[:, None] & mask_d[None, :], other=0.0)
        g = tl.dot(z, tl.trans(w2.to(tl.float32)))
        g = tl.sigmoid(g + tl.load(B2 + offs_r, mask=mask_r, other=0.0).to(tl.float32)[None, :])
        hg = g * h
        if HAS_ALPHA:
            hg = hg * tl.load(ALPHA).to(tl.float32)
        # all R_P columns (those >= R hold g * 0 = 0): a BLAS reading HG[:, :R] with its row stride
        # R_P may load the padding in vector blocks, and uninitialised memory there can be NaN
        tl.store(HG + offs_m[:, None] * R_P + offs_r[None, :], hg.to(HG.dtype.element_ty), mask=mask_m[:, None])

    @triton.jit
    def _ec_expand_add_kernel(
        HG, B, ALPHA, Y, M, N, R, stride_ym,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, R_P: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_r = tl.arange(0, R_P)
        mask_m = offs_m < M
        mask_n = offs_n < N
        mask_r = offs_r < R
        hg = tl.load(HG + offs_m[:, None] * R_P + offs_r[None, :], mask=mask_m[:, None] & mask_r[None, :], other=0.0)
        b = tl.load(B + offs_n[:, None] * R + offs_r[None, :], mask=mask_n[:, None] & mask_r[None, :], other=0.0)
        delta = tl.dot(hg, tl.trans(b.to(tl.float32))) * tl.load(ALPHA).to(tl.float32)
        ptrs = Y + offs_m[:, None] * stride_ym + offs_n[None, :]
        mask = mask_m[:, None] & mask_n[None, :]
        y = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(ptrs, (y + delta).to(Y.dtype.element_ty), mask=mask)


GATE_CONFIG = (16, 4) if INTERPRET else (64, 4)  # BLOCK_M, num_warps
SHRINK_CONFIG = (16, 32, 4) if INTERPRET else (64, 64, 4)  # BLOCK_M, BLOCK_K, num_warps
SHRINK_PROGRAMS = 528  # aim: four programs per SM of an H200 (132 SMs)
SHRINKS = ("splitk", "cublas")
SHRINK = "splitk"  # ec_shrink_gate's default


def shrink_splits(M: int, K: int, r_p: int, block_m: int, block_k: int) -> tuple[int, int]:
    """(splits, K columns per split) for the split-K shrink: enough programs to fill the GPU
    (``SHRINK_PROGRAMS``), but the fp32 partials (splits * M * r_p * 4 bytes, written and read
    once more) at most half of x's bytes (M * K * 2), so the split never costs more traffic than
    it hides; slices are whole BLOCK_K tiles."""
    tiles_k = -(-K // block_k)
    want = -(-SHRINK_PROGRAMS // -(-M // block_m))
    splits = max(1, min(want, tiles_k, K // (4 * r_p)))
    k_per = -(-tiles_k // splits) * block_k
    return -(-K // k_per), k_per
EXPAND_CONFIG = (16, 32, 4) if INTERPRET else (64, 128, 4)  # BLOCK_M, BLOCK_N, num_warps


def ec_shrink_gate(x2: torch.Tensor, A, W1, b1, W2, b2, act: str = "silu", alpha=None,
                   dtype: torch.dtype = torch.float32, shrink: str | None = None) -> torch.Tensor:
    """``g * h`` (times ``alpha`` when given) as [M, R_P] in ``dtype`` (columns >= r are zeros).
    ``shrink`` (default ``SHRINK``): "splitk" accumulates h in fp32; "cublas" rounds h to x's
    dtype (a relative 2^-9 of the correction, far below the output's own rounding)."""
    shrink = shrink or SHRINK
    if shrink not in SHRINKS:
        raise ValueError(f"ec_shrink_gate: shrink={shrink!r}; expected one of {SHRINKS}")
    M, K = x2.shape
    R, D = A.shape[0], W1.shape[0]
    r_p, d_p = max(16, next_pow2(R)), max(16, next_pow2(D))  # tl.dot needs dims >= 16
    if shrink == "cublas":
        h = torch.mm(x2, A.t() if A.dtype == x2.dtype else A.to(x2.dtype).t())  # [M, R] in x's dtype
        splits, stride_hs = 1, 0
    else:
        if x2.stride(1) != 1 or not A.is_contiguous():
            raise ValueError(f"ec_shrink_gate: x needs unit column stride and A must be contiguous "
                             f"(x strides {tuple(x2.stride())}, A strides {tuple(A.stride())})")
        bm, bk, warps = SHRINK_CONFIG
        splits, k_per = shrink_splits(M, K, r_p, bm, bk)
        h = torch.empty(splits, M, r_p, dtype=torch.float32, device=x2.device)
        _ec_shrink_splitk_kernel[(triton.cdiv(M, bm), splits)](
            x2, A, h, M, K, R, x2.stride(0), k_per, BLOCK_M=bm, BLOCK_K=bk, R_P=r_p,
            IEEE=x2.dtype == torch.float32 or INTERPRET, num_warps=warps)
        stride_hs = M * r_p
    hg = torch.empty(M, r_p, dtype=dtype, device=x2.device)
    bm, warps = GATE_CONFIG
    _ec_gate_kernel[(triton.cdiv(M, bm),)](
        h, W1, b1, W2, b2, alpha if alpha is not None else b2, hg, M, R, D, h.stride(-2), splits, stride_hs,
        BLOCK_M=bm, R_P=r_p, D_P=d_p, ACT=ACT_CODES[act], HAS_ALPHA=alpha is not None, num_warps=warps,
    )
    return hg


def ec_expand_add_(y: torch.Tensor, hg: torch.Tensor, B, alpha) -> torch.Tensor:
    """``y += alpha * hg[:, :r] B^T`` in place; returns y."""
    M, N = y.shape
    R = B.shape[1]
    bm, bn, warps = EXPAND_CONFIG
    _ec_expand_add_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn))](
        hg, B, alpha, y, M, N, R, y.stride(0), BLOCK_M=bm, BLOCK_N=bn, R_P=hg.shape[1], num_warps=warps,
    )
    return y
