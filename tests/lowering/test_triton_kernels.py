"""Every Triton kernel against its PyTorch reference, on odd shapes.

On CPU these run under ``TRITON_INTERPRET=1`` (set in conftest.py); on a GPU machine
the same tests run the compiled kernels. Tolerances: fp32 accumulation everywhere;
the references round the dequantized weight to the activation dtype, the GEMV does
not, so bf16/fp16 differ by a few units in the last place of the output.
"""
import pytest
import torch

from spear_compile import QuantConfig
from spear_compile.lowering._triton import HAS_TRITON
from spear_compile.ops.ec_ref import ec_delta_ref, ec_linear_ref
from spear_compile.ops.w4a16_ref import w4a16_linear_ref
from spear_compile.quant import quantize_rtn
from tests.helpers import DEV, close_to as _close, ec_operands as _ec, packed_weight as _weight  # noqa: F401

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is a test dependency; install .[test]")

from tests.helpers import TOL  # noqa: E402,F401
from spear_compile.dispatch import cuda as DC


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("G", [64, None])
@pytest.mark.parametrize("M", [1, 3])
@pytest.mark.parametrize("with_bias,with_zero", [(True, True), (False, False)])
def test_gemv_matches_reference(dtype, G, M, with_bias, with_zero):
    from spear_compile.dispatch.cuda import w4a16_gemv

    qweight, scales, zeros, bias, Gs = _weight(123, 320, G, dtype)
    bias = bias if with_bias else None
    zeros = zeros if with_zero else None
    x = torch.randn(M, 320, generator=torch.Generator().manual_seed(M)).to(DEV, dtype)
    y = torch.full((M, 123), float("nan"), dtype=dtype, device=DEV)  # poison: every element must be written
    w4a16_gemv(x, qweight, scales, zeros, Gs, bias, out=y)
    _close(y, w4a16_linear_ref(x, qweight, scales, zeros, Gs, bias), dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("G", [64, None])
@pytest.mark.parametrize("M", [1, 3, 17])
def test_gemm_matches_reference(dtype, G, M):
    from spear_compile.dispatch.cuda import w4a16_gemm

    qweight, scales, zeros, bias, Gs = _weight(123, 320, G, dtype)
    x = torch.randn(M, 320, generator=torch.Generator().manual_seed(M)).to(DEV, dtype)
    y = torch.full((M, 123), float("nan"), dtype=dtype, device=DEV)
    w4a16_gemm(x, qweight, scales, zeros, Gs, bias, out=y)
    _close(y, w4a16_linear_ref(x, qweight, scales, zeros, Gs, bias), dtype)


@pytest.mark.parametrize("G", [32, 64, None])
@pytest.mark.parametrize("which", ["gemv_multi_group_tiles", "gemm_multi_group_tiles", "dequant_cublas",
                                   "dequant_cublas_pipe"])
def test_explicit_configs(G, which):
    """Tiles spanning several groups (NT > 1) and the dequantize + cuBLAS path."""
    from spear_compile.dispatch import cuda as D
    from spear_compile.lowering import w4a16_triton as T

    dtype = torch.float16
    qweight, scales, zeros, bias, Gs = _weight(123, 320, G, dtype)
    M = 2 if which.startswith("gemv") else 5
    x = torch.randn(M, 320, generator=torch.Generator().manual_seed(3)).to(DEV, dtype)
    if which == "gemv_multi_group_tiles":
        y = D.w4a16_gemv(x, qweight, scales, zeros, Gs, bias, config=(8, 256, 4, 1))
    elif which == "gemm_multi_group_tiles":
        y = D.w4a16_gemm(x, qweight, scales, zeros, Gs, bias, config=(16, 32, 128, 4, 1))
    elif which == "dequant_cublas":
        y = D.w4a16_gemm(x, qweight, scales, zeros, Gs, bias, config=T.DEQUANT_CUBLAS)
        torch.testing.assert_close(T.w4_dequantize(qweight, scales, zeros, Gs, dtype),
                                   spear_dequant(qweight, scales, zeros, Gs, dtype), rtol=0, atol=0)
    else:  # row slices (123 rows: 64 + 59) give the same numbers as one pass
        y = torch.full((M, 123), float("nan"), dtype=dtype, device=DEV)
        D.w4a16_gemm(x, qweight, scales, zeros, Gs, bias, config=T.DEQUANT_CUBLAS_PIPE, out=y)
        torch.testing.assert_close(y, D.w4a16_gemm(x, qweight, scales, zeros, Gs, bias, config=T.DEQUANT_CUBLAS),
                                   rtol=0, atol=0)
    _close(y, w4a16_linear_ref(x, qweight, scales, zeros, Gs, bias), dtype)


def spear_dequant(qweight, scales, zeros, G, dtype):
    from spear_compile.ops.w4a16_ref import dequantize_ref

    return dequantize_ref(qweight, scales, zeros, G, "spear", dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("R,D", [(8, 4), (5, 3)])
@pytest.mark.parametrize("M", [1, 3])
def test_fused_ec_gemv_matches_reference_and_leaves_workspace_clean(dtype, R, D, M):
    from spear_compile.lowering._triton import next_pow2
    from spear_compile.dispatch.cuda import w4a16_gemv
    from spear_compile.lowering.w4a16_triton import GEMV_MAX_M, ec_workspace

    qweight, scales, zeros, bias, Gs = _weight(123, 320, 64, dtype)
    ec = _ec(123, 320, R, D, dtype)
    for rep in range(2):  # the second launch relies on the first having reset the workspace
        x = torch.randn(M, 320, generator=torch.Generator().manual_seed(rep)).to(DEV, dtype)
        y = w4a16_gemv(x, qweight, scales, zeros, Gs, bias, ec=ec, act="silu")
        _close(y, ec_linear_ref(x, qweight, scales, zeros, Gs, bias, *ec, "silu"), dtype)
    hbuf, cnt = ec_workspace(torch.device(DEV), next_pow2(R))
    # h accumulators and counters are reset; the last row is the M = 1 kernel's published g * h
    assert int(cnt.abs().sum()) == 0 and float(hbuf[:GEMV_MAX_M].abs().sum()) == 0.0


@pytest.mark.parametrize("act", ["silu", "relu", "gelu"])
@pytest.mark.parametrize("M", [3, 17])
def test_shrink_gate_and_expand_add_match_reference(act, M):
    from spear_compile.lowering.ec_triton import ec_expand_add_, ec_shrink_gate

    dtype = torch.bfloat16
    R, D = 6, 5
    A, B, W1, b1, W2, b2, alpha = _ec(123, 320, R, D, dtype)
    x = torch.randn(M, 320, generator=torch.Generator().manual_seed(0)).to(DEV, dtype)
    hg = ec_shrink_gate(x, A, W1, b1, W2, b2, act)
    y0 = torch.randn(M, 123, generator=torch.Generator().manual_seed(1)).to(DEV, dtype)
    y = ec_expand_add_(y0.clone(), hg, B, alpha)
    ref = y0.float() + ec_delta_ref(x, A, B, W1, b1, W2, b2, alpha, act).float()
    _close(y, ref, dtype)


def test_tiles_hold_whole_groups_or_lie_inside_one():
    from spear_compile.lowering.w4a16_triton import _tiles

    assert _tiles(256, 64, 4096) == (256, 64)   # 4 groups per tile, one scale per 64
    assert _tiles(64, 128, 4096) == (64, 64)    # tile inside a group
    assert _tiles(1024, 320, 320) == (512, 512)  # per-channel: one group, tail masked
    assert _tiles(8, 32, 320) == (16, 16)


@pytest.mark.parametrize("nib,dtype", [("exact", torch.float16), ("exact", torch.bfloat16), ("biased", torch.float16),
                                       ("biased", torch.bfloat16), ("bf16x2", torch.bfloat16)])
@pytest.mark.parametrize("G", [32, 64, None])
@pytest.mark.parametrize("config", [(16, 64, 4, 1), (8, 16, 1, 0), (4, 16, 1, 1)])
def test_gemv1_modes_and_tiles(nib, dtype, G, config):
    """The M = 1 kernel in every nibble mode, one K tile or several (K = 320 is 40 words), with
    and without the next tile prefetched. (bf16x2's PTX runs on GPUs only; under the interpreter
    the same x pairing and nibble order are evaluated in fp32.)"""
    from spear_compile.lowering.w4a16_triton import w4a16_gemv1

    qweight, scales, zeros, bias, Gs = _weight(123, 320, G, dtype)
    for with_bias, with_zero in ((True, True), (False, False)):
        b, z = (bias if with_bias else None), (zeros if with_zero else None)
        x = torch.randn(1, 320, generator=torch.Generator().manual_seed(7)).to(DEV, dtype)
        y = torch.full((1, 123), float("nan"), dtype=dtype, device=DEV)
        w4a16_gemv1(x, qweight, scales, z, Gs, b, config=config, nib=nib, out=y)
        _close(y, w4a16_linear_ref(x, qweight, scales, z, Gs, b), dtype)


def test_gemv1_bf16x2_error_is_about_bf16_rounding():
    """Packed bf16 products (summed 4 at a time in bf16) stay within a few bf16 ulps of the
    fp64 result on a realistic K; the fp32 modes are the yardstick."""
    from spear_compile.lowering.w4a16_triton import w4a16_gemv1

    qweight, scales, zeros, _, Gs = _weight(256, 4096, 128, torch.bfloat16)
    x = torch.randn(1, 4096, generator=torch.Generator().manual_seed(3)).to(DEV, torch.bfloat16)
    ref = w4a16_linear_ref(x.double(), qweight, scales.double(), zeros.double(), Gs, None)
    for nib in ("exact", "bf16x2"):
        y = w4a16_gemv1(x, qweight, scales, zeros, Gs, None, nib=nib)
        assert ((y.double() - ref).norm() / ref.norm()).item() < 8e-3, nib


def test_gemv1_rejects_bad_nibble_modes():
    from spear_compile.lowering.w4a16_triton import w4a16_gemv1

    qweight, scales, zeros, _, Gs = _weight(16, 64, 32, torch.float16)
    x = torch.randn(1, 64).to(DEV, torch.float16)
    with pytest.raises(ValueError, match="needs bf16"):
        w4a16_gemv1(x, qweight, scales, zeros, Gs, None, nib="bf16x2")
    with pytest.raises(ValueError, match="nib='fp8'"):
        w4a16_gemv1(x, qweight, scales, zeros, Gs, None, nib="fp8")


def test_gemv1_biased_mode_error_is_small_in_fp32():
    """Biased nibbles (2^E + q, E <= 15) lose a few bits per 32-column chunk, not more."""
    from spear_compile.lowering.w4a16_triton import w4a16_gemv1

    qweight, scales, zeros, bias, Gs = _weight(64, 1024, 128, torch.float32)
    x = torch.randn(1, 1024, generator=torch.Generator().manual_seed(2)).to(DEV)
    ref = w4a16_linear_ref(x.double(), qweight, scales.double(), zeros.double(), Gs, None)
    for nib, tol in (("exact", 1e-5), ("biased", 2e-3)):
        y = w4a16_gemv1(x, qweight, scales, zeros, Gs, None, config=(16, 64, 4, 1), nib=nib)
        assert ((y.double() - ref).norm() / ref.norm()).item() < tol


def test_gemv_words_layout_and_cache():
    from spear_compile.lowering.w4a16_triton import gemv_words, repack_gemv
    from spear_compile.quant import unpack_int4

    qweight = _weight(8, 96, 32, torch.float16)[0]
    words = repack_gemv(qweight)
    q = unpack_int4(qweight).long()
    w = words.long() & 0xFFFFFFFF
    for c in range(3):
        for j in range(4):
            for i in range(8):
                assert torch.equal((w[:, 4 * c + j] >> (4 * i)) & 0xF, q[:, 32 * c + 4 * i + j])
    assert gemv_words(qweight) is gemv_words(qweight)  # cached
    before = gemv_words(qweight)
    qweight[0, 0] ^= 0x11  # an in-place update bumps the version: repacked, not stale
    after = gemv_words(qweight)
    assert after is not before and torch.equal(after, repack_gemv(qweight))


def test_gemv_falls_back_for_unchunkable_shapes():
    """K not a multiple of 32 (or G not) goes to the M > 1 kernel, still correct."""
    from spear_compile.dispatch.cuda import w4a16_gemv
    from spear_compile.lowering.w4a16_triton import gemv1_ok

    dtype = torch.float16
    qweight, scales, zeros, bias, Gs = _weight(40, 48, None, dtype)
    assert not gemv1_ok(1, 48, Gs, qweight)
    x = torch.randn(1, 48, generator=torch.Generator().manual_seed(5)).to(DEV, dtype)
    _close(w4a16_gemv(x, qweight, scales, zeros, Gs, bias), w4a16_linear_ref(x, qweight, scales, zeros, Gs, bias), dtype)


@pytest.mark.parametrize("G,dtype", [(64, torch.bfloat16), (None, torch.float16)])
def test_cat_gemv1_equals_its_parts_and_caches_the_concatenation(G, dtype):
    """w4a16_linear_cat's M = 1 path: one GEMV over concatenated words/scales/zeros/biases (a part
    without a bias contributes zeros) equals the parts' references; the concatenation is reused
    while the weights are unchanged and rebuilt after an in-place update."""
    from spear_compile.dispatch import cuda as D
    from spear_compile.dispatch import route as R
    from spear_compile.lowering import w4a16_cat as C

    w = [_weight(n, 320, G, dtype, seed=n) for n in (40, 24, 59)]
    qs, ss, zs, bs = [p[0] for p in w], [p[1] for p in w], [p[2] for p in w], [w[0][3], None, w[2][3]]
    Gs = w[0][4]
    x = torch.randn(1, 320, generator=torch.Generator().manual_seed(5)).to(DEV, dtype)
    ok = [R.gemv1_can_implement(R.cat_problem_of("w4a16_cat", x, qs, ss, z3, Gs, bs))[0]
          for z3 in (zs, [zs[0], None, zs[2]])]
    assert ok == [True, False]  # the M = 1 kernel takes the parts; zero points on some parts only: not
    ref = torch.cat([w4a16_linear_ref(x, q, s, z, Gs, b) for q, s, z, b in zip(qs, ss, zs, bs)], -1)
    y = torch.full((1, 123), float("nan"), dtype=dtype, device=DEV)
    D.w4a16_cat_gemv1(x, qs, ss, zs, Gs, bs, out=y)
    _close(y, ref, dtype)
    first = C.concatenated(qs, ss, zs, bs)
    assert C.concatenated(qs, ss, zs, bs) is first  # cached
    qs[1][0, 0] ^= 0x11  # in place: the cache must not serve the old weight
    again = C.concatenated(qs, ss, zs, bs)
    assert again is not first and not torch.equal(again[0], first[0])


@pytest.mark.parametrize("M", [3, 40])
def test_cat_gemm_equals_its_parts_and_caches_the_concatenated_weight(M, monkeypatch):
    """w4a16_linear_cat's "cat_gemm" route (2 <= M <= 256 on a GPU): one GEMM over the concatenated packed
    weights, a part without a bias contributing zeros, equals the parts' references; the concatenated weight
    is reused while the parts are unchanged and rebuilt after an in-place update. (On CPU the route answers
    "reference" for CUDA-only kernels, so the test hands the op the route a GPU gets: the GEMM of the
    concatenated shape, which runs here under TRITON_INTERPRET.)"""
    from spear_compile.dispatch import cuda as D
    from spear_compile.dispatch import route as R
    from spear_compile.lowering import w4a16_cat as C

    dtype = torch.bfloat16
    w = [_weight(n, 320, 64, dtype, seed=n) for n in (40, 24, 59)]
    qs, ss, zs, bs = [p[0] for p in w], [p[1] for p in w], [p[2] for p in w], [w[0][3], None, w[2][3]]
    zs[0] = zs[0] + 0.25  # fractional zero points on one part (HQQ-style): the op must tell its route
    Gs = w[0][4]
    x = torch.randn(1, M, 320, generator=torch.Generator().manual_seed(5)).to(DEV, dtype)
    first = C.concatenated_weight(qs, ss, zs, bs)
    assert C.concatenated_weight(qs, ss, zs, bs) is first and first[0].shape == (123, 160)
    gemm = R.gemm_route(R.problem_of("w4a16", x.reshape(M, 320), *first[:3], Gs, first[3]))
    seen = []

    def as_on_a_gpu(p):
        seen.append(p.op)
        assert p.zeros_probe is not None and p.zeros_probe() is False  # these zero points are not integers
        return R.Route("cat_gemm", parts=(gemm,)) if p.op == "w4a16_cat" else R.route(p)
    monkeypatch.setattr(D, "route", as_on_a_gpu)
    ref = torch.cat([w4a16_linear_ref(x, q, s, z, Gs, b) for q, s, z, b in zip(qs, ss, zs, bs)], -1)
    _close(D.w4a16_linear_cat_cuda(x, qs, ss, zs, Gs, bs), ref, dtype)
    assert seen == ["w4a16_cat"]  # one launch, no part on its own route
    qs[1][0, 0] ^= 0x11  # in place: the cache must not serve the old weight
    again = C.concatenated_weight(qs, ss, zs, bs)
    assert again is not first and not torch.equal(again[0], first[0])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("G", [64, None])
@pytest.mark.parametrize("with_bias", [True, False])
def test_ec_in_the_gemm_c_operand_matches_reference(dtype, G, with_bias):
    """The prefill EC as E = alpha * hg B^T (+ bias), then E += x W^T (``structure="c_operand"``):
    the same function as the reference and as the side-stream structure."""
    from spear_compile.dispatch.cuda import ec_overlapped

    qweight, scales, zeros, bias, Gs = _weight(123, 320, G, dtype)
    bias = bias if with_bias else None
    ec = _ec(123, 320, 5, 3, dtype)
    x = torch.randn(17, 320, generator=torch.Generator().manual_seed(2)).to(DEV, dtype)
    ref = ec_linear_ref(x, qweight, scales, zeros, Gs, bias, *ec, "silu")
    y = ec_overlapped(x, qweight, scales, zeros, Gs, bias, *ec, "silu", structure="c_operand")
    assert y.shape == (17, 123) and y.dtype == dtype
    _close(y, ref, dtype)
    # the high-priority variant: the same kernels, the EC and the dequantize on swapped streams
    _close(ec_overlapped(x, qweight, scales, zeros, Gs, bias, *ec, "silu", structure="c_operand_hi"), ref, dtype)
    if DEV == "cuda":  # the side-stream structures need CUDA streams
        for st in ("side", "side_hi"):
            _close(y, ec_overlapped(x, qweight, scales, zeros, Gs, bias, *ec, "silu", structure=st), dtype)
    with pytest.raises(ValueError, match="structure="):
        ec_overlapped(x, qweight, scales, zeros, Gs, bias, *ec, "silu", structure="epilogue")


def test_shrink_gate_folds_alpha_and_stores_in_the_asked_dtype():
    from spear_compile.lowering.ec_triton import ec_shrink_gate

    A, B, W1, b1, W2, b2, alpha = _ec(123, 320, 6, 5, torch.bfloat16)
    x = torch.randn(9, 320, generator=torch.Generator().manual_seed(4)).to(DEV, torch.bfloat16)
    hg = ec_shrink_gate(x, A, W1, b1, W2, b2, "silu")
    hga = ec_shrink_gate(x, A, W1, b1, W2, b2, "silu", alpha=alpha, dtype=torch.bfloat16)
    assert hg.dtype == torch.float32 and hga.dtype == torch.bfloat16
    # one bf16 rounding apart (the interpreter's fp32 -> bf16 cast need not round to nearest)
    torch.testing.assert_close(hga[:, :6].float(), hg[:, :6] * alpha.float(), rtol=2 ** -7, atol=1e-6)


def test_shrink_gate_zeroes_its_padding_columns(monkeypatch):
    """hg is [M, R_P] with R_P >= 16 > r: the padding must be written (zeros), not left as whatever
    the allocator returned, because the C-operand path hands ``hg[:, :r]`` (row stride R_P) to a
    BLAS GEMM, and a BLAS may read the padding in vector blocks (a NaN there made a CPU run flaky)."""
    from spear_compile.lowering import ec_triton

    A, B, W1, b1, W2, b2, alpha = _ec(123, 320, 5, 3, torch.bfloat16)
    x = torch.randn(17, 320, generator=torch.Generator().manual_seed(5)).to(DEV, torch.bfloat16)
    real_empty = torch.empty
    monkeypatch.setattr(ec_triton.torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(float("nan")))
    hg = ec_triton.ec_shrink_gate(x, A, W1, b1, W2, b2, "silu", alpha=alpha, dtype=torch.bfloat16)
    assert hg.shape == (17, 16) and bool(torch.isfinite(hg).all()) and float(hg[:, 5:].abs().max()) == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_concatenated_ecs_equal_the_parts_through_reference_and_fused_kernel(dtype):
    """Three ECs sharing an input (different ranks, gate widths and alphas) as one block-diagonal EC
    over the concatenated weights: the reference and the fused M = 1 kernel (interpreted on CPU; the
    block-diagonal rank 56 pads to 64) give what the parts give separately."""
    from spear_compile.lowering import ec_cat as E
    from spear_compile.dispatch.cuda import w4a16_gemv

    K, G = 256, 64
    parts = [(40, 16, 8), (24, 8, 4), (59, 32, 16)]  # (N, R, D)
    ws = [_weight(n, K, G, dtype, seed=i) for i, (n, _, _) in enumerate(parts)]
    ecs = [_ec(n, K, r, d, dtype, seed=10 + i) for i, (n, r, d) in enumerate(parts)]
    ecs = [e[:-1] + (e[-1] * (1 + 0.5 * i),) for i, e in enumerate(ecs)]  # distinct alphas
    x = torch.randn(1, K, generator=torch.Generator().manual_seed(3)).to(DEV, dtype)
    ref = torch.cat([ec_linear_ref(x, w[0], w[1], w[2], G, w[3], *e) for w, e in zip(ws, ecs)], -1)
    cat_ec = E.concatenated_ecs(*[list(t) for t in zip(*ecs)], [w[0] for w in ws])
    assert cat_ec[0].shape == (56, K) and cat_ec[1].shape == (123, 56) and cat_ec[2].shape == (28, 56)
    q, s, z, b = (torch.cat([w[i] for w in ws]) for i in range(4))
    _close(ec_linear_ref(x, q, s, z, G, b, *cat_ec), ref, dtype)
    _close(w4a16_gemv(x, q, s, z, G, b, ec=cat_ec), ref, dtype)
    assert E.concatenated_ecs(*[list(t) for t in zip(*ecs)], [w[0] for w in ws]) is cat_ec  # cached
    # spear::ec_linear_cat's CUDA path end to end (concatenated words + block-diagonal EC), interpreted here
    y = DC.ec_gemv1_cat(x, [w[0] for w in ws], [w[1] for w in ws], [w[2] for w in ws], G, [w[3] for w in ws],
                       *[list(t) for t in zip(*ecs)])
    _close(y, ref, dtype)
    # the middle part without an EC (a plain linear fused beside EC ones): its rows are its W4 linear alone
    mixed = [ecs[0], (None,) * 7, ecs[2]]
    y = DC.ec_gemv1_cat(x, [w[0] for w in ws], [w[1] for w in ws], [w[2] for w in ws], G, [w[3] for w in ws],
                        *[list(t) for t in zip(*mixed)])
    plain = w4a16_linear_ref(x, *ws[1][:3], G, ws[1][3])
    _close(y, torch.cat([ref[:, :40], plain, ref[:, 64:]], -1), dtype)
    assert (y[:, 40:64] - ref[:, 40:64]).abs().max() > 1e-3  # (the middle EC mattered where it was given)


@pytest.mark.parametrize("M", [2, 5])
def test_ec_cat_gemm_adds_each_ec_into_its_own_rows(M):
    """``ec_cat_gemm`` (the batched concatenation with ECs, interpreted here without streams): one GEMM over the
    concatenated weights and each EC's shrink / gate / expand added into its own columns equals the parts; a part
    without an EC gets its plain linear; a mutant adding the EC to the wrong columns would fail."""
    from spear_compile.dispatch.route import Route

    K, G = 128, 32
    parts = [(40, 8, 4), (24, 0, 0), (48, 16, 8)]  # (N, R, D); the middle part without an EC
    ws = [_weight(n, K, G, torch.float32, seed=i) for i, (n, _, _) in enumerate(parts)]
    ecs = [_ec(n, K, r, d, torch.float32, seed=10 + i) if r else (None,) * 7 for i, (n, r, d) in enumerate(parts)]
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(3)).to(DEV)
    ref = torch.cat([ec_linear_ref(x, w[0], w[1], w[2], G, w[3], *e) if e[0] is not None
                     else w4a16_linear_ref(x, w[0], w[1], w[2], G, w[3]) for w, e in zip(ws, ecs)], -1)
    rt = Route("ec_cat_gemm", (), (), parts=(Route("gemm", (16, 32, 32, 4, 1), ()),))
    y = DC.ec_cat_gemm(rt, x, [w[0] for w in ws], [w[1] for w in ws], [w[2] for w in ws], G, [w[3] for w in ws],
                       *[list(t) for t in zip(*ecs)])
    _close(y, ref, torch.float32)
    no_ec = torch.cat([w4a16_linear_ref(x, w[0], w[1], w[2], G, w[3]) for w in ws], -1)
    assert (ref - no_ec)[:, :40].abs().max() > 1e-3 and (ref - no_ec)[:, 64:].abs().max() > 1e-3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="runs the op's CUDA path (side stream, the route's GEMM)")
@pytest.mark.parametrize("M", [2, 16, 64])
def test_ec_cat_op_at_batched_m_runs_one_gemm_with_each_ec_beside_it_on_gpu(M):
    """``spear::ec_linear_cat`` on CUDA at 2 <= M <= 256: the route takes ``ec_cat_gemm`` and the result matches
    the parts' reference, a part without an EC included; twice (the cached concatenation)."""
    from spear_compile.dispatch import route as RT
    from spear_compile.ops.refs import cat_part_ref

    K, G = 1024, 128
    parts = [(512, 16, 8), (256, 0, 0), (768, 32, 16)]
    ws = [[t.cuda() for t in _weight(n, K, G, torch.bfloat16, seed=i)[:4]] for i, (n, _, _) in enumerate(parts)]
    ecs = [[t.cuda() for t in _ec(n, K, r, d, torch.bfloat16, seed=10 + i)] if r else [None] * 7
           for i, (n, r, d) in enumerate(parts)]
    ecl = [list(t) for t in zip(*ecs)]
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    qs, ss, zs, bs = ([w[i] for w in ws] for i in range(4))
    p = RT.cat_problem_of("ec_cat", x, qs, ss, zs, G, bs, ecl[0], ecl[1], ecl[2])
    assert RT.route(p).kernel == "ec_cat_gemm", RT.route(p).describe()
    ref = torch.cat([cat_part_ref(x, (q, s, z, G, b, *e), "silu", "spear") for q, s, z, b, *e in zip(qs, ss, zs, bs, *ecl)],
                    -1)
    for _ in range(2):
        y = torch.ops.spear.ec_linear_cat(x, qs, ss, zs, G, bs, *ecl)
        assert float((y.float() - ref.float()).norm() / ref.float().norm()) < 1e-2
