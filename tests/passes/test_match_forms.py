"""Each source form: ops before/after, matched_count, numbers equal to eager."""
import pytest
import torch
import torch.nn as nn

import spear_compile as spear
from spear_compile import ECConfig, ErrorCompensator, QuantConfig
from tests.helpers import DequantLinear, Int4PackLinear, capture, ops_before_first_pass, spear_ops_after

W4 = "spear.w4a16_linear.default"
EC = "spear.ec_linear.default"


def _compiled(model, x):
    with torch.no_grad():
        return torch.compile(model, backend="spear")(x)


def test_spear_op_form():
    m = nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 64, bias=False))
    spear.quantize_(m, QuantConfig(group_size=32), progress=False)
    x = torch.randn(3, 64)
    rep = capture(m, (x,))
    assert ops_before_first_pass(rep)[W4] == 2
    assert spear_ops_after(rep) == {W4: 2}
    assert rep.pass_counts()["match_spear_op"] == 2
    assert rep.summary()["by_source_form"] == {"spear_op": 2}
    assert {r["weight"] for r in rep.linears} == {"0.qweight", "2.qweight"}
    torch.testing.assert_close(_compiled(m, x), m(x), rtol=0, atol=0)


@pytest.mark.parametrize("group_size,bias,zero,qdtype", [
    (32, True, "tensor", torch.uint8),
    (None, False, "tensor", torch.uint8),
    (64, True, "scalar", torch.int8),
    (None, True, "none", torch.int32),
])
def test_dequant_linear_form(group_size, bias, zero, qdtype):
    m = DequantLinear(48, 128, group_size=group_size, bias=bias, zero=zero, qdtype=qdtype)
    x = torch.randn(5, 128)
    rep = capture(m, (x,))
    before = ops_before_first_pass(rep)
    assert before["aten.mm.default"] + before["aten.addmm.default"] == 1
    after = rep.graphs[0].snapshots[-1].ops_after
    assert spear_ops_after(rep) == {W4: 1}
    assert "aten.mm.default" not in after and "aten.addmm.default" not in after
    assert "aten.sub.Tensor" not in after and "aten.mul.Tensor" not in after  # dequant chain removed
    assert rep.pass_counts()["match_dequant_linear"] == 1
    rec = rep.linears[0]
    assert rec["source_form"] == "dequant_linear" and rec["layout"] == "unpacked"
    assert rec["group_size"] == (group_size or 128) and (rec["N"], rec["K"]) == (48, 128)
    with torch.no_grad():
        torch.testing.assert_close(_compiled(m, x), m(x), rtol=1e-6, atol=1e-6)


def test_dequant_with_3d_input_and_bf16():
    m = DequantLinear(48, 64, group_size=32).to(torch.bfloat16)
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    rep = capture(m, (x,))
    assert rep.pass_counts()["match_dequant_linear"] == 1
    with torch.no_grad():
        torch.testing.assert_close(_compiled(m, x), m(x), rtol=1e-2, atol=1e-2)


def test_per_input_channel_scale_is_not_matched():
    class PerInput(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("q", torch.randint(0, 16, (48, 64), dtype=torch.uint8))
            self.register_buffer("s", torch.rand(64))  # scales along K: not a per-(row, group) quantizer

        def forward(self, x):
            return nn.functional.linear(x, self.q.to(x.dtype) * self.s)

    m = PerInput()
    x = torch.randn(3, 64)
    rep = capture(m, (x,))
    assert rep.summary()["matched_linears"] == 0 and spear_ops_after(rep) == {}
    with torch.no_grad():
        torch.testing.assert_close(_compiled(m, x), m(x))


def test_int4pack_form():
    m = Int4PackLinear(48, 128, group_size=32)
    x = torch.randn(4, 128)
    rep = capture(m, (x,))
    assert ops_before_first_pass(rep)["aten._weight_int4pack_mm_for_cpu.default"] == 1
    assert spear_ops_after(rep) == {W4: 1}
    assert "aten._weight_int4pack_mm_for_cpu.default" not in rep.graphs[0].snapshots[-1].ops_after
    assert rep.pass_counts()["match_int4pack_mm"] == 1
    assert rep.linears[0]["layout"] == "tinygemm_cpu"
    with torch.no_grad():
        torch.testing.assert_close(_compiled(m, x), m(x), rtol=0, atol=0)


@pytest.mark.parametrize("form", ["spear_op", "dequant_linear", "int4pack_mm"])
def test_registered_ec_turns_each_form_into_ec_linear(form):
    K, N = 64, 48
    if form == "spear_op":
        m = nn.Sequential(nn.Linear(K, N))
        spear.quantize_(m, QuantConfig(group_size=32), progress=False)
    elif form == "dequant_linear":
        m = nn.Sequential(DequantLinear(N, K, group_size=32))
    else:
        m = nn.Sequential(Int4PackLinear(N, K, group_size=32))
    ec = ErrorCompensator(K, N, ECConfig(rank=4, gate_hidden=4))
    with torch.no_grad():
        for p in (ec.A, ec.B, ec.W2):
            p.normal_(0, 0.3)
    x = torch.randn(3, K)
    with torch.no_grad():
        base = m(x)
    spear.attach_(m, {"0": ec})
    rep = capture(m, (x,))
    assert spear_ops_after(rep) == {EC: 1}
    assert rep.linears[0]["ec_rank"] == 4 and rep.summary()["ec_linears"] == 1
    with torch.no_grad():
        out = _compiled(m, x)
        torch.testing.assert_close(out, base + ec(x), rtol=1e-5, atol=1e-5)
        # ECs of foreign modules are live graph inputs: training after compile is seen
        if form != "spear_op":
            cm = torch.compile(m, backend="spear")
            cm(x)
            ec.alpha.mul_(2)
            torch.testing.assert_close(cm(x), base + ec(x), rtol=1e-5, atol=1e-5)


def test_foreign_ec_of_wrong_shape_is_a_clear_compile_error():
    m = nn.Sequential(DequantLinear(48, 64))
    spear.compensators.register_ec(m[0].q, ErrorCompensator(64, 40, ECConfig(rank=2)), "0")
    with pytest.raises(Exception, match=r"EC registered for 0: EC tensor B has shape \(40, 2\), expected \(48, 2\)"):
        _compiled(m, torch.randn(2, 64))


def test_disabled_matchers_leave_graph_alone():
    m = DequantLinear(48, 64)
    cfg = spear.CompileConfig(enable_dequant_match=False)
    rep = capture(m, (torch.randn(2, 64),), config=cfg)
    assert rep.summary()["matched_linears"] == 0
