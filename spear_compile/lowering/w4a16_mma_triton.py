"""M = 1 W4A16 GEMV on tensor cores: nibbles to bf16 with one LOP3 per pair, products by ``tl.dot``.

Reference: ``lowering/w4a16.py:w4a16_linear_ref``.

Why a tensor-core kernel for a matrix-vector product: the CUDA-core M = 1 kernel
(``w4a16_triton._w4a16_gemv1_kernel``) spends ~3.7 SASS instructions per weight in its K loop
(LOP3 + FFMA per weight, plus shifts, chunk reductions, activation conversions and scale
addressing; counted offline from the sm_90 cubin, benchmarks/NOTES.md session 7) and runs at
~0.6 instructions per cycle per scheduler, so on the H200 it is issue-bound at ~2 TB/s, not
bandwidth-bound. Here the multiply-adds go to the tensor cores (the activation is the one
non-zero column of a [BLOCK_K, 16] operand; the 15 zero columns are free: the MMA unit is idle
otherwise), and a weight costs what it takes to make a bf16 operand of it:

- the weight is repacked once (``repack_mma``, cached): word c of row n holds columns
  8c .. 8c + 7, nibble p < 4 at column 8c + 2p and nibble p + 4 at column 8c + 2p + 1, so
  ``(w >> 4p) & 0x000F000F`` is the pair of adjacent columns (2p, 2p + 1);
- one LOP3 ORs that pair into the mantissas of bf16 128.0 (0x4300): exactly 128 + q, two
  weights per instruction, no conversion instruction (~0.9 instructions per weight with the
  three shifts per word);
- the 128 and the zero point are removed after the dot, in fp32, once per row and K tile:
  ``y = sum_tiles s * (dot(128 + q, x) - (128 + z) * sum(x))``. The products of the dot are
  exact (bf16 x bf16 in fp32) and it accumulates in fp32, so the only rounding beyond fp32 is
  the output's: more accurate than the CUDA-core kernel's biased mode.

A K tile never straddles a quantization group (BLOCK_K divides G), so the scale and zero
point are one value per row and tile. Triton's interpreter cannot run PTX: there the same
128 + q pairs are made with integer ops (what the CPU tests check).
"""
from __future__ import annotations

from typing import Optional

import torch

from ._triton import HAS_TRITON, INTERPRET

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _pair_bf16(w, p: tl.constexpr):
        """The interpreter's stand-in for one LOP3: (128 + nibble p, 128 + nibble p + 4) as bf16."""
        lo = (((w >> (4 * p)) & 0xF) + 128).to(tl.float32).to(tl.bfloat16)
        hi = (((w >> (16 + 4 * p)) & 0xF) + 128).to(tl.float32).to(tl.bfloat16)
        return lo, hi

    @triton.jit
    def _biased_bf16(w, ASM: tl.constexpr):
        """Words [BN, BW] (``repack_mma`` layout) -> bf16 [BN, 8 BW] of 128 + q, column order kept."""
        if ASM:
            o0, o1, o2, o3, o4, o5, o6, o7 = tl.inline_asm_elementwise(
                """{
                .reg .b32 t, p;
                lop3.b32 p, $8, 0x000F000F, 0x43004300, 0xEA;
                mov.b32 {$0, $1}, p;
                shr.u32 t, $8, 4;
                lop3.b32 p, t, 0x000F000F, 0x43004300, 0xEA;
                mov.b32 {$2, $3}, p;
                shr.u32 t, $8, 8;
                lop3.b32 p, t, 0x000F000F, 0x43004300, 0xEA;
                mov.b32 {$4, $5}, p;
                shr.u32 t, $8, 12;
                lop3.b32 p, t, 0x000F000F, 0x43004300, 0xEA;
                mov.b32 {$6, $7}, p;
                }""",
                "=h,=h,=h,=h,=h,=h,=h,=h,r", [w], dtype=[tl.bfloat16] * 8, is_pure=True, pack=1)
        else:
            o0, o1 = _pair_bf16(w, 0)
            o2, o3 = _pair_bf16(w, 1)
            o4, o5 = _pair_bf16(w, 2)
            o6, o7 = _pair_bf16(w, 3)
        # column 2p + c of a word is o_(2p + c); join's new axis is the innermost one
        v = tl.join(tl.join(tl.join(o0, o4), tl.join(o2, o6)), tl.join(tl.join(o1, o5), tl.join(o3, o7)))
        return tl.reshape(v, [w.shape[0], w.shape[1] * 8])

    @triton.jit
    def _w4a16_mma_gemv_kernel(X, QW, S, Z, BIAS, Y, N, K, KW, NG,
                               G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                               PER_CHANNEL: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr,
                               ASM: tl.constexpr):
        pid = tl.program_id(0)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        BW: tl.constexpr = BLOCK_K // 8
        offs_w = tl.arange(0, BW)
        offs_k = tl.arange(0, BLOCK_K)
        col = tl.arange(0, 16)
        acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
        sx = 0.0
        for k0 in range(0, K, BLOCK_K):
            ww = k0 // 8 + offs_w
            w = tl.load(QW + offs_n[:, None] * KW + ww[None, :], mask=mask_n[:, None] & (ww < KW)[None, :], other=0,
                        eviction_policy="evict_first")
            xk = tl.load(X + k0 + offs_k, mask=(k0 + offs_k) < K, other=0.0)
            xb = tl.where(col[None, :] == 0, xk[:, None], 0.0).to(tl.bfloat16)  # [BLOCK_K, 16]: x in column 0
            v = _biased_bf16(w, ASM)
            if not ASM:  # the interpreter multiplies bf16 operands' raw bits in tl.dot (Triton 3.6)
                v = v.to(tl.float32)
                xb = xb.to(tl.float32)
            d = tl.dot(v, xb, input_precision="ieee")  # [BLOCK_N, 16]: sum (128 + q) x in column 0
            xs = tl.sum(xk.to(tl.float32), axis=0)
            if PER_CHANNEL:  # scale and zero point once, after the loop
                acc += d
                sx += xs
            else:
                g = k0 // G
                sc = tl.load(S + offs_n * NG + g, mask=mask_n, other=0.0).to(tl.float32)
                zz = 128.0
                if HAS_Z:
                    zz = 128.0 + tl.load(Z + offs_n * NG + g, mask=mask_n, other=0.0).to(tl.float32)
                acc += sc[:, None] * (d - (zz * xs)[:, None])
        out = tl.sum(tl.where(col[None, :] == 0, acc, 0.0), axis=1)
        if PER_CHANNEL:
            zz = 128.0
            if HAS_Z:
                zz = 128.0 + tl.load(Z + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            out = tl.load(S + offs_n, mask=mask_n, other=0.0).to(tl.float32) * (out - zz * sx)
        if HAS_BIAS:
            out += tl.load(BIAS + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        tl.store(Y + offs_n, out.to(Y.dtype.element_ty), mask=mask_n)


# (BLOCK_N, BLOCK_K, num_warps, num_stages); BLOCK_K is clipped to divide the group size
MMA_CONFIGS = [(16, 64, 4, 1)] if INTERPRET else [
    (256, 128, 8, 2), (256, 128, 8, 1), (128, 128, 4, 1), (128, 128, 4, 2), (256, 128, 4, 1), (64, 128, 4, 2),
]


def repack_mma(qweight: torch.Tensor) -> torch.Tensor:
    """spear-packed uint8 [N, K/2] -> int32 [N, K/8] for the tensor-core GEMV (K % 8 == 0).

    Word c holds columns 8c .. 8c + 7: nibble p < 4 (bits 4p) column 8c + 2p, nibble p + 4
    (bits 16 + 4p) column 8c + 2p + 1.
    """
    from ..quant.format import unpack_int4

    N, K = qweight.shape[0], qweight.shape[1] * 2
    q = unpack_int4(qweight).view(N, K // 8, 8)[..., [0, 2, 4, 6, 1, 3, 5, 7]]  # nibble p's column
    b = (q[..., 0::2] | (q[..., 1::2] << 4)).contiguous()  # byte b of a word: nibbles 2b, 2b + 1
    return b.view(torch.int32).view(N, K // 8)


_PACKED: dict = {}


def mma_words(qweight: torch.Tensor) -> torch.Tensor:
    """``repack_mma(qweight)``, cached while the weight's storage lives and is unchanged."""
    from .w4a16_triton import derived_cached

    return derived_cached(_PACKED, [qweight], lambda: repack_mma(qweight))


def mma_ok(M: int, K: int, G: int) -> bool:
    """Shapes this kernel takes: one row, K a multiple of 16, groups of at least 16 columns."""
    return M == 1 and K % 16 == 0 and (G >= K or (G % 16 == 0 and G >= 16))


def w4a16_mma_gemv(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
                   G: int, bias: Optional[torch.Tensor], config: Optional[tuple] = None,
                   out: Optional[torch.Tensor] = None, words: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Y[1, N] = x2 @ dequant(W)^T (+ bias) for bf16 activations. config = (BLOCK_N, BLOCK_K, warps, stages)."""
    M, K = x2.shape
    if not mma_ok(M, K, G):
        raise ValueError(f"w4a16_mma_gemv: M={M}, K={K}, G={G}; needs M = 1, K % 16 == 0 and G % 16 == 0")
    if x2.dtype != torch.bfloat16:
        raise ValueError(f"w4a16_mma_gemv: bf16 activations only (128 + q is a bf16 operand), got {x2.dtype}")
    words = mma_words(qweight) if words is None else words
    N = words.shape[0]
    bn, bk, warps, stages = config or MMA_CONFIGS[0]
    bk = min(bk, G, max(16, 1 << (K - 1).bit_length()))
    while G < K and G % bk:
        bk //= 2
    y = out if out is not None else torch.empty(M, N, dtype=x2.dtype, device=x2.device)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    _w4a16_mma_gemv_kernel[(triton.cdiv(N, bn),)](
        x2, words, scales, zeros if zeros is not None else scales, bias if bias is not None else scales, y,
        N, K, K // 8, scales.shape[1],
        G=G, BLOCK_N=bn, BLOCK_K=bk, PER_CHANNEL=G >= K, HAS_Z=zeros is not None, HAS_BIAS=bias is not None,
        ASM=not INTERPRET, num_warps=warps, num_stages=stages,
    )
    return y
