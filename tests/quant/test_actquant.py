"""Per-token symmetric activation fake quantization (W4A8 / W4A4 evaluation)."""
import pytest
import torch

import spear_compile as spear
from spear_compile.quant.actquant import add_act_quant_, fake_quant_activation


def _reference(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Token by token, element by element, in Python floats."""
    qmax = 2 ** (bits - 1) - 1
    rows = x.reshape(-1, x.shape[-1]).tolist()
    out = []
    for row in rows:
        s = max(max(abs(v) for v in row) / qmax, 1e-8)
        out.append([min(max(round(v / s), -qmax), qmax) * s for v in row])
    return torch.tensor(out, dtype=torch.float64).reshape(x.shape)


@pytest.mark.parametrize("bits", [8, 4, 3])
@pytest.mark.parametrize("shape", [(7, 33), (2, 5, 64), (1, 1, 6)])
def test_matches_reference_and_error_bound(bits, shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(bits)) * torch.linspace(0.1, 5.0, shape[-1])
    out = fake_quant_activation(x, bits)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out.double(), _reference(x, bits), atol=1e-5, rtol=1e-5)
    s = x.abs().amax(-1, keepdim=True) / (2 ** (bits - 1) - 1)
    assert ((out - x).abs() <= s / 2 + 1e-6).all()
    # per token: every row's largest magnitude is exact; at most 2^bits - 1 levels per row
    torch.testing.assert_close(out.abs().amax(-1), x.abs().amax(-1))
    assert max(len(r.unique()) for r in out.reshape(-1, shape[-1])) <= 2 ** bits - 1


@pytest.mark.parametrize("group_size", [8, 16])
def test_group_wise_is_per_token_on_each_group(group_size):
    x = torch.randn(5, 3, 32) * torch.linspace(0.1, 9.0, 32)
    out = fake_quant_activation(x, 4, group_size)
    groups = x.reshape(5, 3, 32 // group_size, group_size)
    torch.testing.assert_close(out.double(), _reference(groups, 4).reshape(x.shape), atol=1e-5, rtol=1e-5)
    assert (out - x).norm() < (fake_quant_activation(x, 4) - x).norm()  # finer scales, smaller error
    with pytest.raises(ValueError, match="K=32 channels are not divisible by activation group_size=12"):
        fake_quant_activation(x, 4, 12)


def test_int8_error_small_int4_larger():
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    rel = {b: ((fake_quant_activation(x, b) - x).norm() / x.norm()).item() for b in (8, 4)}
    assert rel[8] < 0.01
    assert rel[4] > 8 * rel[8]


def test_straight_through_gradient_and_identity_for_none():
    x = torch.randn(3, 16, requires_grad=True)
    (fake_quant_activation(x, 4) * torch.arange(16.0)).sum().backward()
    torch.testing.assert_close(x.grad, torch.arange(16.0).expand(3, 16))
    assert fake_quant_activation(x, None) is x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_dtypes_stay_on_grid(dtype):
    x = (torch.randn(4, 32) * 3).to(dtype)
    out = fake_quant_activation(x, 4)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), _reference(x.float(), 4).to(dtype).float())


def test_zero_token_and_bad_bits():
    x = torch.zeros(2, 8)
    assert torch.equal(fake_quant_activation(x, 4), x)
    for bad in (1, 17, 4.0, True):
        with pytest.raises(ValueError, match="activation bits"):
            fake_quant_activation(x, bad)
    with pytest.raises(ValueError, match="floating"):
        fake_quant_activation(torch.ones(2, 3, dtype=torch.int32), 8)


def test_add_act_quant_hooks_every_quantlinear_and_is_removable():
    from tests.helpers import LlamaLike

    m = LlamaLike()
    spear.quantize_(m, spear.QuantConfig(), progress=False)
    x = torch.randn(2, 5, 64)
    y16 = m(x)
    seen = {}
    hooks = add_act_quant_(m, 4, group_size=32)
    probe = m.layers[0].q_proj.register_forward_pre_hook(lambda mod, a: seen.setdefault("x", a[0]))
    y4 = m(x)
    probe.remove()
    assert len(hooks) == 7 and not torch.allclose(y4, y16)
    # hooks run in registration order: the probe saw the already-quantized input
    xin = m.layers[0].n1(x)
    torch.testing.assert_close(seen["x"], fake_quant_activation(xin, 4, 32))
    for h in hooks:
        h.remove()
    torch.testing.assert_close(m(x), y16)
    with pytest.raises(ValueError, match="bits=None would do nothing"):
        add_act_quant_(m, None)
    with pytest.raises(ValueError, match="layers.0.q_proj: K=64 channels are not divisible by activation group_size"):
        add_act_quant_(m, 4, group_size=48)
