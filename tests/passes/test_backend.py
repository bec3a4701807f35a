"""The backend: entry point, options, cache key, and graphs without quantized linears."""
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

import spear_compile as spear
from spear_compile import CompileConfig
from spear_compile.passes.context import PassContext, fqn_from_source
from spear_compile.passes.manager import SpearPassManager
from tests.helpers import LlamaLike, capture


def _entry_point_installed() -> bool:
    from importlib.metadata import entry_points

    return any(ep.name == "spear" for ep in entry_points(group="torch_dynamo_backends"))


@pytest.mark.skipif(not _entry_point_installed(), reason="package not installed (e.g. run from a source tree on "
                    "PYTHONPATH): no entry-point metadata to resolve; setup.sh / CI install it")
def test_backend_name_resolves_in_a_process_that_never_imported_spear_compile():
    code = textwrap.dedent("""
        import sys, torch
        m = torch.nn.Linear(8, 8)
        with torch.no_grad():
            out = torch.compile(m, backend="spear")(torch.randn(2, 8))
        assert out.shape == (2, 8)
        assert "spear_compile" in sys.modules  # loaded by Dynamo through the entry point
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().endswith("ok")


def test_model_without_quantized_linears_compiles_exactly_as_inductor():
    m = LlamaLike(layers=2)
    x = torch.randn(2, 7, 64)
    rep = capture(m, (x,))
    assert rep.summary()["matched_linears"] == 0
    for g in rep.graphs:
        for snap in g.snapshots:
            assert snap.before == snap.after  # no pass touched the graph
    with torch.no_grad():
        ours = torch.compile(m, backend="spear")(x)
        torch._dynamo.reset()
        theirs = torch.compile(m, backend="inductor")(x)
    assert torch.equal(ours, theirs)


def test_options_are_validated_and_applied():
    m = nn.Sequential(nn.Linear(64, 64))
    spear.quantize_(m, spear.QuantConfig(), progress=False)
    x = torch.randn(8, 64)
    with pytest.raises(Exception, match=r"unknown options \['crossover'\]"):
        with torch.no_grad():
            torch.compile(m, backend="spear", options={"crossover": 4})(x)
    torch._dynamo.reset()
    with pytest.raises(ValueError, match="crossover_m=1"):
        CompileConfig(crossover_m=1)
    with pytest.raises(Exception, match=r"CompileConfig.crossover_m='32': expected an integer or None"):
        with torch.no_grad():
            torch.compile(m, backend="spear", options={"crossover_m": "32"})(x)
    torch._dynamo.reset()
    with pytest.warns(UserWarning, match="ignores torch.compile mode='max-autotune'"):
        with torch.no_grad():
            torch.compile(m, backend="spear", mode="max-autotune")(x)
    torch._dynamo.reset()


def test_uuid_changes_with_config_and_is_stable():
    a = SpearPassManager(PassContext(CompileConfig()))
    b = SpearPassManager(PassContext(CompileConfig()))
    c = SpearPassManager(PassContext(CompileConfig(crossover_m=32)))
    assert a.uuid() == b.uuid() != c.uuid()


def test_uuid_covers_what_the_decode_passes_ask_on_a_gpu(monkeypatch):
    """fuse_glu / fuse_rmsnorm decide from the tuned table and SPEAR_NO_TMA_GEMV: a change to either
    must not reuse a cached graph compiled under the other answer."""
    from tests.helpers import use_tuned_table

    use_tuned_table(monkeypatch, {})
    base = SpearPassManager(PassContext(CompileConfig())).uuid()
    use_tuned_table(monkeypatch, {"gemv1tma|22016|4096|128": [2, 2, 2, 2, 2]})
    with_table = SpearPassManager(PassContext(CompileConfig())).uuid()
    monkeypatch.setenv("SPEAR_NO_TMA_GEMV", "1")
    assert len({base, with_table, SpearPassManager(PassContext(CompileConfig())).uuid()}) == 3


def test_fqn_from_dynamo_source():
    src = "L['self']._modules['model']._modules['layers']._modules['0']._modules['q_proj']._buffers['qweight']"
    assert fqn_from_source(src) == "model.layers.0.q_proj.qweight"
    assert fqn_from_source("L['x']") == "L['x']"
    # torch 2.13 passes the compiled module as the first positional argument
    assert fqn_from_source("L['args'][0]._modules['model']._modules['layers']._modules['0']._buffers['q']") == \
        "model.layers.0.q"


def test_compiling_under_grad_mode_works_for_inference():
    m = LlamaLike()
    spear.quantize_(m, spear.QuantConfig(), progress=False)
    x = torch.randn(1, 4, 64)
    out = torch.compile(m, backend="spear")(x)  # parameters require grad: AOT builds a joint graph
    torch.testing.assert_close(out, m(x), rtol=1e-5, atol=1e-5)
