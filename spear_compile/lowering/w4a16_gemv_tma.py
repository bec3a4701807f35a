"""M = 1 W4A16 GEMV fed by a TMA ring: weight tiles stream into shared memory while the warps compute.

Reference: ``ops/w4a16_ref.py:w4a16_linear_ref``; the arithmetic is that of the int4 word layout
(``w4a16_words.py``: nibbles OR-ed into bf16 ``128 + q`` that *are* the MMA's A fragments,
``s * (D - (128 + z) D_ones)`` per group), mirrored in PyTorch by ``tiles_emulated`` for the CPU tests
(Gluon kernels do not run in Triton's interpreter). With x staged in shared memory (OPS_SMEM, every
shipped config) x fills all 8 columns of the MMA's B operand (each column of D is then y) and D_ones is
each 128-column entry's sum of x, computed once per CTA as x is staged - measured on an H200: the column mask
and the all-ones MMA were 1 / 5 of the K step's instructions and on its critical path (-7.5 to -15 %).

Why: every register-fed M = 1 kernel we built (CUDA-core, mma.sync, split-K, persistent) stalls at
1.5-1.8x the time of a kernel that only reads the same bytes (docs/kernels.md, H200): each
program waits for its loads, then computes with nothing in flight, and registers cap how many bytes a
program can have outstanding. Here one thread issues TMA copies of whole weight tiles into a ring of
``STAGES`` shared-memory buffers, so ``STAGES - 1`` tiles are in flight while all warps compute the
current one, and the bytes in flight cost shared memory, not registers. What the H200 said (docs/kernels.md,
H200): deeper rings did not help - bytes in flight were not the limit; what paid was taking the
per-step global loads of x and the scales out of the loop (x staged in shared memory once, scales
brought with each tile: OPS_SMEM) and giving each warp more slices per step (less per-step barrier and
wait overhead). K-split configs (two programs per row block) were slower (kept, measured, out of the
shipped table); a persistent variant (a few programs per SM streaming many row blocks) was slower too and
was removed (docs/kernels.md).
After the leaner K step (above), 0.58x tinygemm at 28672x8192 and 0.63x at 8192x8192; an
L2 prefetch of the tiles past the ring was slower everywhere, like deeper rings (removed).

Epilogue / prologue options used by the decode fusions (``passes/fuse_glu.py``, ``fuse_rmsnorm.py``):
GLU (gate / up rows interleaved per CTA, silu(gate) * up stored) and NORM (x RMS-normalised as it is
staged in shared memory), both for OPS_SMEM configs without a K-split; and the decode EC's term added
to the rows before them (``w4a16_gemv_tma_ec``: the kernel PDL-launched behind the EC's producer grid;
no K-split).

Layout: the gluon words (``repack_gluon``) are re-tiled once per weight (``repack_tiles``) so that one
CTA's tile for one K step (BN rows x NB slices of 128 columns) is one contiguous block, stored as
``[NB, BN, 16]`` words; the TMA copies it as ``[TR, 256]`` int32 rows (no swizzle) and a warp's 32
lanes read 512 contiguous bytes of it (4 words each): no bank conflicts, and the loaded registers are
the MMA operand with no layout conversion (asserted at compile time).

Dispatch: ``w4a16_triton.w4a16_gemv`` (and the concatenated q/k/v, gate/up GEMV of ``w4a16_cat``)
takes this kernel at M = 1 for the shapes where ``benchmarks/kernels.py --lab gemv --tma`` measured it
faster than the CUDA-core kernel on this GPU (``dispatch.keys.tma_key`` entries of the tuned table, ``dispatch.route.tma_config``);
elsewhere the CUDA-core kernel runs. With a decode EC the same shapes take it with the EC epilogue
(the "ec_pair_tma", "ec_cat_tma" and "ec_glu_tma" routes of ``dispatch/route.py``). Constraints: CUDA sm_90+ (TMA), bf16 activations,
bf16 scales and zero points (the shared-memory mode reads them as bf16 pairs), K % 128 == 0, G a
multiple of 128 (or per-channel).
"""
from __future__ import annotations

from typing import Optional

import torch

from . import device as _device
from ._triton import next_pow2
from .w4a16_words import (CHUNK, HAS_GLUON, compile_gluon_sm90, gemv_gluon_emulated, gluon_ok, repack_gluon,
                          word_layout, word_layout_bases)
from .layout_cache import derived_cached, derived_peek, grown_workspace, outside_pools  # noqa: F401
from .w4a16_gemv_tma_configs import (OPS_GLOBAL, OPS_PREFETCH, OPS_SMEM, ROW, TMA_CONFIGS, ec_ok,  # noqa: F401
                                     norm_ok, split_fits, tile_geometry, unpack_config)
from .ec_self import SPIN

HAS_TMA = False
if HAS_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from .w4a16_words import _mma_words, _rows_out, _scale_index, _x_index
    from .w4a16_gemv_tma_ec import (_ec_operands, _ec_rows, _self_collect, _self_gate_operands, _self_own,
                                    _self_publish, _self_rows, _self_slots, _self_ticket)

    try:  # Hopper TMA and mbarriers in Gluon (Triton 3.5+); without them the dispatch never picks this kernel
        from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

        HAS_TMA = True
    except ImportError:  # pragma: no cover - depends on the installed Triton
        pass




def tile_layout_bases(warps: int, rb: int, ch: int) -> tuple[list, list, list]:
    """``word_layout_bases`` mapped from [NB, BN, 16] (j, n, w) to the tile's [TR, ROW] view: the flat
    word index ``j BN 16 + n 16 + w`` split into (row, column). A reshape of the loaded [TR, ROW]
    tensor to [NB, BN, 16] is then exactly the MMA word layout."""
    bn = 16 * rb

    def flat(b):
        f = b[0] * bn * 16 + b[1] * 16 + b[2]
        return [f // ROW, f % ROW]

    return tuple([flat(b) for b in bases] for bases in word_layout_bases(warps, rb, ch))


def repack_tiles(qweight: torch.Tensor, config: tuple) -> torch.Tensor:
    """spear-packed uint8 [N, K/2] -> int32 [tiles * TR, ROW]: tile (row block b, K step t) at rows
    ``(b KT + t) TR``, as [NB, BN, 16] words; N and K are zero-padded to whole tiles (padded columns meet
    x = 0, padded rows are never stored)."""
    bn, step, _ = tile_geometry(config)
    nb = step // 128
    words = repack_gluon(qweight)  # [N, K/8]
    N, KW = words.shape
    Np, KWp = -(-N // bn) * bn, -(-KW // (step // 8)) * (step // 8)
    if (Np, KWp) != (N, KW):
        words = torch.nn.functional.pad(words, (0, KWp - KW, 0, Np - N))
    t = words.view(Np // bn, bn, KWp // (step // 8), nb, 16).permute(0, 2, 3, 1, 4)
    return t.contiguous().view(-1, ROW)


def repack_scale_tiles(scales: torch.Tensor, zeros: Optional[torch.Tensor], G: int, K: int, config: tuple):
    """bf16 scales and zero points [N, K/G] -> int32 [tiles, NB BN]: tile (row block b, K step t) holds,
    for slice j and row n, the (scale, zero) bf16 pair (scale in the low half) of the group of
    column ``t STEP + 128 j`` - what the kernel's TMA brings beside the weight tile (OPS_SMEM)."""
    for name, t in (("scales", scales), ("zeros", zeros)):
        if t is not None and t.dtype != torch.bfloat16:
            raise ValueError(f"repack_scale_tiles: {name} are {t.dtype}; the TMA kernel's shared-memory mode reads "
                             "bf16 (scale, zero) pairs (the route declines other dtypes)")
    bn, step, _ = tile_geometry(config)
    nb = step // 128
    N = scales.shape[0]
    Np, KT = -(-N // bn) * bn, -(-K // step)
    grp = ((torch.arange(KT, device=scales.device).view(KT, 1) * step
            + 128 * torch.arange(nb, device=scales.device).view(1, nb)) // G).clamp_max(scales.shape[1] - 1)
    lo = scales.view(torch.int16).to(torch.int32) & 0xFFFF
    hi = (zeros.view(torch.int16).to(torch.int32) << 16) if zeros is not None else torch.zeros_like(lo)
    pair = torch.nn.functional.pad(lo | hi, (0, 0, 0, Np - N))  # [Np, NG]
    t = pair[:, grp.flatten()].view(Np // bn, bn, KT, nb).permute(0, 2, 3, 1)  # [b, t, j, n]
    return t.contiguous().view(-1, nb * bn)


def tiles_emulated(x2, tiles, scales, zeros, G: int, bias, N: int, config: tuple) -> torch.Tensor:
    """Undo ``repack_tiles`` and run the Gluon kernel's emulation: the CPU check that the tiling keeps
    every word where the kernel's layout expects it."""

    bn, step, _ = tile_geometry(config)
    nb = step // 128
    K = x2.shape[1]
    KWp = -(-K // step) * (step // 8)
    t = tiles.view(-1, KWp // (step // 8), nb, bn, 16).permute(0, 3, 1, 2, 4)
    words = t.reshape(-1, KWp)[:N, : K // 8]
    return gemv_gluon_emulated(x2, words, scales, zeros, G, bias)


if HAS_TMA:

    @gluon.jit
    def _step_operands(X, S, Z, N, K, NG, k0, x_k, x_c0, s_row, s_k, G: gl.constexpr, PER_CHANNEL: gl.constexpr,
                       HAS_Z: gl.constexpr):
        """One K step's x (as the [NB, 128, 8] B operand, column 0) and, for groups, its scales and
        128 + zero points ([NB, BN], fp32; zeros when per-channel: applied after the loop)."""
        xb = gl.load(X + k0 + x_k + x_c0 * 0, mask=x_c0 & (k0 + x_k < K), other=0.0)
        zz = gl.full([s_k.shape[0], s_row.shape[1]], 128.0, gl.float32, layout=s_row.type.layout)
        sc = zz
        if not PER_CHANNEL:
            gp = (k0 + s_k) // G
            ms = (s_row < N) & (k0 + s_k < K)
            sc = gl.load(S + s_row * NG + gp, mask=ms, other=0.0).to(gl.float32)
            if HAS_Z:
                zz += gl.load(Z + s_row * NG + gp, mask=ms, other=0.0).to(gl.float32)
        return xb, sc, zz

    @gluon.jit
    def _ring(desc, sdesc, STAGES: gl.constexpr, TR: gl.constexpr, NB: gl.constexpr, BN: gl.constexpr,
              SZ_TMA: gl.constexpr):
        """The TMA ring: STAGES weight tiles [TR, 256], with SZ_TMA their (scale, zero) bf16 pairs [1, NB BN]
        (else the weight ring stands in, never read: ``_request_tile`` copies scale tiles only with
        SZ_TMA), and one initialised mbarrier per slot."""
        smem = gl.allocate_shared_memory(gl.int32, [STAGES, TR, 256], desc.layout)
        if SZ_TMA:
            ssmem = gl.allocate_shared_memory(gl.int32, [STAGES, 1, NB * BN], sdesc.layout)
        else:
            ssmem = smem
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)
        return smem, ssmem, bars

    @gluon.jit
    def _request_tile(desc, sdesc, smem, ssmem, bars, slot, wrow, stile, nbytes: gl.constexpr, pred,
                      SZ_TMA: gl.constexpr):
        """One thread's TMA request of a weight tile (rows ``wrow``.. of the re-tiled weight) and, with
        SZ_TMA, its scale / zero tile (``stile``) into ring slot ``slot``, arriving on that slot's barrier."""
        mbarrier.expect(bars.index(slot), nbytes, pred=pred)
        tma.async_copy_global_to_shared(desc, [wrow, 0], bars.index(slot), smem.index(slot), pred=pred)
        if SZ_TMA:
            tma.async_copy_global_to_shared(sdesc, [stile, 0], bars.index(slot), ssmem.index(slot), pred=pred)

    @gluon.jit
    def _x_operand(xsmem, k, x_c0, lb: gl.constexpr):
        """K step ``k`` of the staged x as the MMA's B operand: x in all 8 columns (every column of D is
        then y, and ``_rows_out`` reads column 0). Masking columns 1-7 to zero cost a SEL per B register
        and step (64 of the 627 SASS instructions of a (4, 2, 2, 2, 2) step) and bought nothing."""
        xv = xsmem.index(k).load(gl.SliceLayout(2, lb))
        return gl.broadcast(gl.expand_dims(xv, 2), x_c0)[0]

    @gluon.jit
    def _scale_operands(ssmem, slot, NB: gl.constexpr, BN: gl.constexpr, mma: gl.constexpr):
        """(scales, 128 + zero points) of the tile in ring slot ``slot``, from its bf16 pairs."""
        szw = ssmem.index(slot).reshape([NB, BN]).load(gl.SliceLayout(2, mma))
        return (szw << 16).to(gl.float32, bitcast=True), 128.0 + (szw & -65536).to(gl.float32, bitcast=True)

    @gluon.jit
    def _tile_mma(smem, slot, xb, sc, zz, acc, acc1, ones, zero, WL: gl.constexpr, TL: gl.constexpr,
                  NB: gl.constexpr, BN: gl.constexpr, la: gl.constexpr, PER_CHANNEL: gl.constexpr,
                  XSUM: gl.constexpr = False):
        """The weight tile in ring slot ``slot`` times x, into the accumulators (``_mma_words``)."""
        w2 = smem.index(slot).load(TL)
        w = gl.convert_layout(gl.reshape(w2, [NB, BN, 16]), WL, assert_trivial=True)
        return _mma_words(w, xb, sc, zz, acc, acc1, ones, zero, NB, BN, la, PER_CHANNEL, XSUM)

    @gluon.jit
    def _x_sums(xsum, k, zero, mma: gl.constexpr):
        """K step ``k``'s sums of x per 128-column entry (staged by ``_stage_x``) as D_ones: [NB]
        broadcast over the accumulator's [NB, BN, 8] (the same for every row and column)."""
        xs = xsum.index(k).load(gl.SliceLayout(1, gl.SliceLayout(2, mma)))
        return gl.broadcast(gl.expand_dims(gl.expand_dims(xs, 1), 2), zero)[0]

    @gluon.jit
    def _split_store(acc, acc1, S, Z, BIAS, Y, WS, CNT, N, pid, BN: gl.constexpr, mma: gl.constexpr,
                     SPLIT: gl.constexpr, PER_CHANNEL: gl.constexpr, HAS_Z: gl.constexpr, HAS_BIAS: gl.constexpr):
        """K-split epilogue: each of the row block's SPLIT programs adds its partial rows into the fp32
        workspace (SPLIT = 2: a + b is the same either way round, so the result is deterministic), and
        the last to arrive (acq_rel counter) adds the bias, stores Y and zeroes the workspace rows and
        the counter for the next launch."""
        out, on, mo = _rows_out(acc, acc1, S, Z, N, pid, BN, mma, PER_CHANNEL, HAS_Z)
        gl.atomic_add(WS + on, out, mask=mo, sem="relaxed")
        gl.thread_barrier()  # every thread's partial is in before the CTA's arrival is published
        old = gl.atomic_add(CNT + pid, 1, sem="acq_rel")
        if old == SPLIT - 1:
            tot = gl.load(WS + on, mask=mo, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                tot += gl.load(BIAS + on, mask=mo, other=0.0).to(gl.float32)
            gl.store(Y + on, tot.to(Y.dtype.element_ty), mask=mo)
            gl.store(WS + on, gl.zeros_like(tot), mask=mo)
            gl.atomic_xchg(CNT + pid, 0)

    @gluon.jit
    def _stage_x(X, NW, EPS, K, t0, NB: gl.constexpr, STEP: gl.constexpr, KTS: gl.constexpr, WARPS: gl.constexpr,
                 NORM: gl.constexpr):
        """x [K] (this program's KTS steps of it) into shared memory as [KTS, NB, 128] bf16. NORM:
        RMS-normalised on the way, as the model's RMSNorm rounds (fp32, to bf16, times the weight, to
        bf16); the sum of squares is over all of K, so NORM needs the whole row (SPLIT = 1): a first
        pass reads x for it (L2-resident, 2K bytes), the second stages the normalised values. (Staging x
        and the weight raw in one pass and normalising in shared memory measured slower on the H200:
        +0.45 us per GEMV, docs/kernels.md.) Also returns each 128-column entry's sum of the staged
        values, fp32 [KTS, NB] in shared memory: D_ones of every step (``_x_sums``), once per CTA instead
        of an all-ones MMA per step."""
        xl: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [WARPS, 1], [1, 0])
        xo = (gl.expand_dims(gl.arange(0, NB, layout=gl.SliceLayout(1, xl)) * 128, 1)
              + gl.expand_dims(gl.arange(0, 128, layout=gl.SliceLayout(0, xl)), 0))
        xsmem = gl.allocate_shared_memory(gl.bfloat16, [KTS, NB, 128], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        xsum = gl.allocate_shared_memory(gl.float32, [KTS, NB], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        if NORM:
            ss = gl.zeros([NB, 128], gl.float32, layout=xl)
            for i in gl.static_range(KTS):
                xk0 = (t0 + i) * STEP
                xv = gl.load(X + xk0 + xo, mask=xk0 + xo < K, other=0.0).to(gl.float32)
                ss += xv * xv
            r = gl.rsqrt(gl.sum(gl.sum(ss, axis=1), axis=0) / K + EPS)
            for i in gl.static_range(KTS):
                xk0 = (t0 + i) * STEP
                mk = xk0 + xo < K
                xv = gl.load(X + xk0 + xo, mask=mk, other=0.0).to(gl.float32)
                wv = gl.load(NW + xk0 + xo, mask=mk, other=0.0).to(gl.float32)
                h = (xv * r).to(gl.bfloat16).to(gl.float32)
                xn = (h * wv).to(gl.bfloat16)
                xsmem.index(i).store(xn)
                xsum.index(i).store(gl.sum(xn.to(gl.float32), axis=1))
        elif (KTS * NB) & (KTS * NB - 1) != 0:  # (a step count that is no power of two: per-step stores)
            for i in gl.static_range(KTS):
                xk0 = (t0 + i) * STEP
                xv = gl.load(X + xk0 + xo, mask=xk0 + xo < K, other=0.0)
                xsmem.index(i).store(xv)
                xsum.index(i).store(gl.sum(xv.to(gl.float32), axis=1))
        else:  # all of x in one load and one store, the sums in one store (per-step stores each drew a CTA
            # barrier that held back the next steps' loads: ~KTS / 2 dependent L2 round trips per CTA)
            xa = (t0 * STEP + gl.expand_dims(gl.arange(0, KTS * NB, layout=gl.SliceLayout(1, xl)) * 128, 1)
                  + gl.expand_dims(gl.arange(0, 128, layout=gl.SliceLayout(0, xl)), 0))  # [KTS NB, 128]
            xv = gl.load(X + xa, mask=xa < K, other=0.0)
            flat = xsmem._reinterpret(gl.bfloat16, [KTS * NB, 128], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
            flat.store(xv)
            fsum = xsum._reinterpret(gl.float32, [KTS * NB], gl.SwizzledSharedLayout(1, 1, 1, [0]))
            fsum.store(gl.sum(xv.to(gl.float32), axis=1))
        gl.thread_barrier()
        return xsmem, xsum

    @gluon.jit
    def _store_glu(out, Y, N, pid, BN: gl.constexpr, WARPS: gl.constexpr):
        """GLU epilogue: the CTA's BN rows ``out`` are BN / 2 gate rows then the matching BN / 2 up rows
        (``glu_interleave``); they meet through shared memory (the MMA layout spreads a row over
        lanes) and the CTA stores Y[pid BN / 2 + i] = silu(gate_i) * up_i, rounded as the unfused
        graph rounds: gate and up to bf16, silu in fp32 to bf16, the product to bf16."""
        buf = gl.allocate_shared_memory(gl.float32, [BN], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        H: gl.constexpr = BN // 2
        buf.store(out)
        gl.thread_barrier()
        l1: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
        g = buf.slice(0, H).load(l1).to(gl.bfloat16).to(gl.float32)
        u = buf.slice(H, H).load(l1).to(gl.bfloat16).to(gl.float32)
        s = (g / (1.0 + gl.exp(-g))).to(gl.bfloat16).to(gl.float32)
        on = pid * H + gl.arange(0, H, layout=l1)
        gl.store(Y + on, (s * u).to(Y.dtype.element_ty), mask=on < N // 2)

    @gluon.jit
    def _epilogue(acc, acc1, S, Z, BIAS, Y, N, pid, ecb, ecg, ecm, eca, GH, R, GHS, term, BN: gl.constexpr,
                  mma: gl.constexpr, WARPS: gl.constexpr, PER_CHANNEL: gl.constexpr, HAS_Z: gl.constexpr,
                  HAS_BIAS: gl.constexpr, GLU: gl.constexpr, HAS_EC: gl.constexpr, GH_COPIES: gl.constexpr,
                  WAIT: gl.constexpr, SELF: gl.constexpr = False):
        """The CTA's BN rows (no K-split): ``_rows_out``, the EC term (HAS_EC: ``_ec_rows`` of the
        operands ``_ec_operands`` requested before the K loop; SELF: ``term``, computed by the one-launch
        form), then the GLU store or the bias and a plain store."""
        out, on, mo = _rows_out(acc, acc1, S, Z, N, pid, BN, mma, PER_CHANNEL, HAS_Z)
        if HAS_EC:
            if SELF:
                out += term
            else:
                out += _ec_rows(ecb, ecg, ecm, eca, GH, R, GHS, pid, gl.SliceLayout(1, gl.SliceLayout(0, mma)),
                                GH_COPIES, WAIT)
        if GLU:
            _store_glu(out, Y, N, pid, BN, WARPS)
        else:
            if HAS_BIAS:
                out += gl.load(BIAS + on, mask=mo, other=0.0).to(gl.float32)
            gl.store(Y + on, out.to(Y.dtype.element_ty), mask=mo)

    @gluon.jit
    def _w4a16_gemv_tma_kernel(X, desc, sdesc, S, Z, BIAS, Y, WS, CNT, NW, EPS, EB, ROFF, GH, ALPHA, N, K, NG, RC, R,
                               GHS, EA, EW1, EB1, EW2, EB2, D, NC, OWNERS, WL: gl.constexpr, TL: gl.constexpr,
                               G: gl.constexpr, WARPS: gl.constexpr,
                               RB: gl.constexpr, CH: gl.constexpr, STAGES: gl.constexpr, OPS: gl.constexpr,
                               KP: gl.constexpr, SPLIT: gl.constexpr, PER_CHANNEL: gl.constexpr,
                               HAS_Z: gl.constexpr, HAS_BIAS: gl.constexpr, GLU: gl.constexpr = False,
                               NORM: gl.constexpr = False, HAS_EC: gl.constexpr = False, RC_P: gl.constexpr = 16,
                               HAS_ROFF: gl.constexpr = False, GH_COPIES: gl.constexpr = 16,
                               WAIT: gl.constexpr = False, SELF: gl.constexpr = False, PW: gl.constexpr = 256,
                               PPC_P: gl.constexpr = 1, NC_P: gl.constexpr = 1, SPIN: gl.constexpr = 0,
                               D_P: gl.constexpr = 1, ACT: gl.constexpr = 0, PUBLISH: gl.constexpr = True):
        """One CTA per BN rows; K steps of NB * 128 columns; tile t + STAGES - 1 is requested (one
        thread, TMA) before the warps wait for tile t. A CTA barrier before each request keeps a
        buffer from being refilled while a slower warp still reads it. KP: K padded to whole steps.
        SPLIT > 1: program (pid, ps) takes the ps-th of SPLIT equal runs of K steps (twice the CTAs for
        SPLIT = 2, for shapes whose row blocks alone leave the GPU half empty); the partial rows meet
        in ``_split_store``. GLU: the rows are gate / up blocks of BN / 2 interleaved
        (``glu_interleave``) and the CTA stores silu(gate) * up, BN / 2 values (``_store_glu``).
        NORM (OPS = 2, SPLIT = 1): x is RMS-normalised (weight NW, epsilon EPS) as it is staged
        (``_stage_x``), in place of a separate RMSNorm kernel. HAS_EC (SPLIT = 1): the decode EC's term
        is added to the rows before the bias / GLU (``w4a16_gemv_tma_ec``; WAIT when launched with PDL
        behind the EC's producer grid). SELF (with HAS_EC, no ROFF): the one-launch form (``ec_self.py``):
        GH holds the int64 slots, CNT the site's int64 ticket, EA / EW1 / EB1 / EW2 / EB2 the
        EC's A and gate; the CTA's pieces of h are requested before x's staging and published after the
        first K step (their loads have had x's staging and that step to land), the slots are read at the
        start of the last K step (their round trip overlaps it), and after the loop the term is collected,
        gated and added. Without ``PUBLISH`` (tests) no CTA publishes its own pieces, so every CTA computes the
        missing pieces itself after SPIN re-reads (the same result)."""
        BN: gl.constexpr = 16 * RB
        NB: gl.constexpr = WARPS * CH
        STEP: gl.constexpr = 128 * NB
        TR: gl.constexpr = NB * BN * 16 // 256
        KT: gl.constexpr = KP // STEP  # K steps of the whole row
        KTS: gl.constexpr = KT // SPLIT  # this program's
        SZ_TMA: gl.constexpr = OPS == 2 and not PER_CHANNEL
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1, 1],
                                                      instr_shape=[1, 16, 8])
        la: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        lb: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
        pid = gl.program_id(0)
        if SPLIT == 1:
            t0 = 0
        else:
            t0 = gl.program_id(1) * KTS  # first K step of this program
        row0 = (pid * KT + t0) * TR
        smem, ssmem, bars = _ring(desc, sdesc, STAGES, TR, NB, BN, SZ_TMA)
        if SZ_TMA:  # bytes each slot's barrier expects: the weight tile and its (scale, zero) pairs
            nbytes: gl.constexpr = desc.block_type.nbytes + sdesc.block_type.nbytes
        else:
            nbytes: gl.constexpr = desc.block_type.nbytes
        for i in gl.static_range(STAGES - 1):
            if i < KTS:
                _request_tile(desc, sdesc, smem, ssmem, bars, i, row0 + i * TR, pid * KT + t0 + i, nbytes, True,
                              SZ_TMA)
        if HAS_EC:  # the EC's rows of B (and offsets, alpha) are in flight during the K loop
            ecb, ecg, ecm, eca = _ec_operands(EB, ROFF, ALPHA, N, RC, pid, BN, RC_P, HAS_ROFF, WARPS)
            if SELF:  # the launch's tag and this CTA's role, its pieces of h = A x requested, the gate
                tag, role = _self_ticket(CNT)
                sp, smp, sa, sx = _self_own(GH, EA, X, K, R, NC, OWNERS, role, PW, PPC_P, WARPS)
                w1, b1, w2, b2 = _self_gate_operands(EW1, EB1, EW2, EB2, R, D, RC_P, D_P, WARPS)
        else:
            ecb = 0
            ecg = 0
            ecm = 0
            eca = 0
        x_k, x_c0 = _x_index(NB, lb)
        if OPS == 2:  # all of x into shared memory once, as [KT, NB, 128]
            xsmem, xsum = _stage_x(X, NW, EPS, K, t0, NB, STEP, KTS, WARPS, NORM)
        if HAS_EC and SELF:  # the slots, read during the last K step
            sptr, sm = _self_slots(GH, R, NC, RC_P, NC_P, WARPS)
            sv = gl.zeros_like(sm).to(gl.int64)
        s_row, s_k = _scale_index(pid, NB, BN, mma)
        zero = gl.zeros([NB, BN, 8], gl.float32, layout=mma)
        if OPS != 2:  # D_ones by an all-ones MMA per step (OPS = 2: from the sums staged with x)
            ones = gl.full([NB, BN, 128], 1.0, gl.bfloat16, layout=la)
        acc = gl.zeros([NB, BN, 8], gl.float32, layout=mma)
        acc1 = gl.zeros([NB, BN, 8], gl.float32, layout=mma)
        if OPS == 1:
            xb, sc, zz = _step_operands(X, S, Z, N, K, NG, t0 * STEP, x_k, x_c0, s_row, s_k, G, PER_CHANNEL, HAS_Z)
        if OPS == 2 and PER_CHANNEL:  # unused: per-channel scales apply once, in the epilogue (_rows_out)
            sc = 0.0
            zz = 0.0
        for t in range(KTS):
            k0 = (t0 + t) * STEP
            gl.thread_barrier()  # tile t - 1's buffer, refilled below, has been read by every warp
            nt = t + STAGES - 1
            _request_tile(desc, sdesc, smem, ssmem, bars, nt % STAGES, row0 + nt * TR, pid * KT + t0 + nt, nbytes,
                          nt < KTS, SZ_TMA)
            if OPS == 1:  # the next step's x, scales and zeros are in flight while this step computes
                xn, scn, zzn = _step_operands(X, S, Z, N, K, NG, k0 + STEP, x_k, x_c0, s_row, s_k, G, PER_CHANNEL,
                                              HAS_Z)
            elif OPS == 0:  # this step's, issued before the wait so that their latency hides behind it
                xb, sc, zz = _step_operands(X, S, Z, N, K, NG, k0, x_k, x_c0, s_row, s_k, G, PER_CHANNEL, HAS_Z)
            if HAS_EC and SELF:
                if t == KTS - 1:
                    sv = gl.load(sptr, mask=sm, other=0, volatile=True)
            mbarrier.wait(bars.index(t % STAGES), (t // STAGES) & 1)
            if OPS == 2:
                xb = _x_operand(xsmem, t, x_c0, lb)
                ones = _x_sums(xsum, t, zero, mma)
                if SZ_TMA:
                    sc, zz = _scale_operands(ssmem, t % STAGES, NB, BN, mma)
            acc, acc1 = _tile_mma(smem, t % STAGES, xb, sc, zz, acc, acc1, ones, zero, WL, TL, NB, BN, la, PER_CHANNEL,
                                  OPS == 2)
            if OPS == 1:
                xb, sc, zz = xn, scn, zzn
            if HAS_EC and SELF and PUBLISH:
                if t == 0:
                    _self_publish(GH, sp, smp, sa, sx, tag)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))
        if SPLIT == 1:
            term = 0.0
            if HAS_EC and SELF:
                h = _self_collect(sv, sptr, sm, GH, EA, X, K, R, NC, tag, PW, PPC_P, SPIN, WARPS, RC_P)
                term = _self_rows(h, w1, b1, w2, b2, ecb, eca, gl.SliceLayout(1, gl.SliceLayout(0, mma)), ACT)
            _epilogue(acc, acc1, S, Z, BIAS, Y, N, pid, ecb, ecg, ecm, eca, GH, R, GHS, term, BN, mma, WARPS,
                      PER_CHANNEL, HAS_Z, HAS_BIAS, GLU, HAS_EC, GH_COPIES, WAIT, SELF)
        else:
            _split_store(acc, acc1, S, Z, BIAS, Y, WS, CNT, N, pid, BN, mma, SPLIT, PER_CHANNEL, HAS_Z, HAS_BIAS)


def _layouts(config: tuple):

    warps, rb, ch = config[:3]
    _, _, tr = tile_geometry(config)
    reg, lane, warp = tile_layout_bases(warps, rb, ch)
    tl_ = gl.DistributedLinearLayout(reg_bases=reg, lane_bases=lane, warp_bases=warp, block_bases=[],
                                     shape=[tr, ROW])
    smem = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    return word_layout(warps, rb, ch), tl_, smem


def compile_sm90(config: tuple, G: int = 128, per_channel: bool = False, K: int = 4096, glu: bool = False,
                 norm: bool = False, ec=False) -> dict:
    """Compile for sm_90 without a GPU (Triton's own ptxas); returns the ``asm`` dict (ttgir, ptx,
    cubin) so registers, shared memory and the trivial layout conversions are checked offline. The
    integer arguments are marked divisible by 16, as a launch with such shapes specialises them (a
    shape like N = 200 compiles a slightly different variant)."""

    warps, rb, ch, stages, ops, split = unpack_config(config)
    bn, step, tr = tile_geometry(config)
    wl, tl_, smem = _layouts(config)
    types = dict(X="*bf16", desc=f"tensordesc<i32[{tr}, {ROW}],{smem!r}>",
                 sdesc=f"tensordesc<i32[1, {step // 128 * bn}],{smem!r}>", S="*bf16", Z="*bf16", BIAS="*bf16",
                 Y="*bf16", WS="*fp32", CNT="*i32", NW="*bf16", EPS="fp32", EB="*bf16", ROFF="*i32", GH="*fp32",
                 ALPHA="*bf16", N="i32", K="i32", NG="i32", RC="i32", R="i32", GHS="i32", EA="*bf16", EW1="*bf16",
                 EB1="*bf16", EW2="*bf16", EB2="*bf16", D="i32", NC="i32", OWNERS="i32")
    consts = dict(WL=wl, TL=tl_, G=G, WARPS=warps, RB=rb, CH=ch, STAGES=stages, OPS=ops, KP=-(-K // step) * step,
                  SPLIT=split, PER_CHANNEL=per_channel, HAS_Z=True, HAS_BIAS=not glu, GLU=glu, NORM=norm)
    if ec == "self" or isinstance(ec, tuple):  # the one-launch form (ec_self.py) at r = 64: ("self", PW, PPC_P)
        pw, ppc_p = (1024, 2) if ec == "self" else ec[1:]  # (1024, 2): two pieces of 1024 columns per CTA
        types.update(GH="*i64", CNT="*i64")
        consts.update(HAS_EC=True, RC_P=64, SELF=True, PW=pw, PPC_P=ppc_p, NC_P=next_pow2(-(-K // pw)), SPIN=4096,
                      D_P=16, ACT=0)
    elif ec:  # the decode EC's epilogue as a concatenation runs it (64 columns per row, row offsets, PDL wait)
        consts.update(HAS_EC=True, RC_P=64, HAS_ROFF=True, GH_COPIES=16, WAIT=True)
    return compile_gluon_sm90(_w4a16_gemv_tma_kernel, types, consts, warps)


_TILES: dict = {}
_SCALE_TILES: dict = {}
_SPLIT_WS: dict = {}


def split_workspace(device: torch.device, rows: int, row_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The K-split epilogue's fp32 row sums and int32 arrival counters (``layout_cache.grown_workspace``), kept
    zero by the kernel (the last program of each row block resets its rows). Two split launches must not run
    concurrently on different streams."""
    return grown_workspace(_SPLIT_WS, device, rows, row_blocks, "the K-split GEMV")


def _tma_capable(device: torch.device) -> bool:
    """TMA needs a Hopper-class GPU (sm_90+)."""
    return _device.is_sm90(device)


def _descriptor(t: torch.Tensor, block: list):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return TensorDescriptor(t, list(t.shape), list(t.stride()), block,
                            gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2))


def tma_tiles(qweight: torch.Tensor, config: tuple):
    """(tiles, TMA descriptor) for a weight and config, built once per weight storage and version."""
    _, _, tr = tile_geometry(config)

    def build():
        t = repack_tiles(qweight, config)
        return t, _descriptor(t, [tr, ROW])

    return derived_cached(_TILES.setdefault(tuple(config[:3]), {}), [qweight], build)


def tma_scale_tiles(scales: torch.Tensor, zeros: Optional[torch.Tensor], G: int, K: int, config: tuple):
    """(scale tiles, TMA descriptor), cached like ``tma_tiles`` (OPS_SMEM, groups only)."""
    bn, step, _ = tile_geometry(config)

    def build():
        t = repack_scale_tiles(scales, zeros, G, K, config)
        return t, _descriptor(t, [1, step // 128 * bn])

    return derived_cached(_SCALE_TILES.setdefault((tuple(config[:3]), G, K), {}), [scales, zeros], build)


def check_operands(name: str, K: int, G: int, qweight: Optional[torch.Tensor], scales: torch.Tensor,
                   zeros: Optional[torch.Tensor], bias: Optional[torch.Tensor]) -> int:
    """N, once the operands' shapes agree with x's K and the group size G (ValueError naming the operand,
    ``name`` the caller); ``qweight`` None: not given (a concatenation's descriptors stand in for it)."""
    N = scales.shape[0]
    if scales.dim() != 2 or scales.shape[1] != (1 if G >= K else K // G):
        raise ValueError(f"{name}: scales {tuple(scales.shape)} do not match K={K}, group size {G}")
    if zeros is not None and zeros.shape != scales.shape:
        raise ValueError(f"{name}: zeros {tuple(zeros.shape)} != scales {tuple(scales.shape)}")
    if qweight is not None and tuple(qweight.shape) != (N, K // 2):
        raise ValueError(f"{name}: packed weight {tuple(qweight.shape)} does not match x's K={K} and the scales' "
                         f"N={N} (expected {(N, K // 2)})")
    if bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"{name}: bias {tuple(bias.shape)} != ({N},)")
    return N


def w4a16_gemv_tma(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
                   G: int, bias: Optional[torch.Tensor], config: Optional[tuple] = None,
                   out: Optional[torch.Tensor] = None, descs: Optional[tuple] = None, glu: bool = False,
                   norm: Optional[tuple] = None, ec=None) -> torch.Tensor:
    """Y[1, N] through the TMA-ring kernel (CUDA sm_90+ only). config = (WARPS, RB, CH, STAGES, OPS[, SPLIT]).
    ``descs``: (weight descriptor, scale descriptor or None) made by the caller (``w4a16_cat``'s
    concatenations; ``qweight`` is then not read: N comes from ``scales``). ``glu``: the N rows are
    gate / up blocks interleaved by ``glu_interleave`` for this config; Y is [1, N / 2] =
    silu(gate) * up (no bias, no K-split). ``norm``: (weight [K], eps) of an RMSNorm applied to x as the
    kernel stages it (OPS = 2, no K-split; ``norm_ok``). ``ec``: the decode EC's term added to every row
    before the bias / GLU (``EcEpilogue``: the pair's epilogue; ``EcSelf``: the one-launch form, without
    norm or GLU; either with no K-split: ``ec_ok``)."""
    M, K = x2.shape
    if not gluon_ok(M, K, G, x2.dtype):
        raise ValueError(f"w4a16_gemv_tma: M={M}, K={K}, G={G}, {x2.dtype}; needs M = 1, bf16, "
                         f"K % {CHUNK} == 0 and G % {CHUNK} == 0 (or per-channel)")
    config = tuple(config or TMA_CONFIGS[0])
    warps, rb, ch, stages, ops, split = unpack_config(config)
    per_channel = G >= K
    N = check_operands("w4a16_gemv_tma", K, G, qweight, scales, zeros, bias)
    bn, step, _ = tile_geometry(config)
    kt, rows = -(-K // step), -(-N // bn)
    if glu and (split != 1 or bias is not None or N % bn):
        raise ValueError(f"w4a16_gemv_tma: the GLU epilogue needs SPLIT 1, no bias and N={N} a multiple of the "
                         f"config's {bn} rows (config {config})")
    if norm is not None and not norm_ok(config):
        raise ValueError(f"w4a16_gemv_tma: an RMSNorm prologue needs x staged in shared memory and no K-split "
                         f"(OPS {OPS_SMEM}, SPLIT 1), not config {config}")
    if norm is not None and (tuple(norm[0].shape) != (K,) or norm[0].dtype != x2.dtype):
        raise ValueError(f"w4a16_gemv_tma: norm weight {tuple(norm[0].shape)} {norm[0].dtype} does not match x's "
                         f"K={K} and dtype {x2.dtype}")
    if ec is not None and getattr(ec, "self", False):  # the one-launch EC (EcSelf): pieces read x as given
        if norm is not None or glu:
            raise ValueError("w4a16_gemv_tma: the one-launch EC takes neither an RMSNorm prologue nor the GLU "
                             "epilogue (its pieces read x unnormalised; use the pair, EcEpilogue)")
        ec.check(N, K, config, rows, x2)
    elif ec is not None:
        ec.check(N, config)

    if not split_fits(config, K):
        raise ValueError(f"w4a16_gemv_tma: config {config} splits K into {split} runs, but K={K} has {kt} steps "
                         f"of {step} columns")
    if not _tma_capable(x2.device):
        raise ValueError(f"w4a16_gemv_tma: needs a CUDA GPU with TMA (sm_90+); x is on {x2.device}")
    if descs is None:
        desc = tma_tiles(qweight, config)[1]
        sdesc = tma_scale_tiles(scales, zeros, G, K, config)[1] if ops == OPS_SMEM and not per_channel else None
    else:
        desc, sdesc = descs
    sdesc = desc if sdesc is None else sdesc  # unused by the kernel then
    wl, tl_, _ = _layouts(config)
    y = out if out is not None else torch.empty(M, N // 2 if glu else N, dtype=x2.dtype, device=x2.device)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    ws, cnt = split_workspace(x2.device, rows * bn, rows) if split > 1 else (scales, scales)
    self_args = (scales,) * 5 + (1, 1, 1)  # the one-launch EC's A, gate, D, NC, OWNERS (dummies unless ec.self)
    if ec is None:  # EC operands unused without HAS_EC: fixed dummies, so nothing else specialises the kernel
        ec_args, ec_consts = (scales, cnt, scales, scales, 1, 1, 1), {}
    elif getattr(ec, "self", False):  # EcSelf: slots in GH's place, the ticket in CNT's

        tick, slots = ec.workspace(rows, warps)
        cnt, plan, R = tick, ec.plan(rows, warps), ec.a.shape[0]
        ec_args = (ec.b, cnt, slots, ec.alpha, R, R, 0)
        self_args = (ec.a, ec.w1, ec.b1, ec.w2, ec.b2, ec.w1.shape[0], plan.nc, plan.owners)
        ec_consts = dict(HAS_EC=True, RC_P=max(16, next_pow2(R)), SELF=True, PW=plan.pw, PPC_P=plan.ppc_p,
                         NC_P=plan.nc_p, SPIN=SPIN, D_P=next_pow2(ec.w1.shape[0]), ACT=ec.act, PUBLISH=ec.publish)
    else:
        ec_args = (ec.b, ec.roff if ec.roff is not None else cnt, ec.gh, ec.alpha, ec.b.shape[-1], ec.r,
                   ec.gh.stride(0))
        ec_consts = dict(HAS_EC=True, RC_P=max(16, next_pow2(ec.b.shape[-1])), HAS_ROFF=ec.roff is not None,
                         GH_COPIES=ec.copies, WAIT=ec.wait, **({"launch_pdl": True} if ec.wait else {}))
    eb, eroff, egh, ealpha, rc, r, ghs = ec_args
    _w4a16_gemv_tma_kernel[(rows, split)](
        x2, desc, sdesc, scales, zeros if zeros is not None else scales, bias if bias is not None else scales, y,
        ws, cnt, norm[0] if norm is not None else scales, float(norm[1]) if norm is not None else 0.0,
        eb, eroff, egh, ealpha, N, K, scales.shape[1], rc, r, ghs, *self_args,
        WL=wl, TL=tl_, G=G, WARPS=warps, RB=rb, CH=ch, STAGES=stages, OPS=ops, KP=kt * step, SPLIT=split,
        PER_CHANNEL=per_channel, HAS_Z=zeros is not None, HAS_BIAS=bias is not None, GLU=glu, NORM=norm is not None,
        num_warps=warps, **ec_consts,
    )
    return y



def glu_interleave(t: torch.Tensor, F: int, half: int) -> torch.Tensor:
    """Rows of a gate / up concatenation ``t`` [2F, ...] (gate rows 0..F-1, up rows F..2F-1) reordered
    into blocks of ``half`` gate rows followed by the matching ``half`` up rows, so that one CTA of the
    GLU epilogue (BN = 2 half rows) holds both factors of its outputs. F % half == 0."""
    if F % half or t.shape[0] != 2 * F:
        raise ValueError(f"glu_interleave: {tuple(t.shape)} is not two halves of {F} rows in blocks of {half}")
    return t.reshape(2, F // half, half, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def can_implement(p, config: Optional[tuple] = None, norm: bool = False, glu: bool = False) -> tuple:
    """(ok, reason) of whether the TMA GEMV runs problem ``p`` (a ``lowering.problem.Problem``): this Triton has
    Gluon TMA, M = 1, bf16 activations, K and G multiples of 128 (or per-channel), a sm_90+ GPU, bf16 scales and
    zero points; with ``config``, also the RMSNorm prologue (``norm``: ``norm_ok``) and the GLU epilogue
    (``glu``: no K-split, and the config's row blocks divide F = ``p.N`` rows per half)."""
    if not HAS_TMA:
        return False, "this Triton has no Gluon TMA"
    if not gluon_ok(1, p.K, p.G, p.dtype):
        return False, f"{p.dtype}, K = {p.K}, G = {p.G} (the TMA GEMV needs M = 1, bf16, K and G multiples of 128)"
    if not _tma_capable(p.device):
        return False, "not a sm_90+ GPU"
    if any(d != torch.bfloat16 for d in p.param_dtypes):
        return False, f"scales / zero points {p.param_dtypes} (needs bf16)"
    if config is not None and norm and not norm_ok(config):
        return False, f"TMA config {list(config)} does not stage x in shared memory without a K-split (RMSNorm)"
    if config is not None and glu and (unpack_config(config)[5] != 1 or p.N % (tile_geometry(config)[0] // 2)):
        return False, f"TMA config {list(config)} has a K-split or rows that do not divide F = {p.N}"
    return True, "sm_90+, Gluon TMA, bf16, K and G multiples of 128"
