"""W4A16 at 2 <= M <= 16 on the TMA-fed GEMV: the M rows of x are the columns of the MMA's B operand.

Reference: ``ops/w4a16_ref.py:w4a16_linear_ref``; the arithmetic is the M = 1 kernel's (``w4a16_gemv_tma.py``,
``w4a16_words.py``: bf16 ``128 + q`` A fragments straight from the words, ``s * (D - (128 + z) D_ones)`` per
group), mirrored in PyTorch by ``rows_emulated`` for the CPU tests (Gluon kernels do not run in Triton's
interpreter).

Why. The M = 1 kernel already runs ``mma.sync.m16n8k16`` with x broadcast into all 8 columns of B: seven of
the eight columns compute copies. Giving each column its own row of x makes M = 2..8 cost the M = 1 kernel's
MMAs (M = 9..16: two column blocks, twice the MMAs) while every weight byte is still read once, through the
same TMA ring and the same tiles (``tma_tiles`` / ``tma_scale_tiles`` are shared with the M = 1 kernel for
the same (WARPS, RB, CH)). The GEMMs this competes with at serving's decode batches tile M by 16 or more and
run a serial K chain per output tile; on the H200 they took 0.94-1.57x cuBLAS bf16 at M <= 16 on the
benchmark shapes where the M = 1 kernel takes 0.29-0.45x (README, "Serving's batch sizes"). Prediction, to be
measured by ``benchmarks/small_m_gemm.py`` (provider ``tma_rows_best``): within ~1.2x of the M = 1 kernel's
time at M <= 8 (x's staging and the per-column epilogue are the extra work), so 0.35-0.55x cuBLAS.

What differs from the M = 1 kernel, and what it costs:
* x [M, K] is staged once per CTA in shared memory as ``[KT, NB, MC, 128]`` bf16 (MC = 8 or 16 columns, rows
  past M zero), swizzled so that the B-operand load (lane (n, t) reads row n's pair 2t) touches 32 distinct
  banks: every step's 16-byte ``cp.async`` copies are issued at once (no registers held, one wait), then each
  128-column entry's sum per row (D_ones, ``[KT, NB, MC]`` fp32) is read back from shared memory once (K MC 2
  bytes per CTA). The weight ring's first tiles are requested before the staging. The main loop compiles to
  the M = 1 kernel's instructions: 412 SASS instructions per K step at M <= 8 against its 413 ((4, 2, 2, 2),
  sm_90a), 484 at M = 9..16 (twice the MMAs and FMAs).
  Shared memory: ``K MC 2`` bytes for x, so the route takes this kernel only where ``smem_bytes`` fits
  (``rows_fit``): with (4, 2, 2, 2) (16 KB ring slots) M <= 8 up to K = 11264, M <= 16 up to K = 5120.
* the epilogue stores MC columns per row block (masked to M), ``Y[c, n]`` at ``c * SYM + n``.
* no fusions: no EC, GLU, RMSNorm or K-split (the serving engine's decode batches run the plain linears and
  the overlapped EC around them).
* memory: the re-tiled weight (``tma_tiles``) is cached per (WARPS, RB, CH), shared with the M = 1 kernel where
  the geometries agree; an M bucket tuned to another geometry (e.g. RB = 1, which no M = 1 config uses) keeps
  one more tiled copy of that weight (its W4 bytes again).

Configs: ``(WARPS, RB, CH, STAGES)``, the M = 1 kernel's tile geometry with x in shared memory (its OPS_SMEM, SPLIT
1). Table value ``("gemv_tma_rows", WARPS, RB, CH, STAGES)`` in a GEMM entry (``dispatch.keys.gemm_key``): the route
takes it for an M bucket only where ``spear tune`` / ``benchmarks/small_m_gemm.py`` measured it fastest
(``route.tma_rows_choices``). Opt-in (``SPEAR_TMA_ROWS=1``) until it is timed the benchmarks' way: its GPU tests pass
(H100, 2026-12-08), and an eager call measured ~240 us of host time (hidden inside a CUDA graph). Constraints: CUDA sm_90+, bf16 activations, scales
and zero points, K % 128 == 0, G a multiple of 128 (or per-channel), M <= 16, shared memory as above.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import w4a16_gemv_tma as _gt
from .w4a16_gemv_tma import HAS_TMA, _layouts, tma_scale_tiles, tma_tiles
from .w4a16_gemv_tma_configs import OPS_SMEM, ROW, tile_geometry, unpack_config
from .w4a16_words import CHUNK, compile_gluon_sm90, gluon_ok

TABLE_KERNEL = "gemv_tma_rows"  # the GEMM table value's tag, and the route's kernel name
MAX_ROWS = 16  # two column blocks of the MMA's 8
SMEM_LIMIT = 232448  # bytes of shared memory one CTA may use on sm_90 (227 KB)
# (WARPS, RB, CH, STAGES): the M = 1 kernel's shipped OPS_SMEM geometries, and a 16-row block (more CTAs)
ROWS_CONFIGS = [(4, 2, 2, 2), (8, 2, 2, 2), (2, 2, 2, 2), (4, 2, 4, 2), (2, 2, 4, 2), (4, 2, 1, 2), (4, 2, 2, 3),
                (4, 4, 2, 2), (4, 1, 2, 2), (4, 1, 2, 4)]

if HAS_TMA:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier

    from .w4a16_gemv_tma import _request_tile, _ring, _scale_operands, _tile_mma


def columns(M: int) -> int:
    """The B operand's columns for M rows: 8 (one mma n-block) up to 8 rows, else 16."""
    return 8 if M <= 8 else 16


def tile_config(config: tuple) -> tuple:
    """The M = 1 kernel's config with the same tiles (x in shared memory, no K-split): the key of the shared
    ``tma_tiles`` / ``tma_scale_tiles`` caches."""
    if len(config) != 4:
        raise ValueError(f"TMA rows config {config}: expected (WARPS, RB, CH, STAGES)")
    cfg = tuple(int(v) for v in config) + (OPS_SMEM,)
    unpack_config(cfg)  # the same validation as the M = 1 kernel's
    return cfg


def smem_bytes(config: tuple, K: int, M: int) -> int:
    """Shared memory one CTA allocates: the staged x and its sums, the weight ring with its scale tiles, the
    ring's barriers."""
    bn, step, tr = tile_geometry(tile_config(config))
    nb, kt, mc, stages = step // CHUNK, -(-K // step), columns(M), int(config[3])
    return kt * step * mc * 2 + kt * nb * mc * 4 + stages * (tr * ROW * 4 + nb * bn * 4 + 8)


def rows_fit(config: tuple, K: int, M: int) -> bool:
    """Whether the config's shared memory fits one CTA at this K and M (``smem_bytes``)."""
    return M <= MAX_ROWS and smem_bytes(config, K, M) <= SMEM_LIMIT


def rows_emulated(x2: torch.Tensor, tiles: torch.Tensor, scales, zeros, G: int, bias, N: int,
                  config: tuple) -> torch.Tensor:
    """The kernel's arithmetic in PyTorch, row by row of x (each a column of B): the M = 1 kernel's emulation
    (``w4a16_gemv_tma.tiles_emulated``) on each row, undoing the shared tiles."""
    tcfg = tile_config(config)
    return torch.cat([_gt.tiles_emulated(x2[m:m + 1], tiles, scales, zeros, G, bias, N, tcfg)
                      for m in range(x2.shape[0])], 0)


if HAS_TMA:

    @gluon.jit
    def _stage_rows(X, SXM, M, K, KT: gl.constexpr, NB: gl.constexpr, STEP: gl.constexpr, MC: gl.constexpr,
                    WARPS: gl.constexpr):
        """x [M, K] (row stride SXM) into shared memory as [KT, NB, MC, 128] bf16, rows past M and columns past
        K zero: every step's 16-byte copies issued at once (``cp.async``, no registers held, one wait), then
        each 128-column entry's sum per row read back, fp32 [KT, NB, MC]: D_ones of every step. The swizzle
        (16-byte vectors XOR-ed with the row mod 8) puts the 8 rows a warp's B-operand load reads at the same
        columns in different banks."""
        xl: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 2, 16], [WARPS, 1, 1], [2, 1, 0])
        j = gl.arange(0, NB, layout=gl.SliceLayout(1, gl.SliceLayout(2, xl)))
        c = gl.arange(0, MC, layout=gl.SliceLayout(0, gl.SliceLayout(2, xl)))
        k = gl.arange(0, 128, layout=gl.SliceLayout(0, gl.SliceLayout(1, xl)))
        col = gl.expand_dims(gl.expand_dims(j * 128, 1), 2) + gl.expand_dims(gl.expand_dims(k, 0), 1)  # [NB, 1, 128]
        row = gl.expand_dims(gl.expand_dims(c, 0), 2)  # [1, MC, 1]
        rm = row < M
        xsmem = gl.allocate_shared_memory(gl.bfloat16, [KT, NB, MC, 128], gl.SwizzledSharedLayout(8, 1, 8, [2, 1, 0]))
        xsum = gl.allocate_shared_memory(gl.float32, [KT, NB, MC], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        for i in range(KT):
            k0 = i * STEP
            async_copy.async_copy_global_to_shared(xsmem.index(i), X + row * SXM + (k0 + col),
                                                   mask=rm & (k0 + col < K))
        async_copy.commit_group()
        async_copy.wait_group(0)
        gl.thread_barrier()
        for i in range(KT):
            xsum.index(i).store(gl.sum(xsmem.index(i).load(xl).to(gl.float32), axis=2))
        gl.thread_barrier()
        return xsmem, xsum

    @gluon.jit
    def _rows_store(acc, acc1, S, Z, BIAS, Y, SYM, N, M, pid, BN: gl.constexpr, MC: gl.constexpr,
                    mma: gl.constexpr, PER_CHANNEL: gl.constexpr, HAS_Z: gl.constexpr, HAS_BIAS: gl.constexpr):
        """The NB entries' K slices meet ([BN, MC]: column c is row c of Y); per-channel zero point and scale,
        the bias; Y[c, n] stored for c < M, n < N."""
        if PER_CHANNEL:
            acc = acc - 128.0 * acc1
        out = gl.sum(acc, axis=0)  # [BN, MC]
        lo: gl.constexpr = gl.SliceLayout(0, mma)
        on = pid * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, lo))
        oc = gl.arange(0, MC, layout=gl.SliceLayout(0, lo))
        mo = on < N
        if PER_CHANNEL:
            if HAS_Z:
                zr = gl.load(Z + on, mask=mo, other=0.0).to(gl.float32)
                out -= gl.expand_dims(zr, 1) * gl.sum(acc1, axis=0)
            out *= gl.expand_dims(gl.load(S + on, mask=mo, other=0.0).to(gl.float32), 1)
        if HAS_BIAS:
            out += gl.expand_dims(gl.load(BIAS + on, mask=mo, other=0.0).to(gl.float32), 1)
        offs = gl.expand_dims(oc, 0) * SYM + gl.expand_dims(on, 1)
        mask = gl.expand_dims(oc < M, 0) & gl.expand_dims(mo, 1)
        gl.store(Y + offs, out.to(Y.dtype.element_ty), mask=mask)

    @gluon.jit
    def _w4a16_gemv_tma_rows_kernel(X, desc, sdesc, S, Z, BIAS, Y, N, K, M, SXM, SYM, WL: gl.constexpr,
                                    TL: gl.constexpr, WARPS: gl.constexpr, RB: gl.constexpr, CH: gl.constexpr,
                                    STAGES: gl.constexpr, KP: gl.constexpr, MC: gl.constexpr,
                                    PER_CHANNEL: gl.constexpr, HAS_Z: gl.constexpr, HAS_BIAS: gl.constexpr):
        """One CTA per BN rows of W; K steps of NB * 128 columns through the TMA ring (tile t + STAGES - 1
        requested before the warps wait for tile t, a CTA barrier before each request); the B operand is the
        step's [NB, 128, MC] slice of the staged x, D_ones its staged sums."""
        BN: gl.constexpr = 16 * RB
        NB: gl.constexpr = WARPS * CH
        STEP: gl.constexpr = 128 * NB
        TR: gl.constexpr = NB * BN * 16 // 256
        KT: gl.constexpr = KP // STEP
        SZ_TMA: gl.constexpr = not PER_CHANNEL
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1, 1],
                                                      instr_shape=[1, 16, 8])
        la: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        lb: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
        pid = gl.program_id(0)
        row0 = pid * KT * TR
        smem, ssmem, bars = _ring(desc, sdesc, STAGES, TR, NB, BN, SZ_TMA)
        if SZ_TMA:
            nbytes: gl.constexpr = desc.block_type.nbytes + sdesc.block_type.nbytes
        else:
            nbytes: gl.constexpr = desc.block_type.nbytes
        for i in gl.static_range(STAGES - 1):
            if i < KT:
                _request_tile(desc, sdesc, smem, ssmem, bars, i, row0 + i * TR, pid * KT + i, nbytes, True, SZ_TMA)
        xsmem, xsum = _stage_rows(X, SXM, M, K, KT, NB, STEP, MC, WARPS)
        zero = gl.zeros([NB, BN, MC], gl.float32, layout=mma)
        acc = gl.zeros([NB, BN, MC], gl.float32, layout=mma)
        acc1 = gl.zeros([NB, BN, MC], gl.float32, layout=mma)
        if PER_CHANNEL:  # unused: per-channel scales and zero points apply once, in the epilogue
            sc = 0.0
            zz = 0.0
        for t in range(KT):
            gl.thread_barrier()  # tile t - 1's buffer, refilled below, has been read by every warp
            nt = t + STAGES - 1
            _request_tile(desc, sdesc, smem, ssmem, bars, nt % STAGES, row0 + nt * TR, pid * KT + nt, nbytes,
                          nt < KT, SZ_TMA)
            mbarrier.wait(bars.index(t % STAGES), (t // STAGES) & 1)
            xb = xsmem.index(t).permute([0, 2, 1]).load(lb)  # [NB, 128, MC]
            xs = xsum.index(t).load(gl.SliceLayout(1, mma))  # [NB, MC]
            ones = gl.broadcast(gl.expand_dims(xs, 1), zero)[0]
            if SZ_TMA:
                sc, zz = _scale_operands(ssmem, t % STAGES, NB, BN, mma)
            acc, acc1 = _tile_mma(smem, t % STAGES, xb, sc, zz, acc, acc1, ones, zero, WL, TL, NB, BN, la,
                                  PER_CHANNEL, True)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))
        _rows_store(acc, acc1, S, Z, BIAS, Y, SYM, N, M, pid, BN, MC, mma, PER_CHANNEL, HAS_Z, HAS_BIAS)


def compile_sm90(config: tuple, M: int = 8, G: int = 128, per_channel: bool = False, K: int = 4096) -> dict:
    """Compile for sm_90 without a GPU (Triton's own ptxas); returns the ``asm`` dict (ttgir, ptx, cubin): the
    offline check of layouts (every conversion in ``_tile_mma`` asserted free), registers and shared memory."""
    tcfg = tile_config(config)
    bn, step, tr = tile_geometry(tcfg)
    wl, tl_, smem = _layouts(tcfg)
    types = dict(X="*bf16", desc=f"tensordesc<i32[{tr}, {ROW}],{smem!r}>",
                 sdesc=f"tensordesc<i32[1, {step // 128 * bn}],{smem!r}>", S="*bf16", Z="*bf16", BIAS="*bf16",
                 Y="*bf16", N="i32", K="i32", M="i32", SXM="i32", SYM="i32")
    consts = dict(WL=wl, TL=tl_, WARPS=tcfg[0], RB=tcfg[1], CH=tcfg[2], STAGES=tcfg[3], KP=-(-K // step) * step,
                  MC=columns(M), PER_CHANNEL=per_channel, HAS_Z=True, HAS_BIAS=True)
    return compile_gluon_sm90(_w4a16_gemv_tma_rows_kernel, types, consts, tcfg[0])


def w4a16_gemv_tma_rows(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                        zeros: Optional[torch.Tensor], G: int, bias: Optional[torch.Tensor], config: tuple,
                        out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Y[M, N] = x2 W^T (+ bias) for M <= ``MAX_ROWS`` through the TMA-ring kernel (CUDA sm_90+ only).
    ``config`` = (WARPS, RB, CH, STAGES); ``out``: a [M, N] tensor with unit column stride to write into."""
    M, K = x2.shape
    if not 1 <= M <= MAX_ROWS or not gluon_ok(1, K, G, x2.dtype):
        raise ValueError(f"w4a16_gemv_tma_rows: M={M}, K={K}, G={G}, {x2.dtype}; needs 1 <= M <= {MAX_ROWS}, bf16, "
                         f"K % {CHUNK} == 0 and G % {CHUNK} == 0 (or per-channel)")
    tcfg = tile_config(config)
    per_channel = G >= K
    N = _gt.check_operands("w4a16_gemv_tma_rows", K, G, qweight, scales, zeros, bias)
    if out is not None and (tuple(out.shape) != (M, N) or out.stride(-1) != 1 or out.dtype != x2.dtype):
        raise ValueError(f"w4a16_gemv_tma_rows: out {tuple(out.shape)} {out.dtype} stride {out.stride()}; needs "
                         f"({M}, {N}) {x2.dtype} with unit column stride")
    if not rows_fit(config, K, M):
        raise ValueError(f"w4a16_gemv_tma_rows: config {tuple(config)} at K={K}, M={M} needs "
                         f"{smem_bytes(config, K, M)} bytes of shared memory (at most {SMEM_LIMIT})")
    if not _gt._tma_capable(x2.device):
        raise ValueError(f"w4a16_gemv_tma_rows: needs a CUDA GPU with TMA (sm_90+); x is on {x2.device}")
    desc = tma_tiles(qweight, tcfg)[1]
    sdesc = tma_scale_tiles(scales, zeros, G, K, tcfg)[1] if not per_channel else desc
    bn, step, _ = tile_geometry(tcfg)
    wl, tl_, _ = _layouts(tcfg)
    y = out if out is not None else torch.empty(M, N, dtype=x2.dtype, device=x2.device)
    # x's 16-byte async copies need rows Triton knows to be aligned: a base and a row stride it specialises as
    # divisible by 16 (a stride of 8 mod 16 elements is 16-byte aligned, but compiles to copies under 4 bytes)
    if x2.stride(-1) != 1 or (M > 1 and x2.stride(0) % 16) or x2.data_ptr() % 16:
        x2 = x2.clone(memory_format=torch.contiguous_format)
    _w4a16_gemv_tma_rows_kernel[(-(-N // bn),)](
        x2, desc, sdesc, scales, zeros if zeros is not None else scales, bias if bias is not None else scales, y,
        N, K, M, x2.stride(0), y.stride(0), WL=wl, TL=tl_, WARPS=tcfg[0], RB=tcfg[1], CH=tcfg[2], STAGES=tcfg[3],
        KP=-(-K // step) * step, MC=columns(M), PER_CHANNEL=per_channel, HAS_Z=zeros is not None,
        HAS_BIAS=bias is not None, num_warps=tcfg[0])
    return y


def can_implement(p, config: Optional[tuple] = None) -> tuple:
    """(ok, reason) of whether the kernel runs problem ``p`` (a ``lowering.problem.Problem``): this Triton has
    Gluon TMA, M <= 16, bf16 activations, scales and zero points, K and G multiples of 128 (or per-channel), a
    sm_90+ GPU, a contiguous output; with ``config``, its shared memory fits (``rows_fit``)."""
    if not HAS_TMA:
        return False, "this Triton has no Gluon TMA"
    if not 1 <= p.M <= MAX_ROWS:
        return False, f"M = {p.M} > {MAX_ROWS} (the B operand's columns hold x's rows)"
    if not gluon_ok(1, p.K, p.G, p.dtype):
        return False, f"{p.dtype}, K = {p.K}, G = {p.G} (needs bf16, K and G multiples of 128)"
    if any(d != torch.bfloat16 for d in p.param_dtypes):
        return False, f"scales / zero points {p.param_dtypes} (needs bf16)"
    if not _gt._tma_capable(p.device):
        return False, "not a sm_90+ GPU"
    if not p.out_contiguous:
        return False, "out not contiguous"
    if not (p.weight_contiguous and p.params_contiguous):
        return False, "weight / scales / zero points not contiguous"
    if config is not None and not rows_fit(config, p.K, p.M):
        return False, (f"config {list(config)} needs {smem_bytes(config, p.K, p.M)} bytes of shared memory at "
                       f"K = {p.K}, M = {p.M} (at most {SMEM_LIMIT})")
    return True, "sm_90+, Gluon TMA, bf16, K and G multiples of 128, M <= 16"
