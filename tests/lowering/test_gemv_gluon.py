"""The Gluon tensor-core M = 1 GEMV (``lowering/w4a16_gemv_gluon.py``).

Gluon kernels do not run in Triton's interpreter, so on CPU the weight layout and the arithmetic
are checked through ``gemv_gluon_emulated`` (the kernel's data flow in PyTorch) against the
reference, and the kernel is compiled for sm_90 to check that every layout conversion in it is free
(``assert_trivial``). On a GPU the kernel itself runs against the reference and the emulation.
"""
import pytest
import torch

from spear_compile.ops.w4a16_ref import w4a16_linear_ref
from spear_compile.quant import pack_int4
from tests.helpers import gemv_case as _case, exact_gemv as _exact, run_compiled  # noqa: F401

gg = pytest.importorskip("spear_compile.lowering.w4a16_gemv_gluon")
pytestmark = pytest.mark.skipif(not gg.HAS_GLUON, reason="needs Triton with Gluon (>= 3.5)")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_repack_places_each_column_where_the_mma_fragment_wants_it():
    """Column k of a row sits in lane t = (k >> 1) & 3, word i = k >> 5 & 3, nibble 4 (k & 1) + (k >> 3 & 3)."""
    K = 256
    q = (torch.arange(K) % 16).repeat(2, 1)
    w = gg.repack_gluon(pack_int4(q)).to(torch.int64) & 0xFFFFFFFF  # [2, K / 8]
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
        y = gg.gemv_gluon_emulated(x, gg.repack_gluon(qw), s, zz, Gs, bb)
        ex = _exact(x, q, s, zz, Gs, bb)
        assert ((y.double() - ex).abs() <= ex.abs() * 2 ** -7 + 1e-6).all()


def test_ok_and_errors():
    assert gg.gluon_ok(1, 4096, 128, torch.bfloat16) == gg.HAS_GLUON
    assert not gg.gluon_ok(1, 4096, 64, torch.bfloat16)   # groups smaller than a 128-column slice
    assert not gg.gluon_ok(1, 4096, 128, torch.float16)
    assert not gg.gluon_ok(2, 4096, 128, torch.bfloat16)
    with pytest.raises(ValueError, match="K=200"):
        gg.repack_gluon(torch.zeros(4, 100, dtype=torch.uint8))


def test_kernel_compiles_for_sm90_with_free_layout_conversions():
    """Every convert_layout in the kernel is asserted trivial, so compiling is the check."""
    code = ("from spear_compile.lowering.w4a16_gemv_gluon import GLUON_CONFIGS, compile_sm90\n"
            "for cfg in GLUON_CONFIGS[:3]:\n"
            "    for pc in (False, True):\n"
            "        ptx = compile_sm90(cfg, per_channel=pc)['ptx']\n"
            "        assert 'mma.sync.aligned.m16n8k16' in ptx, cfg\n"
            "        assert 'st.shared' not in ptx.split('mma.sync')[0], cfg  # no smem staging of A\n"
            "print('ok')\n")
    run_compiled(code)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="runs the kernel: CUDA only")
@pytest.mark.parametrize("G", [128, None])
@pytest.mark.parametrize("config", gg.GLUON_CONFIGS)
def test_kernel_matches_reference_on_gpu(G, config):
    N, K = 200, 1280
    Gs = G or K
    x, q, qw, s, z, b = _case(N, K, Gs)
    x, qw, s, z, b = (t.cuda() for t in (x, qw, s, z, b))
    for zz, bb in ((z, b), (None, None)):
        y = gg.w4a16_gemv_gluon(x, qw, s, zz, Gs, bb, config=config)
        ex = _exact(x.cpu(), q, s.cpu(), zz.cpu() if zz is not None else None, Gs, bb.cpu() if bb is not None else None)
        assert ((y.cpu().double() - ex).abs() <= ex.abs() * 2 ** -7 + 1e-5).all()
        ref = w4a16_linear_ref(x, qw, s, zz, Gs, bb)
        assert ((y.float() - ref.float()).norm() / ref.float().norm()).item() < 8e-3
