"""Checks of the register-fed mma.sync GEMV study (``gemv_mma_sync.py``; not shipped, not in CI):
``python -m pytest benchmarks/experimental/test_gemv_mma_sync.py`` on a GPU machine (the compile check runs
anywhere Triton can compile for sm_90). The word layout and its emulation are the package's
(``tests/lowering/test_words.py``)."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import gemv_mma_sync as gm  # noqa: E402

from spear_compile.ops.w4a16_ref import w4a16_linear_ref  # noqa: E402

from tests.helpers import exact_gemv, gemv_case  # noqa: E402

pytestmark = pytest.mark.skipif(not gm.HAS_GLUON, reason="needs Triton with Gluon (>= 3.5)")


_case, _exact = gemv_case, exact_gemv  # the shared GEMV case and its float64 reference


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="a real sm_90 compile")
@pytest.mark.parametrize("config", gm.GLUON_CONFIGS[:3])
def test_kernel_compiles_for_sm90_with_free_layout_conversions(config):
    """Every convert_layout in the kernel is asserted trivial, so compiling is the check."""
    for pc in (False, True):
        ptx = gm.compile_sm90(config, per_channel=pc)["ptx"]
        assert "mma.sync.aligned.m16n8k16" in ptx, config
        assert "st.shared" not in ptx.split("mma.sync")[0], config  # no smem staging of A


def test_wrapper_rejects_what_the_layout_cannot_hold():
    x = torch.zeros(2, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="M=2"):
        gm.w4a16_gemv_gluon(x, torch.zeros(4, 128, dtype=torch.uint8), torch.zeros(4, 2), None, 128, None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="runs the kernel: CUDA only")
@pytest.mark.parametrize("G", [128, None])
@pytest.mark.parametrize("config", gm.GLUON_CONFIGS)
def test_kernel_matches_reference_on_gpu(G, config):
    N, K = 200, 1280
    Gs = G or K
    x, q, qw, s, z, b = _case(N, K, Gs)
    x, qw, s, z, b = (t.cuda() for t in (x, qw, s, z, b))
    for zz, bb in ((z, b), (None, None)):
        y = gm.w4a16_gemv_gluon(x, qw, s, zz, Gs, bb, config=config)
        ex = _exact(x.cpu(), q, s.cpu(), zz.cpu() if zz is not None else None, Gs, bb.cpu() if bb is not None else None)
        assert ((y.cpu().double() - ex).abs() <= ex.abs() * 2 ** -7 + 1e-5).all()
        ref = w4a16_linear_ref(x, qw, s, zz, Gs, bb)
        assert ((y.float() - ref.float()).norm() / ref.float().norm()).item() < 8e-3
