"""A study, not shipped: the register-fed M = 1 W4A16 GEMV on tensor cores (Gluon, mma.sync), with no
shared-memory round trip.

Why: a test of "the M = 1 GEMV is bound by its instruction count". Every thread loads, in one 16-byte load
per row and 128 columns, exactly the nibbles its ``mma.sync.m16n8k16`` A fragments hold (the word layout of
``spear_compile/lowering/w4a16_words.py``), so the dequantized registers *are* the MMA operand: 2.1-2.7 SASS
instructions per weight instead of the CUDA-core kernel's 3.7. x is the one non-zero column of the
[BLOCK_K, 8] B operand (lanes of the first MMA column load it; the others are masked), and an MMA of a
constant all-ones A with the same B gives sum x in the accumulator layout (``_mma_words`` without XSUM).

Measured (H200, 2026-11-30, docs/kernels.md): 17.6 us at 8192^2 against the CUDA-core kernel's 17.2-17.6 -
no gain, so the dispatch never had a route to it. Its K step, index setup and row sums (``_mma_words``,
``_x_index``, ``_scale_index``, ``_rows_out``) live on in ``w4a16_words.py`` and are what the shipped
TMA-fed GEMV (``w4a16_gemv_tma.py``) computes with. ``python benchmarks/kernels.py --lab gemv --gluon`` and
``benchmarks/ncu_gemv1.py --gluon`` time it.

Constraints: CUDA, bf16 activations, K % 128 == 0, G a multiple of 128 (or per-channel).
"""
from __future__ import annotations

from typing import Optional

import torch

from spear_compile.lowering.layout_cache import derived_cached
from spear_compile.lowering.w4a16_words import CHUNK, HAS_GLUON, compile_gluon_sm90, gluon_ok, repack_gluon, word_layout

if HAS_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from spear_compile.lowering.w4a16_words import _mma_words, _rows_out, _scale_index, _x_index

    @gluon.jit
    def _store_rows(acc, acc1, S, Z, BIAS, Y, N, pid, BN: gl.constexpr, mma: gl.constexpr,
                    PER_CHANNEL: gl.constexpr, HAS_Z: gl.constexpr, HAS_BIAS: gl.constexpr):
        """Epilogue: ``_rows_out``, bias, store the CTA's BN rows."""
        out, on, mo = _rows_out(acc, acc1, S, Z, N, pid, BN, mma, PER_CHANNEL, HAS_Z)
        if HAS_BIAS:
            out += gl.load(BIAS + on, mask=mo, other=0.0).to(gl.float32)
        gl.store(Y + on, out.to(Y.dtype.element_ty), mask=mo)

    @gluon.jit
    def _w4a16_gemv_gluon_kernel(X, QW, S, Z, BIAS, Y, N, K, KW, NG,
                                 WL: gl.constexpr, G: gl.constexpr, WARPS: gl.constexpr, RB: gl.constexpr,
                                 CH: gl.constexpr, PREFETCH: gl.constexpr, PER_CHANNEL: gl.constexpr,
                                 HAS_Z: gl.constexpr, HAS_BIAS: gl.constexpr):
        """Batched mma.sync over NB = WARPS * CH slices of 128 columns per step (batch entry j: warp
        j % WARPS, columns k0 + 128 j): split-K inside the CTA, one quantization group per entry
        (G % 128 == 0); the entries' partial sums meet once, after the loop."""
        BN: gl.constexpr = 16 * RB
        NB: gl.constexpr = WARPS * CH
        STEP: gl.constexpr = 128 * NB
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1, 1],
                                                      instr_shape=[1, 16, 8])
        la: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        lb: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
        pid = gl.program_id(0)
        # words [NB, BN, 16]: entry j's slice; lane (g, t) holds rows g, g + 8 and 4 contiguous words
        wj = gl.arange(0, NB, layout=gl.SliceLayout(1, gl.SliceLayout(2, WL)))
        wn = pid * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, gl.SliceLayout(2, WL)))
        ww = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, WL)))
        w_row = gl.expand_dims(gl.expand_dims(wn, 0), 2)  # [1, BN, 1]
        w_col = gl.expand_dims(gl.expand_dims(wj * 16, 1), 2) + gl.expand_dims(gl.expand_dims(ww, 0), 1)
        wp = QW + w_row * KW + w_col
        w_nok = w_row < N
        x_k, x_c0 = _x_index(NB, lb)
        s_row, s_k = _scale_index(pid, NB, BN, mma)
        ones = gl.full([NB, BN, 128], 1.0, gl.bfloat16, layout=la)
        zero = gl.zeros([NB, BN, 8], gl.float32, layout=mma)
        acc = gl.zeros([NB, BN, 8], gl.float32, layout=mma)
        acc1 = gl.zeros([NB, BN, 8], gl.float32, layout=mma)
        w = gl.load(wp, mask=w_nok & (w_col < KW), other=0, eviction_policy="evict_first")
        for k0 in range(0, K, STEP):
            if PREFETCH:  # the next step's words are in flight while this one computes
                wnext = gl.load(wp + (k0 + STEP) // 8, mask=w_nok & ((k0 + STEP) // 8 + w_col < KW), other=0,
                                eviction_policy="evict_first")
            else:
                w = gl.load(wp + k0 // 8, mask=w_nok & (k0 // 8 + w_col < KW), other=0, eviction_policy="evict_first")
            xb = gl.load(X + k0 + x_k + x_c0 * 0, mask=x_c0 & (k0 + x_k < K), other=0.0)
            if PER_CHANNEL:
                acc, acc1 = _mma_words(w, xb, 0.0, 0.0, acc, acc1, ones, zero, NB, BN, la, PER_CHANNEL)
            else:
                gp = (k0 + s_k) // G
                ms = (s_row < N) & (k0 + s_k < K)
                sc = gl.load(S + s_row * NG + gp, mask=ms, other=0.0).to(gl.float32)
                zz = gl.full([NB, BN], 128.0, gl.float32, layout=gl.SliceLayout(2, mma))
                if HAS_Z:
                    zz += gl.load(Z + s_row * NG + gp, mask=ms, other=0.0).to(gl.float32)
                acc, acc1 = _mma_words(w, xb, sc, zz, acc, acc1, ones, zero, NB, BN, la, PER_CHANNEL)
            if PREFETCH:
                w = wnext
        _store_rows(acc, acc1, S, Z, BIAS, Y, N, pid, BN, mma, PER_CHANNEL, HAS_Z, HAS_BIAS)


# (WARPS = K slices per CTA, RB row blocks of 16, CH 128-column chunks per warp and step, PREFETCH)
GLUON_CONFIGS = [(8, 2, 1, 1), (8, 1, 1, 1), (16, 1, 1, 1), (8, 1, 2, 1), (16, 2, 1, 1), (4, 1, 1, 1), (16, 1, 1, 0),
                 (4, 2, 1, 1)]


def compile_sm90(config: tuple, G: int = 128, per_channel: bool = False) -> dict:
    """Compile the kernel for sm_90 without a GPU (Triton's own ptxas) and return its ``asm`` dict
    (ttgir, ptx, cubin): the offline check that every layout conversion in it is free, and the
    source of the SASS counts in docs/kernels.md. Needs TRITON_INTERPRET unset."""
    warps, rb, ch, pf = config
    types = dict(X="*bf16", QW="*i32", S="*bf16", Z="*bf16", BIAS="*bf16", Y="*bf16", N="i32", K="i32", KW="i32",
                 NG="i32")
    consts = dict(WL=word_layout(warps, rb, ch), G=G, WARPS=warps, RB=rb, CH=ch, PREFETCH=bool(pf),
                  PER_CHANNEL=per_channel, HAS_Z=True, HAS_BIAS=True)
    return compile_gluon_sm90(_w4a16_gemv_gluon_kernel, types, consts, warps)


_PACKED: dict = {}


def gluon_words(qweight: torch.Tensor) -> torch.Tensor:
    return derived_cached(_PACKED, [qweight], lambda: repack_gluon(qweight))


def w4a16_gemv_gluon(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
                     G: int, bias: Optional[torch.Tensor], config: Optional[tuple] = None,
                     out: Optional[torch.Tensor] = None, words: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Y[1, N] through the Gluon kernel (CUDA only). config = (WARPS, RB, CH, PREFETCH)."""
    M, K = x2.shape
    if not gluon_ok(M, K, G, x2.dtype):
        raise ValueError(f"w4a16_gemv_gluon: M={M}, K={K}, G={G}, {x2.dtype}; needs M = 1, bf16, "
                         f"K % {CHUNK} == 0 and G % {CHUNK} == 0 (or per-channel)")
    words = gluon_words(qweight) if words is None else words
    N = words.shape[0]
    warps, rb, ch, pf = config or GLUON_CONFIGS[0]
    bn = 16 * rb
    y = out if out is not None else torch.empty(M, N, dtype=x2.dtype, device=x2.device)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    _w4a16_gemv_gluon_kernel[(-(-N // bn),)](
        x2, words, scales, zeros if zeros is not None else scales, bias if bias is not None else scales, y,
        N, K, K // 8, scales.shape[1],
        WL=word_layout(warps, rb, ch), G=G, WARPS=warps, RB=rb, CH=ch, PREFETCH=bool(pf), PER_CHANNEL=G >= K,
        HAS_Z=zeros is not None, HAS_BIAS=bias is not None, num_warps=warps,
    )
    return y
