"""fuse_rmsnorm: at decode, the RMSNorm in front of a concatenated / GLU GEMV -> that op's norm_weight."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spear_compile as spear
from spear_compile import CompileConfig
from tests.helpers import (assert_compiled_matches_eager, capture, quantized_llama, round_trip_reaches_pass,
                           snapshot)


class HFNorm(nn.Module):
    """LlamaRMSNorm's form: fp32, back to the input dtype, times the weight."""

    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.rand(d) + 0.5), eps

    def forward(self, x):
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class MLPBlock(nn.Module):
    """norm -> gate/up -> silu * up -> down, plus forms the pass must leave alone."""

    def __init__(self, form="plain"):
        super().__init__()
        self.form = form
        self.norm = HFNorm(64)
        self.q, self.k = nn.Linear(64, 32, bias=False), nn.Linear(64, 32, bias=False)
        self.gate, self.up = nn.Linear(64, 96, bias=False), nn.Linear(64, 96, bias=False)
        self.down = nn.Linear(96, 64, bias=False)

    def forward(self, x):
        h = self.norm(x)
        a = self.q(h) * self.k(h)  # a concatenated GEMV reading the norm
        y = x + self.down(F.silu(self.gate(x + a.sum(-1, keepdim=True))) * self.up(x + a.sum(-1, keepdim=True)))
        if self.form == "norm_escapes":
            y = y + h  # the normalised x is read elsewhere too: cannot move into the GEMV
        return y


def _quantized(m, dtype):
    spear.quantize_(m, spear.QuantConfig(group_size=32), progress=False)
    return m.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hf_norm_moves_into_the_concatenated_gemv_and_matches_eager(dtype):
    torch.manual_seed(0)
    m = _quantized(MLPBlock(), dtype)
    x = torch.randn(1, 1, 64, dtype=dtype)
    rep = capture(m, (x,))
    snap = snapshot(rep, "fuse_rmsnorm")
    assert snap.matched_count == 1
    assert "aten.rsqrt.default" in snap.before and "aten.rsqrt.default" not in snap.after
    normed = {r["weight"].split(".")[0] for r in rep.linears if r.get("rms_norm")}
    assert normed == {"q", "k"}, normed
    assert_compiled_matches_eager(m, x, tol=1e-5 if dtype == torch.float32 else 3e-2)


def test_llama_norms_move_into_qkv_and_the_glu_gemv():
    m = quantized_llama(d=64, layers=2, heads=2, ff=128, group_size=32)  # fp32 norms
    x = torch.randn(1, 1, 64)
    rep = capture(m, (x,))
    assert snapshot(rep, "fuse_rmsnorm").matched_count == 4  # two per layer: q/k/v and gate/up (GLU)
    assert_compiled_matches_eager(m, x, tol=1e-5)


def test_left_alone_when_the_norm_is_read_elsewhere_low_precision_prefill_or_off():
    m = _quantized(MLPBlock("norm_escapes"), torch.float32)
    assert snapshot(capture(m, (torch.randn(1, 1, 64),)), "fuse_rmsnorm").matched_count == 0
    # bf16 norm computed in bf16 (no upcast): another rounding than the fused kernel's, not this form
    m = quantized_llama(d=64, layers=1, heads=2, ff=128, dtype=torch.bfloat16)
    assert snapshot(capture(m, (torch.randn(1, 1, 64, dtype=torch.bfloat16),)), "fuse_rmsnorm").matched_count == 0
    m = quantized_llama(d=64, layers=1, heads=2, ff=128)
    assert snapshot(capture(m, (torch.randn(1, 4, 64),)), "fuse_rmsnorm").matched_count == 0  # prefill
    rep = capture(m, (torch.randn(1, 1, 64),), config=CompileConfig(fuse_rmsnorm=False))
    assert snapshot(rep, "fuse_rmsnorm").matched_count == 0


class _OddNorm(nn.Module):
    """Norm-like forms that are not this RMSNorm: eps added with alpha 2; x rounded to bf16 inside."""

    def __init__(self, form):
        super().__init__()
        self.form, self.norm = form, HFNorm(64)
        self.q, self.k = nn.Linear(64, 32, bias=False), nn.Linear(64, 32, bias=False)

    def forward(self, x):
        if self.form == "alpha":
            xf = x.float()
            h = self.norm.weight * (xf * torch.rsqrt(torch.add(xf.pow(2).mean(-1, keepdim=True), 0.5, alpha=2.0)))
        else:  # rounded: the graph normalises bf16-rounded x; a fused op must read that rounded tensor
            xf = x.to(torch.bfloat16).float()
            h = self.norm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5))
        return self.q(h) * self.k(h)


@pytest.mark.parametrize("form,fused", [("alpha", 0), ("rounded", 0)])
def test_alpha_and_lossy_conversions_are_respected(form, fused):
    torch.manual_seed(0)
    m = _quantized(_OddNorm(form), torch.float32)
    x = torch.randn(1, 1, 64)
    snap = snapshot(capture(m, (x,)), "fuse_rmsnorm")
    if form == "rounded" and not round_trip_reaches_pass(snap):  # (torch 2.11: removed before the passes)
        fused = 1
    assert snap.matched_count == fused
    if form == "alpha":  # (not for "rounded": Inductor itself drops a to(bf16).float() round trip)
        assert_compiled_matches_eager(m, x)


def test_ops_check_and_apply_the_norm():
    from spear_compile.ops.refs import rms_norm_ref
    from spear_compile.quant import quantize_rtn

    parts = [quantize_rtn(torch.randn(16, 64) * 0.05, spear.QuantConfig(group_size=32)) for _ in range(2)]
    qs, ss, zs = [p.qweight for p in parts], [p.scales for p in parts], [p.zeros for p in parts]
    x, w = torch.randn(2, 64), torch.rand(64) + 0.5
    y = torch.ops.spear.w4a16_linear_cat(x, qs, ss, zs, 32, [None, None], "spear", w, 1e-5)
    torch.testing.assert_close(y, torch.ops.spear.w4a16_linear_cat(rms_norm_ref(x, w, 1e-5), qs, ss, zs, 32,
                                                                   [None, None]), rtol=0, atol=0)
    y = torch.ops.spear.w4a16_linear_glu(x, qs, ss, zs, 32, "silu", "spear", w, 1e-5)
    torch.testing.assert_close(y, torch.ops.spear.w4a16_linear_glu(rms_norm_ref(x, w, 1e-5), qs, ss, zs, 32),
                               rtol=0, atol=0)
    for bad, msg in ((torch.rand(32), r"norm_weight has shape \(32,\), expected \(64,\)"),
                     (torch.rand(64, dtype=torch.float64), "norm_weight dtype torch.float64")):
        with pytest.raises(spear.QuantFormatError, match=msg):
            torch.ops.spear.w4a16_linear_cat(x, qs, ss, zs, 32, [None, None], "spear", bad, 1e-5)
    with pytest.raises(spear.QuantFormatError, match="norm_eps=0.0 must be > 0"):
        torch.ops.spear.w4a16_linear_glu(x, qs, ss, zs, 32, "silu", "spear", w, 0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_reference_norm_is_the_models(dtype):
    """rms_norm_ref (what the fused ops and the GPU prologue compute) against LlamaRMSNorm's form."""
    from spear_compile.ops.refs import rms_norm_ref

    torch.manual_seed(0)
    norm = HFNorm(64, eps=1e-5).to(dtype)
    x = torch.randn(3, 64, dtype=dtype) * 4
    with torch.no_grad():
        torch.testing.assert_close(rms_norm_ref(x, norm.weight, 1e-5), norm(x), rtol=0, atol=0)


def test_norm_moves_into_the_ec_concatenation_and_matches_eager():
    """q/k/v and gate/up with ECs (spear::ec_linear_cat, and ec_linear_glu after fuse_glu): both norms move
    into them; the compiled decode step equals eager; the op applies the norm (its reference is the
    parts on rms_norm_ref(x))."""
    from spear_compile.ops.refs import rms_norm_ref
    from spear_compile.quant import quantize_rtn
    from tests.helpers import spear_ops_after
    from tests.helpers import llama_with_ecs as _llama_with_ecs, random_ec as _ec

    m = _llama_with_ecs()
    x = torch.randn(1, 1, 64)
    rep = capture(m, (x,))
    ops = spear_ops_after(rep)
    assert ops["spear.ec_linear_cat.default"] == 1 and ops["spear.ec_linear_glu.default"] == 1, ops
    snap = snapshot(rep, "fuse_rmsnorm")
    assert snap.matched_count == 2
    assert snap.before.count("aten.rsqrt.default") == 3 and snap.after.count("aten.rsqrt.default") == 1  # final norm
    normed = {r["weight"].split(".")[-2] for r in rep.linears if r.get("rms_norm")}
    assert normed == {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}, normed
    assert_compiled_matches_eager(m, x, tol=1e-5)
    off = capture(m, (x,), config=CompileConfig(fuse_rmsnorm=False))
    assert snapshot(off, "fuse_rmsnorm").matched_count == 0
    # the op itself: norm_weight applies rms_norm_ref before the parts
    parts = [quantize_rtn(torch.randn(n, 64) * 0.05, spear.QuantConfig(group_size=32)) for n in (16, 8)]
    ecs = [_ec(64, n, r, r) for n, r in ((16, 4), (8, 2))]
    ec_lists = [[getattr(e, k).detach() for e in ecs] for k in ("A", "B", "W1", "b1", "W2", "b2", "alpha")]
    qs, ss, zs = [p.qweight for p in parts], [p.scales for p in parts], [p.zeros for p in parts]
    xx, w = torch.randn(2, 64), torch.rand(64) + 0.5
    y = torch.ops.spear.ec_linear_cat(xx, qs, ss, zs, 32, [None, None], *ec_lists, "silu", "spear", w, 1e-5)
    ref = torch.ops.spear.ec_linear_cat(rms_norm_ref(xx, w, 1e-5), qs, ss, zs, 32, [None, None], *ec_lists)
    torch.testing.assert_close(y, ref, rtol=0, atol=0)
    with pytest.raises(spear.QuantFormatError, match=r"spear::ec_linear_cat: norm_weight has shape \(32,\)"):
        torch.ops.spear.ec_linear_cat(xx, qs, ss, zs, 32, [None, None], *ec_lists, "silu", "spear", w[:32], 1e-5)
