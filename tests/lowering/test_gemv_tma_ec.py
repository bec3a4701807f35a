"""The decode EC in the TMA GEMV's epilogue (``w4a16_gemv_tma_ec``), PDL-launched behind the EC's producer grid.

The TMA kernel is a Gluon kernel (not run by Triton's interpreter): on the CPU the routing is checked
(which configs and devices take the EC epilogue) and ``ec_cat.ec_rows`` - the per-row EC columns the
epilogue reads - is checked through its emulation in ``test_ec_decode_pdl.py``; the kernel is compiled
for sm_90 in ``test_gemv_tma.py``. On a Hopper GPU the concatenated and single EC GEMVs run against
the reference, with and without the RMSNorm prologue, twice (the counters must be left zeroed), and
under a CUDA graph.
"""
import pytest
import torch

from spear_compile.dispatch import keys as TK
from spear_compile.ops import refs

from spear_compile.dispatch import route as R

from spear_compile.lowering import device as capability

from tests.helpers import use_tuned_table

from spear_compile.ops.ec_ref import ec_linear_ref

from tests.helpers import gemv_case as _case
from tests.helpers import bf16_ec as _ec, rel_err as _rel  # noqa: F401
from spear_compile.dispatch import cuda as DC

gt = pytest.importorskip("spear_compile.lowering.w4a16_gemv_tma")
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
pytestmark = pytest.mark.skipif(not gt.HAS_TMA, reason="needs Triton with Gluon and its Hopper TMA ops (>= 3.5)")
on_hopper = pytest.mark.skipif(not HOPPER, reason="runs the kernel: TMA and PDL need CUDA sm_90+")


def _parts(K, G, dev="cuda"):
    """q/k/v-like parts of 96, 40 and 120 rows (the middle one without a bias), ECs of rank 8, 5, 8."""
    cases = [_case(n, K, G, seed=n) for n in (96, 40, 120)]
    x = (cases[0][0] * 3).to(dev)
    qs, ss, zs = ([c[i].to(dev) for c in cases] for i in (2, 3, 4))
    bs = [cases[0][5].to(dev), None, cases[2][5].to(dev)]
    ecs = [[t.to(dev) for t in _ec(n, K, r, 4, seed=i)] for i, (n, r) in enumerate(((96, 8), (40, 5), (120, 8)))]
    return x, qs, ss, zs, bs, [list(v) for v in zip(*ecs)]


def _ref(x, qs, ss, zs, G, bs, ecl, norm):
    from spear_compile.ops.refs import rms_norm_ref

    from spear_compile.ops.refs import cat_part_ref

    xn = rms_norm_ref(x, *norm) if norm is not None else x
    return torch.cat([cat_part_ref(xn, (q, s, z, G, b, *ec), "silu", "spear")
                      for q, s, z, b, *ec in zip(qs, ss, zs, bs, *ecl)], -1)


def test_ec_epilogue_routing(monkeypatch):
    """ec_tma_config: only a tuned TMA config without a K-split, only where PDL runs,
    and with an RMSNorm only where the config stages x in shared memory."""
    from spear_compile.lowering import ec_decode_triton as ED
    from spear_compile.lowering import ec_cat as E
    from spear_compile.dispatch import cuda as D
    from spear_compile.lowering import w4a16_triton as T

    K, N = 1280, 256
    x = torch.zeros(1, K, dtype=torch.bfloat16)
    monkeypatch.setattr(gt, "_tma_capable", lambda device: True)
    monkeypatch.setattr(capability, "pdl", lambda device: True)
    for cfg, plain, normed in (([4, 2, 2, 2, 2], True, True), ([8, 2, 1, 3, 0], True, False),
                               ([4, 2, 2, 2, 2, 2], False, False)):
        use_tuned_table(monkeypatch, {TK.tma_key(N, K, 128): cfg})
        assert (R.ec_tma_config(x, N, 128, (), None) is not None) == plain, cfg
        assert (R.ec_tma_config(x, N, 128, (), (torch.ones(K), 1e-5)) is not None) == normed, cfg
    use_tuned_table(monkeypatch, {TK.tma_key(N, K, 128): [4, 2, 2, 2, 2]})
    assert R.ec_tma_config(x, N + 16, 128, (), None) is None  # no entry for the shape
    monkeypatch.setenv("SPEAR_NO_TMA_EC", "1")  # the escape hatch / A/B switch
    assert R.ec_tma_config(x, N, 128, (), None) is None
    monkeypatch.setenv("SPEAR_NO_TMA_EC", "0")
    assert R.ec_tma_config(x, N, 128, (), None) == (4, 2, 2, 2, 2)
    assert R.ec_tma_config(x, N, 128, (), None, rc=R.EC_RC_MAX) == (4, 2, 2, 2, 2)
    assert R.ec_tma_config(x, N, 128, (), None, rc=R.EC_RC_MAX + 1) is None  # its operands would spill
    monkeypatch.setattr(capability, "pdl", lambda device: False)
    assert R.ec_tma_config(x, N, 128, (), None) is None


def test_ec_epilogue_host_checks():
    """Wrong EC operands are refused before any launch, naming what is wrong."""
    from spear_compile.lowering.w4a16_gemv_tma_ec import EcEpilogue

    ok = dict(b=torch.zeros(64, 8), roff=None, gh=torch.zeros(16, 8), alpha=torch.ones(()), r=8, copies=16)
    EcEpilogue(**ok).check(64, (4, 2, 2, 2, 2))
    for change, msg in ((dict(b=torch.zeros(32, 8)), r"EC rows \(32, 8\) must be a contiguous \[64, RC\]"),
                        (dict(roff=torch.zeros(64, dtype=torch.int64)), "row offsets"),
                        (dict(gh=torch.zeros(4, 8)), "at least 8 contiguous values, 16 of them"),
                        (dict(gh=torch.zeros(16, 4)), "at least 8 contiguous values"),
                        (dict(alpha=torch.ones(2)), "alpha has 2 elements")):
        with pytest.raises(ValueError, match=msg):
            EcEpilogue(**dict(ok, **change)).check(64, (4, 2, 2, 2, 2))
    with pytest.raises(ValueError, match="needs SPLIT 1"):
        EcEpilogue(**ok).check(64, (4, 2, 2, 2, 2, 2))


@on_hopper
@pytest.mark.parametrize("G", [128, None])
@pytest.mark.parametrize("config", [(4, 2, 2, 2, 2), (4, 2, 4, 2, 2), (8, 2, 1, 3, 0)])
@pytest.mark.parametrize("norm", [False, True])
def test_concatenated_ec_through_the_tma_epilogue_matches_reference(G, config, norm, monkeypatch):
    from spear_compile.lowering import ec_cat as E
    from spear_compile.lowering import w4a16_cat as C
    from spear_compile.lowering import w4a16_triton as T

    K = 1280
    Gs = G or K
    x, qs, ss, zs, bs, ecl = _parts(K, Gs)
    nw = ((torch.rand(K) + 0.5).to(torch.bfloat16).cuda(), 1e-5) if norm else None
    calls = []
    real = gt.w4a16_gemv_tma
    monkeypatch.setattr(gt, "w4a16_gemv_tma", lambda *a, **k: calls.append(k.get("ec")) or real(*a, **k))
    use_tuned_table(monkeypatch, {**dict(TK.tuned_table()), **{TK.tma_key(256, K, Gs): list(config)}})
    ref = _ref(x, qs, ss, zs, Gs, bs, ecl, nw)
    for _ in range(2):  # the second launch relies on the producer's counter having been reset
        y = DC.ec_gemv1_cat(x, qs, ss, zs, Gs, bs, *ecl, norm=nw)
        assert _rel(y, ref) < 1e-2
    takes_tma = not (norm and config[4] != gt.OPS_SMEM)
    assert len(calls) == (2 if takes_tma else 0) and all(c is not None and c.wait for c in calls)
    assert int(T.ec_workspace(x.device, 32)[1].abs().sum()) == 0  # the last producer reset its counter
    no_ec = torch.cat([torch.ops.spear.w4a16_linear(x if nw is None else refs.rms_norm_ref(x, *nw), q, s, z, Gs, b)
                       for q, s, z, b in zip(qs, ss, zs, bs)], -1)
    assert _rel(no_ec, ref) > 5e-2  # the EC term is large enough that dropping it would fail


@on_hopper
def test_ec_linear_cat_op_with_norm_and_single_ec_on_gpu(monkeypatch):
    """The op's CUDA entry (norm_weight) and a single ec_linear's M = 1 path take the TMA epilogue where
    the table has the shape, and match the reference."""

    K, G = 1280, 128
    x, qs, ss, zs, bs, ecl = _parts(K, G)
    w = (torch.rand(K) + 0.5).to(torch.bfloat16).cuda()
    use_tuned_table(monkeypatch, {**dict(TK.tuned_table()), **{TK.tma_key(256, K, G): [4, 2, 2, 2, 2],
                                                              TK.tma_key(96, K, G): [4, 2, 2, 2, 2]}})
    calls = []
    real = gt.w4a16_gemv_tma
    monkeypatch.setattr(gt, "w4a16_gemv_tma", lambda *a, **k: calls.append(k.get("ec")) or real(*a, **k))
    y = torch.ops.spear.ec_linear_cat(x.view(1, 1, K), qs, ss, zs, G, bs, *ecl, "silu", "spear", w, 1e-5)
    assert y.shape == (1, 1, 256) and _rel(y.view(1, -1), _ref(x, qs, ss, zs, G, bs, ecl, (w, 1e-5))) < 1e-2
    ec0 = tuple(v[0] for v in ecl)
    y = DC.gemv1_ec(x, qs[0], ss[0], zs[0], G, bs[0], ec0)
    assert _rel(y, ec_linear_ref(x, qs[0], ss[0], zs[0], G, bs[0], *ec0)) < 1e-2
    assert len(calls) == 2 and calls[1].roff is None
    mixed = [[v[0], None, v[2]] for v in ecl]  # the middle part without an EC: zero EC rows in the epilogue
    y = torch.ops.spear.ec_linear_cat(x.view(1, 1, K), qs, ss, zs, G, bs, *mixed, "silu", "spear", w, 1e-5)
    ref = _ref(x, qs, ss, zs, G, bs, mixed, (w, 1e-5))
    assert _rel(y.view(1, -1), ref) < 1e-2 and len(calls) == 3 and calls[2] is not None
    assert _rel(ref, _ref(x, qs, ss, zs, G, bs, ecl, (w, 1e-5))) > 1e-2  # (the dropped EC mattered)


@on_hopper
def test_ec_epilogue_pair_replays_in_a_cuda_graph(monkeypatch):
    """The producer grid + PDL-launched TMA GEMV captured once and replayed with new inputs."""
    from spear_compile.lowering import ec_cat as E

    K, G = 1280, 128
    x, qs, ss, zs, bs, ecl = _parts(K, G)
    nw = ((torch.rand(K) + 0.5).to(torch.bfloat16).cuda(), 1e-5)
    use_tuned_table(monkeypatch, {**dict(TK.tuned_table()), **{TK.tma_key(256, K, G): [4, 2, 2, 2, 2]}})
    calls = []
    real = gt.w4a16_gemv_tma
    monkeypatch.setattr(gt, "w4a16_gemv_tma", lambda *a, **k: calls.append(k.get("ec")) or real(*a, **k))
    xs = x.clone()
    DC.ec_gemv1_cat(xs, qs, ss, zs, G, bs, *ecl, norm=nw)  # warm-up: caches and compilation
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = DC.ec_gemv1_cat(xs, qs, ss, zs, G, bs, *ecl, norm=nw)
    for seed in range(3):
        xs.copy_(torch.randn(1, K, generator=torch.Generator().manual_seed(seed)).to(xs) * 2)
        g.replay()
        torch.cuda.synchronize()
        assert _rel(y, _ref(xs, qs, ss, zs, G, bs, ecl, nw)) < 1e-2
    assert len(calls) == 2 and all(c is not None and c.wait for c in calls)  # warm-up and capture: the TMA pair


def test_glu_ec_rows_follow_the_interleaved_weights():
    """ec_glu_rows: the EC rows of a gate / up pair interleaved like concatenated_glu_tma's weights, so
    through the epilogue's arithmetic row i of the GLU kernel gets the EC of interleaved row i."""
    from spear_compile.lowering.ec_cat import concatenated_ecs, ec_glu_rows, ec_rows_emulated

    F, half = 48, 8
    ecs = [_ec(F, 64, r, 4, seed=s) for s, r in enumerate((8, 5))]
    ecl = [list(v) for v in zip(*ecs)]
    qs = [torch.zeros(F, 32, dtype=torch.uint8)] * 2  # (only their row counts count)
    rows, offs = ec_glu_rows(ecl[1], ecl[6], half, qs)
    gh = torch.randn(13, generator=torch.Generator().manual_seed(0))
    full = concatenated_ecs(*ecl, qs)[1].float() @ gh  # [2F] in gate-then-up order
    torch.testing.assert_close(ec_rows_emulated(gh, rows, offs, 13), gt.glu_interleave(full, F, half),
                               rtol=1e-5, atol=1e-5)


@on_hopper
@pytest.mark.parametrize("norm,mixed", [(False, False), (True, False), (True, True)])
def test_ec_glu_op_through_the_tma_epilogue_matches_reference(norm, mixed, monkeypatch):
    """spear::ec_linear_glu on CUDA where the table runs [2F, K] on the TMA kernel: GLU epilogue with each
    row's EC (and the RMSNorm prologue), twice, against the op's reference; ``mixed``: the gate without an EC."""
    from spear_compile.ops.refs import cat_part_ref, glu_of, rms_norm_ref

    F, K, G = 144, 1280, 128
    cases = [_case(F, K, G, seed=s) for s in (1, 2)]
    x = (cases[0][0] * 3).cuda()
    qs, ss, zs = ([c[i].cuda() for c in cases] for i in (2, 3, 4))
    ecl = [list(v) for v in zip(*[[t.cuda() for t in _ec(F, K, r, 4, seed=s)] for s, r in enumerate((8, 5))])]
    if mixed:
        ecl = [[None, v[1]] for v in ecl]
    w = (torch.rand(K) + 0.5).to(torch.bfloat16).cuda()
    use_tuned_table(monkeypatch, {**dict(TK.tuned_table()), **{TK.tma_key(2 * F, K, G): [4, 2, 2, 2, 2]}})
    calls = []
    real = gt.w4a16_gemv_tma
    monkeypatch.setattr(gt, "w4a16_gemv_tma",
                        lambda *a, **k: calls.append((k.get("glu"), k.get("ec"))) or real(*a, **k))
    nargs = ("silu", "spear", w, 1e-5) if norm else ()
    xr = rms_norm_ref(x, w, 1e-5) if norm else x
    ref = glu_of(torch.cat([cat_part_ref(xr, (q, s, z, G, None, *ec), "silu", "spear")
                            for q, s, z, *ec in zip(qs, ss, zs, *ecl)], -1))
    for _ in range(2):
        y = torch.ops.spear.ec_linear_glu(x.view(1, 1, K), qs, ss, zs, G, *ecl, *nargs)
        assert y.shape == (1, 1, F) and _rel(y.view(1, F), ref) < 1e-2
    assert len(calls) == 2 and all(g and e is not None and e.wait for g, e in calls)


def test_tma_ec_gemv_launches_the_producer_then_the_gemv_behind_it(monkeypatch):
    """tma_ec_gemv (the one place the TMA EC pair is put together): the producer gets x, the EC, the gate
    activation and the norm; the GEMV waits for it exactly when the producer was launched for PDL and
    gets B's rows, offsets, alpha and the rank."""
    from spear_compile.lowering import ec_decode_triton as ED
    from spear_compile.dispatch.cuda import tma_ec_gemv

    A, B, alpha = torch.zeros(5, 64), torch.zeros(32, 5), torch.ones(())
    ec = (A, B, None, None, None, None, alpha)
    gh = torch.zeros(16, 8)
    seen = {}
    monkeypatch.setattr(ED, "ec_produce",
                        lambda x2, e, act, norm: seen.update(produce=(x2, e, act, norm)) or (gh, True))
    monkeypatch.setattr(gt, "w4a16_gemv_tma", lambda *a, **k: seen.update(gemv=(a, k)) or "y")
    x, norm, roff = torch.zeros(1, 64), (torch.ones(64), 1e-5), torch.zeros(32, dtype=torch.int32)
    assert tma_ec_gemv(x, None, "s", "z", 128, None, ec, "relu", (4, 2, 2, 2, 2), B, roff, norm=norm, glu=True) == "y"
    assert seen["produce"] == (x, ec, "relu", norm)
    args, kw = seen["gemv"]
    assert args == (x, None, "s", "z", 128, None) and kw["config"] == (4, 2, 2, 2, 2)
    assert kw["glu"] and kw["norm"] is norm
    epi = kw["ec"]
    assert epi.b is B and epi.roff is roff and epi.gh is gh and epi.alpha is alpha and epi.r == 5 and epi.wait
