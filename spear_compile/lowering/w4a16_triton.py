"""Triton W4A16 kernels (CUDA; on CPU under ``TRITON_INTERPRET=1`` for tests).

Reference: ``ops/w4a16_ref.py:w4a16_linear_ref`` (and ``ec_linear_ref`` for the fused EC).

``_w4a16_gemv1_kernel`` - M = 1 (decode), the fast path. It reads the weight in a GEMV
layout made once per weight (``gemv_words``: int32 words, nibble i of word 4c + j holds
column 32c + 4i + j), so each thread streams 16-byte weight loads while the eight
activation slices it needs are contiguous 8-byte loads in the same register layout (no
shared-memory shuffles). Nibbles become fp32 without I2F: OR-ing a nibble into the
mantissa of 2^E gives exactly 2^E + q. Exact mode subtracts 2^E per weight (LOP3, FADD,
FFMA); biased mode places every nibble where 2^E <= 2^15 and removes sum_k 2^E x_k once per
32-column chunk from the activation side (LOP3, FFMA). Scales and zero points apply once
per 32-column chunk. With ``HAS_EC`` and ``SELF`` the EC runs in the same launch (``ec_self.py``):
the first programs to start (by ticket) compute the pieces of ``h = A x`` right after requesting their
first weight tile and publish them tagged; after its weight loop every program reads all pieces, gates
and adds ``alpha * B[rows] (g * h)``. Without ``SELF`` (the pair; ``PDL_WAIT``) g * h comes from a
separate producer grid (``ec_decode_triton.py``, launched before this one, which then runs under
programmatic dependent launch and waits with ``griddepcontrol.wait`` only before the epilogue).

``_w4a16_gemv_kernel`` - small M > 1 (and shapes the M = 1 kernel does not take: K or G
not a multiple of 32). One program per BLOCK_N output rows loops
over all of K. The int4 weight is never dequantized element-wise: per K-tile (which
never straddles a quantization group) it accumulates ``sum_k q[n,k] x[k]`` and
``sum_k x[k]`` and applies ``s * (qx - z * sx)`` once, so the inner loop is
convert + FMA on the bytes it streams. With ``HAS_EC`` the same launch also computes
the error compensator: the first ``P_H`` programs compute split-K partials of
``h = A x`` into a tiny fp32 workspace and publish them with a release-counter; the
GEMV programs, after their weight loop, acquire that counter, run the gate MLP on the
r-vector and add ``alpha * B[rows] (g * h)`` to the accumulator before the single
store. The last GEMV program resets the workspace, so consecutive launches (and CUDA
graph replays) need no memset.
NOTE (forward progress): GEMV programs spin on the counter only after their main loop;
the producers are the lowest program ids, which the hardware dispatches first, the
same assumption CUB's decoupled look-back scan makes.

``_w4a16_gemm_kernel`` - 1 < M < 256 (from M = 256 dequantize + cuBLAS wins on the H200:
``dequant_cublas.py``, ``_w4_dequant_kernel``). Tiled GEMM; each K-tile of packed weights
is unpacked (``join`` of low/high nibbles), dequantized in the activation dtype in the
same order as the reference, ``(q - z) * s``, and fed to ``tl.dot``.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..ops.packing import unpack_int4
from ._triton import ACT_CODES, HAS_TRITON, INTERPRET, next_pow2
from . import ec_self as _es
from .layout_cache import derived_cached, derived_peek, outside_pools  # noqa: F401  (the kernels' operands are cached there)
from .ec_self import SPIN, slot_rows
from .ec_self import check_self_operands, self_plan, self_workspace

GEMV_MAX_M = 4  # rows handled by the GEMV kernel; above this the tiled GEMM (tensor cores) is faster

if HAS_TRITON:
    import triton
    import triton.language as tl

    from ._triton import gate_act, gdc_wait
    from .ec_self import ec_collect, ec_produce_own, ec_ticket

    @triton.jit
    def _nib(w, MASK: tl.constexpr, MAGIC, BIAS: tl.constexpr, EXACT: tl.constexpr):
        """The nibble ``w & MASK`` (sitting where the mantissa bit weight of MAGIC = 2^E is 1)
        as fp32: 2^E + q (biased), or q (exact; BIAS = 2^E)."""
        v = ((w & MASK) | MAGIC).to(tl.float32, bitcast=True)
        if EXACT:
            v = v - BIAS
        return v

    @triton.jit
    def _xi(X, ww, mask, i: tl.constexpr):
        """Activations multiplying nibble i of words ``ww``: X[32 (ww // 4) + 4 i + ww % 4]."""
        return tl.load(X + (ww // 4) * 32 + (ww % 4) + 4 * i, mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def _xpair(X, ww, mask, i: tl.constexpr):
        """bf16 bits of the activations multiplying nibbles i (low half) and i + 4 (high half)
        of words ``ww``, packed as one bf16x2 int32 per word column."""
        base = X + (ww // 4) * 32 + (ww % 4) + 4 * i
        lo = tl.load(base, mask=mask, other=0.0).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        hi = tl.load(base + 16, mask=mask, other=0.0).to(tl.int16, bitcast=True).to(tl.int32)
        return lo | (hi << 16)

    @triton.jit
    def _bf16x2_lo(p):
        return (p << 16).to(tl.float32, bitcast=True)

    @triton.jit
    def _bf16x2_hi(p):
        return ((p >> 16) << 16).to(tl.float32, bitcast=True)

    @triton.jit
    def _dot8_bf16x2(w, xp0, xp1, xp2, xp3, ASM: tl.constexpr):
        """sum_i q_i x_i over the 8 nibbles of each word, as fp32.

        On the GPU (ASM) in packed bf16x2 arithmetic: nibbles i and i + 4 sit at bits 4i and
        16 + 4i, so one shift and one LOP3 put both into the low mantissa bits of 128.0 (bf16
        0x4300) - exactly 128 + q - one FMA removes the 128 and one FMA multiplies by the
        (x_i, x_i+4) pair and accumulates: ~2.25 instructions per weight, about what the biased
        fp32 mode needs (LOP3 + FFMA), so it is only 5-6 % faster on the H200 while its error is
        3.4x larger (docs/kernels.md): opt-in. The four products per half are
        summed in bf16 (4 roundings of 2^-9) and the two halves in fp32. Triton's interpreter
        cannot run PTX: there (not ASM) the same nibble pairing and x packing is evaluated in
        fp32, which is what CPU tests check.
        """
        if ASM:
            s = tl.inline_asm_elementwise(
                """{
                .reg .b32 q0, q1, q2, q3, t, m, one, a, lo, hi;
                .reg .f32 fl, fh, fs;
                mov.b32 m, 0xC300C300;
                mov.b32 one, 0x3F803F80;
                lop3.b32 q0, $1, 0x000F000F, 0x43004300, 0xEA;
                shr.u32 t, $1, 4;
                lop3.b32 q1, t, 0x000F000F, 0x43004300, 0xEA;
                shr.u32 t, $1, 8;
                lop3.b32 q2, t, 0x000F000F, 0x43004300, 0xEA;
                shr.u32 t, $1, 12;
                lop3.b32 q3, t, 0x000F000F, 0x43004300, 0xEA;
                fma.rn.bf16x2 q0, q0, one, m;
                fma.rn.bf16x2 q1, q1, one, m;
                fma.rn.bf16x2 q2, q2, one, m;
                fma.rn.bf16x2 q3, q3, one, m;
                mov.b32 a, 0x80008000;
                fma.rn.bf16x2 a, q0, $2, a;
                fma.rn.bf16x2 a, q1, $3, a;
                fma.rn.bf16x2 a, q2, $4, a;
                fma.rn.bf16x2 a, q3, $5, a;
                shl.b32 lo, a, 16;
                and.b32 hi, a, 0xFFFF0000;
                mov.b32 fl, lo;
                mov.b32 fh, hi;
                add.f32 fs, fl, fh;
                mov.b32 $0, fs;
                }""",
                "=r,r,r,r,r,r", [w, xp0, xp1, xp2, xp3], dtype=tl.int32, is_pure=True, pack=1)
            return s.to(tl.float32, bitcast=True)
        else:
            return _pair_fp32(w, xp0, 0) + _pair_fp32(w, xp1, 1) + _pair_fp32(w, xp2, 2) + _pair_fp32(w, xp3, 3)

    @triton.jit
    def _pair_fp32(w, xp, i: tl.constexpr):
        """q_i x_i + q_(i+4) x_(i+4) in fp32 (the interpreter's stand-in for one bf16x2 FMA)."""
        pr = (w >> (4 * i)) & 0x000F000F
        return (pr & 0xF).to(tl.float32) * _bf16x2_lo(xp) + (pr >> 16).to(tl.float32) * _bf16x2_hi(xp)

    @triton.jit
    def _ec_gate_operands(W1, B1, W2, B2, R, D, R_P: tl.constexpr, D_P: tl.constexpr):
        offs_r = tl.arange(0, R_P)
        mask_r = offs_r < R
        offs_d = tl.arange(0, D_P)
        mask_d = offs_d < D
        w1 = tl.load(W1 + offs_d[:, None] * R + offs_r[None, :], mask=mask_d[:, None] & mask_r[None, :],
                     other=0.0).to(tl.float32)
        b1 = tl.load(B1 + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        w2 = tl.load(W2 + offs_r[:, None] * D + offs_d[None, :], mask=mask_r[:, None] & mask_d[None, :],
                     other=0.0).to(tl.float32)
        b2 = tl.load(B2 + offs_r, mask=mask_r, other=0.0).to(tl.float32)
        return w1, b1, w2, b2

    @triton.jit
    def _ec_gate(h, w1, b1, w2, b2, ACT: tl.constexpr):
        """g * h for one r-vector h [R_P]: g = sigmoid(W2 act(W1 h + b1) + b2)."""
        z = gate_act(tl.sum(w1 * h[None, :], axis=1) + b1, ACT)
        return tl.sigmoid(tl.sum(w2 * z[None, :], axis=1) + b2) * h

    @triton.jit
    def _ec_h_partial(X, A, K, R, pid, P_H: tl.constexpr, BLOCK_KH: tl.constexpr, R_P: tl.constexpr, NW=None,
                      rstd=1.0, NORM: tl.constexpr = False):
        """Producer ``pid``'s split-K slice of ``h = A x`` ([R_P], fp32; rows >= R are zero). NORM: of the
        RMS-normalised x (``rstd`` = 1 / rms(x), weight NW), rounded as the model's RMSNorm rounds (fp32,
        to x's dtype, times the weight, to x's dtype: ``ops/refs.py:rms_norm_ref``)."""
        offs_r = tl.arange(0, R_P)
        mask_r = offs_r < R
        chunk = tl.cdiv(tl.cdiv(K, P_H), BLOCK_KH) * BLOCK_KH
        k_lo = pid * chunk
        h = tl.zeros([R_P], dtype=tl.float32)
        for k0 in range(k_lo, tl.minimum(k_lo + chunk, K), BLOCK_KH):
            offs_k = k0 + tl.arange(0, BLOCK_KH)
            mask_k = offs_k < K
            a = tl.load(A + offs_r[:, None] * K + offs_k[None, :], mask=mask_r[:, None] & mask_k[None, :],
                        other=0.0).to(tl.float32)
            xv = tl.load(X + offs_k, mask=mask_k, other=0.0)
            if NORM:
                xn = (xv.to(tl.float32) * rstd).to(xv.dtype).to(tl.float32)
                xf = (xn * tl.load(NW + offs_k, mask=mask_k, other=0.0).to(tl.float32)).to(xv.dtype).to(tl.float32)
            else:
                xf = xv.to(tl.float32)
            h += tl.sum(a * xf[None, :], axis=1)
        return h

    @triton.jit
    def _ec_gate_publish(HBUF, GH, w1, b1, w2, b2, P_H: tl.constexpr, P_HP: tl.constexpr, R_P: tl.constexpr,
                         ACT: tl.constexpr, GH_COPIES: tl.constexpr):
        """The last producer: sum the P_H partial rows of h, gate once, store g * h in GH_COPIES
        copies (every consumer reads one: no single hot L2 line)."""
        offs_r = tl.arange(0, R_P)
        offs_p = tl.arange(0, P_HP)
        hp = tl.load(HBUF + offs_p[:, None] * R_P + offs_r[None, :], mask=(offs_p < P_H)[:, None], other=0.0,
                     cache_modifier=".cg")
        gh = _ec_gate(tl.sum(hp, axis=0), w1, b1, w2, b2, ACT)
        offs_g = tl.arange(0, GH_COPIES)
        tl.store(GH + offs_g[:, None] * R_P + offs_r[None, :], tl.broadcast_to(gh[None, :], [GH_COPIES, R_P]))

    @triton.jit
    def _gemv1_tile(w, sc, z, X, w0, KW, MAG7, MAG11, MAG15, MAG19, MAG23,
                    BLOCK_W: tl.constexpr, NIB: tl.constexpr, ASM: tl.constexpr, PER_CHANNEL: tl.constexpr,
                    HAS_Z: tl.constexpr):
        """One K tile of one row block: words w [BLOCK_N, BLOCK_W] -> per-chunk partials
        [BLOCK_N, BLOCK_W // 4] (group-wise: times the chunk's scale sc, zero point z removed;
        per-channel: raw) and sum_k x per chunk [BLOCK_W // 4].
        NIB: 0 exact fp32 nibbles, 1 biased fp32 nibbles, 2 packed bf16x2 (``_dot8_bf16x2``)."""
        offs_w = tl.arange(0, BLOCK_W)
        BC: tl.constexpr = BLOCK_W // 4  # 32-column chunks per tile (4 words, one thread's 16 bytes)
        ww = w0 + offs_w
        mask_w = ww < KW
        if NIB == 2:
            xp0 = _xpair(X, ww, mask_w, 0)
            xp1 = _xpair(X, ww, mask_w, 1)
            xp2 = _xpair(X, ww, mask_w, 2)
            xp3 = _xpair(X, ww, mask_w, 3)
            t = _dot8_bf16x2(w, xp0[None, :], xp1[None, :], xp2[None, :], xp3[None, :], ASM)
            d = tl.sum(tl.reshape(t, [t.shape[0], BC, 4]), axis=2)  # [BLOCK_N, BC]: sum over one chunk
            xs = (_bf16x2_lo(xp0) + _bf16x2_hi(xp0) + _bf16x2_lo(xp1) + _bf16x2_hi(xp1)
                  + _bf16x2_lo(xp2) + _bf16x2_hi(xp2) + _bf16x2_lo(xp3) + _bf16x2_hi(xp3))  # used if HAS_Z
        else:
            d, xs = _gemv1_tile_fp32(w, X, ww, mask_w, MAG7, MAG11, MAG15, MAG19, MAG23, BC, NIB == 0)
        sx = tl.zeros([BC], dtype=tl.float32)
        if HAS_Z:
            sx = tl.sum(tl.reshape(xs, [BC, 4]), axis=1)  # [BC]
        if not PER_CHANNEL:  # a 32-column chunk lies inside one group (G % 32 == 0)
            if HAS_Z:
                d -= z * sx[None, :]
            d = sc * d
        return d, sx

    @triton.jit
    def _gemv1_tile_fp32(w, X, ww, mask_w, MAG7, MAG11, MAG15, MAG19, MAG23, BC: tl.constexpr,
                         EXACT: tl.constexpr):
        """The fp32 nibble modes of ``_gemv1_tile``: per-chunk partials [BLOCK_N, BC] and the sum of
        the 8 activations of each word column [BLOCK_W]."""
        x0 = _xi(X, ww, mask_w, 0)
        x1 = _xi(X, ww, mask_w, 1)
        x2 = _xi(X, ww, mask_w, 2)
        x3 = _xi(X, ww, mask_w, 3)
        x4 = _xi(X, ww, mask_w, 4)
        x5 = _xi(X, ww, mask_w, 5)
        x6 = _xi(X, ww, mask_w, 6)
        x7 = _xi(X, ww, mask_w, 7)
        hi = w >> 12  # nibbles 5..7 at bits 8..19
        if EXACT:  # nibble p at bits 4p: mantissa weight 1 under 2^(23 - 4p)
            t = _nib(w, 0xF, MAG23, 8388608.0, True) * x0[None, :]
            t += _nib(w, 0xF0, MAG19, 524288.0, True) * x1[None, :]
            t += _nib(w, 0xF00, MAG15, 32768.0, True) * x2[None, :]
            t += _nib(w, 0xF000, MAG11, 2048.0, True) * x3[None, :]
            t += _nib(w, 0xF0000, MAG7, 128.0, True) * x4[None, :]
            t += _nib(hi, 0xF00, MAG15, 32768.0, True) * x5[None, :]
            t += _nib(hi, 0xF000, MAG11, 2048.0, True) * x6[None, :]
            t += _nib(hi, 0xF0000, MAG7, 128.0, True) * x7[None, :]
        else:  # every nibble at bits 8..19 (2^E <= 2^15); the biases leave through xb below
            lo = w << 8
            t = _nib(lo, 0xF00, MAG15, 32768.0, False) * x0[None, :]
            t += _nib(lo, 0xF000, MAG11, 2048.0, False) * x1[None, :]
            t += _nib(lo, 0xF0000, MAG7, 128.0, False) * x2[None, :]
            t += _nib(w, 0xF000, MAG11, 2048.0, False) * x3[None, :]
            t += _nib(w, 0xF0000, MAG7, 128.0, False) * x4[None, :]
            t += _nib(hi, 0xF00, MAG15, 32768.0, False) * x5[None, :]
            t += _nib(hi, 0xF000, MAG11, 2048.0, False) * x6[None, :]
            t += _nib(hi, 0xF0000, MAG7, 128.0, False) * x7[None, :]
        d = tl.sum(tl.reshape(t, [t.shape[0], BC, 4]), axis=2)  # [BLOCK_N, BC]: sum over one chunk
        if not EXACT:
            xb = 32768.0 * (x0 + x5) + 2048.0 * (x1 + x3 + x6) + 128.0 * (x2 + x4 + x7)
            d -= tl.sum(tl.reshape(xb, [BC, 4]), axis=1)[None, :]
        return d, x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7

    @triton.jit
    def _gemv1_scales(S, Z, offs_n, mask_n, w0, KW, NG, G: tl.constexpr, BLOCK_W: tl.constexpr,
                      PER_CHANNEL: tl.constexpr, HAS_Z: tl.constexpr):
        """Scale and zero point of each row and 32-column chunk of the tile at word w0."""
        BC: tl.constexpr = BLOCK_W // 4
        if PER_CHANNEL:  # applied once after the loop
            return tl.zeros([offs_n.shape[0], BC], tl.float32), tl.zeros([offs_n.shape[0], BC], tl.float32)
        cc = w0 // 4 + tl.arange(0, BC)
        g = cc * 32 // G
        mg = mask_n[:, None] & (cc < KW // 4)[None, :]
        sc = tl.load(S + offs_n[:, None] * NG + g[None, :], mask=mg, other=0.0).to(tl.float32)
        z = tl.zeros([offs_n.shape[0], BC], tl.float32)
        if HAS_Z:
            z = tl.load(Z + offs_n[:, None] * NG + g[None, :], mask=mg, other=0.0).to(tl.float32)
        return sc, z

    @triton.jit
    def _w4a16_gemv1_kernel(
        X, QW, S, Z, BIAS, Y,
        A, B, W1, B1, W2, B2, ALPHA, SLOTS, GH, TICK,
        N, K, KW, NG, R, D, NC, OWNERS, MAG7, MAG11, MAG15, MAG19, MAG23,
        G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, PREFETCH: tl.constexpr,
        NIB: tl.constexpr, ASM: tl.constexpr, PER_CHANNEL: tl.constexpr, HAS_Z: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        HAS_EC: tl.constexpr, PUBLISH: tl.constexpr, PDL_WAIT: tl.constexpr, SELF: tl.constexpr, PW: tl.constexpr,
        PPC_P: tl.constexpr,
        NC_P: tl.constexpr, SPIN: tl.constexpr, R_P: tl.constexpr, D_P: tl.constexpr, ACT: tl.constexpr,
        GH_COPIES: tl.constexpr, SLOT_T: tl.constexpr,
    ):
        """SELF: the one launch - ``PUBLISH`` this program's pieces of h (if its ticket makes it an owner; off,
        in tests, every program computes the pieces itself: the same result), collect, gate, add
        ``alpha B (g h)``. Else the pair's epilogue reads g * h from GH, after ``griddepcontrol.wait`` with
        ``PDL_WAIT``."""
        pid = tl.program_id(0)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        offs_w = tl.arange(0, BLOCK_W)
        BC: tl.constexpr = BLOCK_W // 4
        # the first tile's weights are requested first: the EC's pieces below overlap their latency
        wp = QW + offs_n[:, None] * KW + offs_w[None, :]
        mrow = mask_n[:, None]
        w = tl.load(wp, mask=mrow & (offs_w < KW)[None, :], other=0, eviction_policy="evict_first")
        if HAS_BIAS:  # requested now, used after the loop: a residual folded in as the bias
            # (passes/fold_residual_add.py) was just written by the previous kernel; loading it after the
            # loop put one more memory round trip on every program's tail
            bias = tl.load(BIAS + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        if HAS_EC:
            offs_r = tl.arange(0, R_P)
            mask_r = offs_r < R
            if SELF:
                tag, role = ec_ticket(TICK)
                if PUBLISH:
                    ec_produce_own(SLOTS, A, X, K, R, NC, OWNERS, role, tag, PW, PPC_P)
                w1, b1, w2, b2 = _ec_gate_operands(W1, B1, W2, B2, R, D, R_P, D_P)
            # EC operands that do not depend on h: load them before the weight stream
            bt = tl.load(B + offs_n[:, None] * R + offs_r[None, :], mask=mask_n[:, None] & mask_r[None, :],
                         other=0.0).to(tl.float32)
            alpha = tl.load(ALPHA).to(tl.float32)
        acc = tl.zeros([BLOCK_N, BC], dtype=tl.float32)
        sxa = tl.zeros([BC], dtype=tl.float32)  # per-channel zero point: sum_k x
        sc, z = _gemv1_scales(S, Z, offs_n, mask_n, 0, KW, NG, G, BLOCK_W, PER_CHANNEL, HAS_Z)
        for w0 in range(0, KW, BLOCK_W):
            if PREFETCH:  # the next tile's weights, scales and zeros are in flight during this one
                wn = tl.load(wp + (w0 + BLOCK_W), mask=mrow & ((w0 + BLOCK_W + offs_w) < KW)[None, :], other=0,
                             eviction_policy="evict_first")
                scn, zn = _gemv1_scales(S, Z, offs_n, mask_n, w0 + BLOCK_W, KW, NG, G, BLOCK_W, PER_CHANNEL, HAS_Z)
            else:  # (tile 0 again: measured faster than guarding it with `if w0 > 0`, run 4 in docs/kernels.md)
                w = tl.load(wp + w0, mask=mrow & ((w0 + offs_w) < KW)[None, :], other=0, eviction_policy="evict_first")
                sc, z = _gemv1_scales(S, Z, offs_n, mask_n, w0, KW, NG, G, BLOCK_W, PER_CHANNEL, HAS_Z)
            d, sx = _gemv1_tile(w, sc, z, X, w0, KW, MAG7, MAG11, MAG15, MAG19, MAG23,
                                BLOCK_W, NIB, ASM, PER_CHANNEL, HAS_Z)
            acc += d
            if PER_CHANNEL and HAS_Z:
                sxa += sx
            if PREFETCH:
                w = wn
                sc = scn
                z = zn
        out = tl.sum(acc, axis=1)  # [BLOCK_N]
        if PER_CHANNEL:  # y = s * (sum q x - z * sum x), applied once
            if HAS_Z:
                out -= tl.load(Z + offs_n, mask=mask_n, other=0.0).to(tl.float32) * tl.sum(sxa, axis=0)
            out *= tl.load(S + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        if HAS_BIAS:
            out += bias
        if HAS_EC:
            if SELF:
                h = ec_collect(SLOTS, A, X, K, R, NC, tag, PW, PPC_P, R_P, NC_P, SPIN, SLOT_T)
                gh = _ec_gate(h, w1, b1, w2, b2, ACT)
                out += alpha * tl.sum(bt * gh[None, :], axis=1)
            else:
                if PDL_WAIT:  # g * h comes from a separate producer grid (ec_decode_triton.py)
                    gdc_wait()
                gh = tl.load(GH + (pid % GH_COPIES) * R_P + offs_r, cache_modifier=".cg")
                out += alpha * tl.sum(bt * gh[None, :], axis=1)
        tl.store(Y + offs_n, out.to(Y.dtype.element_ty), mask=mask_n)

    @triton.jit
    def _w4a16_gemv_kernel(
        X, QW, S, Z, BIAS, Y,
        A, B, W1, B1, W2, B2, ALPHA, HBUF, CNT,
        M, N, K, G, NG, stride_xm, stride_ym, R, D,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TG: tl.constexpr,
        PER_CHANNEL: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr,
        HAS_EC: tl.constexpr, P_H: tl.constexpr, BLOCK_KH: tl.constexpr, R_P: tl.constexpr, D_P: tl.constexpr,
        ACT: tl.constexpr,
    ):
        pid = tl.program_id(0)
        offs_m = tl.arange(0, BLOCK_M)
        mask_m = offs_m < M
        if HAS_EC and pid < P_H:
            # ---- producer (the first P_H programs, before their own GEMV work): split-K partial
            # of h = A x, published to HBUF. No extra programs: the GEMV keeps its wave count.
            offs_r = tl.arange(0, R_P)
            mask_r = offs_r < R
            chunk = tl.cdiv(tl.cdiv(K, P_H), BLOCK_KH) * BLOCK_KH
            k_lo = pid * chunk
            h = tl.zeros([BLOCK_M, R_P], dtype=tl.float32)
            for k0 in range(k_lo, tl.minimum(k_lo + chunk, K), BLOCK_KH):
                offs_k = k0 + tl.arange(0, BLOCK_KH)
                mask_k = offs_k < K
                a = tl.load(A + offs_r[:, None] * K + offs_k[None, :], mask=mask_r[:, None] & mask_k[None, :],
                            other=0.0).to(tl.float32)
                x = tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                            other=0.0).to(tl.float32)
                h += tl.sum(x[:, None, :] * a[None, :, :], axis=2)
            tl.atomic_add(HBUF + offs_m[:, None] * R_P + offs_r[None, :], h,
                          mask=mask_m[:, None] & mask_r[None, :], sem="release")
            tl.debug_barrier()
            tl.atomic_add(CNT, 1, sem="release")
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        if HAS_EC:  # EC operands do not depend on h: load them before the weight stream
            offs_r = tl.arange(0, R_P)
            mask_r = offs_r < R
            w1, b1, w2, b2 = _ec_gate_operands(W1, B1, W2, B2, R, D, R_P, D_P)
            bt = tl.load(B + offs_n[:, None] * R + offs_r[None, :], mask=mask_n[:, None] & mask_r[None, :],
                         other=0.0).to(tl.float32)
            alpha = tl.load(ALPHA).to(tl.float32)
        HALF: tl.constexpr = BLOCK_K // 2
        offs_h = tl.arange(0, HALF)
        NT: tl.constexpr = BLOCK_K // TG  # scale groups per K tile
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        sx_all = tl.zeros([BLOCK_M], dtype=tl.float32)  # per-channel: sum_k x, for the zero point
        KB = K // 2
        for k0 in range(0, K, BLOCK_K):
            kb = k0 // 2 + offs_h
            mask_kb = kb < KB
            p = tl.load(QW + offs_n[:, None] * KB + kb[None, :], mask=mask_n[:, None] & mask_kb[None, :], other=0)
            lo = (p & 0xF).to(tl.float32)
            hi = (p >> 4).to(tl.float32)
            offs_k = k0 + tl.arange(0, BLOCK_K)
            if not PER_CHANNEL:
                g = k0 // TG * TG // G + tl.arange(0, NT)  # group index of each TG sub-tile
                mask_g = mask_n[:, None] & (g[None, :] < NG)
                s = tl.load(S + offs_n[:, None] * NG + g[None, :], mask=mask_g, other=0.0).to(tl.float32)
                if HAS_Z:
                    z = tl.load(Z + offs_n[:, None] * NG + g[None, :], mask=mask_g, other=0.0).to(tl.float32)
            for m in tl.static_range(BLOCK_M):
                x = tl.load(X + m * stride_xm + offs_k, mask=(offs_k < K) & (m < M), other=0.0).to(tl.float32)
                xe, xo = tl.split(tl.reshape(x, [HALF, 2]))
                prod = lo * xe[None, :] + hi * xo[None, :]  # [BLOCK_N, BLOCK_K / 2]
                if PER_CHANNEL:
                    part = tl.sum(prod, axis=1)
                    sx_all += tl.where(offs_m == m, tl.sum(xe + xo, axis=0), 0.0)
                else:
                    qx = tl.sum(tl.reshape(prod, [BLOCK_N, NT, TG // 2]), axis=2)  # [BLOCK_N, NT]
                    if HAS_Z:
                        sx = tl.sum(tl.reshape(xe + xo, [NT, TG // 2]), axis=1)  # [NT]
                        qx = qx - z * sx[None, :]
                    part = tl.sum(s * qx, axis=1)
                acc += tl.where(offs_m[:, None] == m, part[None, :], 0.0)
        if PER_CHANNEL:  # y = s * (sum q x - z * sum x), applied once
            s1 = tl.load(S + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            if HAS_Z:
                z1 = tl.load(Z + offs_n, mask=mask_n, other=0.0).to(tl.float32)
                acc = acc - z1[None, :] * sx_all[:, None]
            acc = acc * s1[None, :]
        if HAS_BIAS:
            acc += tl.load(BIAS + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        if HAS_EC:
            # ---- consumer: wait for h, gate it, add alpha * B (g * h)
            c = tl.load(CNT, volatile=True)  # poll with plain loads, then one acquire
            while c < P_H:
                c = tl.load(CNT, volatile=True)
            tl.atomic_add(CNT, 0, sem="acquire")
            tl.debug_barrier()  # every thread reads h after the acquire (L2, not a per-thread system-scope load)
            h = tl.load(HBUF + offs_m[:, None] * R_P + offs_r[None, :], cache_modifier=".cg")
            zz = gate_act(tl.sum(h[:, None, :] * w1[None, :, :], axis=2) + b1[None, :], ACT)
            gg = tl.sigmoid(tl.sum(zz[:, None, :] * w2[None, :, :], axis=2) + b2[None, :])
            acc += alpha * tl.sum((gg * h)[:, None, :] * bt[None, :, :], axis=2)
            tl.debug_barrier()
            done = tl.atomic_add(CNT + 1, 1, sem="acq_rel")
            if done == tl.num_programs(0) - 1:  # last reader resets the workspace
                tl.store(HBUF + offs_m[:, None] * R_P + offs_r[None, :], tl.zeros([BLOCK_M, R_P], tl.float32))
                tl.atomic_xchg(CNT + 1, 0)
                tl.atomic_xchg(CNT, 0)
        tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty),
                 mask=mask_m[:, None] & mask_n[None, :])

    @triton.jit
    def _w4a16_gemm_kernel(
        X, QW, S, Z, BIAS, Y, M, N, K, G, NG, stride_xm, stride_ym,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TG: tl.constexpr, GROUP_M: tl.constexpr,
        HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr,
    ):
        pid = tl.program_id(0)
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        group = pid // (GROUP_M * num_n)  # grouped ordering: tiles sharing weights run together
        first_m = group * GROUP_M
        size_m = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % size_m)
        pid_n = (pid % (GROUP_M * num_n)) // size_m
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m = offs_m < M
        mask_n = offs_n < N
        HALF: tl.constexpr = BLOCK_K // 2
        KB = K // 2
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask_m[:, None] & (offs_k[None, :] < K),
                        other=0.0)
            kb = k0 // 2 + tl.arange(0, HALF)
            p = tl.load(QW + offs_n[:, None] * KB + kb[None, :], mask=mask_n[:, None] & (kb[None, :] < KB), other=0)
            q = tl.join(p & 0xF, p >> 4).reshape(BLOCK_N, BLOCK_K)
            NT: tl.constexpr = BLOCK_K // TG
            g = k0 // TG * TG // G + tl.arange(0, NT)
            if UPCAST:  # Triton's interpreter mishandles bf16 arithmetic: CPU tests use fp32 there
                x = x.to(tl.float32)
            mask_g = mask_n[:, None] & (g[None, :] < NG)
            s = tl.load(S + offs_n[:, None] * NG + g[None, :], mask=mask_g, other=0.0).to(x.dtype)
            w = tl.reshape(q.to(x.dtype), [BLOCK_N, NT, TG])
            if HAS_Z:
                z = tl.load(Z + offs_n[:, None] * NG + g[None, :], mask=mask_g, other=0.0).to(x.dtype)
                w = w - z[:, :, None]
            w = tl.reshape(w * s[:, :, None], [BLOCK_N, BLOCK_K])
            acc = tl.dot(x, tl.trans(w), acc)
        if HAS_BIAS:
            acc += tl.load(BIAS + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty),
                 mask=mask_m[:, None] & mask_n[None, :])


    @triton.jit
    def _w4_dequant_kernel(QW, S, Z, W, N, K, NG, G, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr,
                           TG: tl.constexpr, HAS_Z: tl.constexpr):
        """W[N, K] = (q - z) * s in W's dtype: the prologue of the dequantize + cuBLAS path.
        Each thread turns 8 packed bytes into 16 contiguous outputs (``join`` of the low and
        high nibbles keeps column order), so loads are 8-byte and stores 16-byte vectors; a
        scale and zero point are loaded once per TG columns (TG divides G)."""
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        b0 = tl.program_id(1) * BLOCK_B
        offs_b = b0 + tl.arange(0, BLOCK_B)
        mask_n = offs_n < N
        BK: tl.constexpr = 2 * BLOCK_B
        NT: tl.constexpr = BK // TG
        p = tl.load(QW + offs_n[:, None] * (K // 2) + offs_b[None, :], mask=mask_n[:, None] & (offs_b < K // 2)[None, :],
                    other=0, eviction_policy="evict_first")
        q = tl.reshape(tl.join(p & 0xF, p >> 4), [BLOCK_N, NT, TG]).to(tl.float32)  # column 2 b0 + TG t + c
        g = (2 * b0 + TG * tl.arange(0, NT)) // G
        mg = mask_n[:, None] & (g < NG)[None, :]
        if HAS_Z:
            q = q - tl.load(Z + offs_n[:, None] * NG + g[None, :], mask=mg, other=0.0).to(tl.float32)[:, :, None]
        w = q * tl.load(S + offs_n[:, None] * NG + g[None, :], mask=mg, other=0.0).to(tl.float32)[:, :, None]
        offs_k = 2 * b0 + tl.arange(0, BK)
        tl.store(W + offs_n[:, None] * K + offs_k[None, :], tl.reshape(w, [BLOCK_N, BK]).to(W.dtype.element_ty),
                 mask=mask_n[:, None] & (offs_k < K)[None, :])


# ------------------------------------------------------------------------ host side
# M = 1 kernel: (BLOCK_N, BLOCK_W int32 words per row per tile, num_warps, prefetch 0/1)
# (the five that were fastest on some shape in benchmarks/results/kernels/2026-11-29_h200_lab_gemv_configs.json)
GEMV1_CONFIGS = [(16, 64, 4, 1)] if INTERPRET else [
    (8, 512, 4, 0), (8, 512, 4, 1), (8, 256, 2, 1), (16, 512, 4, 0), (8, 128, 1, 1),
]
GH_COPIES = 16  # copies of the M = 1 kernel's g * h in the workspace
MAX_PRODUCERS = 64  # programs computing split-K partials of h = A x in the decode EC's producer grid
# Nibble arithmetic of the M = 1 kernel: "exact" (q exact in fp32), "biased" (2^E + q with
# 2^E <= 2^15, the bias removed per 32-column chunk; fp32 relative error ~3e-4) or "bf16x2"
# (packed bf16 pairs, bf16 activations only; products summed 4 at a time in bf16). The default
# for bf16 activations is GEMV1_BF16_NIB; other dtypes always run "exact". See the kernel
# docstrings and docs/kernels.md.
GEMV1_NIBS = {"exact": 0, "biased": 1, "bf16x2": 2}
GEMV1_BF16_NIB = "biased"
_MAGICS = (0x43000000, 0x45000000, 0x47000000, 0x49000000, 0x4B000000)  # 2^7, 2^11, 2^15, 2^19, 2^23
# (BLOCK_N, BLOCK_K, num_warps, num_stages) of the M > 1 GEMV; BLOCK_K is clipped to the group size.
GEMV_CONFIGS = [(16, 128, 4, 1)] if INTERPRET else [
    (32, 1024, 8, 2), (16, 1024, 4, 3), (32, 512, 4, 3), (16, 2048, 8, 2), (64, 512, 8, 3), (8, 2048, 4, 2),
    (32, 2048, 8, 1), (16, 512, 4, 4), (64, 1024, 8, 2), (8, 1024, 4, 3),
]
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
GEMM_CONFIGS = [(16, 32, 64, 4, 1)] if INTERPRET else [
    (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (64, 128, 64, 4, 4), (128, 128, 128, 8, 3), (64, 64, 64, 4, 4),
    (16, 64, 128, 4, 4), (32, 64, 128, 4, 4), (64, 256, 64, 8, 3), (16, 32, 256, 4, 4), (16, 32, 512, 4, 3),
    (16, 64, 256, 4, 3), (32, 32, 256, 4, 4),
]

def _default_gemm(M: int) -> tuple:
    if INTERPRET:
        return GEMM_CONFIGS[0]
    if M >= 256:  # dequantize + cuBLAS beat the Triton GEMM on all five benchmark shapes (docs/kernels.md)
        return DEQUANT_CUBLAS
    return (16, 64, 128, 4, 4) if M <= 16 else (64, 128, 64, 4, 4) if M <= 128 else (128, 128, 64, 8, 3)


_WORKSPACE: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _tiles(bk: int, G: int, K: int) -> tuple[int, int]:
    """(BLOCK_K, TG): TG is the sub-tile sharing one scale; a K tile holds whole groups or
    lies inside one (powers of two), and never runs past what masking covers."""
    bk = max(16, min(bk, next_pow2(K)))
    if G >= K:  # per-channel: one group, any tile
        return bk, bk
    return bk, min(bk, G)


def ec_workspace(device: torch.device, r_p: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused kernels' workspace: fp32 [GEMV_MAX_M + GH_COPIES + MAX_PRODUCERS, r_p] (rows <
    GEMV_MAX_M: the M > 1 kernel's h accumulators; then the g * h copies the decode EC's producer grid
    publishes and its producers' h partials, ``ec_decode_triton.py``) and int32 counters (the M > 1
    kernel uses [0], [1]; the producer grid [0]), zeroed once. (The one-launch M = 1 EC has its own,
    per site: ``ec_self.self_workspace``.)

    Shared by every fused launch on the device: launches on one stream serialize, and each
    launch leaves the h rows and counters zeroed (see the kernel docstrings).
    """
    key = (str(device), r_p)
    ws = _WORKSPACE.get(key)
    if ws is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():  # a memset captured, not run
            raise RuntimeError(f"ec_workspace: the fused EC's workspace (rank {r_p}) is made on first use, and this "
                               "first use is inside a CUDA graph capture: run the model once before capturing")
        ws = outside_pools(lambda: (
            torch.zeros(GEMV_MAX_M + GH_COPIES + MAX_PRODUCERS, r_p, dtype=torch.float32, device=device),
            torch.zeros(96, dtype=torch.int32, device=device)))
        _WORKSPACE[key] = ws
    return ws


def repack_gemv(qweight: torch.Tensor) -> torch.Tensor:
    """spear-packed uint8 [N, K/2] -> the M = 1 kernel's int32 [N, K/8] (K % 32 == 0).

    Nibble i (bits 4i..4i+3) of word 4c + j holds column 32c + 4i + j, so the activations a
    thread needs for one nibble position of its four words are 4 contiguous values.
    """
    N, K = qweight.shape[0], qweight.shape[1] * 2
    q = unpack_int4(qweight).view(N, K // 32, 8, 4).transpose(2, 3)  # [N, chunk, j, i]
    b = (q[..., 0::2] | (q[..., 1::2] << 4)).contiguous()  # byte b of a word: nibbles 2b, 2b+1
    return b.view(torch.int32).view(N, K // 8)


_PACKED: dict = {}  # gemv_words' cache (see derived_cached)


def gemv_words(qweight: torch.Tensor) -> torch.Tensor:
    """``repack_gemv(qweight)``, made on first use and cached while the weight's storage lives
    and its version is unchanged (an in-place update of the weight repacks it)."""
    return derived_cached(_PACKED, [qweight], lambda: repack_gemv(qweight))


def gemv1_ok(M: int, K: int, G: int, qweight: torch.Tensor) -> bool:
    """Whether the M = 1 kernel takes this weight: 32-column chunks that never straddle a group."""
    return M == 1 and K % 32 == 0 and (G >= K or G % 32 == 0) and qweight.is_contiguous()


def check_x(kernel: str, x2: torch.Tensor, qweight: Optional[torch.Tensor], words: Optional[torch.Tensor] = None
            ) -> None:
    """What the launches assume of x: [M, K] with unit column stride (rows may be strided) and K equal to the
    weight's (``qweight`` [N, K/2] packed bytes, or ``words`` [N, K/8] the M = 1 layout); fp16 / bf16 / fp32."""
    if x2.dim() != 2:
        raise ValueError(f"{kernel}: x must be [M, K], got shape {tuple(x2.shape)}")
    if x2.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"{kernel}: x dtype {x2.dtype}; expected float16, bfloat16 or float32")
    if x2.shape[1] > 1 and x2.stride(1) != 1:
        raise ValueError(f"{kernel}: x {tuple(x2.shape)} stride {x2.stride()} is not contiguous along K "
                         "(pass x.contiguous())")
    K = x2.shape[1]
    if qweight is not None and qweight.shape[1] * 2 != K:
        raise ValueError(f"{kernel}: x has K={K} columns but the packed weight {tuple(qweight.shape)} holds "
                         f"K={qweight.shape[1] * 2}")
    if words is not None and words.shape[1] * 8 != K:
        raise ValueError(f"{kernel}: x has K={K} columns but the GEMV words {tuple(words.shape)} hold "
                         f"K={words.shape[1] * 8}")


def w4a16_gemv1(x2, qweight, scales, zeros, G: int, bias, ec: Optional[tuple] = None, act: str = "silu",
                config: Optional[tuple] = None, out: Optional[torch.Tensor] = None, nib: Optional[str] = None,
                publish: bool = True, pair: bool = False, launch_pdl: bool = False,
                words: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Y[1, N] through the M = 1 kernel. config = (BLOCK_N, BLOCK_W, num_warps, prefetch 0/1), else
    ``GEMV1_CONFIGS[0]`` (``dispatch.route`` passes the tuned one).
    ``nib`` (a GEMV1_NIBS key) defaults to GEMV1_BF16_NIB for bf16 activations (its error is at
    most about bf16's own rounding) and "exact" otherwise; "bf16x2" needs bf16 activations.
    With ``ec``: the EC in the same launch (``ec_self.py``), or with ``pair`` the epilogue of the
    two-launch pair, reading g * h from the producer grid's workspace (``ec_decode_triton.py``; waits
    for that grid when ``launch_pdl``). ``publish`` (tests): off, no program of the one launch publishes its
    pieces of h, so every program computes them itself (the readers' fallback; the same result).
    ``words``: the GEMV layout itself (``qweight`` is then unused): the concatenated weights of
    ``w4a16_cat.py``."""
    M, K = x2.shape
    if M != 1:
        raise ValueError(f"w4a16_gemv1: x {tuple(x2.shape)} has M={M} rows; the M = 1 kernel takes one")
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    check_x("w4a16_gemv1", x2, qweight if words is None else None, words)
    words = gemv_words(qweight) if words is None else words
    N = words.shape[0]
    if nib is None:
        nib = GEMV1_BF16_NIB if x2.dtype == torch.bfloat16 else "exact"
    if nib not in GEMV1_NIBS:
        raise ValueError(f"w4a16_gemv1: nib={nib!r}; expected one of {sorted(GEMV1_NIBS)}")
    if nib == "bf16x2" and x2.dtype != torch.bfloat16:
        raise ValueError(f"w4a16_gemv1: nib='bf16x2' needs bf16 activations, got {x2.dtype}")
    y = out if out is not None else torch.empty(M, N, dtype=x2.dtype, device=x2.device)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    bn, bw, warps, prefetch = config or GEMV1_CONFIGS[0]  # the route passes the tuned one
    grid = triton.cdiv(N, bn)
    dummy = scales
    plan = None
    if ec is not None:
        A, B, W1, b1, W2, b2, alpha = ec
        R, D = A.shape[0], W1.shape[0]
        r_p, d_p = next_pow2(R), next_pow2(D)
        if pair:
            ws, _ = ec_workspace(x2.device, r_p)
            slots, gh, tick = dummy, ws[GEMV_MAX_M:GEMV_MAX_M + GH_COPIES], dummy
        else:

            plan = self_plan(R, K, grid, 32 * warps, _es.sm_count(x2.device))
            if plan is None:
                raise ValueError(f"w4a16_gemv1: the one-launch EC's pieces of A {tuple(A.shape)} do not fit "
                                 f"{grid} programs of {warps} warps (ec_self.self_plan): use the two-launch pair")
            check_self_operands(A, K, x2)
            tick, slots = self_workspace(A, grid, plan)
            gh = dummy
    else:
        A = B = W1 = b1 = W2 = b2 = alpha = slots = gh = tick = dummy
        R = D = r_p = d_p = 1

    _w4a16_gemv1_kernel[(grid,)](
        x2, words, scales, zeros if zeros is not None else dummy, bias if bias is not None else dummy, y,
        A, B, W1, b1, W2, b2, alpha, slots, gh, tick,
        N, K, K // 8, K // G, R, D, plan.nc if plan else 1, plan.owners if plan else 1, *_MAGICS,
        G=G, BLOCK_N=bn, BLOCK_W=bw, PREFETCH=bool(prefetch), NIB=GEMV1_NIBS[nib], ASM=not INTERPRET,
        PER_CHANNEL=G >= K, HAS_Z=zeros is not None, HAS_BIAS=bias is not None, HAS_EC=ec is not None,
        PUBLISH=bool(publish), PDL_WAIT=pair and launch_pdl, SELF=plan is not None, PW=plan.pw if plan else 1, PPC_P=plan.ppc_p if plan else 1,
        NC_P=plan.nc_p if plan else 1, SPIN=SPIN, R_P=r_p, D_P=d_p, ACT=ACT_CODES[act], GH_COPIES=GH_COPIES,
        SLOT_T=slot_rows(r_p, warps, plan.nc_p if plan else 1), num_warps=warps, num_stages=1,
        **({"launch_pdl": True} if launch_pdl else {}),
    )
    return y


def w4a16_gemv_small(x2, qweight, scales, zeros, G: int, bias, ec: Optional[tuple] = None, act: str = "silu",
                     config: Optional[tuple] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Y[M, N] for M <= GEMV_MAX_M through ``_w4a16_gemv_kernel``, optionally with the EC fused (ec = (A, B,
    W1, b1, W2, b2, alpha)). config = (BLOCK_N, BLOCK_K, num_warps, num_stages), else ``GEMV_CONFIGS[0]``
    (``dispatch.route`` passes the tuned one)."""
    M, K = x2.shape
    N = qweight.shape[0]
    if M > GEMV_MAX_M:
        raise ValueError(f"w4a16_gemv: M={M} > {GEMV_MAX_M}; use the GEMM kernel")
    check_x("w4a16_gemv", x2, qweight)
    y = out if out is not None else torch.empty(M, N, dtype=x2.dtype, device=x2.device)
    bn, bk, warps, stages = config or GEMV_CONFIGS[0]  # the route passes the tuned one
    bk, tg = _tiles(bk, G, K)
    BM = next_pow2(M)
    dummy = scales
    if ec is not None:
        A, B, W1, b1, W2, b2, alpha = ec
        R, D = A.shape[0], W1.shape[0]
        r_p, d_p = next_pow2(R), next_pow2(D)
        hbuf, cnt = ec_workspace(x2.device, r_p)
        # Programs run one after another in Triton's interpreter: a single producer (program 0)
        # keeps the spin-wait satisfiable there; GPUs split A x over up to 64 producers.
        p_h = 1 if INTERPRET else max(1, min(64, triton.cdiv(K, 256), triton.cdiv(N, bn)))
    else:
        A = B = W1 = b1 = W2 = b2 = alpha = hbuf = cnt = dummy
        R = D = r_p = d_p = 1
        p_h = 0
    grid = (triton.cdiv(N, bn),)
    _w4a16_gemv_kernel[grid](
        x2, qweight, scales, zeros if zeros is not None else dummy,
        bias if bias is not None else dummy, y, A, B, W1, b1, W2, b2, alpha, hbuf, cnt,
        M, N, K, G, K // G, x2.stride(0), y.stride(0), R, D,
        BLOCK_M=BM, BLOCK_N=bn, BLOCK_K=bk, TG=tg, PER_CHANNEL=G >= K, HAS_Z=zeros is not None,
        HAS_BIAS=bias is not None, HAS_EC=ec is not None, P_H=p_h, BLOCK_KH=32 if INTERPRET else 64,
        R_P=r_p, D_P=d_p, ACT=ACT_CODES[act],
        num_warps=warps, num_stages=stages,
    )
    return y


def w4_dequantize(qweight, scales, zeros, G: int, dtype: torch.dtype) -> torch.Tensor:
    """The whole weight as [N, K] in ``dtype`` (one pass: reads N*K/2 bytes, writes N*K*2)."""
    N, K = qweight.shape[0], qweight.shape[1] * 2
    w = torch.empty(N, K, dtype=dtype, device=qweight.device)
    bn, bb = (8, 16) if INTERPRET else DEQUANT_TILE
    tg = min(2 * bb, G & -G)  # a power of two dividing G: every TG-column sub-tile lies inside one group
    _w4_dequant_kernel[(triton.cdiv(N, bn), triton.cdiv(K // 2, bb))](
        qweight, scales, zeros if zeros is not None else scales, w, N, K, K // G, G,
        BLOCK_N=bn, BLOCK_B=bb, TG=tg, HAS_Z=zeros is not None, num_warps=4)
    return w


DEQUANT_TILE = (16, 128)  # (rows, packed bytes) per program of the dequantize pass
DEQUANT_CUBLAS = ("dequant_cublas",)  # table value: dequantize to a scratch weight, then cuBLAS
DEQUANT_CUBLAS_PIPE = ("dequant_cublas_pipe", 4)  # the same in 4 row slices, dequant overlapped with the GEMMs
WGMMA = "wgmma"  # table value ("wgmma", BM, BN, STAGES, WARPS): the Hopper in-loop-dequant GEMM (w4a16_gemm_wgmma)
# ("wgmma_ra", BNW, BMX, STAGES, WARPS[, PF]): the same, weight as the MMA's register operand
WGMMA_RA = "wgmma_ra"


def is_dequant_cublas(config: tuple) -> bool:
    """Whether ``config`` is the dequantize + cuBLAS path (one pass or pipelined)."""
    return config[0] in (DEQUANT_CUBLAS[0], DEQUANT_CUBLAS_PIPE[0])


def w4a16_gemm_triton(x2, qweight, scales, zeros, G: int, bias, config: Optional[tuple] = None,
                      out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Y[M, N] through the tiled in-loop-dequant Triton GEMM. config = (BLOCK_M, BLOCK_N, BLOCK_K, num_warps,
    num_stages), else M's default. (Which GEMM runs a shape is ``dispatch.route.gemm_route``'s choice.)"""
    M, K = x2.shape
    N = qweight.shape[0]
    check_x("w4a16_gemm", x2, qweight)
    config = tuple(config or _default_gemm(M))
    y = out if out is not None else torch.empty(M, N, dtype=x2.dtype, device=x2.device)
    bm, bn, bk, warps, stages = config
    bk, tg = _tiles(bk, G, K)
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    _w4a16_gemm_kernel[grid](
        x2, qweight, scales, zeros if zeros is not None else scales, bias if bias is not None else scales, y,
        M, N, K, G, K // G, x2.stride(0), y.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, TG=tg, GROUP_M=8, HAS_Z=zeros is not None, HAS_BIAS=bias is not None,
        UPCAST=INTERPRET and x2.dtype == torch.bfloat16, num_warps=warps, num_stages=stages,
    )
    return y


def compile_gemv1_self_sm90(warps: int, r_p: int, nc_p: int, block_n: int = 16, block_w: int = 64):
    """Offline sm_90 compile of the CUDA-core GEMV with the one-launch EC (``_w4a16_gemv1_kernel``,
    SELF), for tests that read its layouts (the slot read must hold no replicated copies: ``ec_collect``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {p: "*bf16" for p in ("X", "S", "Z", "BIAS", "Y", "A", "B", "W1", "B1", "W2", "B2")}
    sig.update(QW="*i32", ALPHA="*fp32", SLOTS="*i64", GH="*fp32", TICK="*i64")
    sig.update({p: "i32" for p in "N K KW NG R D NC OWNERS MAG7 MAG11 MAG15 MAG19 MAG23".split()})
    consts = dict(G=128, BLOCK_N=block_n, BLOCK_W=block_w, PREFETCH=True, NIB=0, ASM=True, PER_CHANNEL=False,
                  HAS_Z=True, HAS_BIAS=False, HAS_EC=True, PUBLISH=True, PDL_WAIT=False, SELF=True, PW=512, PPC_P=4, NC_P=nc_p,
                  SPIN=4096, R_P=r_p, D_P=16, ACT=0, GH_COPIES=4, SLOT_T=_es.slot_rows(r_p, warps, nc_p))
    sig.update({c: "constexpr" for c in consts})
    src = ASTSource(fn=_w4a16_gemv1_kernel, signature=sig, constexprs=consts)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=1))


def can_implement(p) -> tuple:
    """(ok, reason) of whether the M = 1 CUDA-core GEMV (``_w4a16_gemv1_kernel``) runs problem ``p`` (a
    ``lowering.problem.Problem``): whole 32-column chunks that never straddle a group, a contiguous weight,
    zero points on every part of a concatenation or on none. (The M > 1 GEMV and the tiled GEMM take any
    shape the Triton kernels run: ``_triton.can_implement``.)"""
    if p.M != 1:
        return False, f"M = {p.M} (needs M = 1)"
    if p.K % 32 or not (p.G >= p.K or p.G % 32 == 0):
        return False, f"K = {p.K}, G = {p.G} (needs K % 32 == 0 and G >= K or G % 32 == 0)"
    if not p.weight_contiguous:
        return False, "the packed weight is not contiguous"
    if not p.zeros_consistent:
        return False, "zero points on some parts only"
    return True, "M = 1, 32-column chunks inside groups"
