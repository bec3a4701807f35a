"""Phase dispatch: static M, value ranges from the ShapeEnv, runtime branch."""
import math

import pytest
import torch
import torch.nn as nn

import spear_compile as spear
from spear_compile import CompileConfig, QuantConfig
from spear_compile.passes.phase_dispatch import decide
from tests.helpers import capture


def _model():
    m = nn.Sequential(nn.Linear(64, 64))
    spear.quantize_(m, QuantConfig(), progress=False)
    return m


@pytest.mark.parametrize("lo,hi,expected", [
    (1, 1, "fused"), (8, 8, "fused"), (16, 16, "overlapped"), (2, math.inf, "dispatch"),
    (64, math.inf, "overlapped"), (2, 15, "fused"), (2, 16, "dispatch"),
])
def test_decide(lo, hi, expected):
    assert decide(lo, hi, 16)[0] == expected


def test_decode_graph_is_fused():
    rep = capture(_model(), (torch.randn(1, 1, 64),))
    (rec,) = rep.linears
    assert rec["lowering"] == "fused" and rec["M"] == "1" and "decode" in rec["reason"]


def test_static_large_m_is_overlapped_and_crossover_is_configurable():
    rep = capture(_model(), (torch.randn(4, 8, 64),))
    assert rep.linears[0]["lowering"] == "overlapped"
    rep = capture(_model(), (torch.randn(4, 8, 64),), config=CompileConfig(crossover_m=64))
    assert rep.linears[0]["lowering"] == "fused" and "crossover 64" in rep.linears[0]["reason"]


def test_dynamic_m_straddling_crossover_is_a_runtime_branch():
    rep = capture(_model(), (torch.randn(5, 64),), dynamic=True, config=CompileConfig(default_crossover_m=16))
    rec = rep.linears[0]
    assert rec["lowering"] == "dispatch" and rec["M_range"][0] == 2 and rec["M_range"][1] is None
    # the default crossover (2: the fused EC at M = 1 only) puts a dynamic M >= 2 wholly on the overlapped EC
    rec = capture(_model(), (torch.randn(5, 64),), dynamic=True).linears[0]
    assert rec["lowering"] == "overlapped" and "crossover 2" in rec["reason"]


def test_value_range_above_crossover_is_overlapped():
    x = torch.randn(128, 64)
    torch._dynamo.mark_dynamic(x, 0, min=64, max=4096)
    rep = capture(_model(), (x,))
    rec = rep.linears[0]
    assert rec["lowering"] == "overlapped" and rec["M_range"] == [64, 4096]


def test_runtime_branch_gives_the_same_numbers_for_every_m():
    m = _model()
    with torch.no_grad():
        cm = torch.compile(m, backend="spear", dynamic=True)
        for M in (1, 3, 17, 200):
            x = torch.randn(M, 64)
            torch.testing.assert_close(cm(x), m(x), rtol=0, atol=0)
