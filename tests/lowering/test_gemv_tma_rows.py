"""The TMA GEMV with x's rows in the MMA's columns, M = 2..16 (``lowering/w4a16_gemv_tma_rows.py``).

Gluon kernels do not run in Triton's interpreter: on CPU the shared tiles are checked through the emulation
(every row against fp64, odd N and K that need padding included), the kernel is compiled for sm_90 (layout
conversions asserted free, the MMA count, the async copies of x, no spills), and the host checks, the table
value and the route are tested. On a Hopper GPU the kernel runs against fp64 and the reference.
"""

import pytest
import torch

from spear_compile.dispatch import keys as TK
from spear_compile.dispatch import route as R
from spear_compile.dispatch import table as TT
from tests.helpers import exact_gemv, gemv_case, run_compiled, use_tuned_table

gr = pytest.importorskip("spear_compile.lowering.w4a16_gemv_tma_rows")
gt = pytest.importorskip("spear_compile.lowering.w4a16_gemv_tma")
pytestmark = pytest.mark.skipif(not gr.HAS_TMA, reason="needs Triton with Gluon and its Hopper TMA ops (>= 3.5)")
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
BF = torch.bfloat16


def _rows(M, K, seed=1):
    return torch.randn(M, K, generator=torch.Generator().manual_seed(seed)).to(BF)


@pytest.mark.parametrize("M", [2, 5, 16])
@pytest.mark.parametrize("G", [128, 256, None])
def test_every_row_through_the_shared_tiles_matches_fp64(M, G):
    """N = 45 and K = 768 are not whole tiles; each row of x is a column of B, computed as the M = 1 kernel
    computes its one row, on the very tiles the M = 1 kernel caches."""
    N, K = 45, 768
    Gs = G or K
    _, q, qw, s, z, b = gemv_case(N, K, Gs)
    x = _rows(M, K)
    cfg = (4, 1, 1, 4)  # steps of 512 columns: K is padded
    tiles = gt.repack_tiles(qw, gr.tile_config(cfg))
    y = gr.rows_emulated(x, tiles, s, z, Gs, b, N, cfg)
    ex = exact_gemv(x, q, s, z, Gs, b)
    assert y.shape == (M, N)
    assert ((y.double() - ex).abs() <= ex.abs() * 2 ** -7 + 1e-6).all()


def test_columns_and_shared_memory():
    """8 columns up to M = 8, 16 above; shared memory is x (K MC 2 bytes), its sums and the ring."""
    assert [gr.columns(m) for m in (1, 2, 8, 9, 16)] == [8, 8, 8, 16, 16]
    cfg = (4, 2, 2, 2)  # BN 32, 8 slices of 128 columns: steps of 1024, 16 KB weight tiles
    assert gr.smem_bytes(cfg, 4096, 8) == 4 * 1024 * 8 * 2 + 4 * 8 * 8 * 4 + 2 * (16 * 1024 + 8 * 32 * 4 + 8)
    assert gr.rows_fit(cfg, 11008, 8)  # 11 steps: 176 KB of x
    assert not gr.rows_fit(cfg, 11008, 16) and gr.rows_fit(cfg, 4096, 16)
    assert not gr.rows_fit(cfg, 4096, 17)
    assert gr.tile_config(cfg) == (4, 2, 2, 2, gt.OPS_SMEM)
    for bad in ((4, 2, 2), (4, 3, 2, 2), (4, 2, 2, 2, 2)):
        with pytest.raises(ValueError, match="expected|powers of two"):
            gr.tile_config(bad)


def test_host_errors_name_what_is_wrong():
    N, K, G = 64, 1024, 128
    _, q, qw, s, z, b = gemv_case(N, K, G)
    x = _rows(4, K)
    cfg = (4, 2, 2, 2)
    with pytest.raises(ValueError, match="M=17"):
        gr.w4a16_gemv_tma_rows(_rows(17, K), qw, s, z, G, b, cfg)
    with pytest.raises(ValueError, match="float16"):
        gr.w4a16_gemv_tma_rows(x.half(), qw, s, z, G, b, cfg)
    with pytest.raises(ValueError, match="packed weight"):
        gr.w4a16_gemv_tma_rows(x, qw[:, :256], s, z, G, b, cfg)
    with pytest.raises(ValueError, match="scales"):
        gr.w4a16_gemv_tma_rows(x, qw, s[:, :3], z, G, b, cfg)
    with pytest.raises(ValueError, match="zeros"):
        gr.w4a16_gemv_tma_rows(x, qw, s, z[:, :3], G, b, cfg)
    with pytest.raises(ValueError, match="bias"):
        gr.w4a16_gemv_tma_rows(x, qw, s, z, G, b[:3], cfg)
    with pytest.raises(ValueError, match="out"):
        gr.w4a16_gemv_tma_rows(x, qw, s, z, G, b, cfg, out=torch.empty(4, N + 1, dtype=BF))
    big_K = 16384
    _, _, qb, sb, zb, _ = gemv_case(N, big_K, G)
    with pytest.raises(ValueError, match="bytes of shared memory"):
        gr.w4a16_gemv_tma_rows(_rows(16, big_K), qb, sb, zb, G, None, cfg)
    if not HOPPER:
        with pytest.raises(ValueError, match="sm_90"):
            gr.w4a16_gemv_tma_rows(x, qw, s, z, G, b, cfg)


def test_table_value_round_trips_and_bad_values_raise():
    key = TK.gemm_key(8, 4096, 4096, 128)
    v = TT.parse_value(key, ["gemv_tma_rows", 4, 2, 2, 2])
    assert v.kernel == "gemv_tma_rows" and v.wire() == ["gemv_tma_rows", 4, 2, 2, 2]
    for bad in (["gemv_tma_rows", 4, 2, 2], ["gemv_tma_rows", 3, 2, 2, 2], ["gemv_tma_rows", 4, 2, 2, 1]):
        with pytest.raises(ValueError, match="gemv_tma_rows|expected"):
            TT.parse_value(key, bad)


def _problem(**kw):
    p = R.Problem(op="w4a16", M=8, N=4096, K=4096, G=128, dtype=BF, param_dtypes=(BF, BF),
                  device=torch.device("cuda"))
    return p.replace(**kw)


def test_route_takes_it_only_opted_in_from_the_table_where_it_runs(monkeypatch):
    """A table entry naming the kernel is taken only with SPEAR_TMA_ROWS, on a sm_90+ GPU, at M <= 16 and where its
    shared memory fits; anywhere else M's default GEMM runs and the reasons say why."""
    entry = ["gemv_tma_rows", 4, 2, 2, 2]
    use_tuned_table(monkeypatch, {TK.gemm_key(m, 4096, k, 128): entry for m in (8, 16, 32) for k in (4096, 16384)})
    monkeypatch.setattr(gt, "_tma_capable", lambda device: True)
    monkeypatch.delenv("SPEAR_TMA_ROWS", raising=False)
    rt = R.route(_problem())
    assert rt.kernel != "gemv_tma_rows" and "SPEAR_TMA_ROWS is not set" in " ".join(rt.all_reasons())
    monkeypatch.setenv("SPEAR_TMA_ROWS", "1")
    rt = R.route(_problem())
    assert rt.kernel == "gemv_tma_rows" and rt.config == (4, 2, 2, 2)
    assert R.route(_problem(M=16)).kernel == "gemv_tma_rows"
    assert R.route(_problem(M=32)).kernel != "gemv_tma_rows"  # M > 16
    rt = R.route(_problem(M=16, K=16384))  # x alone would need 512 KB of shared memory
    assert rt.kernel != "gemv_tma_rows" and "shared memory" in " ".join(rt.all_reasons())
    assert R.route(_problem(dtype=torch.float16)).kernel != "gemv_tma_rows"
    assert R.route(_problem(out_contiguous=False)).kernel != "gemv_tma_rows"
    assert R.route(_problem(params_contiguous=False)).kernel != "gemv_tma_rows"
    monkeypatch.setenv("SPEAR_NO_TMA_GEMV", "1")
    assert R.route(_problem()).kernel != "gemv_tma_rows"
    monkeypatch.delenv("SPEAR_NO_TMA_GEMV")
    monkeypatch.setattr(gt, "_tma_capable", lambda device: False)
    assert R.route(_problem()).kernel != "gemv_tma_rows"


def test_choices_are_offered_only_opted_in_and_where_they_fit(monkeypatch):
    monkeypatch.setattr(R._t, "INTERPRET", False)  # (the tests run Triton's interpreter, where no Gluon runs)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gt, "_tma_capable", lambda device: False)  # a GPU that cannot run it: nothing offered
    monkeypatch.setenv("SPEAR_TMA_ROWS", "1")
    assert R.tma_rows_choices(8, 4096, 4096, 128) == []
    monkeypatch.setattr(gt, "_tma_capable", lambda device: True)
    monkeypatch.delenv("SPEAR_TMA_ROWS", raising=False)
    assert R.tma_rows_choices(8, 4096, 4096, 128) == []
    monkeypatch.setenv("SPEAR_TMA_ROWS", "1")
    got = R.tma_rows_choices(8, 4096, 4096, 128)
    assert got == [("gemv_tma_rows",) + c for c in gr.ROWS_CONFIGS]
    assert set(got) <= set(R.gemm_choices(8, 4096, 4096, 128))
    assert R.tma_rows_choices(17, 4096, 4096, 128) == []
    assert R.tma_rows_choices(8, 4096, 4000, 4000) == []  # K not a multiple of 128
    at_11008 = R.tma_rows_choices(16, 4096, 11008, 128)
    assert at_11008 == [("gemv_tma_rows",) + c for c in gr.ROWS_CONFIGS if gr.rows_fit(c, 11008, 16)]
    assert at_11008 == []  # 16 columns of 11008 bf16 are 344 KB
    assert not [c for c in R.gemm_choices(32, 4096, 4096, 128) if c[0] == "gemv_tma_rows"]


def test_the_tuner_skips_a_gemm_choice_that_does_not_match_the_reference(monkeypatch):
    """``autotune._checked_gemm``: a choice whose numbers are wrong raises before it is timed (the search then
    skips it), so it can never become the table's entry."""
    from spear_compile.dispatch import autotune as AT
    from spear_compile.dispatch import cuda as D
    from spear_compile.ops.w4a16_ref import w4a16_linear_ref

    N, K, G = 32, 256, 128
    _, _, qw, s, z, _ = gemv_case(N, K, G)
    xs, ws = [_rows(3, K)], [(qw, s, z)]
    good = lambda x, q, sc, zp, g, b, config: w4a16_linear_ref(x, q, sc, zp, g, b)  # noqa: E731
    monkeypatch.setattr(D, "w4a16_gemm", good)
    assert AT._checked_gemm(xs, ws, G)(("any",))(0).shape == (3, N)
    monkeypatch.setattr(D, "w4a16_gemm", lambda *a, **k: good(*a, **k) * 1.1)
    with pytest.raises(RuntimeError, match="does not match the reference"):
        AT._checked_gemm(xs, ws, G)(("gemv_tma_rows", 4, 2, 2, 2))


def test_kernel_compiles_for_sm90():
    """Compiled offline: one MMA per 16 rows x 16 columns x 8 of x's rows per step (twice that for 16 rows), TMA for the
    weight tiles, 16-byte async copies for x, and ptxas spills nothing in the group-wise mode."""
    code = ("import re\n"
            "from spear_compile.lowering.w4a16_gemv_tma_rows import compile_sm90\n"
            "from tests.lowering.sass_wgmma import compile_sass\n"
            "for cfg, M, pc in [((4, 2, 2, 2), 8, False), ((4, 2, 2, 2), 16, False), ((4, 1, 2, 4), 8, True),\n"
            "                   ((2, 2, 2, 2), 4, False)]:\n"
            "    ptx = compile_sm90(cfg, M=M, per_channel=pc)['ptx']\n"
            "    n_mma = cfg[1] * cfg[2] * 8 * (1 if M <= 8 else 2)\n"
            "    assert ptx.count('mma.sync.aligned.m16n8k16') == n_mma, (cfg, M, ptx.count('mma.sync'))\n"
            "    assert 'cp.async.bulk.tensor.2d' in ptx and 'cp.async.cg.shared.global' in ptx, cfg\n"
            "    log, _ = compile_sass(ptx)\n"
            "    assert re.search(r'\\b0 bytes spill stores', log), (cfg, M, log[-400:])\n"
            "print('ok')\n")
    run_compiled(code)


@pytest.mark.skipif(not HOPPER, reason="runs the kernel: TMA needs CUDA sm_90+")
@pytest.mark.parametrize("M", [2, 7, 8, 9, 16])
@pytest.mark.parametrize("G", [128, None])
@pytest.mark.parametrize("config", [(4, 2, 2, 2), (4, 1, 2, 4), (2, 2, 4, 2)])
def test_kernel_matches_fp64_and_the_reference_on_gpu(M, G, config):
    """N = 200 and K = 3840 are neither whole row blocks nor whole steps; x is a strided view (row stride 2K);
    with and without zero points and bias, and into a given ``out``."""
    from spear_compile.ops.w4a16_ref import w4a16_linear_ref

    N, K = 200, 3840
    Gs = G or K
    _, q, qw, s, z, b = gemv_case(N, K, Gs)
    x = _rows(M, 2 * K)[:, :K]
    xc = _rows(M, 2 * K).cuda()[:, :K]  # (sliced on the GPU: a view whose rows are 2K apart)
    assert xc.stride(0) == 2 * K
    qw, s, z, b = (t.cuda() for t in (qw, s, z, b))
    for zz, bb in ((z, b), (None, None)):
        y = gr.w4a16_gemv_tma_rows(xc, qw, s, zz, Gs, bb, config)
        ex = exact_gemv(x, q, s.cpu(), zz.cpu() if zz is not None else None, Gs, bb.cpu() if bb is not None else None)
        assert ((y.cpu().double() - ex).abs() <= ex.abs() * 2 ** -7 + 1e-4).all()
        ref = w4a16_linear_ref(xc, qw, s, zz, Gs, bb)
        assert ((y.float() - ref.float()).norm() / ref.float().norm()).item() < 8e-3
    out = torch.full((M, N), float("nan"), dtype=BF, device="cuda")
    assert gr.w4a16_gemv_tma_rows(xc, qw, s, z, Gs, b, config, out=out) is out
    assert torch.equal(out, gr.w4a16_gemv_tma_rows(xc, qw, s, z, Gs, b, config))  # and the same bits twice
    odd = _rows(M, K + 8).cuda()[:, :K]  # rows 16-byte aligned but 8 mod 16 elements apart: copied first
    assert torch.equal(gr.w4a16_gemv_tma_rows(odd, qw, s, z, Gs, b, config),
                       gr.w4a16_gemv_tma_rows(odd.contiguous(), qw, s, z, Gs, b, config))


@pytest.mark.skipif(not HOPPER, reason="runs the kernel: TMA needs CUDA sm_90+")
def test_the_op_takes_it_from_the_table_on_gpu(monkeypatch):
    """Through ``spear::w4a16_linear`` with a table entry and SPEAR_TMA_ROWS: the route's kernel runs and matches the
    reference; the traced route names it."""
    from spear_compile.dispatch import cuda as D
    from spear_compile.ops.w4a16_ref import w4a16_linear_ref

    N, K, G = 256, 2048, 128
    _, q, qw, s, z, b = gemv_case(N, K, G)
    x, qw, s, z, b = (t.cuda() for t in (_rows(6, K), qw, s, z, b))
    use_tuned_table(monkeypatch, {TK.gemm_key(6, N, K, G): ["gemv_tma_rows", 4, 2, 2, 2]})
    monkeypatch.setenv("SPEAR_TMA_ROWS", "1")
    with D.trace_routes() as seen:
        y = D.w4a16_linear_cuda(x, qw, s, z, G, b)
    assert [r.kernel for r in seen] == ["gemv_tma_rows"]
    ref = w4a16_linear_ref(x, qw, s, z, G, b)
    assert ((y.float() - ref.float()).norm() / ref.float().norm()).item() < 8e-3
