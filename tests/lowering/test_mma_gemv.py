"""The tensor-core M = 1 GEMV (``lowering/w4a16_mma_triton.py``) against its reference.

On CPU under ``TRITON_INTERPRET=1`` the nibble pairs are made with integer ops (PTX cannot run
there); on a GPU the LOP3 path runs. Odd shapes: N = 123 (a partial row block), K = 320
(a partial K tile), groups of 16 / 32 / 64 and per-channel, with and without zero point and bias.
"""
import pytest
import torch

from spear_compile.lowering._triton import HAS_TRITON
from spear_compile.lowering.w4a16 import w4a16_linear_ref
from spear_compile.quant import pack_int4

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is a test dependency; install .[test]")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _exact(x, q, s, z, G, b):
    """fp64 result of the dequantized weight (the kernel computes in fp32, rounds once at the end)."""
    zz = z.double().repeat_interleave(G, 1)[:, :q.shape[1]] if z is not None else 0.0
    W = (q.double() - zz) * s.double().repeat_interleave(G, 1)[:, :q.shape[1]]
    return x.double() @ W.T + (b.double() if b is not None else 0.0)


@pytest.mark.parametrize("G", [16, 32, 64, None])
@pytest.mark.parametrize("config", [(16, 64, 4, 1), (32, 32, 4, 2)])
def test_mma_gemv_matches_fp64_within_one_output_rounding(G, config):
    from spear_compile.lowering.w4a16_mma_triton import w4a16_mma_gemv

    N, K = 123, 320
    Gs = G or K
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (N, K), generator=gen)
    s = (torch.rand(N, K // Gs, generator=gen) * 0.02 + 0.005).to(torch.bfloat16)
    z = (torch.rand(N, K // Gs, generator=gen) * 15).to(torch.bfloat16)  # fractional zero points
    b = torch.randn(N, generator=gen).to(torch.bfloat16)
    x = torch.randn(1, K, generator=gen).to(torch.bfloat16)
    qw = pack_int4(q)
    for zz, bb in ((z, b), (None, None)):
        ex = _exact(x, q, s, zz, Gs, bb)
        y = w4a16_mma_gemv(*(t.to(DEV) if t is not None else None for t in (x, qw, s, zz)), Gs,
                           bb.to(DEV) if bb is not None else None, config=config)
        # one bf16 rounding of the output (2^-8 relative, truncating in the interpreter) and nothing else
        assert ((y.cpu().double() - ex).abs() <= ex.abs() * 2 ** -7 + 1e-6).all()
        ref = w4a16_linear_ref(x.to(DEV), qw.to(DEV), s.to(DEV), zz.to(DEV) if zz is not None else None, Gs,
                               bb.to(DEV) if bb is not None else None)
        assert ((y.float() - ref.float()).norm() / ref.float().norm()).item() < 8e-3


def test_mma_repack_puts_adjacent_columns_in_one_pair():
    from spear_compile.lowering.w4a16_mma_triton import repack_mma

    q = torch.arange(16).repeat(3, 1)  # row: columns 0..15 hold their own index
    w = repack_mma(pack_int4(q)).to(torch.int64) & 0xFFFFFFFF
    for p in range(4):  # (w >> 4p) & 0x000F000F = (column 2p, column 2p + 1) of the word's 8
        assert ((w[:, 0] >> (4 * p)) & 0xF == 2 * p).all() and ((w[:, 0] >> (16 + 4 * p)) & 0xF == 2 * p + 1).all()
        assert ((w[:, 1] >> (4 * p)) & 0xF == 8 + 2 * p).all()


def test_mma_gemv_rejects_what_it_cannot_run():
    from spear_compile.lowering.w4a16_mma_triton import w4a16_mma_gemv

    qw = pack_int4(torch.zeros(8, 64, dtype=torch.int64)).to(DEV)
    s = torch.ones(8, 2, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match="bf16 activations only"):
        w4a16_mma_gemv(torch.zeros(1, 64, device=DEV, dtype=torch.float16), qw, s.half(), None, 32, None)
    with pytest.raises(ValueError, match="M=2"):
        w4a16_mma_gemv(torch.zeros(2, 64, device=DEV, dtype=torch.bfloat16), qw, s, None, 32, None)
    with pytest.raises(ValueError, match="G=24"):
        w4a16_mma_gemv(torch.zeros(1, 48, device=DEV, dtype=torch.bfloat16), qw[:, :24], s, None, 24, None)
