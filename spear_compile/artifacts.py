"""Saving and loading quantized, error-compensated models.

An artifact is a directory with two files:

* ``model.safetensors``: every tensor of the model (packed int4 weights, scales, zeros,
  EC parameters, the unquantized rest), tied tensors stored once;
* ``spear_config.json``: format name and version, how to rebuild the architecture
  (a built-in model name or the Hugging Face config), which modules are ``QuantLinear``
  (with in/out features, group size, bias), which carry ECs (with their ``ECConfig``),
  every tensor's shape and dtype, the SHA-256 of the tensor file and of the config itself.

``load`` checks everything before it returns anything: the JSON parses and names a
supported version, the config and the tensor file match their checksums (catching
truncation, corruption and a casual edit - an edited EC activation or dtype would otherwise
load as a different model; the checksums detect accidents, they are not a signature), the rebuilt skeleton has exactly the recorded tensors with the
recorded shapes and dtypes. Any failure raises :class:`ArtifactError` naming the file,
module or tensor; nothing is half loaded. Reloading gives bitwise-identical logits.

``save`` writes into a temporary directory and moves it into place (an existing artifact is
removed just before the move), and refuses any other existing path (a
directory holding anything but an artifact's two files, a file, the working directory), so a
mistyped path never deletes a user's files.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import shutil
import tempfile
from typing import Any, Optional

import torch
from torch import nn

from .compensators.ec import ErrorCompensator
from .config import ECConfig
from .errors import ArtifactError
from .quant.linear import QuantLinear

FORMAT = "spear_compile"
FORMAT_VERSION = 1
CONFIG_FILE = "spear_config.json"
TENSOR_FILE = "model.safetensors"




def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _source_of(model: nn.Module) -> dict[str, Any]:
    src = getattr(model, "_spear_source", None)
    if src is not None:
        return dict(src)
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "to_dict"):
        return {"source": "hf_config", "class": type(model).__name__, "config": cfg.to_dict()}
    return {"source": "module", "class": f"{type(model).__module__}.{type(model).__qualname__}"}


def _unique_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """State dict with tied tensors kept once (safetensors refuses shared storage)."""
    out, seen = {}, {}
    for name, t in model.state_dict().items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        if t.numel() and key in seen:
            continue
        seen[key] = name
        out[name] = t.detach().contiguous().cpu()
    return out


def _config_digest(cfg: dict[str, Any]) -> str:
    """SHA-256 of the config without its checksums, in a canonical form (sorted keys)."""
    body = {k: v for k, v in cfg.items() if k != "checksums"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


def _check_target(path: str) -> None:
    """Refuse to write over anything that is not an artifact (see the module docstring)."""
    if not path:
        raise ArtifactError("save: empty path")
    full = os.path.realpath(path)
    if not os.path.exists(full):
        return
    if not os.path.isdir(full):
        raise ArtifactError(f"save: {path} exists and is not a directory; refusing to replace it")
    cwd = os.path.realpath(os.getcwd())
    if cwd == full or cwd.startswith(full.rstrip(os.sep) + os.sep):
        raise ArtifactError(f"save: {path} is (or contains) the working directory; refusing to replace it")
    entries = set(os.listdir(full))
    if entries and (CONFIG_FILE not in entries or not entries <= {CONFIG_FILE, TENSOR_FILE}):
        raise ArtifactError(f"save: {path} exists and is not a spear artifact (it holds {sorted(entries)[:5]}); "
                            f"refusing to replace it - choose a new or empty directory")


def save(model: nn.Module, path: str) -> str:
    """Write ``model`` as an artifact directory at ``path``: a new or empty directory, or an
    existing artifact (replaced). A ``torch.compile`` wrapper is saved as the module
    it wraps, so the artifact loads without it."""
    from safetensors.torch import save_file

    from . import __version__

    _check_target(path)
    model = getattr(model, "_orig_mod", model)  # torch.compile's OptimizedModule: its names carry "_orig_mod."
    quantized, ecs = {}, {}
    for fqn, m in model.named_modules():
        if isinstance(m, QuantLinear):
            quantized[fqn] = {"in_features": m.in_features, "out_features": m.out_features,
                              "group_size": m.group_size, "bias": m.bias is not None,
                              "dtype": str(m.scales.dtype).replace("torch.", "")}
            if m.ec is not None:
                ecs[fqn] = {"config": m.ec.cfg.to_dict(), "rank": m.ec.rank, "gate_hidden": m.ec.W1.shape[0],
                            "dtype": str(m.ec.A.dtype).replace("torch.", "")}
    tensors = _unique_state(model)
    parent = os.path.dirname(os.path.abspath(path)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".spear_save_", dir=parent)
    try:
        save_file(tensors, os.path.join(tmp, TENSOR_FILE))
        cfg = {
            "format": FORMAT, "format_version": FORMAT_VERSION, "library_version": __version__,
            "model": _source_of(model), "quantized": quantized, "ecs": ecs,
            "tensors": {k: {"shape": list(v.shape), "dtype": str(v.dtype).replace("torch.", "")}
                        for k, v in tensors.items()},
            "checksums": {TENSOR_FILE: _sha256(os.path.join(tmp, TENSOR_FILE))},
        }
        cfg["checksums"]["config"] = _config_digest(json.loads(json.dumps(cfg, default=str)))
        with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
            json.dump(cfg, f, indent=1, default=str)
        if os.path.isdir(path):
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _read_config(path: str) -> dict[str, Any]:
    cfg_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(cfg_path):
        raise ArtifactError(f"{path}: not a spear artifact ({CONFIG_FILE} missing)")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{cfg_path}: corrupted JSON ({e})") from e
    if not isinstance(cfg, dict):
        raise ArtifactError(f"{cfg_path}: expected a JSON object, found {type(cfg).__name__}")
    if cfg.get("format") != FORMAT:
        raise ArtifactError(f"{cfg_path}: format {cfg.get('format')!r} is not {FORMAT!r}")
    if cfg.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(f"{cfg_path}: format_version {cfg.get('format_version')!r} is not supported "
                            f"(this library reads version {FORMAT_VERSION})")
    for key, kind in (("model", dict), ("quantized", dict), ("ecs", dict), ("tensors", dict), ("checksums", dict)):
        if key not in cfg:
            raise ArtifactError(f"{cfg_path}: missing key {key!r}")
        if not isinstance(cfg[key], kind):
            raise ArtifactError(f"{cfg_path}: {key!r} is a {type(cfg[key]).__name__}, expected a JSON object")
    want = cfg["checksums"].get("config")  # artifacts written before the config had a checksum have none
    if want is not None and want != _config_digest(cfg):
        raise ArtifactError(f"{cfg_path}: config checksum mismatch (the file was edited or corrupted)")
    return cfg


def _in_quantized(name: str, cfg: dict[str, Any]) -> bool:
    """Whether state-dict key ``name`` belongs to a QuantLinear (or its EC) of the artifact."""
    return any(name.startswith(fqn + ".") for fqn in cfg["quantized"])


def _saved_dtype(cfg: dict[str, Any]) -> Optional[torch.dtype]:
    """The one floating dtype of the artifact's unquantized tensors (embeddings, norms, head), or
    None when they mix dtypes: the skeleton is built in it, so a bf16 model reloads as bf16
    (bitwise), not as an fp32 skeleton the bf16 tensors are cast into."""
    names = {m["dtype"] for k, m in cfg["tensors"].items() if not _in_quantized(k, cfg)}
    dtypes = {getattr(torch, n, None) for n in names}
    floats = {d for d in dtypes if isinstance(d, torch.dtype) and d.is_floating_point}
    return floats.pop() if len(floats) == 1 else None


@contextlib.contextmanager
def _default_dtype(dtype: Optional[torch.dtype]):
    old = torch.get_default_dtype()
    if dtype is not None:
        torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _skeleton(cfg: dict[str, Any], model: Optional[nn.Module]) -> nn.Module:
    dtype = _saved_dtype(cfg)
    if model is not None:
        skel = copy.deepcopy(model)
        return skel.to(dtype) if dtype is not None else skel
    src = cfg["model"]
    if src.get("source") == "builtin":
        from .models import BUILTIN
        from .models import load as load_builtin

        if src.get("name") not in BUILTIN:  # models.load would go to the network for any other name
            raise ArtifactError(f"artifact model {src.get('name')!r} is not a built-in model {BUILTIN}; "
                                f"pass model= (the unquantized architecture)")
        kwargs = dict(src.get("kwargs", {}))
        if dtype is not None:
            kwargs["dtype"] = str(dtype).replace("torch.", "")
        return load_builtin(src["name"], **kwargs)[0]
    if src.get("source") == "hf_config":
        import transformers

        hf_cfg = transformers.AutoConfig.for_model(**src["config"])
        cls = getattr(transformers, src.get("class", "AutoModelForCausalLM"))
        with _default_dtype(dtype):  # what from_pretrained(dtype=...) does: buffers it computes stay as it made them
            return cls(hf_cfg).eval()
    raise ArtifactError(f"artifact model source {src!r} cannot be rebuilt; pass model= (the unquantized architecture)")


def load(path: str, model: Optional[nn.Module] = None, map_location: str = "cpu") -> nn.Module:
    """Rebuild the model saved at ``path``. ``model`` (left untouched) supplies the
    architecture when the artifact cannot rebuild it itself."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    cfg = _read_config(path)
    tpath = os.path.join(path, TENSOR_FILE)
    if not os.path.isfile(tpath):
        raise ArtifactError(f"{tpath}: tensor file missing")
    want = cfg["checksums"].get(TENSOR_FILE)
    got = _sha256(tpath)
    if want != got:
        raise ArtifactError(f"{tpath}: checksum mismatch (file truncated or corrupted): expected {want}, got {got}")
    try:
        tensors = load_file(tpath, device=map_location)
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise ArtifactError(f"{tpath}: unreadable on map_location={map_location!r} ({e})") from e
    for name, meta in cfg["tensors"].items():
        t = tensors.get(name)
        if t is None or list(t.shape) != meta["shape"] or str(t.dtype).replace("torch.", "") != meta["dtype"]:
            raise ArtifactError(f"{tpath}: tensor {name!r} is {None if t is None else (list(t.shape), t.dtype)}, "
                                f"config says {meta}")
    try:
        skel = _rebuild(path, cfg, model, map_location)
    except ArtifactError:
        raise
    except Exception as e:  # noqa: BLE001 - a config that passed its checksum but cannot be rebuilt
        raise ArtifactError(f"{os.path.join(path, CONFIG_FILE)}: cannot rebuild the model "
                            f"({type(e).__name__}: {e})") from e
    expected = skel.state_dict()
    missing = [k for k in expected if k not in tensors and not _tied_elsewhere(skel, k, tensors)]
    unexpected = [k for k in tensors if k not in expected]
    if missing or unexpected:
        raise ArtifactError(f"{path}: tensors do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for k, v in expected.items():  # quantized modules and ECs are built in their recorded dtypes: those must match
        if k in tensors and (tuple(v.shape) != tuple(tensors[k].shape)
                             or (v.dtype != tensors[k].dtype and _in_quantized(k, cfg))):
            raise ArtifactError(f"{path}: tensor {k!r} is {tuple(tensors[k].shape)} {tensors[k].dtype}, the module "
                                f"expects {tuple(v.shape)} {v.dtype}")
    skel.load_state_dict(tensors, strict=False)
    skel._spear_source = cfg["model"]
    return skel.eval()


def _rebuild(path: str, cfg: dict[str, Any], model: Optional[nn.Module], map_location) -> nn.Module:
    """The skeleton with the config's QuantLinears and ECs in place (no weights loaded yet)."""
    skel = _skeleton(cfg, model)
    mods = dict(skel.named_modules())
    for fqn, q in cfg["quantized"].items():
        if fqn not in mods:
            raise ArtifactError(f"{path}: quantized module {fqn!r} does not exist in {type(skel).__name__}")
        dtype = getattr(torch, q["dtype"])
        ql = QuantLinear(q["in_features"], q["out_features"], q["group_size"], q["bias"], dtype, map_location, fqn)
        parent, _, child = fqn.rpartition(".")
        setattr(skel.get_submodule(parent) if parent else skel, child, ql)
    for fqn, e in cfg["ecs"].items():
        if fqn not in cfg["quantized"]:
            raise ArtifactError(f"{path}: EC on {fqn!r}, which is not a quantized module of the artifact")
        ql = skel.get_submodule(fqn)
        ec = ErrorCompensator(ql.in_features, ql.out_features,
                              ECConfig.from_dict({**e["config"], "rank": e["rank"], "gate_hidden": e["gate_hidden"]}),
                              device=map_location, dtype=getattr(torch, e["dtype"]))
        ql.ec = ec
    return skel


def _tied_elsewhere(model: nn.Module, key: str, tensors: dict) -> bool:
    """A state-dict key absent from the file because it shares storage with one that is present."""
    sd = model.state_dict()
    t = sd[key]
    return any(k in tensors and k != key and v.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
               and v.shape == t.shape for k, v in sd.items())
