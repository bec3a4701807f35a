"""M = 1 W4A16 GEMV on tensor cores with no shared-memory round trip (Gluon: explicit layouts).

Reference: ``ops/w4a16_ref.py:w4a16_linear_ref``; the data flow is mirrored in PyTorch by
``gemv_gluon_emulated`` (what the CPU tests check: Gluon kernels do not run in Triton's interpreter).

Status: this register-fed kernel is not dispatched (on the H200 it runs at the CUDA-core kernel's
speed: 8192^2 17.6 vs 17.2-17.6 us; docs/kernels.md); ``benchmarks/kernels.py --lab gemv
--gluon`` times it. Its K-step arithmetic (``_mma_words``), index setup and epilogue (``_store_rows``)
are shared with the TMA-fed kernel of ``w4a16_gemv_tma.py``, which *is* dispatched at M = 1 where it
measured faster.

Every thread loads, in one 16-byte load per row and 128 columns, exactly the
nibbles that its ``mma.sync.m16n8k16`` A fragments hold, so the dequantized registers *are* the MMA
operand:

- weight layout (``repack_gluon``): for row n and 128-column chunk c, lane t (= lane % 4 of the
  MMA quad) owns 4 words; nibble ``4h + s`` of word ``i`` is column
  ``128 c + 64 (i >> 1) + 32 (i & 1) + 16 (s >> 1) + 8 (s & 1) + 2 t + h``;
- ``(w >> 4s) & 0x000F000F | 0x43004300`` (one shift, one LOP3) is then the bf16x2 register
  (128 + q at column k, 128 + q at column k + 1) that the A fragment wants (k_width = 2);
- x is the one non-zero column of the [BLOCK_K, 8] B operand (lanes of the first MMA column load
  it; the others are masked), and an MMA of a constant all-ones A with the same B gives sum x in
  the accumulator layout, so ``y = sum_tiles s * (D - (128 + z) * D_ones)`` is formed in fp32 with
  no reduction across threads until the end. (The TMA kernel puts x in all 8 columns -
  every column of D is then y - and takes D_ones from sums of x computed once per CTA.)

Every conversion between layouts is asserted trivial at compile time (``assert_trivial=True``).
Constraints: bf16 activations, K % 128 == 0, G a multiple of 128 (or per-channel).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..ops.packing import unpack_int4
from ._triton import HAS_TRITON
from .layout_cache import derived_cached, derived_peek  # noqa: F401

try:  # Gluon (Triton >= 3.5) and its Ampere-style mma.sync
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2

    HAS_GLUON = HAS_TRITON
except ImportError:  # pragma: no cover - older Triton: the CUDA-core kernel is used
    HAS_GLUON = False

CHUNK = 128  # columns one thread's 16-byte load covers for one row


def _log2(v: int) -> int:
    assert v > 0 and v & (v - 1) == 0, v
    return v.bit_length() - 1


def word_layout_bases(warps: int, rb: int, ch: int) -> tuple[list, list, list]:
    """(reg, lane, warp) bases of the words tensor [warps ch, 16 rb, 16] (K slices of 128 columns,
    rows, words): the MMA's A operand [warps ch, 16 rb, 128] with a word's 8 nibbles in one thread."""
    reg = [[0, 0, 1], [0, 0, 2], [0, 8, 0]] + [[0, 16 << j, 0] for j in range(_log2(rb))] + \
        [[warps << j, 0, 0] for j in range(_log2(ch))]
    lane = [[0, 0, 4], [0, 0, 8], [0, 1, 0], [0, 2, 0], [0, 4, 0]]
    warp = [[1 << j, 0, 0] for j in range(_log2(warps))]
    return reg, lane, warp


def word_layout(warps: int, rb: int, ch: int):
    """The words tensor's Gluon layout (``word_layout_bases``) for a (WARPS, RB, CH) config."""
    reg, lane, warp = word_layout_bases(warps, rb, ch)
    return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=lane, warp_bases=warp, block_bases=[],
                                      shape=[warps * ch, 16 * rb, 16])


if HAS_GLUON:

    @gluon.jit
    def _x_index(NB: gl.constexpr, lb: gl.constexpr):
        """x as the [NB, 128, 8] B operand: column offsets [NB, 128, 1] of entry j's 128 activations
        and the column-0 mask [1, 1, 8] (the other columns' lanes load nothing)."""
        xj = gl.arange(0, NB, layout=gl.SliceLayout(1, gl.SliceLayout(2, lb)))
        xk = gl.arange(0, 128, layout=gl.SliceLayout(0, gl.SliceLayout(2, lb)))
        xc = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, lb)))
        x_k = gl.expand_dims(gl.expand_dims(xj * 128, 1) + gl.expand_dims(xk, 0), 2)
        x_c0 = gl.expand_dims(gl.expand_dims(xc == 0, 0), 1)
        return x_k, x_c0

    @gluon.jit
    def _scale_index(pid, NB: gl.constexpr, BN: gl.constexpr, mma: gl.constexpr):
        """Rows [1, BN] and entry column offsets [NB, 1] of the scales / zeros, in the accumulator's
        row layout."""
        sj = gl.arange(0, NB, layout=gl.SliceLayout(1, gl.SliceLayout(2, mma)))
        sn = pid * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, gl.SliceLayout(2, mma)))
        return gl.expand_dims(sn, 0), gl.expand_dims(sj * 128, 1)

    @gluon.jit
    def _pairs_packed(w):
        """One word -> its 8 nibbles as bf16 128 + q: 4 tensors [.., 2] (s = 0..3; h the trailing,
        register-contiguous dimension; nibble 4h + s), each pair (h = 0, 1) one bf16x2 register - the LOP3
        result itself. (Returning 8 16-bit values, split from and re-packed into those registers, cost
        ~100 register moves per (4, 2, 2, 2, 2) K step in SASS: 490 -> 414 instructions, H200 build.)"""
        w2 = gl.join(w, w)  # [.., 2]: one asm instance per (word, h pair); it reads the first copy only
        return gl.inline_asm_elementwise(
            """{
            .reg .b32 t;
            lop3.b32 $0, $4, 0x000F000F, 0x43004300, 0xEA;
            shr.u32 t, $4, 4;
            lop3.b32 $1, t, 0x000F000F, 0x43004300, 0xEA;
            shr.u32 t, $4, 8;
            lop3.b32 $2, t, 0x000F000F, 0x43004300, 0xEA;
            shr.u32 t, $4, 12;
            lop3.b32 $3, t, 0x000F000F, 0x43004300, 0xEA;
            }""",
            "=r,=r,=r,=r,r,r", [w2], dtype=[gl.bfloat16] * 4, is_pure=True, pack=2)

    @gluon.jit
    def _mma_words(w, xb, sc, zz, acc, acc1, ones, zero, NB: gl.constexpr, BN: gl.constexpr, la: gl.constexpr,
                   PER_CHANNEL: gl.constexpr, XSUM: gl.constexpr = False):
        """One K step of the tensor-core GEMV: words [NB, BN, 16] (``word_layout``) -> bf16 ``128 + q``
        A fragments (no layout conversion, asserted), D = A x and D_ones = 1 x by mma.sync. Per-channel:
        both accumulate raw (``_store_rows`` applies 128, z and s once); groups: ``acc += s (D - zz
        D_ones)`` with zz = 128 + z per [NB, BN] entry. Shared by the register-fed and TMA-fed kernels.
        XSUM: ``ones`` is D_ones itself (fp32 [NB, BN, 8], each entry's sum of x, computed once when x
        was staged) instead of the all-ones A operand: a third of the step's MMAs saved."""
        w6 = gl.reshape(w, [NB, BN, 4, 2, 2])  # [j, n, t, i1, i0]
        o0, o1, o2, o3 = _pairs_packed(w6)  # each [j, n, t, i1, i0, h]
        v = gl.join(gl.join(o0, o1), gl.join(o2, o3))  # [j, n, t, i1, i0, h, s0, s1]
        v = gl.permute(v, [0, 1, 3, 4, 7, 6, 2, 5])  # [j, n, i1, i0, s1, s0, t, h]: k order
        a = gl.convert_layout(gl.reshape(v, [NB, BN, 128]), la, assert_trivial=True)
        if PER_CHANNEL:
            acc = mma_v2(a, xb, acc)
            if XSUM:
                acc1 += ones
            else:
                acc1 = mma_v2(ones, xb, acc1)
        else:
            d = mma_v2(a, xb, zero)
            if XSUM:
                d1 = ones
            else:
                d1 = mma_v2(ones, xb, zero)
            acc += gl.expand_dims(sc, 2) * (d - gl.expand_dims(zz, 2) * d1)
        return acc, acc1

    @gluon.jit
    def _rows_out(acc, acc1, S, Z, N, pid, BN: gl.constexpr, mma: gl.constexpr, PER_CHANNEL: gl.constexpr,
                  HAS_Z: gl.constexpr):
        """(y [BN] without bias, row indices, row mask): the NB entries' K slices meet, column 0 of the
        MMA result is y; per-channel zero point and scale applied (linear in the K range, so a K-split
        CTA's partial comes out right too)."""
        if PER_CHANNEL:  # D - 128 D_ones per entry; the zero point and scale once, below
            acc = acc - 128.0 * acc1
        tot = gl.sum(acc, axis=0)  # [BN, 8]: the entries' K slices meet
        col = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(0, mma)))
        c0 = gl.expand_dims(col == 0, 0)
        out = gl.sum(gl.where(c0, tot, 0.0), axis=1)  # [BN]
        on = pid * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, gl.SliceLayout(0, mma)))
        mo = on < N
        if PER_CHANNEL:
            if HAS_Z:
                sx = gl.sum(gl.where(c0, gl.sum(acc1, axis=0), 0.0), axis=1)
                out -= gl.load(Z + on, mask=mo, other=0.0).to(gl.float32) * sx
            out *= gl.load(S + on, mask=mo, other=0.0).to(gl.float32)
        return out, on, mo

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


def repack_gluon(qweight: torch.Tensor) -> torch.Tensor:
    """spear-packed uint8 [N, K/2] -> int32 [N, K/8] in the layout the module docstring gives."""
    N, K = qweight.shape[0], qweight.shape[1] * 2
    if K % CHUNK:
        raise ValueError(f"repack_gluon: K={K} must be a multiple of {CHUNK}")
    q = unpack_int4(qweight).view(N, K // CHUNK, 2, 2, 2, 2, 4, 2)  # [n, c, i1, i0, s1, s0, t, h]
    q = q.permute(0, 1, 6, 2, 3, 7, 4, 5).reshape(N, K // 8, 8)  # [n, c, t, i1, i0 | h, s1, s0]
    b = (q[..., 0::2] | (q[..., 1::2] << 4)).contiguous()  # byte b of a word: nibbles 2b, 2b + 1
    return b.view(torch.int32).view(N, K // 8)


def gemv_gluon_emulated(x2, words, scales, zeros, G: int, bias) -> torch.Tensor:
    """The kernel's arithmetic in PyTorch (fp32): 128 + q from the repacked words, D and D_ones per
    128-column tile, ``s * (D - (128 + z) D_ones)`` per group. CPU tests compare it with the
    reference; GPU tests compare the kernel with both."""
    N, KW = words.shape
    K = KW * 8
    w = words.view(N, K // CHUNK, 4, 2, 2)
    nib = torch.stack([(w >> (4 * p)) & 0xF for p in range(8)], -1)  # [n, c, t, i1, i0, p = 4h + s]
    nib = nib.view(N, K // CHUNK, 4, 2, 2, 2, 2, 2)  # [.., h, s1, s0]
    a = nib.permute(0, 1, 3, 4, 6, 7, 2, 5).reshape(N, K).float() + 128.0  # k order
    x = x2.float().view(K)
    gs = min(G, K)
    d = (a * x).view(N, K // gs, gs).sum(-1)  # [N, groups]
    d1 = x.view(K // gs, gs).sum(-1)
    zz = 128.0 + (zeros.float() if zeros is not None else 0.0)
    y = (scales.float() * (d - zz * d1)).sum(-1)
    if bias is not None:
        y = y + bias.float()
    return y.view(1, N).to(x2.dtype)


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


def compile_gluon_sm90(kernel, types: dict, consts: dict, warps: int, **options) -> dict:
    """Compile a Gluon kernel for sm_90 without a GPU: ``types`` maps runtime arguments to Triton
    signature strings, ``consts`` constexpr arguments to values. Pointer and integer arguments are
    marked divisible by 16, as a GPU launch with such values specialises them (tensor descriptors
    take no such mark). ``options``: further compile options (``maxnreg``). Returns the compiled kernel's
    ``asm`` dict (ttgir, ptx, cubin)."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget

    consts = dict(consts)
    for name, p in inspect.signature(kernel.fn).parameters.items():  # constexprs left at their defaults
        if p.default is not inspect.Parameter.empty and name not in consts and name not in types:
            consts[name] = p.default
    sig = dict(types, **{c: "constexpr" for c in consts})
    attrs = {(kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a, t in types.items()
             if not t.startswith("tensordesc")}
    src = gluon._runtime.GluonASTSource(
        fn=kernel, signature=sig, constexprs={(kernel.arg_names.index(c),): v for c, v in consts.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, **options)).asm


_PACKED: dict = {}


def gluon_words(qweight: torch.Tensor) -> torch.Tensor:
    return derived_cached(_PACKED, [qweight], lambda: repack_gluon(qweight))


def gluon_ok(M: int, K: int, G: int, dtype: torch.dtype) -> bool:
    return HAS_GLUON and M == 1 and dtype == torch.bfloat16 and K % CHUNK == 0 and (G >= K or G % CHUNK == 0)


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
