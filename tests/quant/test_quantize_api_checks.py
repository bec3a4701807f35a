"""quantize_: every target is checked before any is replaced; no-ops and re-quantization warn."""
import pytest
import torch
from torch import nn

import spear_compile as spear
from spear_compile.models import tiny_llama
from spear_compile.quant.format import QuantFormatError


def test_a_bad_target_leaves_the_whole_model_unquantized():
    m = tiny_llama(intermediate=96)  # down_proj's K = 96 does not split into groups of 64
    with pytest.raises(QuantFormatError, match=r"model\.layers\.0\.mlp\.down_proj: in_features K=96 is not divisible"):
        spear.quantize_(m, spear.QuantConfig(group_size=64), progress=False)
    assert not spear.quantized_linears(m)  # nothing replaced, not even the layers before it
    seq = nn.Sequential(nn.Linear(64, 15), nn.Linear(15, 8))
    with pytest.raises(QuantFormatError, match="1: in_features K=15 must be even"):
        spear.quantize_(seq, spear.QuantConfig(), progress=False)
    assert isinstance(seq[0], nn.Linear)
    bad = nn.Sequential(nn.Linear(64, 8), nn.Linear(8, 8))
    with torch.no_grad():
        bad[1].weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="1: the weight holds NaN or inf"):
        spear.quantize_(bad, spear.QuantConfig(), progress=False)
    assert isinstance(bad[0], nn.Linear)
    nan_bias = nn.Sequential(nn.Linear(64, 8), nn.Linear(8, 8))
    with torch.no_grad():
        nan_bias[1].bias[3] = float("nan")
    with pytest.raises(ValueError, match="1: the bias holds NaN or inf"):  # was accepted: NaN outputs
        spear.quantize_(nan_bias, spear.QuantConfig(), progress=False)
    assert isinstance(nan_bias[0], nn.Linear)
    with pytest.raises(QuantFormatError, match="0: dtype torch.float64 is not supported"):
        spear.quantize_(nn.Sequential(nn.Linear(64, 8).double()), spear.QuantConfig(), progress=False)


def test_nothing_selected_and_requantizing_warn():
    with pytest.warns(UserWarning, match="bare nn.Linear"):
        spear.quantize_(nn.Linear(64, 8), spear.QuantConfig(), progress=False)
    m = spear.quantize_(nn.Sequential(nn.Linear(64, 8)), spear.QuantConfig(), progress=False)
    with pytest.warns(UserWarning, match="already holds 1 QuantLinear"):
        spear.quantize_(m, spear.QuantConfig(group_size=32, symmetric=True), progress=False)
    assert m[0].group_size == 64  # kept its own (per-channel) quantization
    x = torch.randn(2, 64)
    assert m(x).shape == (2, 8)
