"""The split-K streaming M = 1 GEMV (``lowering/w4a16_splitk_triton.py``) against the reference.

Odd shapes: N = 123 (a partial row block), K = 320 (40 words: a partial last split with 16- and
32-word tiles), groups of 32 / 64 and per-channel, with and without zero point and bias, nibble modes
exact and biased; three launches in a row (the counters must come back to zero each time).
"""
import pytest
import torch

from spear_compile import QuantConfig
from spear_compile.lowering._triton import HAS_TRITON
from spear_compile.lowering.w4a16 import w4a16_linear_ref
from spear_compile.quant import quantize_rtn

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is a test dependency; install .[test]")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _weight(N, K, G, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    qw = quantize_rtn(torch.randn(N, K, generator=gen) * 0.05, QuantConfig(group_size=G), out_dtype=dtype)
    bias = torch.randn(N, generator=gen).to(dtype)
    return [t.to(DEV) for t in (qw.qweight, qw.scales, qw.zeros, bias)] + [qw.group_size]


@pytest.mark.parametrize("dtype,nib", [(torch.float16, "exact"), (torch.bfloat16, "biased"), (torch.float32, "exact")])
@pytest.mark.parametrize("G", [32, 64, None])
@pytest.mark.parametrize("config", [(8, 16, 1), (16, 64, 4)])
def test_splitk_matches_reference(dtype, nib, G, config):
    from spear_compile.lowering.w4a16_splitk_triton import w4a16_gemv1_splitk
    from spear_compile.lowering.w4a16_triton import gemv_words

    qweight, scales, zeros, bias, Gs = _weight(123, 320, G, dtype)
    words = gemv_words(qweight)
    tol = {torch.float32: 2e-4, torch.float16: 3e-3, torch.bfloat16: 1.2e-2}[dtype]
    for with_bias, with_zero in ((True, True), (False, False), (True, False)):
        b, z = (bias if with_bias else None), (zeros if with_zero else None)
        for seed in range(2):  # repeated launches: the per-row-block counters reset themselves
            x = torch.randn(1, 320, generator=torch.Generator().manual_seed(seed)).to(DEV, dtype)
            ref = w4a16_linear_ref(x.double(), qweight, scales.double(), z.double() if z is not None else None, Gs,
                                   b.double() if b is not None else None)
            y = w4a16_gemv1_splitk(x, words, scales, z, Gs, b, config=config, nib=nib)
            err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
            assert err < tol, (seed, with_bias, with_zero, err)


def test_splitk_is_deterministic_and_rejects_bad_shapes():
    from spear_compile.lowering.w4a16_splitk_triton import w4a16_gemv1_splitk
    from spear_compile.lowering.w4a16_triton import gemv_words

    qweight, scales, zeros, bias, Gs = _weight(64, 256, 64, torch.bfloat16)
    words = gemv_words(qweight)
    x = torch.randn(1, 256).to(DEV, torch.bfloat16)
    a = w4a16_gemv1_splitk(x, words, scales, zeros, Gs, bias, config=(8, 8, 1))
    assert torch.equal(a, w4a16_gemv1_splitk(x, words, scales, zeros, Gs, bias, config=(8, 8, 1)))
    with pytest.raises(ValueError, match="M = 1"):
        w4a16_gemv1_splitk(torch.randn(2, 256).to(DEV, torch.bfloat16), words, scales, zeros, Gs, bias)
    with pytest.raises(ValueError, match="K = 8"):
        w4a16_gemv1_splitk(torch.randn(1, 128).to(DEV, torch.bfloat16), words, scales, zeros, Gs, bias)


def test_m1_dispatch_takes_split_k_only_where_the_table_says(monkeypatch):
    """w4a16_gemv1 without an explicit config runs split-K for a shape with a ``gemv1sk`` entry
    (written by the lab where it measured faster), the looping kernel otherwise and always with an EC."""
    from spear_compile.lowering import w4a16_splitk_triton as SK
    from spear_compile.lowering import w4a16_triton as T

    qweight, scales, zeros, bias, Gs = _weight(40, 256, 64, torch.bfloat16)
    x = torch.randn(1, 256).to(DEV, torch.bfloat16)
    calls = []
    real = SK.w4a16_gemv1_splitk
    monkeypatch.setattr(SK, "w4a16_gemv1_splitk", lambda *a, **k: calls.append(k["config"]) or real(*a, **k))
    table = {}
    monkeypatch.setattr(T, "tuned_table", lambda: table)
    ref = w4a16_linear_ref(x, qweight, scales, zeros, Gs, bias)
    y0 = T.w4a16_gemv1(x, qweight, scales, zeros, Gs, bias)
    assert calls == []
    table[T.gemv1_splitk_key(40, 256, Gs)] = [8, 16, 1]
    y1 = T.w4a16_gemv1(x, qweight, scales, zeros, Gs, bias)
    assert calls == [(8, 16, 1)]
    for y in (y0, y1):
        assert ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item() < 1.2e-2
    T.w4a16_gemv1(x, qweight, scales, zeros, Gs, bias, config=T.GEMV1_CONFIGS[0])  # explicit config: looping
    assert len(calls) == 1
