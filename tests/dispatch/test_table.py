"""The typed tuned table: keys and values per kind, validated on load, schema version, user cache."""
import json
import os

import pytest
import torch

from spear_compile.dispatch import table as TT


def test_table_roundtrip_and_measured_crossover(tmp_path, monkeypatch):
    monkeypatch.setenv("SPEAR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(TT, "gpu_key", lambda device=None: "Fake_GPU")
    path = TT.save("crossover", {"4096x4096": 2, "11008x4096": 4})
    assert path == os.path.join(str(tmp_path), "tuned", "crossover_Fake_GPU.json")  # the user cache, not the package
    got = TT.load("crossover")
    assert {str(k): got[k] for k in got} == {"4096x4096": 2, "11008x4096": 4}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert TT.crossover(11008, 4096) == 4
    assert TT.crossover(123, 456) is None


def test_the_user_table_replaces_the_shipped_one(tmp_path, monkeypatch):
    monkeypatch.setenv("SPEAR_CACHE_DIR", str(tmp_path))
    shipped = TT.load("configs", gpu="NVIDIA_H200")
    assert shipped is not None and shipped.source == TT.shipped_path("configs", "NVIDIA_H200")
    mine = TT.TunedTable("configs", {TT.GemmKey(1, 64, 64, 64): [16, 32, 64, 4, 1]})
    TT.save("configs", mine, gpu="NVIDIA_H200")
    got = TT.load("configs", gpu="NVIDIA_H200")
    assert got.source == TT.user_path("configs", "NVIDIA_H200") and list(got) == [TT.GemmKey(1, 64, 64, 64)]


def test_typed_keys_and_values():
    k = TT.GemmKey(256, 11008, 4096, 128)
    assert k.wire() == "gemm|256|11008|4096|128" and TT.parse_key(k.wire()) == k
    t = TT.TunedTable("configs", {k: ["wgmma_ra", 64, 128, 4, 4, 2]})
    assert t.typed(k) == TT.GemmChoice("wgmma_ra", (64, 128, 4, 4, 2)) and t[k] == ["wgmma_ra", 64, 128, 4, 4, 2]
    assert t.get(TT.GemmKey(512, 11008, 4096, 128)) is None
    with pytest.raises(ValueError, match="row bucket"):
        TT.GemmKey(300, 1, 1, 1)
    with pytest.raises(ValueError, match="rank bucket"):
        TT.Gemv1SelfRankKey(1, 1, 1, 48)
    for key, bad in [(k, ["wgmma_rb", 1]), (TT.Gemv1Key(1, 32, 32, 0), [8, 512, 4, 2]),
                     (TT.EcStructKey(256, 1, 1, 1), "sideways"), (TT.Gemv1TmaEcKey(1, 1, 1), 2),
                     (TT.Gemv1SelfKey(1, 1, 1), ["pair"]), (TT.Gemv1TmaKey(1, 1, 1), [3, 2, 2, 2, 2])]:
        with pytest.raises(ValueError):
            t[key] = bad


def test_a_bad_or_stale_file_is_an_error_naming_the_entry(tmp_path):
    good = TT.TunedTable("configs", {TT.GemvKey(64, 64, 64, 0): [16, 128, 4, 1]}).to_json("X")
    bad = dict(good, entries=good["entries"] + [{"kind": "gemm", "M": 3, "N": 1, "K": 1, "G": 1, "value": [1]}])
    p = tmp_path / "configs_X.json"
    p.write_text(json.dumps(bad))
    with pytest.raises(TT.TableError, match=r"configs_X.json: entry 1 .*'M': 3.*row bucket"):
        TT.read(str(p))
    p.write_text(json.dumps({"gemv|64|64|64|0": [16, 128, 4, 1]}))  # the flat format of an older release
    with pytest.raises(TT.TableError, match="without a schema version"):
        TT.read(str(p))
    p.write_text(json.dumps(dict(good, schema_version=TT.SCHEMA_VERSION + 1)))
    with pytest.raises(TT.TableError, match="schema version"):
        TT.read(str(p))
    converted = TT.convert_legacy({"gemv|64|64|64|0": [16, 128, 4, 1]})
    assert converted.to_json("X") == good


def test_shipped_tables_load_and_keep_the_measured_values():
    """Every shipped table validates; the converted configs table holds the entries of every kind."""
    configs = TT.read(TT.shipped_path("configs", "NVIDIA_H200"))
    kinds = {k.KIND for k in configs}
    assert kinds == set(TT.CONFIG_KEYS)
    assert configs[TT.GemmKey(1024, 11008, 4096, 128)] == ["dequant_cublas"]
    assert configs[TT.Gemv1SelfRankKey(11008, 4096, 128, 16)] == ["pair"]
    assert TT.read(TT.shipped_path("crossover", "NVIDIA_H200"))[TT.CrossoverKey(11008, 4096)] == 2
    data = TT.SHIPPED_DIR
    assert sorted(f for f in os.listdir(data) if f.endswith(".json")) == ["configs_NVIDIA_H100_80GB_HBM3.json",
                                                                         "configs_NVIDIA_H200.json",
                                                                         "crossover_NVIDIA_H200.json"]
    h100 = TT.read(TT.shipped_path("configs", "NVIDIA_H100_80GB_HBM3"))  # the small-M GEMMs measured on an H100
    assert {k.KIND for k in h100} == {"gemm"} and {k.M for k in h100} == {2, 4, 8, 16, 32, 64, 128, 256}
    # without the M = 256 rows, M = 129..256 took the dequantize + cuBLAS default: 2.2-4.9x slower in the
    # served model's EC linears (2026-12-06 H100 records, serving/2026-12-06_h100_online_correction)
    assert h100[TT.GemmKey(256, 11008, 4096, 128)] == ["wgmma_ra", 64, 128, 4, 4, 2]
    assert h100[TT.GemmKey(2, 4096, 4096, 128)] == ["wgmma_ra", 64, 16, 6, 4, 2, 8]  # a K split of 8
