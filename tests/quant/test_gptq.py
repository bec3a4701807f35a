"""GPTQ lowers the layer output error against RTN, and produces the same packed format."""
import pytest
import torch

from spear_compile import QuantConfig, QuantFormatError
from spear_compile.quant import quantize_rtn
from spear_compile.quant.gptq import quantize_gptq


def _layer(seed=0, N=64, K=128, n=2048):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(N, K, generator=g) * 0.05
    X = torch.randn(n, K, generator=g) @ (torch.randn(K, K, generator=g) * torch.linspace(0.1, 2.0, K))
    return W, X


def _out_err(qw, W, X):
    return ((X @ (qw.dequantize(torch.float32) - W).t()) ** 2).mean().item()


@pytest.mark.parametrize("group_size", [None, 32])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_beats_rtn_on_output_error(group_size, act_order):
    W, X = _layer()
    cfg = QuantConfig(group_size=group_size)
    H = 2 * X.t() @ X / X.shape[0]
    g = quantize_gptq(W, H, cfg, act_order=act_order, block_size=32)
    r = quantize_rtn(W, cfg)
    assert g.qweight.shape == r.qweight.shape and g.scales.shape == r.scales.shape
    assert _out_err(g, W, X) < 0.8 * _out_err(r, W, X)


def test_gptq_with_identity_hessian_equals_rtn():
    W, _ = _layer()
    cfg = QuantConfig(group_size=32)
    g = quantize_gptq(W, torch.eye(128), cfg, damp=0.0)
    r = quantize_rtn(W, cfg)
    # H = I: no error feedback between columns, so GPTQ rounds exactly like RTN
    assert torch.equal(g.qweight, r.qweight) and torch.allclose(g.scales, r.scales)


def test_gptq_bad_hessian_shape():
    with pytest.raises(QuantFormatError, match=r"Hessian has shape \(4, 4\), expected \(128, 128\)"):
        quantize_gptq(torch.randn(8, 128), torch.eye(4), QuantConfig(), where="blk.q")


def test_quantize_gptq_on_a_model_needs_calibration_and_beats_rtn_layer_by_layer():
    import copy

    import spear_compile as spear
    from spear_compile.quant.stats import collect_input_stats
    from tests.helpers import LlamaLike

    fp = LlamaLike(layers=2)
    x = [torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    with pytest.raises(ValueError, match="needs calib=.*none was given"):
        spear.quantize_(copy.deepcopy(fp), QuantConfig(method="gptq"), progress=False)
    with pytest.raises(ValueError, match="needs calib=.*it is empty"):
        spear.quantize_(copy.deepcopy(fp), QuantConfig(method="gptq"), progress=False, calib=iter([]))
    g = spear.quantize_(copy.deepcopy(fp), QuantConfig(method="gptq", group_size=32), progress=False, calib=x)
    r = spear.quantize_(copy.deepcopy(fp), QuantConfig(group_size=32), progress=False)
    stats = collect_input_stats(fp, x, names=list(spear.quantized_linears(g)), full=True,
                                module_type=torch.nn.Linear)
    fp_mods = dict(fp.named_modules())
    wins = 0
    for name, st in stats.items():
        W = fp_mods[name].weight.detach().double()
        err = {}
        for tag, model in (("gptq", g), ("rtn", r)):
            E = model.get_submodule(name).dequantize(torch.float32).double() - W
            err[tag] = torch.trace(E @ st.rxx @ E.t()).item()  # E||(Q - W) x||^2 on the calibration inputs
        wins += err["gptq"] < err["rtn"]
    assert wins == len(stats) == 14
