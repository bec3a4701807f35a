"""fuse_glu: at decode, silu(gate(h)) * up(h) over the concatenated GEMV -> one spear::w4a16_linear_glu."""
import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import spear_compile as spear
from spear_compile import CompileConfig
from spear_compile.dispatch import keys as TK
from spear_compile.passes.fuse_glu import silu_input
from tests.helpers import (assert_compiled_matches_eager, capture, quantized_llama, round_trip_reaches_pass, snapshot,
                           spear_ops_after)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_mlp_becomes_one_glu_op_and_matches_eager(dtype):
    m = quantized_llama(d=64, layers=2, heads=2, ff=128, group_size=32, dtype=dtype)
    x = torch.randn(1, 1, 64, dtype=dtype)
    rep = capture(m, (x,))
    snap = snapshot(rep, "fuse_glu")
    assert snap.matched_count == 2  # one per layer
    ops = spear_ops_after(rep)
    assert ops["spear.w4a16_linear_glu.default"] == 2 and ops["spear.w4a16_linear_cat.default"] == 2, ops  # + q/k/v
    assert "aten.exp.default" in snap.before and "aten.exp.default" not in snap.after  # the silu went with it
    glu = {r["weight"].split(".")[2] for r in rep.linears if r.get("glu")}
    assert glu == {"gate_proj", "up_proj"}
    assert_compiled_matches_eager(m, x, tol=1e-5 if dtype == torch.float32 else 2e-2)


def test_not_at_prefill_and_not_when_off():
    m = quantized_llama(d=64, layers=1, heads=2, ff=128)
    assert snapshot(capture(m, (torch.randn(1, 8, 64),)), "fuse_glu").matched_count == 0
    assert snapshot(capture(m, (torch.randn(1, 1, 64),), config=CompileConfig(fuse_glu=False)),
                 "fuse_glu").matched_count == 0


class _MLP(torch.nn.Module):
    """A gated MLP whose gate also leaves the block, or whose activation is not silu: not fusable."""

    def __init__(self, form):
        super().__init__()
        self.form = form
        self.gate, self.up = torch.nn.Linear(64, 96, bias=False), torch.nn.Linear(64, 96, bias=False)

    def forward(self, h):
        g, u = self.gate(h), self.up(h)
        if self.form == "gate_escapes":
            return torch.nn.functional.silu(g) * u + g.sum()
        if self.form == "gelu":
            return torch.nn.functional.gelu(g) * u
        return torch.nn.functional.silu(g) * u


@pytest.mark.parametrize("form,fused", [("silu", 1), ("gate_escapes", 0), ("gelu", 0)])
def test_only_the_exact_pattern_is_rewritten(form, fused):
    m = _MLP(form)
    spear.quantize_(m, spear.QuantConfig(group_size=32), progress=False)
    x = torch.randn(1, 64)
    assert snapshot(capture(m, (x,)), "fuse_glu").matched_count == fused
    assert_compiled_matches_eager(m, x, tol=1e-5)


def _graph(body):
    """A hand-made graph; every node carries an fp32 value (a convert to bf16 a bf16 one), as the
    matcher reads dtypes from ``meta["val"]``."""
    g = fx.Graph()
    x = g.placeholder("x")
    out = body(g, x)
    for n in g.nodes:
        bf16 = n.target is torch.ops.prims.convert_element_type.default and n.args[1] == torch.bfloat16
        n.meta["val"] = torch.empty(4, dtype=torch.bfloat16 if bf16 else torch.float32)
    return x, out


def test_silu_forms():
    aten = torch.ops.aten
    x, out = _graph(lambda g, x: g.call_function(aten.silu.default, (x,)))
    assert silu_input(out) is x
    x, out = _graph(lambda g, x: g.call_function(aten.mul.Tensor, (g.call_function(aten.sigmoid.default, (x,)), x)))
    assert silu_input(out) is x

    def decomposed(g, x):
        c = g.call_function(torch.ops.prims.convert_element_type.default, (x, torch.float32))
        e = g.call_function(aten.exp.default, (g.call_function(aten.neg.default, (c,)),))
        d = g.call_function(aten.div.Tensor, (c, g.call_function(aten.add.Tensor, (e, 1))))
        return g.call_function(torch.ops.prims.convert_element_type.default, (d, torch.bfloat16))

    x, out = _graph(decomposed)
    assert silu_input(out) is x
    x, out = _graph(lambda g, x: g.call_function(aten.mul.Tensor, (g.call_function(aten.sigmoid.default, (x,)),
                                                                   g.call_function(aten.neg.default, (x,)))))
    assert silu_input(out) is None  # x * sigmoid(y) with y != x


def test_glu_op_checks_and_reference():
    from spear_compile.quant import quantize_rtn

    parts = [quantize_rtn(torch.randn(n, 64) * 0.05, spear.QuantConfig(group_size=32)) for n in (16, 16, 8)]
    x = torch.randn(2, 64)
    qs, ss, zs = [p.qweight for p in parts], [p.scales for p in parts], [p.zeros for p in parts]
    y = torch.ops.spear.w4a16_linear_glu(x, qs[:2], ss[:2], zs[:2], 32)
    g, u = (torch.ops.spear.w4a16_linear(x, q, s, z, 32, None) for q, s, z in zip(qs[:2], ss[:2], zs[:2]))
    torch.testing.assert_close(y, torch.nn.functional.silu(g) * u, rtol=1e-6, atol=1e-6)  # (SIMD vs scalar exp)
    with pytest.raises(spear.QuantFormatError, match="expected \\[gate, up\\]"):
        torch.ops.spear.w4a16_linear_glu(x, qs, ss, zs, 32)
    with pytest.raises(spear.QuantFormatError, match="gate has 16 outputs but up has 8"):
        torch.ops.spear.w4a16_linear_glu(x, [qs[0], qs[2]], [ss[0], ss[2]], [zs[0], zs[2]], 32)
    with pytest.raises(spear.QuantFormatError, match="unknown gate activation 'gelu'"):
        torch.ops.spear.w4a16_linear_glu(x, qs[:2], ss[:2], zs[:2], 32, "gelu")


class _RoundedGate(torch.nn.Module):
    """fp32 model whose gate is rounded to bf16 before the silu: the fused op would skip that rounding."""

    def __init__(self):
        super().__init__()
        self.gate, self.up = torch.nn.Linear(64, 96, bias=False), torch.nn.Linear(64, 96, bias=False)

    def forward(self, h):
        return torch.nn.functional.silu(self.gate(h).to(torch.bfloat16).float()) * self.up(h)


def test_a_lossy_conversion_chain_is_not_matched():
    torch.manual_seed(0)
    m = _RoundedGate()
    spear.quantize_(m, spear.QuantConfig(group_size=32), progress=False)
    x = torch.randn(1, 64)
    # (no compiled-vs-eager check here: Inductor itself drops a to(bf16).float() round trip)
    snap = snapshot(capture(m, (x,)), "fuse_glu")
    assert snap.matched_count == (0 if round_trip_reaches_pass(snap) else 1)



def test_the_cuda_entry_checks_its_parts():
    """The registered CUDA implementation replaces the op's body, so it checks the parts itself (its
    fallback branch runs on CPU tensors, which is what this calls)."""
    from spear_compile.dispatch.cuda import w4a16_linear_glu_cuda
    from spear_compile.quant import quantize_rtn

    parts = [quantize_rtn(torch.randn(n, 64) * 0.05, spear.QuantConfig(group_size=32)) for n in (16, 8)]
    qs, ss, zs = [p.qweight for p in parts], [p.scales for p in parts], [p.zeros for p in parts]
    with pytest.raises(spear.QuantFormatError, match="gate has 16 outputs but up has 8"):
        w4a16_linear_glu_cuda(torch.randn(1, 64), qs, ss, zs, 32)
    with pytest.raises(spear.QuantFormatError, match="norm_weight has shape"):
        w4a16_linear_glu_cuda(torch.randn(1, 64), [qs[0], qs[0]], [ss[0], ss[0]], [zs[0], zs[0]], 32, "silu",
                              "spear", torch.ones(32), 1e-5)


def _gpu_parts(monkeypatch, F=256, K=1024, G=128, config=(4, 2, 2, 2, 2)):
    """Fake CUDA values of a gate / up pair (nodes as the passes see them) on a faked Hopper GPU whose
    tuned table runs the concatenated shape on the TMA kernel in ``config``."""
    from types import SimpleNamespace

    from torch._subclasses.fake_tensor import FakeTensorMode

    from spear_compile.lowering import device as capability
    from spear_compile.lowering import w4a16_gemv_tma as GT
    from tests.helpers import use_tuned_table

    if not GT.HAS_TMA:
        pytest.skip("needs Triton with Gluon TMA")
    monkeypatch.setattr(capability, "is_sm90", lambda device: True)
    monkeypatch.setattr(capability, "pdl", lambda device: True)
    use_tuned_table(monkeypatch, {TK.tma_key(2 * F, K, G): list(config)})
    node = lambda t: SimpleNamespace(meta={"val": t})  # noqa: E731
    with FakeTensorMode():
        x = torch.empty(1, 1, K, dtype=torch.bfloat16, device="cuda")
        q = torch.empty(F, K // 2, dtype=torch.uint8, device="cuda")
        qt = torch.empty(K // 2, F, dtype=torch.uint8, device="cuda").t()
        s = torch.empty(F, K // G, dtype=torch.bfloat16, device="cuda")
        A = [torch.empty(r, K, dtype=torch.bfloat16, device="cuda") for r in (4, 8, 80)]
        B = [torch.empty(F, r, dtype=torch.bfloat16, device="cuda") for r in (4, 8, 80)]
        W1 = torch.empty(4, 4, dtype=torch.bfloat16, device="cuda")
    kw = {"x": node(x), "group_size": G, "layout": "spear", "qweights": [node(q), node(q)],
          "scales": [node(s), node(s)], "zeros": [node(s), node(s)], "biases": [None, None], "norm_weight": None,
          "As": [node(A[0]), node(A[1])], "Bs": [node(B[0]), node(B[1])], "W1s": [node(W1), node(W1)]}
    return kw, node, {"qt": qt, "A": A, "B": B}


def test_gpu_rewrite_condition_asks_the_route(monkeypatch):
    """fuse_glu's and fuse_rmsnorm's condition on a GPU is ``route`` of the op they would make, from the
    graph's fake values: the TMA kernel only where the M = 1 kernel takes every part (contiguous weights)
    and the zero points are all or none."""
    from spear_compile.passes.common import cat_route

    kw, node, t = _gpu_parts(monkeypatch)
    assert cat_route(kw, "w4a16_glu", norm=False).kernel == "glu_tma"
    assert cat_route(kw, "w4a16_cat", norm=True).kernel == "cat_tma"
    assert cat_route({**kw, "zeros": [kw["zeros"][0], None]}, "w4a16_glu", norm=False).kernel == "glu_of"
    rt = cat_route({**kw, "qweights": [kw["qweights"][0], node(t["qt"])]}, "w4a16_glu", norm=False)
    assert rt.kernel == "glu_of" and any("not contiguous" in r for r in rt.parts[0].all_reasons())


def test_gate_up_with_ecs_become_one_ec_glu_op_and_match_eager():
    """gate / up with ECs (an ec_linear_cat after fuse_shared_input) -> spear::ec_linear_glu; the decode
    step equals eager; off with fuse_glu=False; the op is glu_of(ec_linear_cat) exactly and checks its parts."""
    from spear_compile.ops.refs import glu_of
    from spear_compile.quant import quantize_rtn
    from tests.helpers import llama_with_ecs as _llama_with_ecs, random_ec as _ec

    m = _llama_with_ecs()
    x = torch.randn(1, 1, 64)
    rep = capture(m, (x,))
    assert snapshot(rep, "fuse_glu").matched_count == 1
    ops = spear_ops_after(rep)
    assert ops["spear.ec_linear_glu.default"] == 1 and ops["spear.ec_linear_cat.default"] == 1, ops
    glu = [r for r in rep.linears if r.get("glu")]
    assert {r["weight"].split(".")[-2] for r in glu} == {"gate_proj", "up_proj"}, glu
    assert_compiled_matches_eager(m, x, tol=1e-5)
    ops = spear_ops_after(capture(m, (x,), config=CompileConfig(fuse_glu=False)))
    assert "spear.ec_linear_glu.default" not in ops and ops["spear.ec_linear_cat.default"] == 2, ops
    parts = [quantize_rtn(torch.randn(24, 64) * 0.05, spear.QuantConfig(group_size=32)) for _ in range(2)]
    ecs = [_ec(64, 24, r, r) for r in (4, 2)]
    lists = [[getattr(e, k).detach() for e in ecs] for k in ("A", "B", "W1", "b1", "W2", "b2", "alpha")]
    qs, ss, zs = [p.qweight for p in parts], [p.scales for p in parts], [p.zeros for p in parts]
    xx = torch.randn(3, 64)
    y = torch.ops.spear.ec_linear_glu(xx, qs, ss, zs, 32, *lists)
    ref = glu_of(torch.ops.spear.ec_linear_cat(xx, qs, ss, zs, 32, [None, None], *lists))
    torch.testing.assert_close(y, ref, rtol=0, atol=0)
    with pytest.raises(spear.QuantFormatError, match=r"expected \[gate, up\] weights, got 1"):
        torch.ops.spear.ec_linear_glu(xx, qs[:1], ss[:1], zs[:1], 32, *[v[:1] for v in lists])
    small = quantize_rtn(torch.randn(16, 64) * 0.05, spear.QuantConfig(group_size=32))
    e16 = _ec(64, 16, 2, 2)
    with pytest.raises(spear.QuantFormatError, match="gate has 24 outputs but up has 16"):
        torch.ops.spear.ec_linear_glu(xx, [qs[0], small.qweight], [ss[0], small.scales], [zs[0], small.zeros], 32,
                                      *[[v[0], getattr(e16, k).detach()] for v, k in
                                        zip(lists, ("A", "B", "W1", "b1", "W2", "b2", "alpha"))])


class _CatWithNorm(nn.Module):
    """A concatenation that already carries an RMSNorm (norm_weight), then silu(y[..., :F]) * y[..., F:]
    (an open-ended slice, as user code writes it)."""

    def __init__(self):
        super().__init__()
        from spear_compile.quant import quantize_rtn

        for i in range(2):
            p = quantize_rtn(torch.randn(24, 64) * 0.05, spear.QuantConfig(group_size=32))
            self.register_buffer(f"q{i}", p.qweight)
            self.register_buffer(f"s{i}", p.scales)
            self.register_buffer(f"z{i}", p.zeros)
        self.nw = nn.Parameter(torch.rand(64) + 0.5)

    def forward(self, x):
        y = torch.ops.spear.w4a16_linear_cat(x, [self.q0, self.q1], [self.s0, self.s1], [self.z0, self.z1], 32,
                                             [None, None], "spear", self.nw, 1e-5)
        return torch.nn.functional.silu(y[..., :24]) * y[..., 24:]


def test_a_norm_already_in_the_cat_stays_with_the_glu_op():
    """fuse_glu rewrites a cat that carries norm_weight into a GLU op with the same norm (not dropped),
    and matches the open-ended up slice; compiled equals eager (which applies the norm)."""
    m = _CatWithNorm()
    x = torch.randn(1, 1, 64)
    snap = snapshot(capture(m, (x,)), "fuse_glu")
    assert snap.matched_count == 1
    glu = [ln for ln in snap.after.splitlines() if "spear.w4a16_linear_glu.default" in ln]
    assert len(glu) == 1 and "1e-05" in glu[0], glu
    assert_compiled_matches_eager(m, x, tol=1e-5)


def test_gpu_rewrite_conditions_with_ecs_ask_the_ec_epilogue(monkeypatch):
    """On a GPU, fuse_glu (gate/up with ECs) and fuse_rmsnorm (EC concatenations and EC GLU ops) rewrite
    only where ``route`` runs the op on the TMA kernel adding the ECs: not above its EC_RC_MAX columns per
    row, and with a norm only where the config stages x in shared memory."""
    from types import SimpleNamespace

    from spear_compile.passes import fuse_glu, fuse_rmsnorm
    from spear_compile.passes.context import PassContext

    ctx = PassContext(spear.CompileConfig())
    kw, node, t = _gpu_parts(monkeypatch)
    assert fuse_glu.FuseGLU(ctx)._epilogue_runs(kw, 256, has_ec=True)
    wide = {**kw, "As": [node(t["A"][2]), node(t["A"][1])], "Bs": [node(t["B"][2]), node(t["B"][1])]}
    assert not fuse_glu.FuseGLU(ctx)._epilogue_runs(wide, 256, has_ec=True)  # rank 80 > 64 columns per row
    assert fuse_glu.FuseGLU(ctx)._epilogue_runs(kw, 256, has_ec=False)
    out = node(torch.zeros(1, 1, 512))
    for target in (fuse_glu.EC_CAT, fuse_glu.EC_GLU, fuse_glu.W4A16_CAT, fuse_glu.GLU):
        assert fuse_rmsnorm.FuseRMSNorm(ctx)._prologue_runs(SimpleNamespace(target=target, meta=out.meta), kw)
    kw, node, t = _gpu_parts(monkeypatch, config=(4, 2, 2, 2, 1))  # x not staged in shared memory: no norm
    for target in (fuse_glu.EC_CAT, fuse_glu.EC_GLU, fuse_glu.W4A16_CAT, fuse_glu.GLU):
        assert not fuse_rmsnorm.FuseRMSNorm(ctx)._prologue_runs(SimpleNamespace(target=target, meta=out.meta), kw)
    assert fuse_glu.FuseGLU(ctx)._epilogue_runs(kw, 256, has_ec=True)  # (no norm: the GLU epilogue runs)
