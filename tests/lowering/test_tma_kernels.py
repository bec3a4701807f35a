"""The TMA-fed kernels (``lowering/w4a16_tma_triton.py``) against the PyTorch reference.

On CPU under ``TRITON_INTERPRET=1`` (descriptor loads zero-fill past the tensor there as
TMA does on the GPU). Odd N (123: a partial row block), K = 320 (10 chunks: a partial
K tile for every BLOCK_K > 64), group 32 / 64 / per-channel, M in {1, 3, 17}.
"""
import pytest
import torch

from spear_compile.lowering.w4a16 import w4a16_linear_ref

from .test_triton_kernels import DEV, _close, _weight

TT = pytest.importorskip("spear_compile.lowering.w4a16_tma_triton")
pytestmark = pytest.mark.skipif(not TT.HAS_TMA, reason="this Triton has no host-side tensor descriptors")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("G", [32, 64, None])
@pytest.mark.parametrize("M", [1, 3, 17])
@pytest.mark.parametrize("config", [(16, 32, 32, 4, 1), (16, 16, 128, 4, 2)])
def test_gemm_t_matches_reference(dtype, G, M, config):
    qweight, scales, zeros, bias, Gs = _weight(123, 320, G, dtype)
    for b, z in ((bias, zeros), (None, None)):
        x = torch.randn(M, 320, generator=torch.Generator().manual_seed(M)).to(DEV, dtype)
        y = torch.full((M, 123), float("nan"), dtype=dtype, device=DEV)  # poison: every element written
        TT.w4a16_gemm_t(x, qweight, scales, z, Gs, b, config=config, out=y)
        _close(y, w4a16_linear_ref(x, qweight, scales, z, Gs, b), dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("G", [32, 64, None])
@pytest.mark.parametrize("config", [(16, 8, 4, 2), (8, 32, 2, 3)])
def test_gemv1_tma_matches_reference(dtype, G, config):
    qweight, scales, zeros, bias, Gs = _weight(123, 320, G, dtype)
    for b, z in ((bias, zeros), (None, None)):
        x = torch.randn(1, 320, generator=torch.Generator().manual_seed(5)).to(DEV, dtype)
        y = torch.full((1, 123), float("nan"), dtype=dtype, device=DEV)
        TT.w4a16_gemv1_tma(x, qweight, scales, z, Gs, b, config=config, out=y)
        _close(y, w4a16_linear_ref(x, qweight, scales, z, Gs, b), dtype)


def test_unsupported_problems_are_named():
    qweight, scales, zeros, bias, Gs = _weight(8, 48, None, torch.float16)  # K = 48: not whole words chunks
    x = torch.randn(2, 48).to(DEV, torch.float16)
    with pytest.raises(ValueError, match="K=48"):
        TT.w4a16_gemm_t(x, qweight, scales, zeros, Gs, None)
    qweight, scales, zeros, bias, Gs = _weight(8, 64, None, torch.float32)
    assert not TT.tma_ok(torch.randn(1, 64).to(DEV), 64, Gs)  # fp32 would run the tensor cores in tf32
    assert not TT.tma_ok(torch.randn(3, 65).to(DEV, torch.float16)[:, :64], 64, Gs)  # rows not 16-byte aligned
