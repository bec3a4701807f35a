"""Large-M W4A16 GEMM on Hopper's warpgroup MMA, dequantizing in the K loop (Gluon).

Reference: ``ops/w4a16_ref.py:w4a16_linear_ref`` (``dequantize_ref`` then a GEMM). The weight is
dequantized exactly as the reference does it, ``(q - z) * s`` rounded to bf16 after each operation, so
this kernel multiplies the same bf16 weight cuBLAS gets on the dequantize-then-cuBLAS path and differs
from it only in the fp32 accumulation order.

Why: from M ~ 256 on, the shipped prefill path dequantizes the whole weight into a bf16 scratch
(N K / 2 bytes read, 2 N K written: 48 us at 8192^2 on the H200) and hands it to cuBLAS; at M = 1024 that
pass is 1.21-1.29x cuBLAS bf16's time (docs/kernels.md, H200) and the target is 1.15x.
The pass cannot overlap cuBLAS (a cuBLAS CTA holds a whole SM's registers, so the dequantize programs
only time-slice with it, H200). Here the dequantization rides inside the GEMM: 4-bit words
come in by TMA (a quarter of the bf16 weight's bytes) and are expanded in registers while the previous
K step's warpgroup MMAs run. An earlier attempt in Triton put the dequantized tile through a
register -> shared -> register layout conversion and waited on every MMA (2.9x cuBLAS); Gluon gives the
layouts and the MMA wait depth by hand.

Per K step (BK = 64 columns) of a CTA's [BM, BN] output tile:
  1. wait for the step's TMA tiles (x [BM, BK] bf16, packed words [BN, BK / 8] int32) in ring slot
     ``i % STAGES``;
  2. every thread expands 4 words (32 weights of one row) into bf16 with one inline-asm block per word
     (byte permute + mask + OR builds ``128 + q`` bf16 pairs; three ``fma.rn.bf16x2`` give ``q``,
     ``q - z`` and ``(q - z) * s``, each rounded once like the reference's bf16 ops; two for integer zero
     points, where ``(128 + q) - (128 + z)`` is exact) and stores them into dequantized buffer ``i % 3``
     (128-byte swizzled, the MMA's B operand as a transposed view);
  3. one CTA barrier: every thread's step-i stores are visible and (by the wait of step i - 1) every
     warpgroup's step i - 2 MMA is done, so ring slot (i - 2) % STAGES is refilled with step
     i + STAGES - 2's tiles and buffer (i + 1) % 3 may be overwritten by step i + 1;
  4. issue step i's MMA asynchronously, then ``warpgroup_mma_wait(1)``: step i - 1's MMA is done, step
     i's runs on while the warps expand step i + 1.
The wait sits after the issue in the same iteration: waiting at the top of the next iteration (the
pending MMA's accumulators crossing the loop's back edge) makes ptxas serialise every MMA (its
C7515 "wgmma serialized" note), and so does storing the accumulator tile to shared memory for a TMA
store; the epilogue therefore adds the bias and stores bf16 pairs straight from the MMA layout. The CPU
tests compile the kernel for sm_90 and assert ptxas leaves the MMAs asynchronous.

Configs (BM, BN, STAGES, WARPS): BM rows of x per CTA (64 or 128 per warpgroup), BN weight rows, ring
depth. Constraints: CUDA sm_90+, bf16 x / scales / zero points / bias, K % 64 == 0, G % 64 == 0 or
per-channel (G >= K), N % 8 == 0 (TMA row strides). ``dispatch/route.py:gemm_route`` takes it where
``benchmarks/kernels.py`` measured it fastest (tuned table value ``("wgmma", ...)``; the "in_gemm" EC
structure's own entry: ``gemmwg`` keys). Measured on the H200: faster than
dequantize + cuBLAS at M = 256 on the larger shapes, slower from M = 1024 (1.3-1.4x cuBLAS): its step
is bound by shared-memory traffic (the expanded tile written once and read by both warpgroups).
"""
from __future__ import annotations

from typing import Optional

import torch

from . import device as _device
from .layout_cache import derived_cached, derived_peek  # noqa: F401
from .w4a16_words import HAS_GLUON, compile_gluon_sm90

HAS_WGMMA = False
if HAS_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    try:  # Hopper TMA, mbarriers and warpgroup MMA in Gluon (Triton 3.5+)
        from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                      warpgroup_mma, warpgroup_mma_wait)

        HAS_WGMMA = True
    except ImportError:  # pragma: no cover - depends on the installed Triton
        pass

BK = 64  # K columns per step: one 128-byte swizzled row of bf16 per weight row
# (BM, BN, STAGES, WARPS). (128, 128, 3, 8) and (64, 128, 4, 4) fit two CTAs per SM (one expands while
# the other multiplies); the others one CTA with a deeper ring or a wider tile. BM = 256 (128 x rows per
# warpgroup) feeds each expanded tile to twice the MMAs: the expansion, not the MMAs, bounds a step (docs/kernels.md,
# H200). 16 warps (4 warpgroups of 64 rows) compile and run but were 5-12 % slower than 8 on an H200, and a
# warp-specialised variant was no faster (``benchmarks/experimental/wgmma_ws.py``): neither is searched.
WGMMA_CONFIGS = [(256, 128, 4, 8), (256, 128, 3, 8), (128, 256, 4, 8), (128, 128, 3, 8), (64, 128, 4, 4),
                 (128, 128, 5, 8)]

# One packed word (8 nibbles, k = 8 w + j in nibble j) -> 8 bf16 weights in k order, 4 bf16x2 registers.
# Pair i takes byte i of the word (low nibble: k = 2 i) and byte i of word >> 4 (its low nibble: k = 2 i + 1)
# with one byte permute, keeps the two nibbles under a bf16 128 (0x43 high byte): 128 + q exactly. Then
# q = (128 + q) - 128 (exact), q - z and (q - z) * s by fma.rn.bf16x2, one rounding each (the reference's
# bf16 subtraction and multiplication). Operands: $0-$3 out, $4-$11 the word (8 copies), $12-$15 (z, z),
# $16-$19 (s, s).
_ASM_PAIR_Z = """
    prmt.b32 p, $4, t, {sel};
    lop3.b32 p, p, 0x000F000F, 0x43004300, 0xEA;
    fma.rn.bf16x2 p, p, one, m128;
    fma.rn.bf16x2 p, $12, neg1, p;
    fma.rn.bf16x2 ${o}, p, $16, nz;"""
# Without zero points the reference is q * s: (128 + q) s - 128 s, exact before its one rounding (128 s
# is exact). Operands: $0-$3 out, $4-$11 the word, $12-$15 (s, s).
_ASM_PAIR = """
    prmt.b32 p, $4, t, {sel};
    lop3.b32 p, p, 0x000F000F, 0x43004300, 0xEA;
    fma.rn.bf16x2 ${o}, p, $12, c;"""
# Integer zero points (|z| < 128: what RTN, GPTQ and AWQ produce): 128 + z is exact in bf16, so
# (128 + q) - (128 + z) = q - z is one exact fma and the pair costs two instead of three. Operands as
# _ASM_PAIR_Z; nzz = -(128 + z) once per word.
_ASM_PAIR_ZINT = """
    prmt.b32 p, $4, t, {sel};
    lop3.b32 p, p, 0x000F000F, 0x43004300, 0xEA;
    fma.rn.bf16x2 p, p, one, nzz;
    fma.rn.bf16x2 ${o}, p, $16, nz;"""
_SELS = ("0x4400", "0x5511", "0x6622", "0x7733")


def _asm(zmode: int) -> str:
    """The word's asm block: zmode 0 no zero points, 1 any bf16 zero points, 2 integer ones."""
    head = """{
    .reg .b32 t, p, one, m128, neg1, nz, c, nzz;
    mov.b32 one, 0x3F803F80;
    mov.b32 m128, 0xC300C300;
    mov.b32 neg1, 0xBF80BF80;
    mov.b32 nz, 0x80008000;
    shr.u32 t, $4, 4;"""
    if zmode == 0:
        head += "\n    fma.rn.bf16x2 c, $12, m128, nz;"  # -128 s, exact
    elif zmode == 2:
        head += "\n    fma.rn.bf16x2 nzz, $12, neg1, m128;"  # -(128 + z), exact for integer |z| < 128
    pair = {0: _ASM_PAIR, 1: _ASM_PAIR_Z, 2: _ASM_PAIR_ZINT}[zmode]
    body = "".join(pair.format(sel=s, o=i) for i, s in enumerate(_SELS))
    return head + body + "\n    }"


ASM_NOZ, ASM_Z, ASM_ZINT = _asm(0), _asm(1), _asm(2)
CONSTRAINTS_Z = ",".join(["=r"] * 4 + ["r"] * 16)
CONSTRAINTS_NOZ = ",".join(["=r"] * 4 + ["r"] * 12)


if HAS_WGMMA:
    _BK = gl.constexpr(BK)  # (module globals reach a Gluon kernel only as constexprs)
    _ASM_Z, _ASM_NOZ, _ASM_ZINT = gl.constexpr(ASM_Z), gl.constexpr(ASM_NOZ), gl.constexpr(ASM_ZINT)
    _CONS_Z, _CONS_NOZ = gl.constexpr(CONSTRAINTS_Z), gl.constexpr(CONSTRAINTS_NOZ)

    @gluon.jit
    def _request_step(x_desc, w_desc, bar, xs_slot, ws_slot, off_m, off_n, k, pred):
        """Ask TMA for K step k's x tile and packed words, into one ring slot, counted on its mbarrier
        (every wgmma GEMM's ring: prologue and refills)."""
        mbarrier.expect(bar, x_desc.block_type.nbytes + w_desc.block_type.nbytes, pred=pred)
        tma.async_copy_global_to_shared(x_desc, [off_m, k * _BK], bar, xs_slot, pred=pred)
        tma.async_copy_global_to_shared(w_desc, [off_n, k * (_BK // 8)], bar, ws_slot, pred=pred)

    @gluon.jit
    def _group_params(S, Z, offs_n, mask_n, g, NG, HAS_Z: gl.constexpr):
        """(s, z) of rows ``offs_n`` in scale group ``g`` (z = s when there are no zero points: unused)."""
        s = gl.load(S + offs_n * NG + g, mask=mask_n, other=0.0)
        if HAS_Z:
            z = gl.load(Z + offs_n * NG + g, mask=mask_n, other=0.0)
        else:
            z = s
        return s, z

    @gluon.jit
    def _dequant(words, s, z, HAS_Z: gl.constexpr, BN: gl.constexpr, ZINT: gl.constexpr = False):
        """words int32 [BN, _BK / 8], s / z bf16 [BN] (slice layouts of the same 3-D layout) -> bf16 [BN, _BK]."""
        w3 = gl.expand_dims(words, 2)  # [BN, _BK / 8, 1]: broadcast to 8 in-thread copies by the asm
        s3 = gl.expand_dims(gl.expand_dims(s, 1), 2)
        z3 = gl.expand_dims(gl.expand_dims(z, 1), 2)
        w3, _ = gl.broadcast(w3, gl.full([BN, _BK // 8, 8], 0, gl.int32, w3.type.layout))
        if HAS_Z and ZINT:
            d = gl.inline_asm_elementwise(_ASM_ZINT, _CONS_Z, [w3, z3, s3], dtype=gl.bfloat16, is_pure=True,
                                          pack=8)
        elif HAS_Z:
            d = gl.inline_asm_elementwise(_ASM_Z, _CONS_Z, [w3, z3, s3], dtype=gl.bfloat16, is_pure=True,
                                          pack=8)
        else:
            d = gl.inline_asm_elementwise(_ASM_NOZ, _CONS_NOZ, [w3, s3], dtype=gl.bfloat16, is_pure=True,
                                          pack=8)
        return gl.reshape(d, [BN, _BK])

    @gluon.jit
    def _store_tile(acc, Y, BIAS, M, N, off_m, off_n, BM: gl.constexpr, BN: gl.constexpr, mma: gl.constexpr,
                    HAS_BIAS: gl.constexpr):
        """Y[off_m.., off_n..] = acc (+ bias) in bf16, stored from the MMA layout (two bf16 per thread and
        row): staging the tile in shared memory for a TMA store makes ptxas serialise every MMA of the
        loop (C7515, checked offline by the tests)."""
        offs_m = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, mma))
        offs_o = off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
        if HAS_BIAS:
            acc = acc + gl.expand_dims(gl.load(BIAS + offs_o, mask=offs_o < N, other=0.0).to(gl.float32), 0)
        mask = gl.expand_dims(offs_m < M, 1) & gl.expand_dims(offs_o < N, 0)
        gl.store(Y + gl.expand_dims(offs_m, 1) * N + gl.expand_dims(offs_o, 0), acc.to(gl.bfloat16), mask=mask)

    @gluon.jit
    def _w4a16_gemm_wgmma_kernel(x_desc, w_desc, hg_desc, b_desc, Y, S, Z, BIAS, M, N, K, NG,
                                 G: gl.constexpr, PER_CHANNEL: gl.constexpr, HAS_Z: gl.constexpr, ZINT: gl.constexpr,
                                 HAS_BIAS: gl.constexpr, STAGES: gl.constexpr, WARPS: gl.constexpr,
                                 HAS_EC: gl.constexpr = False):
        BM: gl.constexpr = x_desc.block_type.shape[0]
        BN: gl.constexpr = w_desc.block_type.shape[0]
        BKW: gl.constexpr = _BK // 8
        pid = gl.program_id(0)
        num_m = gl.cdiv(M, BM)
        off_m = (pid % num_m) * BM  # CTAs that share a weight tile run side by side: it leaves DRAM once
        off_n = (pid // num_m) * BN

        # [BN, _BK / 8, 8]: a thread holds WPT words (8 WPT consecutive weights) of one row
        WPT: gl.constexpr = 4 if WARPS <= 8 else 2
        l3: gl.constexpr = gl.BlockedLayout([1, WPT, 8], [32 * WPT // BKW, BKW // WPT, 1], [WARPS, 1, 1], [2, 1, 0])
        lw: gl.constexpr = gl.SliceLayout(2, l3)
        ln: gl.constexpr = gl.SliceLayout(1, lw)
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                      instr_shape=[16, BN, 16])
        dq_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, _BK], gl.bfloat16)

        xs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, _BK], x_desc.layout)
        ws = gl.allocate_shared_memory(gl.int32, [STAGES, BN, BKW], w_desc.layout)
        dq = gl.allocate_shared_memory(gl.bfloat16, [3, BN, _BK], dq_layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)

        if HAS_EC:  # the EC's operands (alpha g h [BM, R_P] and B [BN, R_P], bf16) arrive while the loop runs
            hgs = gl.allocate_shared_memory(gl.bfloat16, hg_desc.block_type.shape, hg_desc.layout)
            bs = gl.allocate_shared_memory(gl.bfloat16, b_desc.block_type.shape, b_desc.layout)
            ecbar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            mbarrier.init(ecbar, count=1)
            mbarrier.expect(ecbar, hg_desc.block_type.nbytes + b_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(hg_desc, [off_m, 0], ecbar, hgs)
            tma.async_copy_global_to_shared(b_desc, [off_n, 0], ecbar, bs)

        KT = K // _BK
        for i in gl.static_range(STAGES - 2):  # the ring's first STAGES - 2 steps
            _request_step(x_desc, w_desc, bars.index(i), xs.index(i), ws.index(i), off_m, off_n, i, i < KT)

        offs_n = off_n + gl.arange(0, BN, layout=ln)
        mask_n = offs_n < N
        s, z = _group_params(S, Z, offs_n, mask_n, 0, NG, HAS_Z)
        acc = gl.zeros([BM, BN], gl.float32, layout=mma)
        for i in range(KT):
            slot = i % STAGES
            if not PER_CHANNEL:  # the next step's group parameters are in flight while this step runs
                gn = gl.minimum((i + 1) * _BK // G, NG - 1)
                sn, zn = _group_params(S, Z, offs_n, mask_n, gn, NG, HAS_Z)
            mbarrier.wait(bars.index(slot), (i // STAGES) & 1)
            buf = dq.index(i % 3)
            buf.store(_dequant(ws.index(slot).load(lw), s, z, HAS_Z, BN, ZINT))
            fence_async_shared()
            gl.thread_barrier()
            nt = i + STAGES - 2
            ns = nt % STAGES
            _request_step(x_desc, w_desc, bars.index(ns), xs.index(ns), ws.index(ns), off_m, off_n, nt, nt < KT)
            acc = warpgroup_mma(xs.index(slot), buf.permute((1, 0)), acc, is_async=True)
            # wait in the same iteration (a wait at the top of the next one makes ptxas serialise every MMA:
            # C7515, the pending MMA's accumulators cross the loop's back edge)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            if not PER_CHANNEL:
                s, z = sn, zn
        if HAS_EC:  # one more K step: y += (alpha g h) B^T, both operands bf16 as they came
            mbarrier.wait(ecbar, 0)
            acc = warpgroup_mma(hgs, bs.permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))
        if HAS_EC:
            mbarrier.invalidate(ecbar)

        _store_tile(acc, Y, BIAS, M, N, off_m, off_n, BM, BN, mma, HAS_BIAS)


def _prmt(a: torch.Tensor, b: torch.Tensor, sel: int) -> torch.Tensor:
    """PTX ``prmt.b32`` (default mode) on int64 tensors holding 32-bit values: byte j of the result is byte
    ``(sel >> 4 j) & 7`` of the 8-byte value (b << 32) | a."""
    src = (b << 32) | a
    return sum(((src >> (8 * ((sel >> (4 * j)) & 7))) & 0xFF) << (8 * j) for j in range(4))


def dequant_emulated(qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor], G: int
                     ) -> torch.Tensor:
    """The kernel's inline-asm dequantization replayed in PyTorch on CPU (``prmt`` / ``lop3`` bit for bit,
    each ``fma.rn.bf16x2`` as an fp32 computation that is exact before its one rounding to bf16): bf16
    [N, K]. The CPU tests compare it bit for bit with ``dequantize_ref``."""
    N, K = qweight.shape[0], qweight.shape[1] * 2
    w = qweight.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # [N, K / 8]
    t = w >> 4
    per = G >= K
    s = scales.float().expand(N, K) if per else scales.float().repeat_interleave(G, 1)
    z = None
    if zeros is not None:
        z = zeros.float().expand(N, K) if per else zeros.float().repeat_interleave(G, 1)
    bf = lambda v: v.to(torch.bfloat16).float()  # noqa: E731  (one rounding)
    out = torch.empty(N, K // 8, 8)
    for i, sel in enumerate(_SELS):
        p = (_prmt(w, t, int(sel, 16)) & 0x000F000F) | 0x43004300
        for h in range(2):  # the low and high bf16 of the pair: k = 8 word + 2 i + h
            v = ((p >> (16 * h)) & 0xFFFF).to(torch.int16).view(torch.bfloat16).float()  # 128 + q
            out[:, :, 2 * i + h] = v
    v = out.reshape(N, K)
    if z is not None:
        v = bf(bf(v - 128.0) - z) * s
    else:
        v = v * s - 128.0 * s
    return v.to(torch.bfloat16)


def check_config(config: tuple) -> tuple[int, int, int, int]:
    """(BM, BN, STAGES, WARPS) with a clear error for a config the kernel cannot take."""
    if len(config) != 4:
        raise ValueError(f"W4A16 wgmma GEMM config {config}: expected (BM, BN, STAGES, WARPS)")
    bm, bn, stages, warps = (int(v) for v in config)
    if bm not in (16 * warps, 32 * warps) or bn not in (64, 128, 256) or stages < 3 or warps not in (4, 8, 16):
        raise ValueError(f"W4A16 wgmma GEMM config {config}: needs WARPS in {{4, 8, 16}}, BM = 16 or 32 WARPS (64 or "
                         f"128 rows per warpgroup), BN in {{64, 128, 256}} and STAGES >= 3")
    return bm, bn, stages, warps


_ZINT: dict = {}


def integer_zeros(zeros: torch.Tensor) -> bool:
    """Whether every zero point is an integer of magnitude < 128 (the two-fma expansion is then exact);
    checked once per zero-point tensor (and again after an in-place update)."""
    return derived_cached(_ZINT, [zeros], lambda: bool(((zeros == zeros.round()) & (zeros.abs() < 128)).all()))


SMEM_LIMIT = 227 * 1024  # per CTA on an H100 / H200


def smem_bytes(config: tuple, r_p: int = 0) -> int:
    """Shared memory of a config: the TMA ring (x and packed words), three dequantized tiles, barriers,
    and with an EC of padded rank ``r_p`` its two operand tiles."""
    bm, bn, stages, _ = check_config(config)
    ec = (bm + bn) * r_p * 2 + 8 if r_p else 0
    return stages * (bm * BK * 2 + bn * BK // 2) + 3 * bn * BK * 2 + 8 * stages + ec


def wgmma_ok(M: int, N: int, K: int, G: int, dtype: torch.dtype, param_dtypes: tuple = ()) -> bool:
    """Whether the kernel takes this problem (before any tensor is looked at; ``hopper`` for the device)."""
    per_channel = G >= K
    return (HAS_WGMMA and dtype == torch.bfloat16 and all(d == torch.bfloat16 for d in param_dtypes)
            and K % BK == 0 and N % 8 == 0 and (per_channel or (G % BK == 0 and K % G == 0)) and M >= 1)


def param_dtypes(scales, zeros, bias) -> tuple:
    """The dtypes of the weight's parameters that are present (``wgmma_ok`` wants them all bf16)."""
    return tuple(p.dtype for p in (scales, zeros, bias) if p is not None)


def takes(x2: torch.Tensor, N: int, G: int, scales, zeros, bias) -> bool:
    """Whether the kernel can run this call here: ``wgmma_ok`` for its shapes and dtypes, on a ``hopper``
    device (what the table dispatch and the "in_gemm" EC structure ask before choosing it)."""
    M, K = x2.shape
    return (hopper(x2.device) and wgmma_ok(M, N, K, G, x2.dtype, param_dtypes(scales, zeros, bias))
            and scales.is_contiguous() and (zeros is None or zeros.is_contiguous()))


def hopper(device: torch.device) -> bool:
    """A CUDA device with warpgroup MMA (sm_90+)."""
    return _device.is_sm90(device)


def _layout(block: list, dtype):
    if dtype == gl.int32:  # packed words: 32-byte rows, no swizzle (a warp's loads are contiguous)
        return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    return gl.NVMMASharedLayout.get_default_for(block, dtype)


def _descriptor(t: torch.Tensor, block: list, dtype):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, _layout(block, dtype))


def check_call(name: str, x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
               zeros: Optional[torch.Tensor], G: int, bias: Optional[torch.Tensor],
               out: Optional[torch.Tensor]) -> tuple[int, int, int, bool]:
    """(M, N, K, per_channel) of a call to one of the warpgroup-MMA GEMMs (``name``), or a ValueError that
    names what does not fit: shapes, dtypes, the packed weight, the device, ``out``."""
    M, K = x2.shape
    N = scales.shape[0] if scales.dim() == 2 else -1
    per_channel = G >= K
    params = param_dtypes(scales, zeros, bias)
    if not wgmma_ok(M, N, K, G, x2.dtype, params):
        raise ValueError(f"{name}: M={M}, N={N}, K={K}, G={G}, x {x2.dtype}, parameters {params}; needs "
                         f"bf16 everywhere, K % {BK} == 0, N % 8 == 0 and G % {BK} == 0 with K % G == 0 (or "
                         f"per-channel), and "
                         f"Triton with Gluon's Hopper ops")
    if scales.shape[1] != (1 if per_channel else K // G):
        raise ValueError(f"{name}: scales {tuple(scales.shape)} do not match K={K}, group size {G}")
    if zeros is not None and zeros.shape != scales.shape:
        raise ValueError(f"{name}: zeros {tuple(zeros.shape)} != scales {tuple(scales.shape)}")
    if not scales.is_contiguous() or (zeros is not None and not zeros.is_contiguous()):
        raise ValueError(f"{name}: scales / zeros must be contiguous [N, NG] (the kernels index them as such)")
    if qweight.dtype != torch.uint8 or tuple(qweight.shape) != (N, K // 2) or not qweight.is_contiguous():
        raise ValueError(f"{name}: packed weight {qweight.dtype} {tuple(qweight.shape)} must be contiguous "
                         f"uint8 of shape {(N, K // 2)} (x's K={K}, the scales' N={N})")
    if bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"{name}: bias {tuple(bias.shape)} != ({N},)")
    if not hopper(x2.device):
        raise ValueError(f"{name}: a CUDA sm_90+ kernel (x is on {x2.device}); elsewhere use w4a16_linear_ref")
    if out is not None and (tuple(out.shape) != (M, N) or out.dtype != x2.dtype or not out.is_contiguous()):
        raise ValueError(f"{name}: out {out.dtype} {tuple(out.shape)} must be a contiguous {x2.dtype} [{M}, {N}]")
    return M, N, K, per_channel


def check_ec_operands(name: str, hg: torch.Tensor, B: torch.Tensor, M: int, N: int) -> int:
    """R_P of the EC operands (hg = alpha g h [M, R_P], B [N, R]) of an "in_gemm" call, or a ValueError."""
    r_p = hg.shape[1]
    if (hg.dtype, B.dtype) != (torch.bfloat16, torch.bfloat16) or hg.shape[0] != M or B.shape[0] != N \
            or B.shape[1] > r_p or r_p not in (16, 32, 64, 128) or (B.shape[1] * 2) % 16 or not B.is_contiguous():
        raise ValueError(f"{name}: EC operands hg {hg.dtype} {tuple(hg.shape)}, B {B.dtype} {tuple(B.shape)}; need "
                         f"bf16 hg [M={M}, R_P] and contiguous B [N={N}, R] with R <= R_P in {{16, 32, 64, 128}} "
                         f"and R % 8 == 0")
    return r_p


def w4a16_gemm_wgmma(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
                     G: int, bias: Optional[torch.Tensor], config: Optional[tuple] = None,
                     out: Optional[torch.Tensor] = None, ec: Optional[tuple] = None) -> torch.Tensor:
    """Y[M, N] = x2 @ dequant(W)^T (+ bias) through the warpgroup-MMA kernel (CUDA sm_90+ only).
    ``qweight``: spear-packed uint8 [N, K / 2]; ``scales`` / ``zeros``: bf16 [N, K / G] (per-channel:
    [N, 1]); config = (BM, BN, STAGES, WARPS), default ``WGMMA_CONFIGS[0]``. ``ec``: (hg, B) with hg the
    EC's ``alpha g h`` [M, R_P] and B its [N, R] expand matrix (bf16, R <= R_P, R_P a power of two >= 16):
    ``hg B^T`` is added as one more K step (the "in_gemm" EC structure, ``dispatch/cuda.py:_ec_in_gemm``); the
    ring loses stages until it fits."""
    bm, bn, stages, warps = check_config(tuple(config or WGMMA_CONFIGS[0]))
    M, N, K, per_channel = check_call("w4a16_gemm_wgmma", x2, qweight, scales, zeros, G, bias, out)
    y, xd, wd, hd, bd, r_p = launch_operands("w4a16_gemm_wgmma", x2, qweight, out, ec, M, N, bm, bn)
    if ec is not None:
        while stages > 3 and smem_bytes((bm, bn, stages, warps), r_p) > SMEM_LIMIT:
            stages -= 1
    grid = (-(-M // bm) * -(-N // bn),)
    _w4a16_gemm_wgmma_kernel[grid](
        xd, wd, hd, bd, y, scales, zeros if zeros is not None else scales, bias if bias is not None else scales,
        M, N, K, scales.shape[1], G=min(G, K), PER_CHANNEL=per_channel, HAS_Z=zeros is not None,
        ZINT=zeros is not None and integer_zeros(zeros),
        HAS_BIAS=bias is not None, STAGES=stages, WARPS=warps, HAS_EC=ec is not None, num_warps=warps)
    return y


def desc_types(rows_x: int, rows_w: int, r_p: int = 0) -> dict:
    """Signature types of the four tensor descriptors of the wgmma GEMMs for an offline compile: x tiles
    [rows_x, BK] bf16, packed words [rows_w, BK / 8] int32, and the EC's alpha g h [rows_x, R_P] and B
    [rows_w, R_P] (the x / word types as stand-ins without an EC)."""
    def t(dtype, name, shape):
        return f"tensordesc<{name}[{shape[0]}, {shape[1]}],{_layout(shape, dtype)!r}>"

    xt, wt = t(gl.bfloat16, "bf16", [rows_x, BK]), t(gl.int32, "i32", [rows_w, BK // 8])
    ht, bt = (t(gl.bfloat16, "bf16", [rows_x, r_p]), t(gl.bfloat16, "bf16", [rows_w, r_p])) if r_p else (xt, wt)
    return dict(x_desc=xt, w_desc=wt, hg_desc=ht, b_desc=bt)


def launch_operands(name: str, x2: torch.Tensor, qweight: torch.Tensor, out: Optional[torch.Tensor],
                    ec: Optional[tuple], M: int, N: int, rows_x: int, rows_w: int) -> tuple:
    """What a wgmma GEMM's launch takes, for tiles of rows_x rows of x and rows_w weight rows: (y, x
    descriptor, word descriptor, alpha g h descriptor, B descriptor, R_P). Without an EC the last two
    descriptors are the first two as stand-ins (never read) and R_P is 0."""
    x2 = x2.contiguous()
    y = out if out is not None else torch.empty(M, N, dtype=x2.dtype, device=x2.device)
    xd = _descriptor(x2, [rows_x, BK], gl.bfloat16)
    wd = _descriptor(qweight.view(torch.int32), [rows_w, BK // 8], gl.int32)
    if ec is None:
        return y, xd, wd, xd, wd, 0
    hg, B = ec
    r_p = check_ec_operands(name, hg, B, M, N)
    return (y, xd, wd, _descriptor(hg.contiguous(), [rows_x, r_p], gl.bfloat16),
            _descriptor(B, [rows_w, r_p], gl.bfloat16), r_p)


def compile_sm90(config: tuple, G: int = 128, per_channel: bool = False, has_z: bool = True,
                 has_bias: bool = True, zint: bool = False, r_p: int = 0) -> dict:
    """Compile for sm_90 without a GPU (see ``w4a16_words.compile_gluon_sm90``): registers, spills,
    shared memory and the MMA instructions are checked offline."""

    bm, bn, stages, warps = check_config(config)
    descs = desc_types(bm, bn, r_p)
    rest = dict(Y="*bf16", S="*bf16", Z="*bf16", BIAS="*bf16", M="i32", N="i32", K="i32", NG="i32")
    consts = dict(G=G, PER_CHANNEL=per_channel, HAS_Z=has_z, ZINT=zint, HAS_BIAS=has_bias, STAGES=stages, WARPS=warps)
    types = dict(**descs, **rest)
    consts.update(HAS_EC=bool(r_p))
    return compile_gluon_sm90(_w4a16_gemm_wgmma_kernel, types, consts, warps)


EC_R_MAX = 128  # the most EC columns the expand step ("in_gemm") takes


def can_implement(p, ec: bool = False) -> tuple:
    """(ok, reason) of whether this GEMM runs problem ``p`` (a ``lowering.problem.Problem``): a sm_90+ GPU, bf16
    activations and parameters, 64-aligned K and G (``wgmma_ok``), contiguous scales and zero points; with ``ec``
    (the "in_gemm" structure) also an EC of rank at most EC_R_MAX."""
    if not hopper(p.device):
        return False, "not a sm_90+ GPU"
    dts = tuple(p.param_dtypes) + ((p.bias_dtype,) if p.bias_dtype is not None else ())
    if not wgmma_ok(p.M, p.N, p.K, p.G, p.dtype, dts):
        return False, f"{p.dtype}, params {dts}, N = {p.N}, K = {p.K}, G = {p.G} (needs bf16 and 64-aligned K, G)"
    if not p.params_contiguous:
        return False, "scales / zero points not contiguous"
    if ec and p.rank > EC_R_MAX:
        return False, f"rank {p.rank} > {EC_R_MAX}"
    return True, "sm_90+, bf16, aligned"
