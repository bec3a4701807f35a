"""The dequantize-then-linear matcher takes every op order of ``(q - z) * s`` it documents, and the
backend refuses to drop an EC whose linear it could not adopt.

Hypothesis draws the order (where the reshape to groups sits, where the zero is subtracted and in
which dtype, which side of the mul holds the scale, explicit or implicit conversion) and the
activation dtype; every draw must be matched, compile to eager's numbers, and with an EC attached
through ``attach_`` compile to eager + EC.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import spear_compile as spear
from spear_compile import ECConfig, ErrorCompensator
from spear_compile.errors import UnmatchedECError
from spear_compile.inspect import capture

N, K, G = 24, 64, 32


class OrderedDequant(nn.Module):
    """A foreign quantized linear whose forward applies ``steps`` to its integer codes in order:
    ``view3`` / ``view2`` (to [N, K/G, G] / [N, K]), ``convert`` (to x's dtype), ``sub_int`` (an integer
    zero), ``sub_float`` (a float zero in x's dtype), ``sub_scalar`` (8), ``mul`` / ``rmul`` (the scale
    on the right / left). Zero and scale have the shape of the form they apply to."""

    def __init__(self, steps: tuple, grouped: bool, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.steps, self.grouped = steps, grouped
        self.register_buffer("q", torch.randint(0, 16, (N, K), generator=gen, dtype=torch.uint8))
        ng = K // G if grouped else 1
        self.register_buffer("s", torch.rand(N, ng, 1, generator=gen) * 0.02 + 0.005)
        self.register_buffer("z", torch.randint(5, 11, (N, ng, 1), generator=gen).float())  # integer-valued
        self.register_buffer("bias", torch.randn(N, generator=gen))

    def forward(self, x):
        w = self.q
        for step in self.steps:
            as_form = (lambda t: t) if w.dim() == 3 else (lambda t: t.reshape(N, 1))
            if step == "view3":
                w = w.view(N, K // G if self.grouped else 1, -1)
            elif step == "view2":
                w = w.reshape(N, K)
            elif step == "convert":
                w = w.to(x.dtype)
            elif step == "sub_int":
                w = w.to(torch.int32) - as_form(self.z).to(torch.int32)
            elif step == "sub_float":
                w = w - as_form(self.z).to(x.dtype)
            elif step == "sub_scalar":
                w = w - 8
            elif step in ("mul", "rmul"):
                s = as_form(self.s).to(x.dtype)
                w = w * s if step == "mul" else s * w
        return F.linear(x, w, self.bias)


@st.composite
def orders(draw):
    """A valid order: an integer zero before the conversion, a float one after it (or promoting the
    integers itself when the conversion is implicit), the mul last; with groups the reshape to 3-d
    anywhere before the first zero / scale, back to 2-d at the end."""
    grouped = draw(st.booleans())
    zero = draw(st.sampled_from(["none", "sub_int", "sub_float", "sub_scalar"]))
    implicit = draw(st.booleans()) and zero != "sub_scalar"  # int - 8 stays integer
    core = [zero] if zero == "sub_int" else []
    if not implicit:
        core.append("convert")
    if zero in ("sub_float", "sub_scalar"):
        core.append(zero)
    core.append(draw(st.sampled_from(["mul", "rmul"])))
    if grouped:
        first = next(i for i, s in enumerate(core) if s != "convert")
        core.insert(draw(st.integers(0, first)), "view3")
        core.append("view2")
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    return tuple(core), grouped, dtype


def _ec(seed=0):
    ec = ErrorCompensator(K, N, ECConfig(rank=4, gate_hidden=4))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in (ec.A, ec.B, ec.W2):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return ec


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(orders())
def test_every_documented_order_is_matched_and_exact(order):
    steps, grouped, dtype = order
    torch._dynamo.reset()
    m = nn.Sequential(OrderedDequant(steps, grouped)).to(dtype)
    x = torch.randn(3, K, dtype=dtype)
    rep = capture(m, (x,))
    assert rep.pass_counts()["match_dequant_linear"] == 1, order
    assert rep.linears[0]["group_size"] == (G if grouped else K)
    with torch.no_grad():
        eager = m(x)
        torch.testing.assert_close(torch.compile(m, backend="spear")(x), eager, rtol=0, atol=0)
        ec = _ec().to(dtype)
        spear.attach_(m, {"0": ec})
        torch._dynamo.reset()
        torch.testing.assert_close(torch.compile(m, backend="spear")(x), eager + ec(x), rtol=1e-2, atol=1e-2)


def test_reported_order_convert_reshape_sub_mul_keeps_its_ec():
    """The form that used to drop its EC: convert -> reshape -> sub -> mul (compiled differed by 52)."""
    m = nn.Sequential(OrderedDequant(("convert", "view3", "sub_float", "mul", "view2"), grouped=True))
    x = torch.randn(4, K)
    ec = _ec(1)
    with torch.no_grad():
        with torch.no_grad():
            ec.B.mul_(100)
        want = m(x) + ec(x)
        spear.attach_(m, {"0": ec})
        torch._dynamo.reset()
        torch.testing.assert_close(torch.compile(m, backend="spear")(x), want, rtol=1e-5, atol=1e-4)


class Fp32ThenCast(nn.Module):
    """Dequantized in fp32 and cast to bf16 afterwards: not the unpacked layout's numbers, so not adopted."""

    def __init__(self):
        super().__init__()
        self.register_buffer("q", torch.randint(0, 16, (N, K), dtype=torch.uint8))
        self.register_buffer("s", torch.rand(N, 1) * 0.02)

    def forward(self, x):
        return F.linear(x, ((self.q.float() - 8) * self.s).to(x.dtype))


def test_unmatched_ec_is_a_compile_error_naming_the_module():
    m = nn.Sequential(nn.Identity(), Fp32ThenCast()).to(torch.bfloat16)
    m[1].s = m[1].s.float()
    x = torch.randn(2, K, dtype=torch.bfloat16)
    spear.attach_(m, {"1": _ec().to(torch.bfloat16)})
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"would be dropped: no pass rewrote the linear of 1 \(weight 1\.q") as ei:
        torch.compile(m, backend="spear")(x)
    inner = getattr(ei.value, "inner_exception", ei.value)
    assert isinstance(inner, UnmatchedECError)
    torch._dynamo.reset()
    # a cached graph skips the passes and so the warning: compile afresh
    with pytest.warns(UserWarning, match="would be dropped"), torch._inductor.config.patch(fx_graph_cache=False):
        out = torch.compile(m, backend="spear", options={"on_unmatched_ec": "warn"})(x)
    with torch.no_grad():
        torch.testing.assert_close(out, m(x), rtol=0, atol=0)  # compiled without the EC, as the warning says


def test_on_unmatched_ec_is_validated():
    with pytest.raises(ValueError, match="CompileConfig.on_unmatched_ec='ignore': expected 'error' or 'warn'"):
        spear.CompileConfig(on_unmatched_ec="ignore")
