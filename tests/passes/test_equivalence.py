"""Hypothesis: compiled (backend="spear") == eager on generated Llama-like models.

Each example is a real torch.compile, so the example count is small; the strategy
space still covers hidden size, depth, group size, M (including decode M == 1),
dtype and ECs on or off.
"""
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import spear_compile as spear
from spear_compile import ECConfig
from spear_compile.compensators.init import random_ecs
from tests.helpers import quantized_llama

TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


@st.composite
def configs(draw):
    d = draw(st.sampled_from([64, 96, 128]))
    return dict(
        d=d,
        layers=draw(st.integers(1, 2)),
        heads=draw(st.sampled_from([1, 2])),
        ff=draw(st.sampled_from([64, 128, 192])),
        group_size=draw(st.sampled_from([None, 32])),
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])),
        batch=draw(st.integers(1, 2)),
        seq=draw(st.sampled_from([1, 1, 3, 9])),
        ec_rank=draw(st.sampled_from([0, 4, 8])),
        seed=draw(st.integers(0, 10_000)),
    )


@settings(max_examples=16, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(configs())
def test_compiled_equals_eager(c):
    torch._dynamo.reset()
    m = quantized_llama(c["d"], c["layers"], c["heads"], c["ff"], c["group_size"], c["dtype"], c["seed"])
    if c["ec_rank"]:
        ecs = random_ecs(m, ECConfig(rank=c["ec_rank"]), seed=c["seed"])
        spear.attach_(m, {k: v.to(c["dtype"]) for k, v in ecs.items()})
    x = torch.randn(c["batch"], c["seq"], c["d"], generator=torch.Generator().manual_seed(c["seed"])).to(c["dtype"])
    with torch.no_grad():
        eager = m(x)
        compiled = torch.compile(m, backend="spear")(x)
    tol = TOL[c["dtype"]]
    torch.testing.assert_close(compiled.float(), eager.float(), rtol=tol, atol=tol)
