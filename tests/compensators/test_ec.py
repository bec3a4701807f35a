"""ErrorCompensator: init, pass-through gate, attach_ and its errors."""
import pytest
import torch
import torch.nn as nn

import spear_compile as spear
from spear_compile import ECConfig, ErrorCompensator, QuantConfig, QuantFormatError, QuantLinear
from spear_compile.compensators.init import svd_ecs
from tests.helpers import DequantLinear, LlamaLike


def _layer(N=48, K=64, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(K, N)
    return lin, QuantLinear.from_linear(lin, QuantConfig(), name="lin")


def test_pass_through_gate_equals_static_svd_compensation():
    lin, q = _layer()
    ec = ErrorCompensator.from_weight_error(lin.weight, q.dequantize(), ECConfig(rank=8))
    x = torch.randn(7, 64)
    torch.testing.assert_close(ec(x), ec.static_forward(x), rtol=1e-5, atol=1e-6)
    # and that static compensator is the rank-8 truncated SVD of the weight error
    err = lin.weight.detach() - q.dequantize()
    U, S, Vh = torch.linalg.svd(err)
    torch.testing.assert_close(ec.B @ ec.A, (U[:, :8] * S[:8]) @ Vh[:8], rtol=1e-4, atol=1e-5)


def test_svd_init_reduces_output_error_and_more_rank_helps():
    lin, q = _layer()
    x = torch.randn(256, 64)
    ref = lin(x)
    base = (q(x) - ref).pow(2).mean()
    errs = []
    for r in (2, 8, 32):
        ec = ErrorCompensator.from_weight_error(lin.weight, q.dequantize(), ECConfig(rank=r))
        errs.append((q(x) + ec(x) - ref).pow(2).mean())
    assert errs[0] < base and errs[1] < errs[0] and errs[2] < errs[1]


def test_activation_scaled_init_beats_plain_on_skewed_inputs():
    lin, q = _layer(seed=1)
    scale = torch.ones(64)
    scale[:4] = 30.0  # a few salient input channels, as in LLM activations
    x = torch.randn(512, 64) * scale
    plain = ErrorCompensator.from_weight_error(lin.weight, q.dequantize(), ECConfig(rank=4))
    scaled = ErrorCompensator.from_weight_error(lin.weight, q.dequantize(), ECConfig(rank=4),
                                                act_scale=x.pow(2).mean(0).sqrt())
    ref = lin(x)
    e_plain = (q(x) + plain(x) - ref).pow(2).mean()
    e_scaled = (q(x) + scaled(x) - ref).pow(2).mean()
    assert e_scaled < 0.8 * e_plain


def test_rxx_init_is_qera_exact_and_beats_diagonal_scaling_on_correlated_inputs():
    lin, q = _layer(seed=2)
    mix = torch.randn(64, 64) * 0.3 + torch.eye(64)
    mix[:, :3] *= 20.0  # correlated inputs with a few dominant directions
    x = torch.randn(2048, 64) @ mix.t()
    rxx = x.t() @ x / x.shape[0]
    cfg = ECConfig(rank=4)
    full = ErrorCompensator.from_weight_error(lin.weight, q.dequantize(), cfg, rxx=rxx)
    diag = ErrorCompensator.from_weight_error(lin.weight, q.dequantize(), cfg, act_scale=x.pow(2).mean(0).sqrt())
    A, B = spear.compensators.static.qera_exact(lin.weight.detach() - q.dequantize(), 4, rxx)
    torch.testing.assert_close(full.B @ full.A, B @ A)
    ref = lin(x)
    e_full = (q(x) + full(x) - ref).pow(2).mean()
    e_diag = (q(x) + diag(x) - ref).pow(2).mean()
    assert e_full < 0.9 * e_diag
    with pytest.raises(ValueError, match="rxx has shape"):
        ErrorCompensator.from_weight_error(lin.weight, q.dequantize(), cfg, rxx=rxx[:10])


def test_attached_ec_changes_forward_by_its_delta():
    lin, q = _layer()
    model = nn.Sequential(q)
    ec = ErrorCompensator.from_weight_error(lin.weight, q.dequantize(), ECConfig(rank=4))
    x = torch.randn(3, 64)
    base = q(x)
    spear.attach_(model, {"0": ec})
    torch.testing.assert_close(model(x), base + ec(x))
    spear.detach_(model)
    torch.testing.assert_close(model(x), base)


def test_attach_rejects_ec_that_does_not_fit_and_changes_nothing():
    m = LlamaLike()
    spear.quantize_(m, QuantConfig(), progress=False)
    good = ErrorCompensator(64, 64, ECConfig(rank=4))
    bad = ErrorCompensator(64, 128, ECConfig(rank=4))  # up_proj shape, put on q_proj
    with pytest.raises(QuantFormatError, match=r"attach_ layers\.0\.q_proj: EC tensor B has shape \(128, 4\), "
                                               r"expected \(64, 4\) for a layer with in_features=64, out_features=64"):
        spear.attach_(m, {"layers.0.k_proj": good, "layers.0.q_proj": bad})
    assert m.layers[0].k_proj.ec is None  # validated before anything was attached
    with pytest.raises(KeyError, match="no module named 'layers.9.q_proj'"):
        spear.attach_(m, {"layers.9.q_proj": good})


def test_attach_to_foreign_module_needs_one_integer_weight():
    with pytest.raises(QuantFormatError, match="is not a QuantLinear and has 0 integer tensors"):
        spear.attach_(nn.Sequential(nn.Linear(4, 4)), {"0": ErrorCompensator(4, 4, ECConfig(rank=2))})
    m = nn.Sequential(DequantLinear(48, 64))
    spear.attach_(m, {"0": ErrorCompensator(64, 48, ECConfig(rank=2))})
    assert spear.compensators.lookup_ec(m[0].q) is not None


def test_svd_ecs_covers_every_quantized_linear():
    ref = LlamaLike()
    q = LlamaLike()
    spear.quantize_(q, QuantConfig(), progress=False)
    ecs = svd_ecs(q, ref, ECConfig(rank=4))
    assert set(ecs) == set(spear.quantized_linears(q))
    assert all(ec.rank == 4 for ec in ecs.values())


def test_ec_config_validates():
    with pytest.raises(ValueError, match="rank=0"):
        ECConfig(rank=0)
    with pytest.raises(ValueError, match="act='tanh'"):
        ECConfig(act="tanh")
    with pytest.raises(ValueError, match="rank 80 exceeds"):
        ErrorCompensator(64, 48, ECConfig(rank=80))
