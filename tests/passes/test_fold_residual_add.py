"""fold_residual_add: at decode, ``x + linear(h)`` -> the linear with bias = x."""
import torch

import spear_compile as spear
from spear_compile import CompileConfig
from tests.helpers import assert_compiled_matches_eager, capture, quantized_llama, snapshot, spear_ops_after


def test_decode_residual_adds_become_biases_and_prefill_keeps_them():
    m = quantized_llama(d=64, layers=1, heads=2, ff=128)
    rep = capture(m, (torch.randn(1, 1, 64),))
    snap = snapshot(rep, "fold_residual_add")
    # o_proj and down_proj each had "x + linear": both adds are gone, each linear reads a view as its bias
    assert snap.matched_count == 2
    assert snap.before.count("aten.add.Tensor") - snap.after.count("aten.add.Tensor") == 2
    assert snap.after.count("aten.view.default") - snap.before.count("aten.view.default") == 2
    folded = {r["weight"].split(".")[2] for r in rep.linears if r.get("residual")}
    assert folded == {"o_proj", "down_proj"}, folded
    rep = capture(m, (torch.randn(1, 8, 64),))  # prefill: the residual is a matrix, not a bias
    snap = snapshot(rep, "fold_residual_add")
    assert snap.matched_count == 0 and snap.before == snap.after
    rep = capture(m, (torch.randn(1, 1, 64),), config=CompileConfig(fold_residual_add=False))
    assert not any(r.get("residual") for r in rep.linears)


class _Block(torch.nn.Module):
    """Forms the pass must leave alone next to one it folds."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(64, 64, bias=bias) for bias in (False, True, False))

    def forward(self, x):
        y = self.a(x)
        used_twice = y + x  # y has two users: folding would change the other one
        with_bias = x + self.b(x)  # the linear has a bias already
        scaled = torch.add(self.c(x), x, alpha=2.0)  # alpha != 1
        return used_twice * y + with_bias + scaled


def test_only_the_folded_form_is_rewritten():
    m = _Block()
    spear.quantize_(m, spear.QuantConfig(group_size=32), progress=False)
    # (the three share x: without fuse_shared_input=False they would become one concatenated GEMV)
    rep = capture(m, (torch.randn(1, 64),), config=CompileConfig(fuse_shared_input=False))
    snap = snapshot(rep, "fold_residual_add")
    assert snap.matched_count == 0, snap.after
    assert spear_ops_after(rep)["spear.w4a16_linear.default"] == 3


class _LateOrBroadcast(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 64, bias=False)
        self.v = torch.nn.Parameter(torch.randn(64))

    def forward(self, x):
        y = self.a(x)
        late = x * 2.0  # computed after the linear: the linear cannot read it as its bias
        z = self.b(x * 3.0)
        return (y + late) + (z + self.v[:1])  # a [1]-shaped addend broadcasts: not a bias of shape [N]


def test_late_or_broadcast_residuals_are_not_folded():
    m = _LateOrBroadcast()
    spear.quantize_(m, spear.QuantConfig(group_size=32), progress=False)
    x = torch.randn(1, 1, 64)
    assert snapshot(capture(m, (x,)), "fold_residual_add").matched_count == 0
    assert_compiled_matches_eager(m, x)


def test_folded_decode_step_equals_eager_with_and_without_ecs():
    torch.manual_seed(0)
    m = quantized_llama(d=64, layers=2, heads=2, ff=128, group_size=32)
    x = torch.randn(1, 1, 64)
    assert_compiled_matches_eager(m, x)
    ec = spear.ErrorCompensator(64, 64, spear.ECConfig(rank=4, gate_hidden=4))
    with torch.no_grad():
        for p in ec.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    spear.attach_(m, {"layers.0.o_proj": ec})
    rep = capture(m, (x,))
    assert any(r.get("residual") and r.get("ec_rank") for r in rep.linears)  # the EC linear folded too
    assert_compiled_matches_eager(m, x)
