"""The one-launch decode EC on the TMA GEMV (``w4a16_gemv_tma_ec.EcSelf``, the Gluon mirror of ``ec_self.py``).

The TMA kernel is a Gluon kernel (not run by Triton's interpreter): on the CPU it is compiled for sm_90
(no spills) and the host checks and the dispatch are tested; the protocol itself (tags, tickets, the
fallback) runs on the CPU through the CUDA-core kernel's Triton form in
``test_ec_self.py``. On a Hopper GPU the kernel runs against ``ec_linear_ref``: several launches, the
fallback path (``publish=False``), and replays of a CUDA graph.
"""
import pytest
import torch

from spear_compile.dispatch import keys as TK
from spear_compile.lowering import device as capability

from tests.helpers import use_tuned_table

from spear_compile.ops.ec_ref import ec_linear_ref

from tests.helpers import gemv_case as _case, run_compiled
from tests.helpers import bf16_ec as _ec, rel_err as _rel

gt = pytest.importorskip("spear_compile.lowering.w4a16_gemv_tma")
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
pytestmark = pytest.mark.skipif(not gt.HAS_TMA, reason="needs Triton with Gluon and its Hopper TMA ops (>= 3.5)")
on_hopper = pytest.mark.skipif(not HOPPER, reason="runs the kernel: TMA needs CUDA sm_90+")


def test_one_launch_tma_ec_compiles_for_sm90_without_spills():
    """Compiled offline for sm_90a (a separate process: Triton's interpreter is on for these tests): the
    slots are re-read with volatile loads, the pieces stored as 64-bit words, and ptxas spills nothing."""
    code = ("import re\n"
            "from spear_compile.lowering.w4a16_gemv_tma import compile_sm90\n"
            "from tests.lowering.sass_wgmma import compile_sass\n"
            "for cfg, K, ec in [((4, 2, 2, 2, 2), 4096, 'self'), ((4, 2, 4, 2, 2), 4096, 'self'),\n"
            "                   ((2, 2, 4, 2, 2), 4096, 'self'), ((4, 2, 2, 2, 2), 8192, ('self', 4096, 1)),\n"
            "                   ((8, 2, 2, 2, 2), 11008, ('self', 4096, 2))]:  # (the last two: shipped plans)\n"
            "    ptx = compile_sm90(cfg, K=K, ec=ec)['ptx']\n"
            "    assert 'ld.volatile.global' in ptx and 'st.global.b64' in ptx, cfg\n"
            "    log, _ = compile_sass(ptx)\n"
            "    assert re.search(r'\\b0 bytes spill stores', log), (cfg, log[-400:])\n"
            "print('ok')\n")
    run_compiled(code)


def test_one_launch_tma_ec_host_checks():
    from spear_compile.lowering.w4a16_gemv_tma_ec import EcSelf

    N, K, R, D = 64, 1024, 8, 4
    ok = [torch.zeros(R, K), torch.zeros(N, R), torch.zeros(D, R), torch.zeros(D), torch.zeros(R, D),
          torch.zeros(R), torch.ones(())]
    x = torch.zeros(1, K)
    EcSelf(ok).check(N, K, (4, 2, 2, 2, 2), 2, x)
    for i, bad, msg in ((1, torch.zeros(32, R), r"EC B \(32, 8\) must be a contiguous \[64, 8\]"),
                        (2, torch.zeros(D, R + 1), "gate W1"),
                        (6, torch.ones(2), "alpha has 2 elements"),
                        (0, torch.zeros(K, R).t(), "A")):
        ec = list(ok)
        ec[i] = bad
        with pytest.raises(ValueError, match=msg):
            EcSelf(ec).check(N, K, (4, 2, 2, 2, 2), 2, x)
    with pytest.raises(ValueError, match="needs SPLIT 1"):
        EcSelf(ok).check(N, K, (4, 2, 2, 2, 2, 2), 2, x)
    big = [torch.zeros(64, 16384)] + ok[1:]
    big[1] = torch.zeros(N, 64)
    big[2], big[4], big[5] = torch.zeros(D, 64), torch.zeros(64, D), torch.zeros(64)
    with pytest.raises(ValueError, match="do not fit"):  # 64 x 16384 of A over 2 CTAs of 128 threads
        EcSelf(big).check(N, 16384, (4, 2, 2, 2, 2), 2, torch.zeros(1, 16384))


def test_one_launch_tma_ec_refuses_a_k_split_norm_and_glu():
    """Refused before any launch (a K-split has no EC epilogue, and the pieces read x unnormalised)."""
    from spear_compile.lowering.w4a16_gemv_tma_ec import EcSelf

    N, K, R, D = 256, 1024, 8, 4
    bf = torch.bfloat16
    ec = EcSelf([torch.zeros(R, K, dtype=bf), torch.zeros(N, R, dtype=bf), torch.zeros(D, R, dtype=bf),
                 torch.zeros(D, dtype=bf), torch.zeros(R, D, dtype=bf), torch.zeros(R, dtype=bf), torch.ones(())])
    x, q, s = torch.zeros(1, K, dtype=bf), torch.zeros(N, K // 2, dtype=torch.uint8), torch.zeros(N, K // 128, dtype=bf)
    with pytest.raises(ValueError, match="needs SPLIT 1"):
        gt.w4a16_gemv_tma(x, q, s, None, 128, None, config=(4, 2, 2, 3, 2, 2), ec=ec)
    with pytest.raises(ValueError, match="neither an RMSNorm prologue nor the GLU"):
        gt.w4a16_gemv_tma(x, q, s, None, 128, None, config=(4, 2, 2, 2, 2), norm=(torch.ones(K, dtype=bf), 1e-5),
                          ec=ec)
    with pytest.raises(ValueError, match="neither an RMSNorm prologue nor the GLU"):
        gt.w4a16_gemv_tma(x, q, s, None, 128, None, config=(4, 2, 2, 2, 2), glu=True, ec=ec)


def test_gemv1_ec_takes_the_one_launch_form_where_the_table_says(monkeypatch):
    """gemv1_ec on a PDL-capable GPU: the table's ``gemv1self`` entry picks the CUDA-core or the TMA form
    (the latter only where TMA can run); without it, the pairs."""
    from spear_compile.lowering import ec_decode_triton as ED
    from spear_compile.lowering import w4a16_gemv_tma_ec as TE
    from spear_compile.dispatch import cuda as D
    from spear_compile.dispatch import route as R
    from spear_compile.lowering import w4a16_triton as T

    N, K, G = 256, 1024, 128
    calls = []
    monkeypatch.setattr(capability, "pdl", lambda dev: True)
    monkeypatch.setattr(T, "w4a16_gemv1", lambda *a, **k: calls.append(("cc", k.get("config"))) or "cc")
    monkeypatch.setattr(D, "tma_self_gemv", lambda *a, **k: calls.append(("tma", a[8])) or "tma")
    monkeypatch.setattr(ED, "w4a16_gemv1_ec_pdl", lambda *a, **k: calls.append(("pair", None)) or "pair")
    monkeypatch.setattr(R, "tma_ec_measured_ok", lambda *a: False)
    q, s, z = torch.zeros(N, K // 2, dtype=torch.uint8), torch.zeros(N, K // G, dtype=torch.bfloat16), None
    ec = tuple(_ec(N, K, 8, 4, 0))
    x = torch.zeros(1, K, dtype=torch.bfloat16)
    use_tuned_table(monkeypatch, {TK.gemv1self_key(N, K, G): ["cc", 8, 512, 4, 0]})
    assert D.gemv1_ec(x, q, s, z, G, None, ec) == "cc" and calls[-1] == ("cc", (8, 512, 4, 0))
    use_tuned_table(monkeypatch, {TK.gemv1self_key(N, K, G): ["tma", 4, 2, 2, 2, 2]})
    monkeypatch.setattr(gt, "_tma_capable", lambda dev: True)
    assert D.gemv1_ec(x, q, s, z, G, None, ec) == "tma" and calls[-1] == ("tma", (4, 2, 2, 2, 2))
    with pytest.raises(ValueError, match="no K-split"):  # (the EC epilogue needs one CTA per row block)
        use_tuned_table(monkeypatch, {TK.gemv1self_key(N, K, G): ["tma", 4, 2, 2, 3, 2, 2]})  # a K-split
    use_tuned_table(monkeypatch, {TK.gemv1self_key(N, K, G): ["tma", 4, 2, 2, 2, 2]})
    monkeypatch.setattr(gt, "_tma_capable", lambda dev: False)  # no TMA here: the pair
    assert D.gemv1_ec(x, q, s, z, G, None, ec) == "pair"
    use_tuned_table(monkeypatch, {})
    assert D.gemv1_ec(x, q, s, z, G, None, ec) == "pair"
    # a per-rank entry overrides the rank-free one for its rank bucket only (ec has rank 8)
    monkeypatch.setattr(gt, "_tma_capable", lambda dev: True)
    generic = ["tma", 4, 2, 2, 2, 2]
    use_tuned_table(monkeypatch, {TK.gemv1self_key(N, K, G): generic, TK.gemv1self_rank_key(N, K, G, 8): ["pair"]})
    assert D.gemv1_ec(x, q, s, z, G, None, ec) == "pair"
    use_tuned_table(monkeypatch, {TK.gemv1self_key(N, K, G): generic, TK.gemv1self_rank_key(N, K, G, 16): ["pair"]})
    assert D.gemv1_ec(x, q, s, z, G, None, ec) == "tma"
    use_tuned_table(monkeypatch, {TK.gemv1self_rank_key(N, K, G, 7): generic})  # bucket next_pow2(7) = 8
    assert D.gemv1_ec(x, q, s, z, G, None, ec) == "tma" and calls[-1] == ("tma", (4, 2, 2, 2, 2))
    # the key format, pinned independently of the helper: an EC of rank 5 reads bucket 8
    ec5 = tuple(_ec(N, K, 5, 4, 0))
    use_tuned_table(monkeypatch, {"gemv1selfr|256|1024|128|8": ["cc", 8, 512, 4, 0]})
    assert D.gemv1_ec(x, q, s, z, G, None, ec5) == "cc" and calls[-1] == ("cc", (8, 512, 4, 0))
    use_tuned_table(monkeypatch, {TK.gemv1self_key(N, K, G): ["cc", 8, 512, 4, 0], "gemv1selfr|256|1024|128|8": ["pair"]})
    assert D.gemv1_ec(x, q, s, z, G, None, ec5) == "pair"


def _setup(N, K, G, R=16, D=8, seed=0):
    x, _, q, s, z, b = _case(N, K, G, seed=seed)
    ec = [t.cuda() for t in _ec(N, K, R, D, seed)]
    return x.cuda() * 3, q.cuda(), s.cuda(), z.cuda(), b.cuda(), ec


@on_hopper
@pytest.mark.parametrize("config", [(4, 2, 2, 2, 2), (4, 2, 4, 2, 2), (2, 2, 4, 2, 2)])
@pytest.mark.parametrize("N,K,G,R", [(1000, 2048, 128, 16), (2048, 4096, 4096, 32), (4096, 2048, 128, 64),
                                     (1024, 1024, 128, 64)])
def test_one_launch_tma_ec_matches_reference(config, N, K, G, R):
    from spear_compile.lowering.ec_self import self_plan, self_workspace, sm_count
    from spear_compile.dispatch.cuda import tma_self_gemv

    x, q, s, z, b, ec = _setup(N, K, G, R)
    rows = -(-N // gt.tile_geometry(config)[0])
    plan = self_plan(R, K, rows, 32 * config[0], sm_count(x.device))
    if plan is None:
        pytest.skip(f"A {R}x{K} does not fit {rows} CTAs of {config[0]} warps (the pair runs there)")
    ref = ec_linear_ref(x, q, s, z, G, b, *ec)
    outs = [tma_self_gemv(x, q, s, z, G, b, ec, "silu", config) for _ in range(3)]
    for y in outs:
        assert _rel(y, ref) < 1e-2
    assert all(torch.equal(outs[0], y) for y in outs[1:])  # the same bits every launch
    no_ec = torch.ops.spear.w4a16_linear(x, q, s, z, G, b)
    assert _rel(no_ec, ref) > 5e-2  # dropping the EC term would fail
    tick, slots = self_workspace(ec[0], rows, plan)
    assert tick.item() == 3 * rows and ((slots >> 32) == 3).all()
    # nobody publishes its own pieces (publish=False): every CTA computes the missing ones itself - same bits,
    # in the pieces themselves (fp32, before any rounding to the output's dtype) and in the output
    own_bits = (slots & 0xFFFFFFFF).clone()
    assert torch.equal(tma_self_gemv(x, q, s, z, G, b, ec, "silu", config, publish=False), outs[0])
    assert torch.equal(slots & 0xFFFFFFFF, own_bits) and ((slots >> 32) == 4).all()


@on_hopper
def test_one_launch_tma_ec_replays_in_a_cuda_graph():
    from spear_compile.dispatch.cuda import tma_self_gemv

    N, K, G = 2048, 2048, 128
    x, q, s, z, b, ec = _setup(N, K, G, 64)
    cfg = (4, 2, 2, 2, 2)
    y = tma_self_gemv(x, q, s, z, G, b, ec, "silu", cfg)  # first use makes the layouts and the workspace
    static_x = x.clone()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = tma_self_gemv(static_x, q, s, z, G, b, ec, "silu", cfg)
    for seed in range(3):
        xn = torch.randn(1, K, generator=torch.Generator().manual_seed(seed)).to("cuda", torch.bfloat16)
        static_x.copy_(xn)
        g.replay()
        torch.cuda.synchronize()
        assert _rel(y, ec_linear_ref(xn, q, s, z, G, b, *ec)) < 1e-2
