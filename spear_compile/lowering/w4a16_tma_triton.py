"""W4A16 kernels that stream their operands with TMA descriptors (Hopper and newer).

Reference: ``lowering/w4a16.py:w4a16_linear_ref``. Both kernels read the weight in the
GEMV word layout (``w4a16_triton.gemv_words``: int32 words, nibble i of word 4c + j is
column 32c + 4i + j), so a model keeps one extra copy of each weight, not one per kernel.

``_w4a16_gemm_t_kernel`` - large M (prefill) on tensor cores, computed transposed:
``Y^T[N-tile, M-tile] = W[N-tile, :] @ X[M-tile, :]^T``. Why transposed: Hopper's wgmma
takes its A operand from registers but B only from shared memory, and the dequantized
weight is made in registers, so it must be A. X arrives through a TMA descriptor (zero
fill past M and K, no masks) and the pipeliner keeps ``num_stages`` tiles of X and of the
weight words in flight. A K tile of ``BLOCK_K = 32 C`` columns is C chunks of 4 words per
row; ``(words[BN, C, 1, 4] >> 4 i) & 0xF`` laid out as [BN, C, 8, 4] and reshaped to
[BN, BLOCK_K] is already in column order (32c + 4i + j), so one contiguous X tile and one
``tl.dot`` per K tile suffice. Dequantization follows the reference's order
``(q - z) * s`` (fp32, rounded once to the activation dtype).

``_w4a16_gemv1_tma_kernel`` - M = 1 (decode) without an EC: the M = 1 GEMV of
``w4a16_triton`` with its weight tiles loaded by TMA into a ``STAGES``-deep shared-memory
ring, so the bytes in flight per SM no longer depend on registers (the register-only
kernel keeps one tile per program in flight: see benchmarks/NOTES.md, session 3).
"""
from __future__ import annotations

from typing import Optional

import torch

from ._triton import HAS_TRITON, INTERPRET

try:  # host-side descriptors: Triton >= 3.3
    from triton.tools.tensor_descriptor import TensorDescriptor

    HAS_TMA = HAS_TRITON
except ImportError:  # pragma: no cover - older Triton
    TensorDescriptor = None
    HAS_TMA = False

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .w4a16_triton import _gemv1_scales, _gemv1_tile

    @triton.jit
    def _w4a16_gemm_t_kernel(
        XD, QW, S, Z, BIAS, Y, M, N, K, NG, stride_ym,
        G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_N: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr,
    ):
        pid = tl.program_id(0)
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        group = pid // (GROUP_N * num_m)  # grouped order: programs sharing an X tile run together
        first_n = group * GROUP_N
        size_n = tl.minimum(num_n - first_n, GROUP_N)
        pid_n = first_n + (pid % size_n)
        pid_m = (pid % (GROUP_N * num_m)) // size_n
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_n = offs_n < N
        BW: tl.constexpr = BLOCK_K // 8  # int32 words per row per K tile
        C: tl.constexpr = BLOCK_K // 32  # 32-column chunks per K tile
        offs_w = tl.arange(0, BW)
        offs_c = tl.arange(0, C)
        shifts = (4 * tl.arange(0, 8))[None, None, :, None]
        KW = K // 8
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ww = k0 // 8 + offs_w
            wd = tl.load(QW + offs_n[:, None] * KW + ww[None, :], mask=mask_n[:, None] & (ww < KW)[None, :], other=0)
            x = XD.load([pid_m * BLOCK_M, k0])
            q = ((tl.reshape(wd, [BLOCK_N, C, 1, 4]) >> shifts) & 0xF).to(tl.float32)  # [BN, C, 8, 4]
            cc = k0 // 32 + offs_c
            gi = cc * 32 // G
            mg = mask_n[:, None] & (cc < K // 32)[None, :]
            s = tl.load(S + offs_n[:, None] * NG + gi[None, :], mask=mg, other=0.0).to(tl.float32)
            if HAS_Z:
                z = tl.load(Z + offs_n[:, None] * NG + gi[None, :], mask=mg, other=0.0).to(tl.float32)
                q = q - z[:, :, None, None]
            w = tl.reshape(q * s[:, :, None, None], [BLOCK_N, BLOCK_K])
            if UPCAST:  # Triton's interpreter mishandles bf16 arithmetic: CPU tests round, then use fp32
                acc = tl.dot(w.to(Y.dtype.element_ty).to(tl.float32), tl.trans(x.to(tl.float32)), acc)
            else:
                acc = tl.dot(w.to(Y.dtype.element_ty), tl.trans(x), acc)
        if HAS_BIAS:
            acc += tl.load(BIAS + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
        tl.store(Y + offs_m[None, :] * stride_ym + offs_n[:, None], acc.to(Y.dtype.element_ty),
                 mask=(offs_m < M)[None, :] & mask_n[:, None])

    @triton.jit
    def _w4a16_gemv1_tma_kernel(
        X, WD, S, Z, BIAS, Y, N, KW, NG, MAG7, MAG11, MAG15, MAG19, MAG23,
        G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, STAGES: tl.constexpr,
        EXACT: tl.constexpr, PER_CHANNEL: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr,
    ):
        pid = tl.program_id(0)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        BC: tl.constexpr = BLOCK_W // 4
        acc = tl.zeros([BLOCK_N, BC], dtype=tl.float32)
        sxa = tl.zeros([BC], dtype=tl.float32)  # per-channel zero point: sum_k x
        for w0 in tl.range(0, KW, BLOCK_W, num_stages=STAGES):
            w = WD.load([pid * BLOCK_N, w0])  # zero past N and KW
            sc, z = _gemv1_scales(S, Z, offs_n, mask_n, w0, KW, NG, G, BLOCK_W, PER_CHANNEL, HAS_Z)
            d, sx = _gemv1_tile(w, sc, z, X, w0, KW, MAG7, MAG11, MAG15, MAG19, MAG23, BLOCK_W, EXACT, PER_CHANNEL, HAS_Z)
            acc += d
            if PER_CHANNEL and HAS_Z:
                sxa += sx
        out = tl.sum(acc, axis=1)
        if PER_CHANNEL:
            if HAS_Z:
                out -= tl.load(Z + offs_n, mask=mask_n, other=0.0).to(tl.float32) * tl.sum(sxa, axis=0)
            out *= tl.load(S + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        if HAS_BIAS:
            out += tl.load(BIAS + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        tl.store(Y + offs_n, out.to(Y.dtype.element_ty), mask=mask_n)


# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages); BLOCK_K >= 128 keeps each wgmma's K >= 16
GEMM_T_CONFIGS = [(16, 32, 32, 4, 1)] if INTERPRET else [
    (128, 128, 64, 8, 4), (128, 128, 128, 8, 3), (256, 128, 64, 8, 3), (64, 128, 128, 4, 4), (128, 256, 64, 8, 3),
    (32, 128, 128, 4, 4), (16, 128, 128, 4, 4), (64, 64, 128, 4, 4), (256, 128, 128, 8, 3),
]
# (BLOCK_N, BLOCK_W, num_warps, stages); a TMA box holds at most 256 words per row
GEMV1_TMA_CONFIGS = [(16, 8, 4, 2)] if INTERPRET else [
    (8, 256, 4, 4), (16, 128, 4, 4), (8, 128, 2, 6), (16, 256, 4, 3), (32, 128, 4, 4), (8, 128, 4, 6),
    (16, 64, 4, 8), (8, 64, 2, 8),
]


def tma_ok(x2: torch.Tensor, K: int, G: int) -> bool:
    """Whether these kernels take the problem: Triton with descriptors, K a multiple of 32
    (the word layout), 32-column chunks inside one group, fp16/bf16 X with 16-byte aligned rows
    (fp32 would run the tensor cores in tf32)."""
    return (HAS_TMA and x2.dtype in (torch.float16, torch.bfloat16) and K % 32 == 0 and (G >= K or G % 32 == 0) and x2.stride(-1) == 1
            and (x2.stride(0) * x2.element_size()) % 16 == 0 and x2.data_ptr() % 16 == 0)


def w4a16_gemm_t(x2, qweight, scales, zeros, G: int, bias, config: Optional[tuple] = None,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Y[M, N] through the transposed tensor-core GEMM. config = (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)."""
    from .w4a16_triton import gemv_words

    M, K = x2.shape
    N = qweight.shape[0]
    if not tma_ok(x2, K, G):
        raise ValueError(f"w4a16_gemm_t: unsupported problem (K={K}, G={G}, x strides {tuple(x2.stride())})")
    bm, bn, bk, warps, stages = config or GEMM_T_CONFIGS[0]
    y = out if out is not None else torch.empty(M, N, dtype=x2.dtype, device=x2.device)
    xd = TensorDescriptor.from_tensor(x2, [bm, bk])
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    _w4a16_gemm_t_kernel[grid](
        xd, gemv_words(qweight), scales, zeros if zeros is not None else scales, bias if bias is not None else scales,
        y, M, N, K, K // G, y.stride(0),
        G=G, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_N=8, HAS_Z=zeros is not None, HAS_BIAS=bias is not None,
        UPCAST=INTERPRET and x2.dtype == torch.bfloat16, num_warps=warps, num_stages=stages,
    )
    return y


def w4a16_gemv1_tma(x2, qweight, scales, zeros, G: int, bias, config: Optional[tuple] = None,
                    out: Optional[torch.Tensor] = None, exact: Optional[bool] = None) -> torch.Tensor:
    """Y[1, N] through the TMA-fed M = 1 GEMV. config = (BLOCK_N, BLOCK_W, warps, stages)."""
    from .w4a16_triton import _MAGICS, GEMV1_EXACT, gemv_words

    M, K = x2.shape
    N = qweight.shape[0]
    if M != 1 or not tma_ok(x2, K, G):
        raise ValueError(f"w4a16_gemv1_tma: unsupported problem (M={M}, K={K}, G={G})")
    bn, bw, warps, stages = config or GEMV1_TMA_CONFIGS[0]
    if exact is None:
        exact = GEMV1_EXACT or x2.dtype != torch.bfloat16
    y = out if out is not None else torch.empty(M, N, dtype=x2.dtype, device=x2.device)
    wd = TensorDescriptor.from_tensor(gemv_words(qweight), [bn, bw])
    _w4a16_gemv1_tma_kernel[(triton.cdiv(N, bn),)](
        x2, wd, scales, zeros if zeros is not None else scales, bias if bias is not None else scales, y,
        N, K // 8, K // G, *_MAGICS,
        G=G, BLOCK_N=bn, BLOCK_W=bw, STAGES=stages, EXACT=exact, PER_CHANNEL=G >= K,
        HAS_Z=zeros is not None, HAS_BIAS=bias is not None, num_warps=warps, num_stages=1,
    )
    return y
