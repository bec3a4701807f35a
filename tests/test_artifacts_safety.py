"""save is crash-safe and strict about its target; load refuses every damaged artifact and every
model that is not the recorded architecture; ECs of foreign modules survive the round trip."""
import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import spear_compile as spear
from spear_compile import ArtifactError, ECConfig, ErrorCompensator
from spear_compile import artifacts
from spear_compile.compensators.init import random_ecs
from spear_compile.models import load as load_builtin

STEPS = ("mkdir", "write_tensors", "write_config", "park_old", "move_new_in", "remove_old")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _model(seed):
    m, _ = load_builtin("tiny-llama")
    spear.quantize_(m, spear.QuantConfig(group_size=32), progress=False)
    spear.attach_(m, dict(list(sorted(random_ecs(m, ECConfig(rank=4, gate_hidden=4), seed=seed).items()))[:3]))
    return m


def _logits(m):
    with torch.no_grad():
        return m(torch.arange(12).reshape(2, 6)).logits


@pytest.fixture(scope="module")
def two_models():
    return _model(1), _model(2)


@pytest.mark.parametrize("step", STEPS)
def test_a_fault_at_any_step_leaves_one_complete_artifact(two_models, tmp_path, monkeypatch, step):
    old, new = two_models
    path = str(tmp_path / "art")
    spear.save(old, path)

    def fault(s):
        if s == step:
            raise OSError(f"injected fault at {s}")

    monkeypatch.setattr(artifacts, "_FAULT", fault)
    if step == "remove_old":  # the new artifact is already in place: the failed cleanup only warns
        with pytest.warns(UserWarning, match="could not be removed .*injected fault"):
            spear.save(new, path)
    else:
        with pytest.raises(OSError, match="injected fault"):
            spear.save(new, path)
    monkeypatch.setattr(artifacts, "_FAULT", None)
    got = _logits(spear.load(path))
    # before the new artifact is moved in, the old one is the artifact; at the last step only the cleanup failed
    assert torch.equal(got, _logits(new if step == "remove_old" else old))
    spear.save(new, path)  # and the next save tidies up whatever was left
    assert torch.equal(_logits(spear.load(path)), _logits(new))
    assert sorted(os.listdir(tmp_path)) == ["art"]


_CHILD = textwrap.dedent("""
    import os, sys, torch
    sys.path.insert(0, {root!r})
    import spear_compile as spear
    from spear_compile import artifacts
    from tests.test_artifacts_safety import _model
    path, step, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    model = _model(seed)
    if step != "random":
        artifacts._FAULT = lambda s: os.kill(os.getpid(), 9) if s == step else None
    print("ready", flush=True)
    while True:
        spear.save(model, path)
""")


@pytest.mark.parametrize("step", STEPS + ("random", "random"))
def test_sigkill_mid_save_leaves_old_or_new(two_models, tmp_path, step):
    """A child saving over an existing artifact is killed with SIGKILL at each file-system step (and
    twice at a random moment); what is on disk then loads as the old or the new model."""
    old, new = two_models
    path = str(tmp_path / "art")
    spear.save(old, path)
    script = tmp_path / "child.py"
    script.write_text(_CHILD.format(root=ROOT))
    child = subprocess.Popen([sys.executable, str(script), path, step, "2"], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    if step == "random":
        import random
        import time

        time.sleep(random.Random(os.getpid()).uniform(0.0, 0.4))
        child.send_signal(signal.SIGKILL)
    child.wait(timeout=120)
    assert child.returncode == -signal.SIGKILL
    with pytest.warns(UserWarning, match="interrupted") if step == "move_new_in" else _no_warning():
        got = _logits(spear.load(path))
    assert torch.equal(got, _logits(old)) or torch.equal(got, _logits(new))


class _no_warning:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def test_save_refuses_a_directory_with_only_a_users_config(two_models, tmp_path):
    d = tmp_path / "mine"
    d.mkdir()
    (d / "spear_config.json").write_text('{"my": "settings"}')
    with pytest.raises(ArtifactError, match="not a complete spear artifact"):
        spear.save(two_models[0], str(d))
    assert (d / "spear_config.json").read_text() == '{"my": "settings"}'  # was deleted before


@pytest.fixture(scope="module")
def saved(two_models, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("saved") / "art")
    spear.save(two_models[0], path)
    return path


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(which=st.sampled_from(["spear_config.json", "model.safetensors"]), cut=st.floats(0.0, 0.999),
       flips=st.lists(st.tuples(st.floats(0.0, 0.999), st.integers(1, 255)), max_size=3), truncate=st.booleans())
def test_any_truncation_or_byte_flip_raises_artifact_error(saved, which, cut, flips, truncate):
    if not truncate and not flips:
        return
    with tempfile.TemporaryDirectory() as d:
        art = os.path.join(d, "art")
        shutil.copytree(saved, art)
        f = os.path.join(art, which)
        original = open(f, "rb").read()
        data = bytearray(original)
        for pos, x in flips:
            data[int(pos * len(data))] ^= x
        if truncate:
            data = data[:int(cut * len(data))]
        if bytes(data) == original:  # flips that cancel out (the same byte twice) leave a valid artifact
            return
        open(f, "wb").write(bytes(data))
        with pytest.raises(ArtifactError):
            spear.load(art)


def test_load_names_the_first_architecture_mismatch(two_models, tmp_path):
    from transformers import LlamaForCausalLM

    model = two_models[0]
    path = spear.save(model, str(tmp_path / "art"))
    other_heads = copy.deepcopy(load_builtin("tiny-llama")[0])
    other_heads.config.num_attention_heads *= 2  # same tensor shapes, a different model
    with pytest.raises(ArtifactError, match=r"config.num_attention_heads is 8, the artifact's is 4"):
        spear.load(path, model=other_heads)

    class OtherLlama(LlamaForCausalLM):
        pass

    fresh = load_builtin("tiny-llama")[0]
    other_cls = OtherLlama(fresh.config)
    with pytest.raises(ArtifactError, match=r"it is a .*OtherLlama, the artifact holds a .*LlamaForCausalLM"):
        spear.load(path, model=other_cls)
    wider = load_builtin("tiny-llama", intermediate=192)[0]
    with pytest.raises(ArtifactError, match=r"model.layers.0.mlp.gate_proj is 192x64 \(out x in\), the artifact's is"):
        spear.load(path, model=wider)
    assert torch.equal(_logits(spear.load(path, model=fresh)), _logits(model))  # the same architecture loads


class ForeignQLinear(nn.Module):
    def __init__(self, N=32, K=64):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.register_buffer("q", torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8))
        self.register_buffer("s", torch.rand(N, 1, generator=g) * 0.02)

    def forward(self, x):
        return F.linear(x, (self.q.to(x.dtype) - 8) * self.s)


def test_ec_registered_on_a_foreign_module_survives_save_and_load(tmp_path):
    m = nn.Sequential(ForeignQLinear(), nn.ReLU(), ForeignQLinear(N=16, K=32))
    ec = ErrorCompensator(64, 32, ECConfig(rank=4, gate_hidden=4))
    with torch.no_grad():
        for p in (ec.A, ec.B, ec.W2):
            p.normal_(0, 0.3)
    spear.attach_(m, {"0": ec})
    x = torch.randn(3, 64)
    torch._dynamo.reset()
    with torch.no_grad():
        want = torch.compile(m, backend="spear")(x)
    path = spear.save(m, str(tmp_path / "art"))
    assert list(json.load(open(os.path.join(path, "spear_config.json")))["foreign_ecs"]) == ["0"]
    skeleton = nn.Sequential(ForeignQLinear(), nn.ReLU(), ForeignQLinear(N=16, K=32))
    loaded = spear.load(path, model=skeleton)
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(loaded, backend="spear")(x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # was saved without its EC: lost on reload
