"""Large-M W4A16 GEMM on warpgroup MMA with the expanded weight as the MMA's register operand (Gluon).

Reference: ``ops/w4a16_ref.py:w4a16_linear_ref``; the weight is expanded exactly as the reference
dequantizes it (bf16 ``(q - z) * s``), as in the plain kernel (``w4a16_gemm_wgmma.py``).

Why: the plain kernel expands each K step's weights into a shared-memory tile that both MMA warpgroups then
read, ~148 KB of shared-memory traffic per 2^21 multiply-adds, measured as its bound on an H200
(docs/kernels.md). Here the product is transposed, Y^T = W X^T: the weight is the MMA's A operand, taken
from registers, so its expanded tile never touches shared memory (~104 KB per 2^21). Measured on the H200: 10-20 % faster than the plain kernel everywhere, and faster than dequantize + cuBLAS at
M = 256 (0.59-0.75x on the large shapes) and M = 1024 (0.93-0.98x); slower at M = 4096.

Each thread's A fragment for a k16 block is the pairs (k = 2t, 2t + 1) and (k = 8 + 2t, 9 + 2t) of rows
g and g + 8 (t = lane % 4, g = lane / 4): byte t of two consecutive packed words. So every thread loads
the 8 words of its two rows for the step (the 4 lanes of a row group read the same words) and takes
byte t of each with one ``prmt`` whose selector holds t; ``lop3`` makes the bf16 pair ``128 + q`` and two
fmas give ``(q - z) * s`` exactly (integer zero points; or ``q * s`` without zero points). The tensor
[BNW, 8 words, 4 lanes, 2] laid out by ``_a_source_layout`` reshapes into the wgmma A layout with no data
movement (``convert_layout(..., assert_trivial=True)``).

The MMA reads its A registers while it runs, until the wait that retires it; ptxas does not keep later
instructions from rewriting them (a first version gave garbage for this reason). K steps
therefore go in pairs on two A tensors, each a dependency of the wait that retires its MMA, and the CPU
tests check the SASS for writes to in-flight A registers (``tests/lowering/sass_wgmma.py``).

The EC ("in_gemm" structure, ``dispatch/cuda.py:_ec_in_gemm``): with ``ec = (hg, B)`` B's rows [BNW, R_P] come in by
TMA at the start, and after the K loop the kernel (launched with programmatic dependent launch behind the
gate kernel that writes hg = alpha g h, when ``ec_wait``) executes ``griddepcontrol.wait``, loads its hg tile
[BMX, R_P] and adds ``B hg^T`` as one more MMA step with both operands in shared memory. Before that wait it
reads only what existed before the gate ran (x, the weight, its scales, B). Measured:
the fastest EC structure on 6 of the 8 shapes x M where the table runs this kernel, at 1.03-1.23x W4.

Config (BNW, BMX, STAGES, WARPS[, PF]): BNW weight rows (16 per warp, the MMA's M), BMX rows of x (the MMA's
N, <= 256), ring depth; PF = 1 loads each step's row scales one step ahead (default 0: where they are used), PF = 2
brings them through the TMA ring with the step's words (``ring_row_params``; faster); an optional sixth value KS
splits K into KS runs per output tile, each a CTA, whose fp32 partials the last run to arrive sums in run order
(``_ra_split_store``; without an EC only). (A stream-K tail of the last partial wave measured slower and was
removed: docs/kernels.md.) Small M (serving's decode batches): BMX = 16 / 32 with deep rings, ``SMALL_CONFIGS``.
Constraints: those of the plain kernel (``check_call``), and integer zero points (or none): ``takes``.
The output tile is stored transposed from the MMA layout (two-byte stores). The tuned table names it
``("wgmma_ra", BNW, BMX, STAGES, WARPS[, PF[, KS]])`` (``dispatch/route.py:gemm_route``).
"""
from __future__ import annotations

from typing import Optional

import torch

from .w4a16_gemm_wgmma import BK, HAS_WGMMA, SMEM_LIMIT, check_call, integer_zeros, launch_operands
from .w4a16_gemm_wgmma import takes as wg_takes
from .w4a16_gemm_wgmma import can_implement as wg_can_implement
from .layout_cache import derived_cached, derived_peek, grown_workspace  # noqa: F401
from ._triton import ACT_CODES, next_pow2
from .ec_gemm_self import R_SHRINK, SPLITS, self_split, self_takes, self_workspace, split_ok
from .w4a16_gemm_wgmma import _descriptor
from . import ec_self
from .w4a16_gemm_wgmma import _layout, desc_types
from .w4a16_words import compile_gluon_sm90

if HAS_WGMMA:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                  warpgroup_mma, warpgroup_mma_wait)

    from .ec_gemm_self import _D_MAX, ec_shrink_role, ec_wait_hg
    from .w4a16_gemv_tma_ec import _self_ticket as ec_ticket
    from .w4a16_gemm_wgmma import _BK, _request_step

    # One asm instance per (row, word, lane t): the bf16 pair of byte t. $0 out; $1-$2 the word, $3-$4 the
    # selector t | t << 4 | (4 + t) << 8 | (4 + t) << 12 (two copies each: pack = 2); $5 c, $6 s (bf16 pairs).
    # With zero points c = -(128 + z): (128 + q) + c = q - z exactly, then * s; without, c = -128 s and
    # (128 + q) s + c = q s, exact before its one rounding.
    _ASM_RA_Z = gl.constexpr("""{
    .reg .b32 t, p, one, nz;
    mov.b32 one, 0x3F803F80;
    mov.b32 nz, 0x80008000;
    shr.u32 t, $1, 4;
    prmt.b32 p, $1, t, $3;
    lop3.b32 p, p, 0x000F000F, 0x43004300, 0xEA;
    fma.rn.bf16x2 p, p, one, $5;
    fma.rn.bf16x2 $0, p, $6, nz;
    }""")
    _ASM_RA_NOZ = gl.constexpr("""{
    .reg .b32 t, p;
    shr.u32 t, $1, 4;
    prmt.b32 p, $1, t, $3;
    lop3.b32 p, p, 0x000F000F, 0x43004300, 0xEA;
    fma.rn.bf16x2 $0, p, $6, $5;
    }""")

    def _a_source_layout(warps: int):
        """[BNW = 16 warps, 8 words, 4 lanes t, 2 (h)]: reshaped to [BNW, 64] (k = 8 word + 2 t + h) it is the
        wgmma A layout (reg: h, row + 8, k 8 / 16 / 32; lanes: t, row g; warps: 16-row blocks)."""
        reg = [[0, 0, 0, 1], [8, 0, 0, 0], [0, 1, 0, 0], [0, 2, 0, 0], [0, 4, 0, 0]]
        lane = [[0, 0, 1, 0], [0, 0, 2, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]]
        warp = [[16 << j, 0, 0, 0] for j in range(warps.bit_length() - 1)]
        return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=lane, warp_bases=warp, block_bases=[],
                                          shape=[16 * warps, 8, 4, 2])

    def _rp_layout(warps: int):
        """[1, BNW = 16 warps]: each thread holds rows g and g + 8 of its warp's 16 (lane = 4 g + t, the 4 lanes t
        of a row group holding the same), i.e. the rows of ``_a_source_layout`` with a leading unit dimension."""
        return gl.DistributedLinearLayout(reg_bases=[[0, 8]], lane_bases=[[0, 0], [0, 0], [0, 1], [0, 2], [0, 4]],
                                          warp_bases=[[0, 16 << j] for j in range(warps.bit_length() - 1)],
                                          block_bases=[], shape=[1, 16 * warps])

    RP_SMEM = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)

    @gluon.jit
    def _row_params(S, Z, offs_n, mask_n, g, NG, HAS_Z: gl.constexpr):
        """(c, s) of rows ``offs_n`` in group g as bf16: c = -(128 + z), or -128 s without zero points."""
        s = gl.load(S + offs_n * NG + g, mask=mask_n, other=0.0)
        if HAS_Z:
            c = -(gl.load(Z + offs_n * NG + g, mask=mask_n, other=0.0) + 128.0)
        else:
            c = s * -128.0
        return c, s

    @gluon.jit
    def _ra_request(x_desc, w_desc, rp_desc, bar, xs_slot, ws_slot, rps_slot, off_m, off_n, k, pred,
                    G: gl.constexpr, RP: gl.constexpr):
        """Ask TMA for K step k's x tile and words (``_request_step``), with ``RP`` also its group's row
        parameters (c, s) [2, BNW] from the [2 NG, N] table (``ring_row_params``), on the same mbarrier."""
        if RP:
            mbarrier.expect(bar, x_desc.block_type.nbytes + w_desc.block_type.nbytes + rp_desc.block_type.nbytes,
                            pred=pred)
            tma.async_copy_global_to_shared(x_desc, [off_m, k * _BK], bar, xs_slot, pred=pred)
            tma.async_copy_global_to_shared(w_desc, [off_n, k * (_BK // 8)], bar, ws_slot, pred=pred)
            tma.async_copy_global_to_shared(rp_desc, [2 * (k * _BK // G), off_n], bar, rps_slot, pred=pred)
        else:
            _request_step(x_desc, w_desc, bar, xs_slot, ws_slot, off_m, off_n, k, pred)

    @gluon.jit
    def _ring_params(rps_slot, RPL: gl.constexpr, ln: gl.constexpr):
        """(c, s) [BNW] of a ring slot's row parameters, in the rows' layout ``ln`` (``RPL`` = the [1, BNW] layout
        that reshapes into it: each thread reads its own rows, g and g + 8 of its warp's 16)."""
        BNW: gl.constexpr = rps_slot.shape[1]
        c = gl.reshape(rps_slot.slice(0, 1).load(RPL), [BNW])
        s = gl.reshape(rps_slot.slice(1, 1).load(RPL), [BNW])
        return (gl.convert_layout(c, ln, assert_trivial=True), gl.convert_layout(s, ln, assert_trivial=True))

    @gluon.jit
    def _expand_a(words, sel, c, s, HAS_Z: gl.constexpr, BNW: gl.constexpr, a_layout: gl.constexpr):
        """words [BNW, 8] (replicated over the 4 lanes of a row group), sel [4], c / s [BNW] -> A [BNW, 64]."""
        w4 = gl.expand_dims(gl.expand_dims(words, 2), 3)  # [BNW, 8, 1, 1]
        t4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(sel, 0), 1), 3)  # [1, 1, 4, 1]
        c4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(c, 1), 2), 3)
        s4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(s, 1), 2), 3)
        w4, _ = gl.broadcast(w4, gl.full([BNW, 8, 4, 2], 0, gl.int32, w4.type.layout))
        if HAS_Z:
            d = gl.inline_asm_elementwise(_ASM_RA_Z, "=r,r,r,r,r,r,r", [w4, t4, c4, s4], dtype=gl.bfloat16,
                                          is_pure=True, pack=2)
        else:
            d = gl.inline_asm_elementwise(_ASM_RA_NOZ, "=r,r,r,r,r,r,r", [w4, t4, c4, s4], dtype=gl.bfloat16,
                                          is_pure=True, pack=2)
        return gl.convert_layout(gl.reshape(d, [BNW, _BK]), a_layout, assert_trivial=True)

    @gluon.jit
    def _ra_step(i, acc, keep, x_desc, w_desc, rp_desc, xs, ws, rps, bars, sel, c, s, S, Z, offs_n, mask_n, NG, n,
                 off_m, off_n, k0, base, G: gl.constexpr, PER_CHANNEL: gl.constexpr, HAS_Z: gl.constexpr,
                 STAGES: gl.constexpr, BNW: gl.constexpr, lw: gl.constexpr, a_layout: gl.constexpr,
                 PF: gl.constexpr, RP: gl.constexpr = False, RPL: gl.constexpr = None):
        """Step i of a run of n K steps starting at K step k0 (ring position base + i): expand, issue the MMA, wait for step i - 1's (``keep``, its A, stays
        alive until then), refill step i - 1's ring slot. Returns the accumulator, this step's A (to keep for the
        next wait) and the row parameters for step i + 1: with PF its loads are issued before this step's
        expansion (meant to take an L2 round trip off each step's path; measured 5-11 % slower, so off: docs/kernels.md
        measured on an H200), else this step's are loaded here, where they are used; with ``RP`` they come with the step's
        words through the ring (``ring_row_params``) and are read from shared memory after its wait."""
        r = base + i
        slot = r % STAGES
        if PER_CHANNEL or RP:
            cn, sn = c, s
        elif PF:
            cn, sn = _row_params(S, Z, offs_n, mask_n, gl.minimum((k0 + i + 1) * _BK // G, NG - 1), NG, HAS_Z)
        else:
            c, s = _row_params(S, Z, offs_n, mask_n, (k0 + i) * _BK // G, NG, HAS_Z)
            cn, sn = c, s
        mbarrier.wait(bars.index(slot), (r // STAGES) & 1)
        if RP:
            c, s = _ring_params(rps.index(slot), RPL, gl.SliceLayout(1, lw))
            cn, sn = c, s
        a = _expand_a(ws.index(slot).load(lw), sel, c, s, HAS_Z, BNW, a_layout)
        acc = warpgroup_mma(a, xs.index(slot).permute((1, 0)), acc, is_async=True)
        acc, keep = warpgroup_mma_wait(num_outstanding=1, deps=(acc, keep))  # step i - 1's MMAs are done
        gl.thread_barrier()  # ... in every warpgroup, and every warp has read step i - 1's words
        prev = gl.maximum(i - 1, 0)
        nt = prev + STAGES
        ps = (base + prev) % STAGES
        fence_async_shared()
        _ra_request(x_desc, w_desc, rp_desc, bars.index(ps), xs.index(ps), ws.index(ps), rps.index(ps), off_m, off_n,
                    k0 + nt, (i > 0) & (nt < n), G, RP)
        return acc, a, cn, sn

    @gluon.jit
    def _ra_run(x_desc, w_desc, rp_desc, xs, ws, rps, bars, S, Z, N, NG, off_m, off_n, k0, n, base, G: gl.constexpr,
                PER_CHANNEL: gl.constexpr, HAS_Z: gl.constexpr, STAGES: gl.constexpr, WARPS: gl.constexpr,
                SRC: gl.constexpr, PF: gl.constexpr, RP: gl.constexpr = False, RPL: gl.constexpr = None):
        """The accumulator [BNW, BMX] (fp32, every MMA retired) of n >= 1 K steps from K step k0 of the tile at
        (off_n, off_m), through the ring from position ``base`` (a whole tile: k0 = 0, n = K / BK, base = 0)."""
        BMX: gl.constexpr = x_desc.block_type.shape[0]
        BNW: gl.constexpr = w_desc.block_type.shape[0]
        src: gl.constexpr = SRC  # _a_source_layout(WARPS), made on the host
        lw: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, src))  # words [BNW, 8]
        ln: gl.constexpr = gl.SliceLayout(1, lw)  # rows [BNW]
        lt: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, src)))  # lanes t [4]
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                      instr_shape=[16, BMX, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        for i in gl.static_range(STAGES):
            j = (base + i) % STAGES
            _ra_request(x_desc, w_desc, rp_desc, bars.index(j), xs.index(j), ws.index(j), rps.index(j), off_m, off_n,
                        k0 + i, i < n, G, RP)

        tl_ = gl.arange(0, 4, layout=lt)
        sel = tl_ * 0x11 + (tl_ + 4) * 0x1100  # prmt: byte t of the word, byte t of word >> 4
        offs_n = off_n + gl.arange(0, BNW, layout=ln)
        mask_n = offs_n < N
        c, s = _row_params(S, Z, offs_n, mask_n, k0 * _BK // G, NG, HAS_Z)  # step 0's: per-channel / PF read these
        acc = gl.zeros([BNW, BMX], gl.float32, layout=mma)
        # The MMA reads A from registers while it runs, and ptxas does not stop the next step's expansion from
        # reusing them (seen in SASS: a first version's garbage). So steps go in pairs with two A tensors, and each
        # is a dependency of the wait that retires its MMA (the next step's wait(1)): the pair never shares
        # registers. ``tests/lowering/test_gemm_wgmma.py`` checks the SASS for writes to in-flight A registers.
        keep = gl.zeros([BNW, _BK], gl.bfloat16, a_layout)
        for j in range(n // 2):
            acc, a0, c, s = _ra_step(2 * j, acc, keep, x_desc, w_desc, rp_desc, xs, ws, rps, bars, sel, c, s, S, Z,
                                     offs_n, mask_n, NG, n, off_m, off_n, k0, base, G, PER_CHANNEL, HAS_Z, STAGES,
                                     BNW, lw, a_layout, PF, RP, RPL)
            acc, keep, c, s = _ra_step(2 * j + 1, acc, a0, x_desc, w_desc, rp_desc, xs, ws, rps, bars, sel, c, s, S,
                                       Z, offs_n, mask_n, NG, n, off_m, off_n, k0, base, G, PER_CHANNEL, HAS_Z,
                                       STAGES, BNW, lw, a_layout, PF, RP, RPL)
        if n % 2 == 1:
            acc, keep, c, s = _ra_step(n - 1, acc, keep, x_desc, w_desc, rp_desc, xs, ws, rps, bars, sel, c, s, S, Z,
                                       offs_n, mask_n, NG, n, off_m, off_n, k0, base, G, PER_CHANNEL, HAS_Z, STAGES,
                                       BNW, lw, a_layout, PF, RP, RPL)
        acc, keep = warpgroup_mma_wait(num_outstanding=0, deps=(acc, keep))
        return acc

    @gluon.jit
    def _ra_store(acc, Y, BIAS, M, N, off_m, off_n, HAS_BIAS: gl.constexpr):
        """Y[off_m + j, off_n + i] = acc[i, j] (+ bias), bf16, stored transposed from the MMA layout."""
        mma: gl.constexpr = acc.type.layout
        BNW: gl.constexpr = acc.type.shape[0]
        BMX: gl.constexpr = acc.type.shape[1]
        offs_w = off_n + gl.arange(0, BNW, layout=gl.SliceLayout(1, mma))  # Y's columns
        offs_x = off_m + gl.arange(0, BMX, layout=gl.SliceLayout(0, mma))  # Y's rows
        if HAS_BIAS:
            acc = acc + gl.expand_dims(gl.load(BIAS + offs_w, mask=offs_w < N, other=0.0).to(gl.float32), 1)
        mask = gl.expand_dims(offs_w < N, 1) & gl.expand_dims(offs_x < M, 0)
        gl.store(Y + gl.expand_dims(offs_x, 0) * N + gl.expand_dims(offs_w, 1), acc.to(gl.bfloat16), mask=mask)

    @gluon.jit
    def _ra_split_store(acc, Y, BIAS, WS, CNT, M, N, off_m, off_n, tile, run, KS: gl.constexpr,
                        HAS_BIAS: gl.constexpr):
        """K-split epilogue: run ``run`` of the tile's KS writes its fp32 partial into its own slot of WS
        ([KS, M, N]); the last run to arrive (acq_rel counter per tile) sums the slots in slot order - the same
        bits whatever the arrival order -, adds the bias, stores Y (bf16) and resets the counter for the next
        launch (CUDA-graph replays need no memset)."""
        mma: gl.constexpr = acc.type.layout
        BNW: gl.constexpr = acc.type.shape[0]
        BMX: gl.constexpr = acc.type.shape[1]
        offs_w = off_n + gl.arange(0, BNW, layout=gl.SliceLayout(1, mma))  # Y's columns
        offs_x = off_m + gl.arange(0, BMX, layout=gl.SliceLayout(0, mma))  # Y's rows
        mask = gl.expand_dims(offs_w < N, 1) & gl.expand_dims(offs_x < M, 0)
        slot = gl.expand_dims(offs_x, 0) * N + gl.expand_dims(offs_w, 1)
        gl.store(WS + run * M * N + slot, acc, mask=mask)
        gl.thread_barrier()  # every thread's partial is written before the CTA's arrival is published
        old = gl.atomic_add(CNT + tile, 1, sem="acq_rel")
        if old == KS - 1:
            tot = gl.zeros_like(acc)
            for j in gl.static_range(KS):
                tot += gl.load(WS + j * M * N + slot, mask=mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                tot = tot + gl.expand_dims(gl.load(BIAS + offs_w, mask=offs_w < N, other=0.0).to(gl.float32), 1)
            gl.store(Y + slot, tot.to(gl.bfloat16), mask=mask)
            gl.atomic_xchg(CNT + tile, 0)

    @gluon.jit
    def _ra_tile(tile, x_desc, w_desc, rp_desc, hg_desc, b_desc, Y, S, Z, BIAS, M, N, K, NG, xs, ws, rps, bars, bs,
                 hgs, ecbars, HG, FLAGS, tag, G: gl.constexpr, PER_CHANNEL: gl.constexpr, HAS_Z: gl.constexpr,
                 HAS_BIAS: gl.constexpr, STAGES: gl.constexpr, WARPS: gl.constexpr, SRC: gl.constexpr,
                 PF: gl.constexpr, HAS_EC: gl.constexpr, EC_WAIT: gl.constexpr, EC_SELF: gl.constexpr,
                 SPLIT: gl.constexpr = 1, RP: gl.constexpr = False, RPL: gl.constexpr = None,
                 KS: gl.constexpr = 1, WS=None, CNT=None):
        """Output tile ``tile`` (x blocks fastest): the K loop, then with an EC its step, then the store. With
        KS > 1 (no EC) ``tile`` counts K runs, KS per output tile: this CTA runs one of them (``_ra_split_store``)."""
        BMX: gl.constexpr = x_desc.block_type.shape[0]
        BNW: gl.constexpr = w_desc.block_type.shape[0]
        if KS > 1:  # ``tile`` counts K runs: this CTA's run of its output tile
            run = tile % KS
            tile = tile // KS
        num_m = gl.cdiv(M, BMX)
        m_blk = tile % num_m
        off_m = m_blk * BMX
        off_n = (tile // num_m) * BNW
        if KS > 1:
            per = K // _BK // KS
            acc = _ra_run(x_desc, w_desc, rp_desc, xs, ws, rps, bars, S, Z, N, NG, off_m, off_n, run * per, per, 0, G,
                          PER_CHANNEL, HAS_Z, STAGES, WARPS, SRC, PF, RP, RPL)
            _ra_split_store(acc, Y, BIAS, WS, CNT, M, N, off_m, off_n, tile, run, KS, HAS_BIAS)
        else:
            if HAS_EC:  # the EC's B rows [BNW, R_P] arrive while the loop runs; alpha g h [BMX, R_P] after it
                mbarrier.expect(ecbars.index(0), b_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(b_desc, [off_n, 0], ecbars.index(0), bs)
            acc = _ra_run(x_desc, w_desc, rp_desc, xs, ws, rps, bars, S, Z, N, NG, off_m, off_n, 0, K // _BK, 0, G,
                          PER_CHANNEL, HAS_Z, STAGES, WARPS, SRC, PF, RP, RPL)
            if HAS_EC:  # one more K step: Y^T += B (alpha g h)^T, both operands from shared memory
                if EC_SELF:  # alpha g h from this launch's shrink role of the block (ec_gemm_self.py)
                    ec_wait_hg(HG, FLAGS, hgs, m_blk, M, tag, WARPS, SPLIT)
                    fence_async_shared()
                    gl.thread_barrier()
                else:
                    if EC_WAIT:  # launched with PDL behind the gate kernel: g * h is complete after this
                        gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32,
                                                  is_pure=False, pack=1)
                    mbarrier.expect(ecbars.index(1), hg_desc.block_type.nbytes)
                    tma.async_copy_global_to_shared(hg_desc, [off_m, 0], ecbars.index(1), hgs)
                    mbarrier.wait(ecbars.index(1), 0)
                mbarrier.wait(ecbars.index(0), 0)
                acc = warpgroup_mma(bs, hgs.permute((1, 0)), acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))

            _ra_store(acc, Y, BIAS, M, N, off_m, off_n, HAS_BIAS)

    @gluon.jit
    def _w4a16_gemm_wgmma_ra_kernel(x_desc, w_desc, rp_desc, hg_desc, b_desc, Y, S, Z, BIAS, M, N, K, NG,
                                    a_desc, xr_desc, HG, W1, B1, W2, B2, ALPHA, FLAGS, TICK, R, D, WS, CNT,
                                    G: gl.constexpr, PER_CHANNEL: gl.constexpr, HAS_Z: gl.constexpr,
                                    HAS_BIAS: gl.constexpr, STAGES: gl.constexpr, WARPS: gl.constexpr,
                                    SRC: gl.constexpr, PF: gl.constexpr, HAS_EC: gl.constexpr = False,
                                    EC_WAIT: gl.constexpr = False, EC_SELF: gl.constexpr = False,
                                    ACT: gl.constexpr = 0, SPLIT: gl.constexpr = 1, RDEEP: gl.constexpr = 1,
                                    RP: gl.constexpr = False, RPL: gl.constexpr = None, KS: gl.constexpr = 1):
        """One CTA: an output tile, or with ``EC_SELF`` one of the SPLIT shrink roles of an x block
        (``ec_gemm_self.py``; a_desc, xr_desc, HG ... D are their operands, stand-ins otherwise; RDEEP: the roles'
        ring is STAGES x RDEEP deep). ``RP``: the row parameters come
        through the ring from ``rp_desc`` (``ring_row_params``; a stand-in otherwise)."""
        BMX: gl.constexpr = x_desc.block_type.shape[0]
        BNW: gl.constexpr = w_desc.block_type.shape[0]
        BKW: gl.constexpr = _BK // 8
        xs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BMX, _BK], x_desc.layout)
        ws = gl.allocate_shared_memory(gl.int32, [STAGES, BNW, BKW], w_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)
        rps = ws
        if RP:
            rps = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 2, BNW], rp_desc.layout)
        bs = xs  # (stand-ins without an EC)
        hgs = xs
        ecbars = bars
        rbars = bars
        if HAS_EC:
            bs = gl.allocate_shared_memory(gl.bfloat16, b_desc.block_type.shape, b_desc.layout)
            hgs = gl.allocate_shared_memory(gl.bfloat16, hg_desc.block_type.shape, hg_desc.layout)
            ecbars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            mbarrier.init(ecbars.index(0), count=1)
            mbarrier.init(ecbars.index(1), count=1)
        if EC_SELF:
            as_ = gl.allocate_shared_memory(gl.bfloat16, [STAGES * RDEEP, a_desc.block_type.shape[0], _BK],
                                            a_desc.layout)
            rbars = gl.allocate_shared_memory(gl.int64, [STAGES * RDEEP, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(STAGES * RDEEP):
                mbarrier.init(rbars.index(i), count=1)
            gw: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0, 1])  # [r, d], r contiguous
            w1s = gl.allocate_shared_memory(gl.float32, [a_desc.block_type.shape[0], _D_MAX], gw)
            w2s = gl.allocate_shared_memory(gl.float32, [a_desc.block_type.shape[0], _D_MAX], gw)
            tag, role = ec_ticket(TICK)
            num_m = gl.cdiv(M, BMX)
            if role < num_m * SPLIT:
                ec_shrink_role(xr_desc, a_desc, xs, as_, w1s, w2s, rbars, role, M, K, W1, B1, W2, B2, ALPHA, HG,
                               FLAGS, tag, R, D, hg_desc.block_type.shape[1], STAGES, WARPS, ACT, SPLIT)
            else:
                _ra_tile(role - num_m * SPLIT, x_desc, w_desc, rp_desc, hg_desc, b_desc, Y, S, Z, BIAS, M, N, K, NG,
                         xs, ws, rps, bars, bs, hgs, ecbars, HG, FLAGS, tag, G, PER_CHANNEL, HAS_Z, HAS_BIAS, STAGES,
                         WARPS, SRC, PF, HAS_EC, EC_WAIT, EC_SELF, SPLIT, RP, RPL, 1, WS, CNT)
        else:
            _ra_tile(gl.program_id(0), x_desc, w_desc, rp_desc, hg_desc, b_desc, Y, S, Z, BIAS, M, N, K, NG, xs, ws,
                     rps, bars, bs, hgs, ecbars, HG, FLAGS, 0, G, PER_CHANNEL, HAS_Z, HAS_BIAS, STAGES, WARPS, SRC,
                     PF, HAS_EC, EC_WAIT, EC_SELF, 1, RP, RPL, KS, WS, CNT)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))
        if HAS_EC:
            mbarrier.invalidate(ecbars.index(0))
            mbarrier.invalidate(ecbars.index(1))
        if EC_SELF:
            for i in gl.static_range(STAGES * RDEEP):
                mbarrier.invalidate(rbars.index(i))


# (BNW, BMX, STAGES, WARPS[, PF]). 128 x 256 tiles feed each expanded weight tile to 256 rows of x (the
# widest MMA): the 128 x 128 tile was 1.8x slower . The 4-warp 64 x 256 tile doubles the CTA count where the
# grid would be small (N = 4096 at M = 256), and 64 x 128 doubles it again (there 64 tiles of 64 x 256 leave half
# the H200's 132 SMs idle). PF = 1 variants are the lab's (docs/kernels.md).
# PF = 2 (row parameters through the TMA ring) first: same bits, and in one run (same process, M = 1024, H200)
# 128 x 256 x 4 went 146.1 -> 121.9 us on 4096x11008 and 226.7 -> 200.0 on 8192^2 (11008x4096: 150.8 -> 151.0,
# where the 3-stage ring measured slower, 149.7 -> 159.0); PF = 0 stays searched beside it.
_TILES = [(128, 256, 3, 8), (128, 256, 4, 8), (64, 256, 4, 4), (64, 128, 4, 4)]
RA_CONFIGS = [(128, 256, 4, 8, 2), (128, 256, 3, 8, 2), (64, 256, 4, 4, 2), (64, 128, 4, 4, 2)] + _TILES


BMXS = (16, 32, 64, 128, 256)  # the MMA's N: x rows per tile (16 and 32 for serving's decode batches)
# Small-M tiles: BMX = 16 / 32 leaves the shared memory to a deep ring (a stage is ~4 KB), which the weight stream
# needs to keep enough bytes in flight per SM when there is little MMA work to hide it behind. Measured (H200,
# 2026-12-05, benchmarks/small_m_gemm.py): 0.62-0.74x cuBLAS on 28672x8192 and 37888x3584 at M = 2..32, but slower
# than the Triton GEMM where N / 64 tiles leave SMs idle (3584-wide outputs); the 8-stage ring won everywhere.
_WHOLE_K = [(64, 16, 8, 4, 2), (64, 16, 12, 4, 2), (64, 16, 16, 4, 2), (128, 16, 8, 8, 2), (64, 32, 8, 4, 2),
            (64, 32, 12, 4, 2), (128, 32, 8, 8, 2), (64, 64, 8, 4, 2)]
# The same tiles with K split into KS runs per output tile (a sixth value): KS times the CTAs where N / 64 tiles leave
# SMs idle, each run's fp32 partial summed in run order (deterministic). Measured (H100, 2026-12-05, same run,
# benchmarks/small_m_gemm.py; GPU tests in tests/lowering/test_gemm_wgmma.py): 4096x4096 at M = 2..16 11.1-11.8 us
# against 19.8-20.4 whole-K and 15.8-16.9 cuBLAS; 3584x18944 27.5 against 78.5; 8192x8192 24.7 against 36.3; on the
# widest outputs (28672x8192, 37888x3584) no faster than whole K.
KSPLIT_CONFIGS = [(64, 16, 8, 4, 2, 2), (64, 16, 8, 4, 2, 4), (64, 16, 6, 4, 2, 8), (64, 32, 8, 4, 2, 2),
                  (64, 32, 8, 4, 2, 4), (64, 64, 6, 4, 2, 2), (64, 64, 6, 4, 2, 4)]
SMALL_CONFIGS = _WHOLE_K + KSPLIT_CONFIGS
KSPLITS = (1, 2, 4, 8)


def ra_ksplit(config: tuple, K: int) -> int:
    """The K split a config runs at K (its sixth value KS, default 1): halved until it divides K's 64-column steps
    (each run takes whole steps and none is empty)."""
    ks = int(config[5]) if len(config) > 5 else 1
    steps = K // BK
    while ks > 1 and steps % ks:
        ks //= 2
    return ks


def check_ra_config(config: tuple) -> tuple[int, int, int, int, int]:
    """(BNW, BMX, STAGES, WARPS, PF) of a config (PF defaults to 0), or a ValueError naming the rule it breaks."""
    vals = tuple(int(v) for v in config)
    if len(vals) not in (4, 5, 6):
        raise ValueError(f"W4A16 register-operand GEMM config {config}: expected (BNW, BMX, STAGES, WARPS[, PF[, KS]])")
    if len(vals) == 6 and vals[5] not in KSPLITS:
        raise ValueError(f"W4A16 register-operand GEMM config {config}: KS (K runs per output tile) must be one of "
                         f"{KSPLITS}")
    bnw, bmx, stages, warps, pf = (vals + (0,))[:5]  # PF defaults to 0; a sixth value (KS) is checked above
    if bnw != 16 * warps or warps not in (4, 8) or bmx not in BMXS or stages < 2 or pf not in (0, 1, 2):
        raise ValueError(f"W4A16 register-operand GEMM config {config}: needs WARPS in {{4, 8}}, BNW = 16 WARPS, "
                         f"BMX in {set(BMXS)}, STAGES >= 2 and PF in {{0, 1, 2}}")
    return bnw, bmx, stages, warps, pf


_RING_PARAMS: dict = {}


def ring_row_params(scales: torch.Tensor, zeros: Optional[torch.Tensor]) -> torch.Tensor:
    """The row parameters as the expansion uses them, [2 NG, N] bf16: row 2 g holds c = -(128 + z) (-128 s
    without zero points) and row 2 g + 1 s, of scale group g for every output row; made once per weight
    (``derived_cached``). Why (PF = 2): loaded from [N, NG] in the K loop, each step's 2-byte loads of 128 rows'
    parameters touch 8-16 sectors per warp and wait an L2 round trip on the expansion's path (an earlier version's
    long-scoreboard stalls); from this table one TMA box [2, BNW] brings a step's parameters with its words, on
    the same mbarrier. Exact: c is an integer below 256 (or s times a power of two), as the kernel computes it.
    Like the other derived weight layouts, a CUDA graph captured with it keeps its address: update the scales in
    place only before capturing (an in-place update remakes the table at the next eager call)."""
    def make():
        c = -(zeros.float() + 128.0) if zeros is not None else scales.float() * -128.0
        return torch.stack([c.t().to(torch.bfloat16), scales.t().to(torch.bfloat16)], 1).reshape(
            -1, scales.shape[0]).contiguous()

    return derived_cached(_RING_PARAMS, [scales, zeros], make)


def ring_params_wanted(config: tuple, G: int, K: int, N: int) -> bool:
    """Whether a launch in ``config`` reads its row parameters through the ring: PF = 2, grouped (not per-channel:
    G < K, as ``check_call`` decides), and N % 8 == 0 (the table's rows 16-byte aligned for TMA)."""
    return check_ra_config(config)[4] == 2 and G < K and N % 8 == 0


MAX_OUT_ELEMENTS = 2 ** 31  # the transposed epilogue's element offsets are 32-bit


def takes(x2: torch.Tensor, N: int, G: int, scales, zeros, bias) -> bool:
    """Whether the kernel can run this call here: the plain kernel's ``takes`` (shapes, dtypes, sm_90),
    integer zero points or none, and M N < 2^31 (what the table dispatch asks before choosing it)."""
    return (wg_takes(x2, N, G, scales, zeros, bias) and x2.shape[0] * N < MAX_OUT_ELEMENTS
            and (zeros is None or integer_zeros(zeros)))


def w4a16_gemm_wgmma_ra(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                        zeros: Optional[torch.Tensor], G: int, bias: Optional[torch.Tensor],
                        config: tuple = RA_CONFIGS[0], out: Optional[torch.Tensor] = None,
                        ec: Optional[tuple] = None, ec_wait: bool = False) -> torch.Tensor:
    """Y[M, N] = x2 @ dequant(W)^T (+ bias) with the weight as the MMA's register operand (CUDA sm_90+ only).
    Arguments as ``w4a16_gemm_wgmma``; zero points must be integers (``integer_zeros``) or absent.
    ``ec`` = (hg, B): ``hg B^T`` added as one more K step (hg the EC's ``alpha g h`` [M, R_P], B [N, R],
    as ``w4a16_gemm_wgmma``); ``ec_wait``: launched with programmatic dependent launch behind the kernel
    that writes hg (which must trigger its dependents), waiting only before hg is read. A config's K split
    (sixth value, ``ra_ksplit``) applies without ``ec`` only: the EC's step needs the whole K in one CTA."""
    bnw, bmx, stages, warps, pf = check_ra_config(config)
    M, N, K, per_channel = check_call("w4a16_gemm_wgmma_ra", x2, qweight, scales, zeros, G, bias, out)
    if zeros is not None and not integer_zeros(zeros):
        raise ValueError("w4a16_gemm_wgmma_ra: zero points must be integers of magnitude < 128 (use the plain "
                         "kernel, w4a16_gemm_wgmma, for fractional ones)")
    if M * N >= MAX_OUT_ELEMENTS:
        raise ValueError(f"w4a16_gemm_wgmma_ra: output [{M}, {N}] has 2^31 elements or more (32-bit offsets); "
                         f"use w4a16_gemm_wgmma")
    if ec is not None and ec_wait and not x2.is_contiguous():
        raise ValueError("w4a16_gemm_wgmma_ra: with ec_wait x2 must be contiguous (a copy made here would be a "
                         "kernel between the gate and this PDL launch, read before the wait)")
    if ec is not None and ec_wait and ring_params_wanted(config, G, K, N) and derived_peek(
            _RING_PARAMS, [scales, zeros]) is None:
        raise ValueError("w4a16_gemm_wgmma_ra: with ec_wait and PF = 2 the row-parameter table must exist before the "
                         "gate kernel runs (call ring_row_params(scales, zeros) first: made here it would be kernels "
                         "between the gate and this PDL launch, read before the wait)")
    y, xd, wd, hd, bd, r_p = launch_operands("w4a16_gemm_wgmma_ra", x2, qweight, out, ec, M, N, bmx, bnw)
    return _launch(x2, y, xd, wd, hd, bd, r_p, scales, zeros, bias, M, N, K, G, per_channel,
                   (bnw, bmx, stages, warps, pf), ec is not None, ec is not None and ec_wait, None,
                   ks=1 if ec is not None else ra_ksplit(config, K))


def _launch(x2, y, xd, wd, hd, bd, r_p, scales, zeros, bias, M, N, K, G, per_channel, cfg, has_ec, ec_wait,
            self_ops, ks: int = 1):
    """Launch the kernel (a grid of output tiles; with ``self_ops`` = (a_desc, x part descriptor, hg, W1, b1, W2,
    b2, alpha, flags, ticket, R, D, act code, split) also ``split`` shrink roles per x block, whose ring is
    ``split`` times deeper where the shared memory allows: ``role_depth``), the ring shortened until it fits."""
    bnw, bmx, stages, warps, pf = cfg
    rp = ring_params_wanted(cfg, G, K, N)
    pf = pf if pf < 2 else 0
    ec_self = self_ops is not None
    if has_ec:
        while stages > 2 and ra_smem_bytes((bnw, bmx, stages, warps, 2 * rp), r_p, ec_self) > SMEM_LIMIT:
            stages -= 1
    rpd = wd
    if rp:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        table = ring_row_params(scales, zeros)
        rpd = TensorDescriptor(table, list(table.shape), list(table.stride()), [2, bnw], RP_SMEM)
    if self_ops is None:
        self_ops = (xd, xd, scales, scales, scales, scales, scales, scales, scales, scales, 1, 1, 0, 0)
    ad, xrd, hg, w1, b1, w2, b2, alpha, flags, tick, R, D, act, split = self_ops
    rdeep = role_depth((bnw, bmx, stages, warps, 2 * rp), r_p, split)
    num_m = -(-M // bmx)
    tiles = num_m * -(-N // bnw)
    ws, cnt = ks_workspace(y.device, ks * M * N, tiles) if ks > 1 else (scales, scales)
    grid = (tiles * ks + num_m * split,)
    _w4a16_gemm_wgmma_ra_kernel[grid](
        xd, wd, rpd, hd, bd, y, scales, zeros if zeros is not None else scales, bias if bias is not None else scales,
        M, N, K, scales.shape[1], ad, xrd, hg, w1, b1, w2, b2, alpha, flags, tick, R, D, ws, cnt,
        G=min(G, K), PER_CHANNEL=per_channel, HAS_Z=zeros is not None,
        HAS_BIAS=bias is not None, STAGES=stages, WARPS=warps, SRC=_a_source_layout(warps), PF=pf,
        HAS_EC=has_ec, EC_WAIT=ec_wait, EC_SELF=ec_self, ACT=act, SPLIT=max(split, 1), RDEEP=rdeep, RP=rp,
        RPL=_rp_layout(warps) if rp else None, KS=ks, num_warps=warps,
        **({"launch_pdl": True} if ec_wait else {}))
    return y


_KS_WS: dict = {}


def ks_workspace(device: torch.device, floats: int, counters: int) -> tuple:
    """The K split's fp32 partial slots [KS, M, N] and per-tile counters (``layout_cache.grown_workspace``)."""
    return grown_workspace(_KS_WS, device, floats, counters, "the K-split register-operand GEMM")


_PADDED_A: dict = {}


def w4a16_gemm_wgmma_ra_ec_self(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                                zeros: Optional[torch.Tensor], G: int, bias: Optional[torch.Tensor], A, B, W1, b1,
                                W2, b2, alpha, act: str = "silu", config: tuple = RA_CONFIGS[0],
                                out: Optional[torch.Tensor] = None, hg: Optional[torch.Tensor] = None,
                                split: Optional[int] = None) -> torch.Tensor:
    """``x2 @ dequant(W)^T (+ bias) + alpha B (g * A x2)`` in one launch: the output tiles plus 1-4 shrink roles
    per block of x rows (the "in_gemm_self" EC structure, ``ec_gemm_self.py``). B bf16 [N, R] contiguous with
    R % 8 == 0 (the caller pads it: ``dispatch/cuda.py:_ec_in_gemm``); A bf16 [R <= 64, K] contiguous (``ec_gemm_self.
    self_takes``); the rest as ``w4a16_gemm_wgmma_ra``. ``hg``: the [M, R_P] bf16 buffer the shrink roles write
    ``alpha g h`` into (tests read it; default a fresh one). ``split``: shrink roles per x block, each taking
    BMX / split tokens (1, 2 or 4; default ``ec_gemm_self.self_split`` of the grid); each role's ring is
    ``split`` times deeper where the shared memory allows (``role_depth``)."""
    bnw, bmx, stages, warps, pf = check_ra_config(config)
    M, N, K, per_channel = check_call("w4a16_gemm_wgmma_ra_ec_self", x2, qweight, scales, zeros, G, bias, out)
    x2 = x2.contiguous()  # (once: the tiles' and the shrink roles' descriptors read the same copy)
    why = self_takes(A, B, W1, K)
    if why is not None:
        raise ValueError(f"w4a16_gemm_wgmma_ra_ec_self: {why}")
    R, D = A.shape[0], W1.shape[0]
    shapes = {"W1": (W1, (D, R)), "b1": (b1, (D,)), "W2": (W2, (R, D)), "b2": (b2, (R,))}
    for name, (t, want) in shapes.items():
        if tuple(t.shape) != want or not t.is_contiguous() or t.device != x2.device:
            raise ValueError(f"w4a16_gemm_wgmma_ra_ec_self: EC {name} {tuple(t.shape)} on {t.device} (contiguous: "
                             f"{t.is_contiguous()}); needs a contiguous {want} on {x2.device} (rank {R}, gate {D})")
    if B.dim() != 2 or B.shape[0] != N or B.shape[1] < R:
        raise ValueError(f"w4a16_gemm_wgmma_ra_ec_self: EC B {tuple(B.shape)}; needs [N = {N}, >= R = {R}]")
    if alpha.numel() != 1 or alpha.device != x2.device:
        raise ValueError(f"w4a16_gemm_wgmma_ra_ec_self: EC alpha {tuple(alpha.shape)} on {alpha.device}; needs one "
                         f"value on {x2.device}")
    if zeros is not None and not integer_zeros(zeros):
        raise ValueError("w4a16_gemm_wgmma_ra_ec_self: zero points must be integers of magnitude < 128")
    if M * N >= MAX_OUT_ELEMENTS:
        raise ValueError(f"w4a16_gemm_wgmma_ra_ec_self: output [{M}, {N}] has 2^31 elements or more")
    if act not in ACT_CODES:
        raise ValueError(f"w4a16_gemm_wgmma_ra_ec_self: act={act!r}; expected one of {sorted(ACT_CODES)}")

    def padded():  # [64, K]: the shrink MMA's M; rows past R are zeros (h's rows there are 0, so g h is)
        a = torch.zeros(R_SHRINK, K, dtype=torch.bfloat16, device=A.device)
        a[:R] = A
        return a

    a64 = A if R == R_SHRINK else derived_cached(_PADDED_A, [A], padded)
    r_p = max(16, next_pow2(R))
    if hg is None:
        hg = torch.empty(M, r_p, dtype=torch.bfloat16, device=x2.device)
    elif hg.shape != (M, r_p) or hg.dtype != torch.bfloat16 or not hg.is_contiguous():
        raise ValueError(f"w4a16_gemm_wgmma_ra_ec_self: hg {hg.dtype} {tuple(hg.shape)}; needs a contiguous bf16 "
                         f"[{M}, {r_p}]")
    y, xd, wd, hd, bd, r_p = launch_operands("w4a16_gemm_wgmma_ra_ec_self", x2, qweight, out, (hg, B), M, N, bmx,
                                             bnw)
    num_m, tiles = -(-M // bmx), -(-M // bmx) * -(-N // bnw)
    if split is None:
        sms = ec_self.sm_count(x2.device)
        split = 1 if sms is None else self_split(tiles, num_m, bmx, sms)
    if not split_ok(split, bmx):
        raise ValueError(f"w4a16_gemm_wgmma_ra_ec_self: split={split}; needs one of {SPLITS} with BMX / split >= 64 "
                         f"(config BMX = {bmx})")
    tick, flags = self_workspace(A, tiles + num_m * split, num_m * split)
    ad = _descriptor(a64, [R_SHRINK, BK], gl.bfloat16)
    xrd = xd if split == 1 else _descriptor(x2, [bmx // split, BK], gl.bfloat16)
    ops = (ad, xrd, hg, W1, b1, W2, b2, alpha, flags, tick, R, D, ACT_CODES[act], split)
    return _launch(x2, y, xd, wd, hd, bd, r_p, scales, zeros, bias, M, N, K, G, per_channel,
                   (bnw, bmx, stages, warps, pf), True, False, ops)


def ra_smem_bytes(config: tuple, r_p: int = 0, ec_self: bool = False, rdeep: int = 1) -> int:
    """Shared memory of a config: the ring (x and word tiles; with PF = 2 the row parameters), and with an EC of R_P
    columns its B rows and alpha g h tiles; ``ec_self``: also the shrink role's ring of A tiles [64, BK] (STAGES x
    ``rdeep`` slots, a barrier each) and its gate weights."""
    bnw, bmx, stages, _, pf = check_ra_config(config)
    return (stages * (bmx * BK * 2 + bnw * BK // 2 + 8 + (4 * bnw if pf == 2 else 0)) + (bnw + bmx) * r_p * 2 + 16
            + (stages * rdeep * (64 * BK * 2 + 8) + 2 * 64 * 16 * 4 + 128 if ec_self else 0))


def role_depth(config: tuple, r_p: int, split: int) -> int:
    """How many times STAGES deep the shrink roles' ring is ("in_gemm_self"): ``split`` where a config's shared
    memory with the deeper ring fits (``ra_smem_bytes``), else 1."""
    return split if split > 1 and ra_smem_bytes(config, r_p, True, split) <= SMEM_LIMIT else 1


def compile_ra_sm90(config: tuple, G: int = 128, per_channel: bool = False, has_z: bool = True,
                    has_bias: bool = True, r_p: int = 0, ec_wait: bool = True,
                    ec_self: bool = False, split: int = 1) -> dict:
    """Offline sm_90 compile (``w4a16_words.compile_gluon_sm90``); ``ec_self``: the in-launch shrink roles
    (``ec_gemm_self.py``; needs ``r_p``), EC_WAIT off, ``split`` roles per x block, their ring as deep as the launch
    makes it (``role_depth``)."""

    bnw, bmx, stages, warps, pf = check_ra_config(config)
    if ec_self and not r_p:
        raise ValueError("compile_ra_sm90: ec_self needs the EC step (r_p > 0)")

    if ec_self and not split_ok(split, bmx):
        raise ValueError(f"compile_ra_sm90: split={split}; needs one of {SPLITS} with BMX / split >= 64 (BMX = {bmx})")
    rp = pf == 2 and not per_channel
    while r_p and stages > 2 and ra_smem_bytes((bnw, bmx, stages, warps, 2 * rp), r_p, ec_self) > SMEM_LIMIT:
        stages -= 1
    rdeep = role_depth((bnw, bmx, stages, warps, 2 * rp), r_p, split) if ec_self else 1
    dt = desc_types(bmx, bnw, r_p)
    dt["rp_desc"] = f"tensordesc<bf16[2, {bnw}],{RP_SMEM!r}>" if rp else dt["w_desc"]
    a_t = f"tensordesc<bf16[64, {BK}],{_layout([64, BK], gl.bfloat16)!r}>" if ec_self else dt["x_desc"]
    xr_t = f"tensordesc<bf16[{bmx // split}, {BK}],{_layout([bmx // split, BK], gl.bfloat16)!r}>"
    types = dict(**dt, Y="*bf16", S="*bf16", Z="*bf16", BIAS="*bf16", M="i32", N="i32", K="i32", NG="i32",
                 a_desc=a_t, xr_desc=xr_t, HG="*bf16", W1="*bf16", B1="*bf16", W2="*bf16", B2="*bf16", ALPHA="*fp32",
                 FLAGS="*i32", TICK="*i64", R="i32", D="i32", WS="*fp32", CNT="*i32")
    ks = int(config[5]) if len(config) > 5 and not r_p else 1
    consts = dict(G=G, PER_CHANNEL=per_channel, HAS_Z=has_z, HAS_BIAS=has_bias, STAGES=stages, WARPS=warps,
                  SRC=_a_source_layout(warps), PF=pf if pf < 2 else 0, HAS_EC=bool(r_p), RP=rp,
                  RPL=_rp_layout(warps) if rp else None, EC_WAIT=bool(r_p) and ec_wait and not ec_self,
                  EC_SELF=ec_self, ACT=0, SPLIT=split, RDEEP=rdeep, KS=ks)
    return compile_gluon_sm90(_w4a16_gemm_wgmma_ra_kernel, types, consts, warps)


def can_implement(p) -> tuple:
    """(ok, reason) of whether the register-operand GEMM runs problem ``p`` (a ``lowering.problem.Problem``): as
    the plain kernel (``w4a16_gemm_wgmma.can_implement``), integer zero points (or none; asked of the probe only
    here, the check reads the tensor), M N < 2^31."""
    ok, why = wg_can_implement(p)
    if not ok:
        return ok, why
    if p.M * p.N >= MAX_OUT_ELEMENTS:
        return False, f"M N = {p.M * p.N} >= 2^31"
    zi = p.zeros_integer if p.zeros_integer is not None else (p.zeros_probe() if p.zeros_probe else None)
    if p.has_zeros and zi is False:
        return False, "zero points are not small integers"
    return True, why
