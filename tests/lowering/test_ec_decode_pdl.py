"""The two-launch decode EC (``lowering/ec_decode_triton.py``) against the reference.

On CPU the producer grid and the GEMV run in stream order under ``TRITON_INTERPRET=1``
(no PDL there); several producers (split K) and one, odd r and gate width, and a second
call that relies on the first having reset the counter.
"""
import pytest
import torch

from spear_compile.lowering.ec_linear import ec_linear_ref

from .test_triton_kernels import DEV, _close, _ec, _weight

ED = pytest.importorskip("spear_compile.lowering.ec_decode_triton")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("R,D", [(8, 4), (5, 3)])
@pytest.mark.parametrize("producers", [None, 1, 3])
@pytest.mark.parametrize("act", ["silu", "gelu"])
def test_ec_pdl_matches_reference_and_resets_counter(dtype, R, D, producers, act):
    from spear_compile.lowering._triton import next_pow2
    from spear_compile.lowering.w4a16_triton import ec_workspace

    qweight, scales, zeros, bias, Gs = _weight(123, 320, 64, dtype)
    ec = _ec(123, 320, R, D, dtype)
    for rep in range(2):
        x = torch.randn(1, 320, generator=torch.Generator().manual_seed(rep)).to(DEV, dtype)
        y = torch.full((1, 123), float("nan"), dtype=dtype, device=DEV)
        ED.w4a16_gemv1_ec_pdl(x, qweight, scales, zeros, Gs, bias, ec, act=act, producers=producers, out=y)
        _close(y, ec_linear_ref(x, qweight, scales, zeros, Gs, bias, *ec, act), dtype)
    assert int(ec_workspace(torch.device(DEV), next_pow2(R))[1].abs().sum()) == 0
