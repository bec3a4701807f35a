"""The int4 word layout whose dequantized registers *are* the A fragments of ``mma.sync.m16n8k16``,
and what every Gluon kernel reading it shares: the repack, the K step, the epilogue's row sums, their
PyTorch emulation and the offline sm_90 compile.

Contract. ``repack_gluon`` turns a spear-packed weight (uint8 [N, K/2]) into int32 words [N, K/8] in
which, for row n and 128-column chunk c, lane t (= lane % 4 of the MMA quad) owns 4 words and nibble
``4h + s`` of word ``i`` is column ``128 c + 64 (i >> 1) + 32 (i & 1) + 16 (s >> 1) + 8 (s & 1) + 2 t + h``.
One 16-byte load per row and 128 columns then gives a thread exactly the nibbles its A fragments hold, and
``(w >> 4s) & 0x000F000F | 0x43004300`` (one shift, one LOP3) is the bf16x2 register (128 + q at
column k, 128 + q at column k + 1) the fragment wants (k_width = 2). ``word_layout`` /
``word_layout_bases`` are that layout as a Gluon layout of the words tensor; ``_mma_words`` is one K step
on it (D = A x and D_ones = 1 x by mma.sync, every layout conversion asserted trivial at compile time),
``_x_index`` / ``_scale_index`` the index setup and ``_rows_out`` the epilogue's row sums, so that
``y = sum_tiles s * (D - (128 + z) * D_ones)`` is formed in fp32 with no reduction across threads until the
end. ``gemv_gluon_emulated`` is that arithmetic in PyTorch: the CPU tests' check (Gluon kernels do not
run in Triton's interpreter) against ``ops/w4a16_ref.py:w4a16_linear_ref``. ``gluon_ok`` states the
constraints: M = 1, bf16 activations, K % 128 == 0, G a multiple of 128 (or per-channel).
``compile_gluon_sm90`` compiles any Gluon kernel for sm_90 without a GPU (the offline layout, register
and SASS checks of the Gluon kernels' tests).

Users: the TMA-fed M = 1 GEMV (``w4a16_gemv_tma.py``, dispatched) and its decode-EC epilogue
(``w4a16_gemv_tma_ec.py``); the wgmma GEMMs (``w4a16_gemm_wgmma.py``, ``w4a16_gemm_wgmma_ra.py``) use
``HAS_GLUON`` and the offline compile. The register-fed mma.sync GEMV this layout was built for is a study,
not shipped (no faster than the CUDA-core kernel on the H200; docs/kernels.md):
``benchmarks/experimental/gemv_mma_sync.py``.
"""
from __future__ import annotations

import torch

from ..ops.packing import unpack_int4
from ._triton import HAS_TRITON

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
        """One K step of a tensor-core GEMV on the words: words [NB, BN, 16] (``word_layout``) -> bf16
        ``128 + q`` A fragments (no layout conversion, asserted), D = A x and D_ones = 1 x by mma.sync. Per-channel:
        both accumulate raw (``_rows_out`` applies 128, z and s once); groups: ``acc += s (D - zz
        D_ones)`` with zz = 128 + z per [NB, BN] entry. Shared by the register-fed and TMA-fed GEMVs.
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


def repack_gluon(qweight: torch.Tensor) -> torch.Tensor:
    """spear-packed uint8 [N, K/2] -> int32 [N, K/8] in the layout the module docstring gives (each thread's
    16-byte load of a row and 128 columns is its MMA A fragments)."""
    N, K = qweight.shape[0], qweight.shape[1] * 2
    if K % CHUNK:
        raise ValueError(f"repack_gluon: K={K} must be a multiple of {CHUNK}")
    q = unpack_int4(qweight).view(N, K // CHUNK, 2, 2, 2, 2, 4, 2)  # [n, c, i1, i0, s1, s0, t, h]
    q = q.permute(0, 1, 6, 2, 3, 7, 4, 5).reshape(N, K // 8, 8)  # [n, c, t, i1, i0 | h, s1, s0]
    b = (q[..., 0::2] | (q[..., 1::2] << 4)).contiguous()  # byte b of a word: nibbles 2b, 2b + 1
    return b.view(torch.int32).view(N, K // 8)


def gemv_gluon_emulated(x2, words, scales, zeros, G: int, bias) -> torch.Tensor:
    """The word-layout GEMVs' arithmetic in PyTorch (fp32): 128 + q from the repacked words, D and D_ones
    per 128-column tile, ``s * (D - (128 + z) D_ones)`` per group. CPU tests compare it with the
    reference; GPU tests compare the kernels with both."""
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


def gluon_ok(M: int, K: int, G: int, dtype: torch.dtype) -> bool:
    """Whether a GEMV call fits the word layout (M = 1, bf16, K % 128 == 0, G % 128 == 0 or per-channel)."""
    return HAS_GLUON and M == 1 and dtype == torch.bfloat16 and K % CHUNK == 0 and (G >= K or G % CHUNK == 0)
