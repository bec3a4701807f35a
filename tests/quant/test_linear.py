"""QuantLinear, quantize_ and the registered ops (eager, fake and autograd)."""
import pytest
import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import spear_compile as spear
from spear_compile import QuantConfig, QuantFormatError, QuantLinear
from spear_compile.ops.ec_ref import ec_linear_ref
from spear_compile.ops.w4a16_ref import w4a16_linear_ref


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("group_size", [None, 32])
@pytest.mark.parametrize("shape", [(1, 64), (5, 3, 64), (17, 64)])
def test_quantlinear_matches_dequantized_linear(dtype, tol, group_size, shape):
    lin = nn.Linear(64, 123).to(dtype)
    q = QuantLinear.from_linear(lin, QuantConfig(group_size=group_size), name="lin")
    x = torch.randn(*shape).to(dtype)
    expected = torch.nn.functional.linear(x.float(), q.dequantize(torch.float32), lin.bias.float())
    out = q(x)
    assert out.dtype == dtype and out.shape == (*shape[:-1], 123)
    torch.testing.assert_close(out.float(), expected, atol=tol * 4, rtol=tol)


def test_quantize_skips_lm_head_and_counts():
    from tests.helpers import LlamaLike

    m = LlamaLike(layers=2)
    spear.quantize_(m, QuantConfig(), progress=False)
    names = list(spear.quantized_linears(m))
    assert len(names) == 14 and "lm_head" not in names
    assert isinstance(m.lm_head, nn.Linear)
    assert m.layers[0].q_proj.name == "layers.0.q_proj"


def test_quantize_bad_group_names_module():
    m = nn.Sequential(nn.Linear(96, 8))
    with pytest.raises(QuantFormatError, match=r"^0: in_features K=96 is not divisible by group_size=64"):
        spear.quantize_(m, QuantConfig(group_size=64), progress=False)


def test_forward_bad_input_names_module():
    q = QuantLinear.from_linear(nn.Linear(64, 8), QuantConfig(), name="blk.up")
    with pytest.raises(QuantFormatError, match=r"blk.up: input has shape \(2, 32\), expected \[..., in_features=64\]"):
        q(torch.randn(2, 32))
    with pytest.raises(QuantFormatError, match=r"blk.up: input has shape \(\), expected \[..., in_features=64\]"):
        q(torch.tensor(1.0))  # 0-d: was an IndexError from torch
    with pytest.raises(QuantFormatError, match="blk.up: input dtype torch.float64 is not supported"):
        q(torch.randn(2, 64, dtype=torch.float64))
    with pytest.raises(QuantFormatError, match="blk.up: dtype torch.int8 is not supported"):
        QuantLinear(64, 8, dtype=torch.int8, name="blk.up")


def test_op_rejects_unknown_layout_and_bad_bias():
    q = QuantLinear.from_linear(nn.Linear(64, 8), QuantConfig())
    x = torch.randn(2, 64)
    with pytest.raises(QuantFormatError, match="unknown layout 'int3'"):
        torch.ops.spear.w4a16_linear(x, q.qweight, q.scales, q.zeros, 64, None, "int3")
    with pytest.raises(QuantFormatError, match=r"bias has shape \(7,\), expected \(8,\)"):
        torch.ops.spear.w4a16_linear(x, q.qweight, q.scales, q.zeros, 64, torch.zeros(7))
    for bad in (0, -3):
        with pytest.raises(QuantFormatError, match=f"crossover={bad} must be an int >= 1"):
            torch.ops.spear.w4a16_linear(x, q.qweight, q.scales, q.zeros, 64, None, "spear", "dispatch", bad)


def test_op_names_mismatched_inputs():
    """K of x against the packed weight, the bias dtype, 0-d x, the unpacked layout's group and
    scales, tensors on another device: each a QuantFormatError naming the problem."""
    from spear_compile.quant.format import unpack_int4

    q = QuantLinear.from_linear(nn.Linear(64, 32), QuantConfig(group_size=32))
    op, args = torch.ops.spear.w4a16_linear, (q.qweight, q.scales, q.zeros, 32)
    with pytest.raises(QuantFormatError, match=r"x has last dim 96 but qweight \(32, 32\) packs in_features 64"):
        op(torch.randn(3, 96), *args, None)
    with pytest.raises(QuantFormatError, match="bias dtype torch.float16 differs from the activation dtype torch.float32"):
        op(torch.randn(3, 64), *args, torch.zeros(32, dtype=torch.float16))
    with pytest.raises(QuantFormatError, match="0-d tensor"):
        op(torch.tensor(1.0), *args, None)
    with pytest.raises(QuantFormatError, match="scales is on meta but x is on cpu"):
        op(torch.randn(3, 64), q.qweight, q.scales.to("meta"), q.zeros, 32, None)
    u = unpack_int4(q.qweight)
    with pytest.raises(QuantFormatError, match="K=64 is not divisible by group_size=7"):
        op(torch.randn(3, 64), u, q.scales, q.zeros, 7, None, "unpacked")
    with pytest.raises(QuantFormatError, match=r"scales has shape \(32, 1\), expected \[N, K/G\] = \[32, 2\]"):
        op(torch.randn(3, 64), u, q.scales[:, :1], q.zeros, 32, None, "unpacked")


def test_an_fp32_layer_with_bias_runs_bf16_inputs_like_one_without():
    """The weight is dequantized to x's dtype; the bias follows it (autocast, mixed models)."""
    lin = nn.Linear(64, 32)
    q = QuantLinear.from_linear(lin, QuantConfig())
    x = torch.randn(3, 64).bfloat16()
    y = q(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), q(x.float()), rtol=3e-2, atol=3e-2)


def test_attach_checks_the_ec_device_and_the_mapping():
    from spear_compile import ECConfig
    from spear_compile.compensators.init import random_ecs

    m = spear.quantize_(nn.Sequential(nn.Linear(64, 32)), QuantConfig(), progress=False)
    ec = random_ecs(m, ECConfig(rank=4))["0"]
    with pytest.raises(QuantFormatError, match="attach_ 0: the EC is on meta, the layer on cpu"):
        spear.attach_(m, {"0": ec.to("meta")})
    with pytest.raises(TypeError, match="ecs must map module names to ErrorCompensators, got list"):
        spear.attach_(m, [ec])
    assert m[0].ec is None


def test_fake_impl_handles_symbolic_rows():
    q = QuantLinear.from_linear(nn.Linear(64, 24), QuantConfig(group_size=32))
    mode = FakeTensorMode(shape_env=ShapeEnv())
    with mode:
        x = mode.from_tensor(torch.randn(5, 3, 64), symbolic_context=None)
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext

    ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.DYNAMIC, DimDynamic.STATIC])
    x = mode.from_tensor(torch.randn(5, 3, 64), source=ConstantSource("x"), symbolic_context=ctx)
    with mode:
        out = torch.ops.spear.w4a16_linear(x, *(mode.from_tensor(t) for t in (q.qweight, q.scales, q.zeros)), 32, None)
    assert out.shape[-1] == 24 and not isinstance(out.shape[0], int)


def test_autograd_matches_reference_autograd():
    torch.manual_seed(0)
    q = QuantLinear.from_linear(nn.Linear(64, 40), QuantConfig(group_size=32))
    ec = spear.ErrorCompensator(64, 40, spear.ECConfig(rank=4, gate_hidden=3))
    with torch.no_grad():
        ec.W2.normal_()
        ec.A.normal_()
        ec.B.normal_()
    params = [ec.A, ec.B, ec.W1, ec.b1, ec.W2, ec.b2, ec.alpha]
    x = torch.randn(3, 64, requires_grad=True)
    out = torch.ops.spear.ec_linear(x, q.qweight, q.scales, q.zeros, 32, q.bias, *params, "silu")
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, [x, *params], g)
    x2 = x.detach().clone().requires_grad_(True)
    p2 = [p.detach().clone().requires_grad_(True) for p in params]
    ref = ec_linear_ref(x2, q.qweight, q.scales, q.zeros, 32, q.bias, *p2, "silu")
    torch.testing.assert_close(out, ref)
    ref_grads = torch.autograd.grad(ref, [x2, *p2], g)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b)
    # the plain W4 op is differentiable in x (calibration back-propagates through quantized layers)
    y = torch.ops.spear.w4a16_linear(x, q.qweight, q.scales, q.zeros, 32, q.bias)
    (gx,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(gx, q.dequantize().sum(0).expand_as(gx))
    torch.testing.assert_close(y, w4a16_linear_ref(x, q.qweight, q.scales, q.zeros, 32, q.bias))


@pytest.mark.parametrize("K,group_size,msg", [
    (96, 48, r"blk.up: group_size=48 is not supported; expected None \(per-channel\), one of \(32, 64, 128, 256\)"),
    (64, -32, r"blk.up: group_size=-32 is not supported"),
    (64, 2.5, r"blk.up: group_size=2.5 must be an integer or None"),
    (96, 64, r"blk.up: in_features K=96 is not divisible by group_size=64"),
    (0, None, r"blk.up: in_features=0 must be a positive even integer"),
])
def test_quantlinear_shares_quantconfig_group_rule(K, group_size, msg):
    """QuantLinear refuses what QuantConfig refuses (it was routed to a kernel that failed deep inside)."""
    with pytest.raises(QuantFormatError, match=msg):
        QuantLinear(K, 8, group_size=group_size, name="blk.up")
    if group_size == 48:
        with pytest.raises(ValueError, match="QuantConfig: group_size=48 is not supported"):
            QuantConfig(group_size=48)


def test_quantlinear_per_channel_spellings():
    for g in (None, 0, 96):
        assert QuantLinear(96, 8, group_size=g).group_size == 96
    with pytest.raises(QuantFormatError, match="out_features=0 must be a positive integer"):
        QuantLinear(64, 0)
