"""A study, not shipped: a warp-specialised variant of the large-M W4A16 wgmma GEMM
(``spear_compile/lowering/w4a16_gemm_wgmma.py``).

Why: in the single-partition kernel the same warps expand the 4-bit words and wait on the MMAs, and one
CTA barrier per K step ties them together; its diagnostic variants (docs/kernels.md)
measured expansion and MMAs each at about cuBLAS's time but adding up instead of overlapping (H200). Here they
are different warps, handing tiles over through mbarriers:

* default partition, the MMA warpgroups (WARPS warps, BM rows of x): per step waits for the x tile (TMA)
  and the expanded tile, issues the MMAs asynchronously, waits for the previous step's, then frees that
  step's expanded buffer (``dq_empty``) and refills its ring slot by TMA (x and words of step
  ``i - 1 + STAGES``); then the epilogue, as in the plain kernel;
* worker partition, the expanders (EXP warps): per step waits for the words and a free expanded buffer,
  expands exactly as the plain kernel (``_dequant``), stores, fences, arrives on ``dq_ready``.

Numbers are the plain kernel's (same expansion, same MMA order per output). Constraints as there; no EC
operand (the "in_gemm" structure uses the plain kernel).

Measured (H200, 2026-12-01, `benchmarks/results/gemm/2026-12-01_h200_warp_specialised/`): correct (GPU tests), and -3 to +13 %
against the plain kernel's (256, 128, 4, 8) - the hand-off was not what bounded the step; the shared-memory
traffic per MMA is (docs/kernels.md). Kept as the base for a variant that feeds the expanded weight to the MMAs
from registers; not in the tuned search (``WS_CONFIGS``).
"""
from __future__ import annotations



from spear_compile.lowering import w4a16_gemm_wgmma as wg
from spear_compile.lowering.w4a16_gemm_wgmma import HAS_WGMMA
from spear_compile.lowering.w4a16_words import compile_gluon_sm90

WS_CONFIGS = [(256, 128, 4, 8, 4)]  # (BM, BN, STAGES, WARPS, EXPANDERS): 4 expander warps beside 8 MMA warps
WS_MAXNREG = 168  # 12 warps x 32 threads x 168 registers fit the 64 K register file
WS_EXP_REGS = 96  # the expanders' share after setmaxnreg (the MMA warpgroups get the rest: 200)

if HAS_WGMMA:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                                  warpgroup_mma_wait)

    from spear_compile.lowering.w4a16_gemm_wgmma import _BK, _dequant, _group_params, _request_step, _store_tile

    NDQ = gl.constexpr(3)  # expanded buffers: the expanders may run two steps ahead of the MMAs

    @gluon.jit
    def _mma_partition(x_desc, w_desc, xs, ws, dq, ready, dq_ready, dq_empty, off_m, off_n, KT,
                       BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, WARPS: gl.constexpr):
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                      instr_shape=[16, BN, 16])
        acc = gl.zeros([BM, BN], gl.float32, layout=mma)
        for i in range(KT):
            slot = i % STAGES
            j = i % NDQ
            mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
            mbarrier.wait(dq_ready.index(j), (i // NDQ) & 1)
            acc = warpgroup_mma(xs.index(slot), dq.index(j).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))  # step i - 1's MMAs are done
            prev = gl.maximum(i - 1, 0)
            mbarrier.arrive(dq_empty.index(prev % NDQ), pred=i > 0)
            nt = prev + STAGES  # refill step i - 1's slot (its words were read before its dq_ready)
            ps = prev % STAGES
            fence_async_shared()
            _request_step(x_desc, w_desc, ready.index(ps), xs.index(ps), ws.index(ps), off_m, off_n, nt,
                          (i > 0) & (nt < KT))
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        return (acc,)  # (partition results are tuples)

    @gluon.jit
    def _expand_partition(ws, dq, ready, dq_ready, dq_empty, S, Z, off_n, N, NG, KT,
                          BN: gl.constexpr, STAGES: gl.constexpr, EXP: gl.constexpr, G: gl.constexpr,
                          PER_CHANNEL: gl.constexpr, HAS_Z: gl.constexpr, ZINT: gl.constexpr):
        l3: gl.constexpr = gl.BlockedLayout([1, 4, 8], [16, 2, 1], [EXP, 1, 1], [2, 1, 0])
        lw: gl.constexpr = gl.SliceLayout(2, l3)
        offs_n = off_n + gl.arange(0, BN, layout=gl.SliceLayout(1, lw))
        mask_n = offs_n < N
        s, z = _group_params(S, Z, offs_n, mask_n, 0, NG, HAS_Z)
        for i in range(KT):
            slot = i % STAGES
            j = i % NDQ
            if not PER_CHANNEL:
                s, z = _group_params(S, Z, offs_n, mask_n, i * _BK // G, NG, HAS_Z)
            mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
            mbarrier.wait(dq_empty.index(j), ((i // NDQ) & 1) ^ 1)
            dq.index(j).store(_dequant(ws.index(slot).load(lw), s, z, HAS_Z, BN, ZINT))
            fence_async_shared()
            mbarrier.arrive(dq_ready.index(j))

    @gluon.jit
    def _w4a16_gemm_wgmma_ws_kernel(x_desc, w_desc, Y, S, Z, BIAS, M, N, K, NG,
                                    G: gl.constexpr, PER_CHANNEL: gl.constexpr, HAS_Z: gl.constexpr,
                                    ZINT: gl.constexpr, HAS_BIAS: gl.constexpr, STAGES: gl.constexpr,
                                    WARPS: gl.constexpr, EXP: gl.constexpr, EXP_REGS: gl.constexpr):
        BM: gl.constexpr = x_desc.block_type.shape[0]
        BN: gl.constexpr = w_desc.block_type.shape[0]
        BKW: gl.constexpr = _BK // 8
        pid = gl.program_id(0)
        num_m = gl.cdiv(M, BM)
        off_m = (pid % num_m) * BM
        off_n = (pid // num_m) * BN
        dq_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, _BK], gl.bfloat16)
        xs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, _BK], x_desc.layout)
        ws = gl.allocate_shared_memory(gl.int32, [STAGES, BN, BKW], w_desc.layout)
        dq = gl.allocate_shared_memory(gl.bfloat16, [NDQ, BN, _BK], dq_layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        dq_ready = gl.allocate_shared_memory(gl.int64, [NDQ, 1], mbarrier.MBarrierLayout())
        dq_empty = gl.allocate_shared_memory(gl.int64, [NDQ, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
        for i in gl.static_range(NDQ):
            mbarrier.init(dq_ready.index(i), count=1)
            mbarrier.init(dq_empty.index(i), count=1)
        KT = K // _BK
        for i in gl.static_range(STAGES):  # the whole ring; the MMA partition refills it
            _request_step(x_desc, w_desc, ready.index(i), xs.index(i), ws.index(i), off_m, off_n, i, i < KT)

        acc, = gl.warp_specialize([
            (_mma_partition, (x_desc, w_desc, xs, ws, dq, ready, dq_ready, dq_empty, off_m, off_n, KT, BM, BN,
                              STAGES, WARPS)),
            (_expand_partition, (ws, dq, ready, dq_ready, dq_empty, S, Z, off_n, N, NG, KT, BN, STAGES, EXP, G,
                                 PER_CHANNEL, HAS_Z, ZINT)),
        ], [EXP], [EXP_REGS])

        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                      instr_shape=[16, BN, 16])
        _store_tile(acc, Y, BIAS, M, N, off_m, off_n, BM, BN, mma, HAS_BIAS)


def check_ws_config(config: tuple) -> tuple:
    """(BM, BN, STAGES, WARPS, EXP): the plain kernel's config plus 4 expander warps (8 MMA warps, BN = 128)."""
    if len(config) != 5 or int(config[4]) != 4 or int(config[3]) != 8 or int(config[1]) != 128:
        raise ValueError(f"warp-specialised wgmma GEMM config {config}: takes 4 expander warps beside 8 MMA warps "
                         f"and BN = 128")
    return wg.check_config(tuple(config[:4])) + (4,)


def w4a16_gemm_wgmma_ws(x2, qweight, scales, zeros, G: int, bias, config: tuple = WS_CONFIGS[0], out=None):
    """Y = x2 W^T through the warp-specialised kernel (no EC operand; the plain kernel's constraints)."""
    bm, bn, stages, warps, exp = check_ws_config(tuple(config))
    M, N, K, per_channel = wg.check_call("w4a16_gemm_wgmma_ws", x2, qweight, scales, zeros, G, bias, out)
    y, xd, wd, _, _, _ = wg.launch_operands("w4a16_gemm_wgmma_ws", x2, qweight, out, None, M, N, bm, bn)
    grid = (-(-M // bm) * -(-N // bn),)
    _w4a16_gemm_wgmma_ws_kernel[grid](
        xd, wd, y, scales, zeros if zeros is not None else scales, bias if bias is not None else scales,
        M, N, K, scales.shape[1], G=min(G, K), PER_CHANNEL=per_channel, HAS_Z=zeros is not None,
        ZINT=zeros is not None and wg.integer_zeros(zeros), HAS_BIAS=bias is not None, STAGES=stages, WARPS=warps,
        EXP=exp, EXP_REGS=WS_EXP_REGS, num_warps=warps, maxnreg=WS_MAXNREG)
    return y


def compile_ws_sm90(config: tuple, G: int = 128, per_channel: bool = False, has_z: bool = True,
                    has_bias: bool = True, zint: bool = False) -> dict:
    """Offline sm_90 compile of the warp-specialised kernel (as ``w4a16_gemm_wgmma.compile_sm90``)."""
    bm, bn, stages, warps, exp = check_ws_config(tuple(config))
    descs = wg.desc_types(bm, bn)
    rest = dict(Y="*bf16", S="*bf16", Z="*bf16", BIAS="*bf16", M="i32", N="i32", K="i32", NG="i32")
    consts = dict(G=G, PER_CHANNEL=per_channel, HAS_Z=has_z, ZINT=zint, HAS_BIAS=has_bias, STAGES=stages,
                  WARPS=warps, EXP=exp, EXP_REGS=WS_EXP_REGS)
    return compile_gluon_sm90(_w4a16_gemm_wgmma_ws_kernel, dict(x_desc=descs["x_desc"], w_desc=descs["w_desc"],
                                                                 **rest), consts, warps, maxnreg=WS_MAXNREG)
