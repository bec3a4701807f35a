"""The int4 word layout that is the mma.sync A fragments (``lowering/w4a16_words.py``): its repack,
its PyTorch emulation and the constraints check.

Gluon kernels do not run in Triton's interpreter, so on CPU the weight layout and the arithmetic of the
kernels that read it (the TMA-fed GEMV, ``tests/lowering/test_gemv_tma.py``) are checked through
``gemv_gluon_emulated`` (the kernels' data flow in PyTorch) against the reference.
"""
import pytest
import torch

from spear_compile.quant import pack_int4
from tests.helpers import gemv_case as _case, exact_gemv as _exact

ww = pytest.importorskip("spear_compile.lowering.w4a16_words")
pytestmark = pytest.mark.skipif(not ww.HAS_GLUON, reason="needs Triton with Gluon (>= 3.5)")


def test_repack_places_each_column_where_the_mma_fragment_wants_it():
    """Column k of a row sits in lane t = (k >> 1) & 3, word i = k >> 5 & 3, nibble 4 (k & 1) + (k >> 3 & 3)."""
    K = 256
    q = (torch.arange(K) % 16).repeat(2, 1)
    w = ww.repack_gluon(pack_int4(q)).to(torch.int64) & 0xFFFFFFFF  # [2, K / 8]
    for k in range(K):
        c, t, i, s, h = k // 128, (k >> 1) & 3, (k >> 5) & 3, (k >> 3) & 3, k & 1
        word = w[0, 16 * c + 4 * t + i]
        assert (word >> (4 * (4 * h + s))) & 0xF == k % 16, k


@pytest.mark.parametrize("G", [128, 256, None])
def test_emulated_kernel_matches_fp64(G):
    N, K = 45, 512
    Gs = G or K
    x, q, qw, s, z, b = _case(N, K, Gs)
    for zz, bb in ((z, b), (None, None)):
        y = ww.gemv_gluon_emulated(x, ww.repack_gluon(qw), s, zz, Gs, bb)
        ex = _exact(x, q, s, zz, Gs, bb)
        assert ((y.double() - ex).abs() <= ex.abs() * 2 ** -7 + 1e-6).all()


def test_ok_and_errors():
    assert ww.gluon_ok(1, 4096, 128, torch.bfloat16) == ww.HAS_GLUON
    assert not ww.gluon_ok(1, 4096, 64, torch.bfloat16)   # groups smaller than a 128-column slice
    assert not ww.gluon_ok(1, 4096, 128, torch.float16)
    assert not ww.gluon_ok(2, 4096, 128, torch.bfloat16)
    with pytest.raises(ValueError, match="K=200"):
        ww.repack_gluon(torch.zeros(4, 100, dtype=torch.uint8))


def test_word_layout_bases_cover_the_words_tensor_once():
    """The (reg, lane, warp) bases of a (WARPS, RB, CH) config span the [WARPS CH, 16 RB, 16] words tensor:
    every element is held by exactly one (register, lane, warp)."""
    for warps, rb, ch in ((8, 2, 1), (4, 1, 2), (16, 1, 1)):
        reg, lane, warp = ww.word_layout_bases(warps, rb, ch)
        bases = reg + lane + warp
        seen = set()
        for idx in range(1 << len(bases)):
            v = [0, 0, 0]
            for j, b in enumerate(bases):
                if idx >> j & 1:
                    v = [a ^ c for a, c in zip(v, b)]
            seen.add(tuple(v))
        assert seen == {(a, b, c) for a in range(warps * ch) for b in range(16 * rb) for c in range(16)}
