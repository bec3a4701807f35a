"""The K-split tensor-core W4 GEMM (``lowering/w4a16_gemm_splitk.py``) against its reference.

On CPU under ``TRITON_INTERPRET=1``: fp16 runs the GPU path (nibbles OR-ed into 1024.0's mantissa and bit-cast),
bf16 the interpreter's fp32 stand-in of the same algebra. The K split's ordered slot sum and its counter reset run
in both (the interpreter runs programs one after another, so arrival order is only exercised on a GPU).
"""
import pytest
import torch

from spear_compile.lowering._triton import HAS_TRITON
from spear_compile.ops.w4a16_ref import w4a16_linear_ref
from tests.helpers import DEV, close_to as _close, packed_weight as _weight

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is a test dependency; install .[test]")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("G", [32, 64, None])
@pytest.mark.parametrize("split", [1, 2, 3])
@pytest.mark.parametrize("with_zero,with_bias", [(True, True), (False, False)])
def test_splitk_matches_reference(dtype, G, split, with_zero, with_bias):
    from spear_compile.lowering.w4a16_gemm_splitk import w4a16_gemm_splitk

    qweight, scales, zeros, bias, Gs = _weight(123, 320, G, dtype)
    zeros, bias = (zeros if with_zero else None), (bias if with_bias else None)
    M = 5 if split != 2 else 17  # 17: two M tiles
    x = torch.randn(M, 320, generator=torch.Generator().manual_seed(split)).to(DEV, dtype)
    y = torch.full((M, 123), float("nan"), dtype=dtype, device=DEV)  # poison: every element must be written
    w4a16_gemm_splitk(x, qweight, scales, zeros, Gs, bias, config=(16, 32, 64, split, 4, 1), out=y)
    _close(y, w4a16_linear_ref(x, qweight, scales, zeros, Gs, bias), dtype)


def test_splitk_is_reproducible_and_leaves_counters_zero():
    """Two launches give the same bits (the slots are summed in order) and leave every counter at zero, so the
    next launch (or a graph replay) needs no memset; more splits than K tiles leave some programs empty."""
    from spear_compile.lowering import w4a16_gemm_splitk as SK

    qweight, scales, zeros, bias, Gs = _weight(96, 256, 64, torch.float16)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0)).to(DEV, torch.float16)
    a = SK.w4a16_gemm_splitk(x, qweight, scales, zeros, Gs, bias, config=(16, 32, 64, 3, 4, 1))
    b = SK.w4a16_gemm_splitk(x, qweight, scales, zeros, Gs, bias, config=(16, 32, 64, 8, 4, 1))  # 4 K tiles
    c = SK.w4a16_gemm_splitk(x, qweight, scales, zeros, Gs, bias, config=(16, 32, 64, 3, 4, 1))
    assert torch.equal(a, c)
    _close(b, w4a16_linear_ref(x, qweight, scales, zeros, Gs, bias), torch.float16)
    _, cnt = SK.workspace(x.device, 1, 1)
    assert int(cnt.abs().sum()) == 0


def test_splitk_refuses_what_it_cannot_run():
    from spear_compile.lowering import w4a16_gemm_splitk as SK

    qweight, scales, zeros, bias, Gs = _weight(64, 256, 64, torch.float16)
    with pytest.raises(ValueError, match="fp16 or bf16"):
        SK.w4a16_gemm_splitk(torch.randn(2, 256, device=DEV), qweight, scales.float(), zeros.float(), Gs, None)
    ok, why = SK.can_implement(torch.float16, 288, 96, (16, 32, 64))  # no power-of-two K tile fits groups of 96
    assert not ok and "group size 96" in why
    ok, why = SK.can_implement(torch.bfloat16, 4096, 128, (16, 64, 128))
    assert ok and "128" in why


@pytest.mark.parametrize("M,N,K", [(2, 4096, 4096), (16, 8192, 8192), (64, 28672, 8192), (256, 4096, 11008)])
def test_default_config_fills_the_gpu_within_its_bounds(M, N, K):
    """The untuned config: the M tile holds M (up to 128), the split is a power of two <= 8 leaving >= 2 K tiles
    per split, and the grid reaches about two programs per SM where the split can do it."""
    from spear_compile.lowering.w4a16_gemm_splitk import default_config, tile_k

    bm, bn, bk, split, warps, stages = default_config(M, N, K, 128, sms=132)
    assert bm >= min(M, 128) and bm in (16, 32, 64, 128)
    assert split in (1, 2, 4, 8) and (K // tile_k(bk, 128, K)) // split >= 2
    tiles = -(-M // bm) * -(-N // bn)
    assert tiles * split >= min(264, tiles * 8) // 2


def test_route_runs_a_splitk_table_choice_and_explains_a_refusal():
    """A table entry ("splitk", ...) is the route's GEMM where the kernel can run; where it cannot (fp32
    activations) the route falls back to M's default and says why."""
    from spear_compile.dispatch import keys as TK
    from spear_compile.dispatch import route as RT
    from spear_compile.dispatch import table as TT

    shipped = TT.configs()
    try:
        t = TT.TunedTable("configs", dict(shipped.items()))
        t[TK.gemm_key(8, 96, 256, 64)] = ["splitk", 16, 32, 64, 2, 4, 1]
        TT.set_configs(t)
        p = RT.Problem(op="w4a16", M=8, N=96, K=256, G=64, dtype=torch.float16,
                       param_dtypes=(torch.float16, torch.float16), device=torch.device("cuda"))
        r = RT.gemm_route(p)
        assert r.kernel == "gemm_splitk" and r.config == (16, 32, 64, 2, 4, 1)
        r32 = RT.gemm_route(p.replace(dtype=torch.float32))
        assert r32.kernel != "gemm_splitk" and any("cannot run here" in w for w in r32.all_reasons())
    finally:
        TT.set_configs(shipped)
