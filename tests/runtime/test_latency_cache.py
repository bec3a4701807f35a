"""The latency cache: a file is used only for its own GPU, model, compile config and library version."""
import json

import pytest

import spear_compile
from spear_compile.runtime import latency_cache as lc
from spear_compile.runtime.latency import AttentionCost, LatencyModel, LatencyTable, LinearTable


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPEAR_CACHE_DIR", str(tmp_path))
    return tmp_path


def model(scale=1.0):
    t = LatencyTable((1, 8), (0.1 * scale, 0.3 * scale))
    return LatencyModel((LinearTable("q_proj", 2, t),), t, AttentionCost(0.01), 2)


KEY = lc.CacheKey("NVIDIA_H200", "llama-2-7b-shaped", "abcd1234", "0.1.0")


def test_library_version_is_the_packages():
    assert lc.library_version() == spear_compile.__version__


def test_save_then_load_in_the_user_cache_dir(_cache_dir):
    path = lc.save(model(), KEY, meta={"torch": "x"})
    assert path.startswith(str(_cache_dir)) and "latency" in path
    got, reason = lc.load(KEY)
    assert got == model() and reason.startswith("loaded")
    assert lc.read(path)[2] == {"torch": "x"}


@pytest.mark.parametrize("field, other", [("gpu", "NVIDIA_A100"), ("model_id", "llama-3-8b"),
                                          ("config_hash", "ffff0000"), ("version", "0.0.9")])
def test_a_file_of_another_gpu_model_config_or_version_is_not_used(field, other):
    theirs = lc.CacheKey(**{**KEY.__dict__, field: other})
    path = lc.save(model(), theirs, path=lc.cache_path(KEY))  # at our path, but keyed for something else
    got, reason = lc.load(KEY)
    assert got is None
    assert field in reason and repr(other) in reason and path in reason


def test_load_or_measure_measures_when_absent_or_stale_and_says_why():
    logs, calls = [], []

    def measure():
        calls.append(1)
        return model(2.0)

    got = lc.load_or_measure(KEY, measure, log=logs.append)
    assert got == model(2.0) and len(calls) == 1 and "no latency model cached" in logs[0] and "measuring" in logs[0]
    assert lc.load_or_measure(KEY, measure, log=logs.append) == model(2.0) and len(calls) == 1  # cached now
    newer = lc.CacheKey(**{**KEY.__dict__, "version": "0.2.0"})
    lc.load_or_measure(newer, measure, path=lc.cache_path(KEY), log=logs.append)
    assert len(calls) == 2 and any("version differs" in m for m in logs)


def test_a_bad_file_is_not_used_and_named():
    path = lc.cache_path(KEY)
    import os
    os.makedirs(os.path.dirname(path))
    with open(path, "w") as f:
        f.write("{not json")
    got, reason = lc.load(KEY)
    assert got is None and "not JSON" in reason and path in reason
    with open(path, "w") as f:
        json.dump({"kind": lc.KIND, "schema_version": 99}, f)
    assert "schema_version=99" in lc.load(KEY)[1]
    obj = json.loads(lc.dumps(model(), KEY))
    obj["model"]["linears"][0]["ms"] = [0.3, 0.1]
    with open(path, "w") as f:
        json.dump(obj, f)
    got, reason = lc.load(KEY)
    assert got is None and "non-decreasing" in reason


def test_key_validates():
    with pytest.raises(ValueError, match="model_id"):
        lc.CacheKey("cpu", "", "h", "v")
