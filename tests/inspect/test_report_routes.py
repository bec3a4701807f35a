"""The inspection report names the kernel each linear's op really launches (GPU only): the report's
``kernel`` of every linear (the route ``phase_dispatch`` / the fusion passes asked for from the graph's
fake values) is the route the CUDA op implementation took at run time (``dispatch.cuda.trace_routes``)."""
import pytest
import torch

import spear_compile as spear
from spear_compile.dispatch.cuda import trace_routes
from spear_compile.inspect import capture
from tests.helpers import quantized_llama, random_ec

SHAPES = {"tiny": (64, 2, 128, None), "llama2_7b_layer": (4096, 32, 11008, 128)}  # d, heads, ff, group size


def _model(shape: str, with_ecs: bool):
    d, heads, ff, G = SHAPES[shape]
    m = quantized_llama(d=d, layers=1, heads=heads, ff=ff, group_size=G)
    if with_ecs:
        outs = {"q_proj": d, "k_proj": d, "v_proj": d, "gate_proj": ff, "up_proj": ff, "o_proj": d}
        spear.attach_(m, {f"layers.0.{n}": random_ec(d if n != "o_proj" else d, o, 16 + 8 * i, i)
                          for i, (n, o) in enumerate(outs.items())})
    return m.to("cuda", torch.bfloat16), d


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA op implementations run on a GPU")
@pytest.mark.parametrize("M", [1, 64])
@pytest.mark.parametrize("with_ecs", [False, True])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_report_names_the_kernel_each_op_launched(shape, with_ecs, M):
    m, d = _model(shape, with_ecs)
    x = torch.randn(1, M, d, device="cuda", dtype=torch.bfloat16)
    with trace_routes() as taken:
        rep = capture(m, (x,))
    named = {r["kernel"] for r in rep.linears}
    launched = {rt.describe() for rt in taken}
    assert rep.linears and named == launched, (sorted(named), sorted(launched))
    assert "reference" not in named
