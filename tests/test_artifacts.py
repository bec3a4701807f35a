"""save / load: exact round trip, and every corruption case fails loudly before loading."""
import copy
import json
import os

import pytest
import torch

import spear_compile as spear
from spear_compile import ArtifactError, ECConfig
from spear_compile.compensators.init import random_ecs
from spear_compile.models import load as load_builtin


@pytest.fixture
def artifact(tmp_path):
    model, _ = load_builtin("tiny-llama")
    ref = copy.deepcopy(model)
    spear.quantize_(model, spear.QuantConfig(group_size=32), progress=False)
    ecs = random_ecs(model, ECConfig(rank=4, gate_hidden=4), seed=3)
    spear.attach_(model, {k: v for i, (k, v) in enumerate(sorted(ecs.items())) if i % 2 == 0})
    path = spear.save(model, str(tmp_path / "art"))
    return model, ref, path


def _logits(m, seed=0):
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return m(ids).logits


def test_round_trip_is_bitwise_exact(artifact):
    model, _, path = artifact
    loaded = spear.load(path)
    assert torch.equal(_logits(loaded), _logits(model))
    assert set(spear.quantized_linears(loaded)) == set(spear.quantized_linears(model))
    assert sum(m.ec is not None for m in spear.quantized_linears(loaded).values()) == 7
    # tied embedding / head stay tied after loading
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    # and the reloaded model compiles with the spear backend to the same numbers
    with torch.no_grad():
        ids = torch.randint(0, 256, (1, 5))
        torch.testing.assert_close(torch.compile(loaded, backend="spear")(ids).logits, loaded(ids).logits,
                                   rtol=1e-5, atol=1e-5)


def test_save_overwrites_atomically(artifact, tmp_path):
    model, _, path = artifact
    spear.save(model, path)
    assert sorted(os.listdir(path)) == ["model.safetensors", "spear_config.json"]
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".spear_save_")]


def test_corrupted_tensor_file(artifact):
    _, _, path = artifact
    f = os.path.join(path, "model.safetensors")
    data = bytearray(open(f, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(f, "wb").write(bytes(data))
    with pytest.raises(ArtifactError, match="checksum mismatch"):
        spear.load(path)


def test_truncated_tensor_file(artifact):
    _, _, path = artifact
    f = os.path.join(path, "model.safetensors")
    data = open(f, "rb").read()
    open(f, "wb").write(data[: len(data) // 3])
    with pytest.raises(ArtifactError, match="truncated or corrupted"):
        spear.load(path)


def test_missing_files_and_bad_json(artifact, tmp_path):
    _, _, path = artifact
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(ArtifactError, match="tensor file missing"):
        spear.load(path)
    with pytest.raises(ArtifactError, match="not a spear artifact"):
        spear.load(str(tmp_path))
    open(os.path.join(path, "spear_config.json"), "w").write("{ not json")
    with pytest.raises(ArtifactError, match="corrupted JSON"):
        spear.load(path)


def _edit_config(path, fn, resign=True):
    """Edit the artifact's JSON; ``resign`` recomputes its checksum, so the checks behind the
    checksum are what the test reaches (an unsigned edit stops at the checksum)."""
    from spear_compile.artifacts import _config_digest

    p = os.path.join(path, "spear_config.json")
    cfg = json.load(open(p))
    fn(cfg)
    if resign:
        cfg["checksums"]["config"] = _config_digest(cfg)
    json.dump(cfg, open(p, "w"))


def test_hand_edited_config_fails_its_checksum(artifact):
    """An edit that keeps every shape (the EC's activation here) would load as another model."""
    _, _, path = artifact
    _edit_config(path, lambda c: [e["config"].update(act="relu") for e in c["ecs"].values()], resign=False)
    with pytest.raises(ArtifactError, match="config checksum mismatch"):
        spear.load(path)


def test_a_config_checksum_is_required_unless_the_version_predates_it(artifact):
    model, _, path = artifact
    # deleted, then hand-edited: used to load the edited config (legacy skip)
    _edit_config(path, lambda c: (c["checksums"].pop("config"), c["ecs"].clear()), resign=False)
    with pytest.raises(ArtifactError, match=r"checksums.config is missing \(required from format_version 2"):
        spear.load(path)


def test_format_1_artifact_without_config_checksum_loads(artifact):
    model, _, path = artifact
    _edit_config(path, lambda c: (c["checksums"].pop("config"), c.update(format_version=1)), resign=False)
    assert torch.equal(_logits(spear.load(path)), _logits(model))


@pytest.mark.parametrize("edit,match", [
    (lambda c: c["quantized"]["model.layers.0.mlp.up_proj"].update(dtype="nonsense"), "cannot rebuild"),
    (lambda c: c["quantized"]["model.layers.0.mlp.up_proj"].update(dtype="float16"), "expects .* torch.float16"),
    (lambda c: c["ecs"].update({"model.norm": next(iter(c["ecs"].values()))}), "not a quantized module"),
    (lambda c: c.update(tensors=[]), "'tensors' is a list"),
    (lambda c: c["model"].update(name="nope-model"), "'nope-model' is not a built-in model"),
])
def test_signed_but_inconsistent_config_raises_artifact_error(artifact, edit, match):
    _, _, path = artifact
    _edit_config(path, edit)
    with pytest.raises(ArtifactError, match=match):
        spear.load(path)


def test_config_that_is_not_an_object(artifact):
    _, _, path = artifact
    open(os.path.join(path, "spear_config.json"), "w").write("[1, 2]")
    with pytest.raises(ArtifactError, match="expected a JSON object"):
        spear.load(path)
    open(os.path.join(path, "spear_config.json"), "wb").write(b"\xff\xfe{")
    with pytest.raises(ArtifactError, match="corrupted JSON"):
        spear.load(path)


def test_save_never_replaces_what_is_not_an_artifact(artifact, tmp_path, monkeypatch):
    model, _, _ = artifact
    keep = tmp_path / "project"
    (keep / "src").mkdir(parents=True)
    (keep / "notes.txt").write_text("keep me")
    with pytest.raises(ArtifactError, match="not a complete spear artifact .*notes.txt"):
        spear.save(model, str(keep))
    assert (keep / "notes.txt").read_text() == "keep me" and (keep / "src").is_dir()
    with pytest.raises(ArtifactError, match="not a directory"):
        spear.save(model, str(keep / "notes.txt"))
    with pytest.raises(ArtifactError, match="empty path"):
        spear.save(model, "")
    art = tmp_path / "art2"
    art.mkdir()
    spear.save(model, str(art))  # an empty directory is fine
    monkeypatch.chdir(art)
    with pytest.raises(ArtifactError, match="working directory"):
        spear.save(model, ".")
    assert sorted(os.listdir(art)) == ["model.safetensors", "spear_config.json"]


def test_a_compiled_model_saves_as_the_module_it_wraps(artifact, tmp_path):
    model, _, _ = artifact
    path = spear.save(torch.compile(model, backend="spear"), str(tmp_path / "compiled"))
    assert torch.equal(_logits(spear.load(path)), _logits(model))


def test_unsupported_version(artifact):
    _, _, path = artifact
    _edit_config(path, lambda c: c.update(format_version=99))
    with pytest.raises(ArtifactError, match="format_version 99 is not supported"):
        spear.load(path)


def test_config_that_does_not_match_the_tensors(artifact):
    _, _, path = artifact
    _edit_config(path, lambda c: c["quantized"]["model.layers.0.mlp.up_proj"].update(group_size=64))
    with pytest.raises(ArtifactError, match=r"model\.layers\.0\.mlp\.up_proj\.scales. is \(128, 2\).*expects \(128, 1\)"):
        spear.load(path)


def test_unknown_module_in_config(artifact):
    _, _, path = artifact
    _edit_config(path, lambda c: c["quantized"].update({"model.layers.7.mlp.up_proj": {
        "in_features": 64, "out_features": 128, "group_size": 32, "bias": False, "dtype": "float32"}}))
    with pytest.raises(ArtifactError, match="'model.layers.7.mlp.up_proj' does not exist"):
        spear.load(path)


def test_custom_architecture_needs_model_argument(tmp_path):
    from tests.helpers import LlamaLike

    m = spear.quantize_(LlamaLike(), spear.QuantConfig(), progress=False)
    path = spear.save(m, str(tmp_path / "custom"))
    with pytest.raises(ArtifactError, match="pass model="):
        spear.load(path)
    skeleton = LlamaLike()
    loaded = spear.load(path, model=skeleton)
    x = torch.randn(1, 3, 64)
    assert torch.equal(loaded(x), m(x))
    assert isinstance(skeleton.layers[0].q_proj, torch.nn.Linear)  # the argument was left untouched


def test_bf16_models_reload_as_bf16_bitwise(tmp_path):
    """The skeleton is built in the saved dtype: a bf16 Hugging Face model (rebuilt from its config,
    as from_pretrained(dtype=bf16) builds it) and a built-in model cast to bf16 after loading both
    come back bf16 with identical logits (they used to come back fp32, or, briefly, not at all)."""
    import transformers

    from spear_compile.artifacts import _default_dtype

    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2)
    with _default_dtype(torch.bfloat16):
        hf = transformers.LlamaForCausalLM(cfg).eval()
    builtin = load_builtin("tiny-llama")[0].to(torch.bfloat16)
    for i, m in enumerate((hf, builtin)):
        spear.quantize_(m, spear.QuantConfig(group_size=32), progress=False)
        loaded = spear.load(spear.save(m, str(tmp_path / f"m{i}")))
        assert loaded.model.embed_tokens.weight.dtype == torch.bfloat16
        assert torch.equal(_logits(loaded), _logits(m)), i
    assert torch.get_default_dtype() == torch.float32  # restored
