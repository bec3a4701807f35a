"""Triton kernels of the EC prefill path (large M), overlapped with the W4 GEMM.

Reference: ``ops/ec_ref.py:ec_delta_ref``.

``ec_shrink_gate``: ``hg = g * h`` with ``h = x A^T`` ([M, r]) and the gate MLP on the
r-vector. It reads x once (M*K*2 bytes) and does M*K*r MACs, on a side stream while the
W4 GEMM (M*N*K MACs) runs. ``h`` comes from cuBLAS (an [M, K] x [K, r] GEMM spread over
every SM); ``_ec_gate_kernel`` then gates BLOCK_M rows per program. (The first version
did the K loop in one Triton program per 64 rows: 16 programs at M = 1024, ~70 us at
8192^2, which showed once the W4 GEMM got faster: docs/kernels.md.)
``_ec_expand_add_kernel``: ``y += alpha * hg B^T`` in place, after the join.
"""
from __future__ import annotations

import torch

from ._triton import ACT_CODES, HAS_TRITON, INTERPRET, next_pow2

if HAS_TRITON:
    import triton
    import triton.language as tl

    from ._triton import gate_act, gdc_launch_dependents

    @triton.jit
    def _ec_gate_kernel(
        H, W1, B1, W2, B2, ALPHA, HG, M, R, D, stride_hm,
        BLOCK_M: tl.constexpr, R_P: tl.constexpr, D_P: tl.constexpr, ACT: tl.constexpr,
        HAS_ALPHA: tl.constexpr, PDL_TRIGGER: tl.constexpr = False,
    ):
        """HG[rows] = (alpha *) g * h for BLOCK_M rows of H ([M, R], any float dtype), computed in
        fp32 and stored in HG's dtype. PDL_TRIGGER: first let the next kernel (launched with PDL, waiting
        before it reads HG) start."""
        if PDL_TRIGGER:
            gdc_launch_dependents()
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < M
        offs_r = tl.arange(0, R_P)
        h = tl.load(H + offs_m[:, None] * stride_hm + offs_r[None, :], mask=mask_m[:, None] & (offs_r < R)[None, :],
                    other=0.0).to(tl.float32)
        ec_gate_store(h, offs_m, mask_m, W1, B1, W2, B2, ALPHA, HG, R, D, R_P, D_P, ACT, HAS_ALPHA)

    @triton.jit
    def ec_gate_store(h, offs_m, mask_m, W1, B1, W2, B2, ALPHA, HG, R, D,
                      R_P: tl.constexpr, D_P: tl.constexpr, ACT: tl.constexpr, HAS_ALPHA: tl.constexpr):
        """HG[offs_m] = (alpha *) g * h for rows ``h`` [BLOCK_M, R_P] (fp32, columns >= R zero): the gate MLP
        in fp32, stored in HG's dtype with row stride R_P (shared by the gate kernels)."""
        offs_r = tl.arange(0, R_P)
        mask_r = offs_r < R
        offs_d = tl.arange(0, D_P)
        mask_d = offs_d < D
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
EXPAND_CONFIG = (16, 32, 4) if INTERPRET else (64, 128, 4)  # BLOCK_M, BLOCK_N, num_warps


def ec_shrink_gate(x2: torch.Tensor, A, W1, b1, W2, b2, act: str = "silu", alpha=None,
                   dtype: torch.dtype = torch.float32, pdl_trigger: bool = False) -> torch.Tensor:
    """``g * h`` (times ``alpha`` when given) as [M, R_P] in ``dtype`` (columns >= r are zeros).
    ``h`` is rounded to x's dtype by cuBLAS: a relative 2^-9 of the correction, far below the
    output's own rounding. ``pdl_trigger``: the gate kernel lets a PDL-launched successor start at once
    (only where ``ec_decode_triton.pdl_launch_ok``); nothing may be launched between it and that successor."""
    M, K = x2.shape
    R, D = A.shape[0], W1.shape[0]
    r_p, d_p = max(16, next_pow2(R)), max(16, next_pow2(D))  # tl.dot needs dims >= 16
    h = torch.mm(x2, A.t() if A.dtype == x2.dtype else A.to(x2.dtype).t())  # [M, R] in x's dtype (cuBLAS)
    hg = torch.empty(M, r_p, dtype=dtype, device=x2.device)
    bm, warps = GATE_CONFIG
    _ec_gate_kernel[(triton.cdiv(M, bm),)](
        h, W1, b1, W2, b2, alpha if alpha is not None else b2, hg, M, R, D, h.stride(0),
        BLOCK_M=bm, R_P=r_p, D_P=d_p, ACT=ACT_CODES[act], HAS_ALPHA=alpha is not None, PDL_TRIGGER=pdl_trigger,
        num_warps=warps,
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
