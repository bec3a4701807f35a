"""Saving and loading quantized, error-compensated models.

An artifact is a directory with two files:

* ``model.safetensors``: every tensor of the model (packed int4 weights, scales, zeros,
  EC parameters, the unquantized rest), tied tensors stored once;
* ``spear_config.json``: format name and version, how to rebuild the architecture
  (a built-in model name or the Hugging Face config), the architecture itself (model class,
  every module's class, the HF config) to check a ``model=`` against, which modules are
  ``QuantLinear`` (with in/out features, group size, bias), which carry ECs (with their
  ``ECConfig``; ECs registered for foreign quantized modules too), every tensor's shape and dtype,
  the SHA-256 of the tensor file and of the config itself.

``load`` checks everything before it returns anything: the JSON parses and names a supported
version, the config and the tensor file match their checksums (both required from format
version 2; they catch truncation, corruption and a casual edit - they detect accidents, they
are not a signature), the architecture of ``model=`` (or of the rebuilt one) is the recorded one
(class, module classes, linear shapes, HF config: the first difference is named), the skeleton
has exactly the recorded tensors with the recorded shapes and dtypes. Any failure raises
:class:`ArtifactError` naming the file, module, field or tensor; nothing is half loaded.
Reloading gives bitwise-identical logits.

``save`` is crash-safe. It writes the new artifact, fsynced, beside the target as
``.<name>.spear-new``, renames an existing artifact aside to ``.<name>.spear-old``, renames the new
one in, fsyncs the parent directory and removes the old one last. A crash or kill at any step
leaves one complete artifact: ``load`` reads the target, or, when the process died between the
two renames, the complete sibling (new first, then old) with a warning; the next ``save`` to the
same path finishes or rolls back what was interrupted. ``save`` refuses any target that is not a
new path, an empty directory or a complete artifact written by ``save`` (a directory holding
anything else, a file, the working directory), so a mistyped path never deletes a user's files.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import shutil
import warnings
from typing import Any, Optional

import torch
from torch import nn

from .compensators.ec import ErrorCompensator
from .compensators.registry import _integer_weight, lookup_ec, register_ec
from .config import ECConfig
from .errors import ArtifactError
from .quant.linear import QuantLinear

FORMAT = "spear_compile"
FORMAT_VERSION = 2  # 2: the config checksum is required, the architecture is recorded, foreign ECs are saved
READABLE_VERSIONS = (1, 2)  # 1: written before those; its missing config checksum is accepted
CONFIG_FILE = "spear_config.json"
TENSOR_FILE = "model.safetensors"
NEW_SUFFIX, OLD_SUFFIX = ".spear-new", ".spear-old"
FOREIGN_EC_PREFIX = "__spear_foreign_ec__."  # tensor-name prefix of ECs registered for foreign modules
_IGNORED_HF_KEYS = frozenset({"_name_or_path", "transformers_version", "torch_dtype", "dtype", "_commit_hash",
                              "use_cache", "output_attentions", "output_hidden_states", "return_dict",
                              "_attn_implementation_autoset", "attn_implementation", "_attn_implementation"})

_FAULT = None  # tests: a callable(step) run before every file-system step of save (fault injection)


def _step(name: str) -> None:
    if _FAULT is not None:
        _FAULT(name)




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


def _siblings(path: str) -> tuple[str, str]:
    """Where ``save`` stages the new artifact and parks the old one: hidden names beside ``path``."""
    parent, base = os.path.split(os.path.abspath(path).rstrip(os.sep))
    return os.path.join(parent, f".{base}{NEW_SUFFIX}"), os.path.join(parent, f".{base}{OLD_SUFFIX}")


def _complete(d: str) -> bool:
    """Whether ``d`` is a whole artifact written by ``save``: exactly its two files, a config of this
    format whose own checksum holds, a tensor file (its checksum is checked by ``load``)."""
    if not os.path.isdir(d) or set(os.listdir(d)) != {CONFIG_FILE, TENSOR_FILE}:
        return False
    try:
        _read_config(d)
    except ArtifactError:
        return False
    return os.path.getsize(os.path.join(d, TENSOR_FILE)) > 0


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
    entries = sorted(os.listdir(full))
    if entries and not _complete(full):
        raise ArtifactError(f"save: {path} exists and is not a complete spear artifact (it holds {entries[:5]}); "
                            f"refusing to replace it - choose a new or empty directory")


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_staged(d: str) -> None:
    """Delete a staging / parked directory of ours (only our two files and nothing else in it)."""
    if os.path.isdir(d) and set(os.listdir(d)) <= {CONFIG_FILE, TENSOR_FILE}:
        shutil.rmtree(d)
    elif os.path.exists(d):
        raise ArtifactError(f"save: {d} is in the way and does not look like a staged spear artifact; remove it")


def _recover(path: str) -> None:
    """Finish or roll back a save that was interrupted (module docstring): afterwards ``path`` is the
    complete artifact (or absent) and no sibling is left."""
    new, old = _siblings(path)
    if not os.path.exists(path):
        for cand in (new, old):
            if _complete(cand):
                os.rename(cand, path)
                break
    for cand in (new, old):
        if os.path.exists(cand):
            _remove_staged(cand)


def save(model: nn.Module, path: str) -> str:
    """Write ``model`` as an artifact directory at ``path``: a new or empty directory, or an
    existing artifact (replaced, crash-safe: see the module docstring). A ``torch.compile``
    wrapper is saved as the module it wraps, so the artifact loads without it. ECs registered
    for foreign quantized modules (``attach_`` on a non-``QuantLinear``) are saved and registered
    again by ``load``."""
    from safetensors.torch import save_file

    from ._version import __version__

    if not path:
        raise ArtifactError("save: empty path")
    _recover(path)
    _check_target(path)
    model = getattr(model, "_orig_mod", model)  # torch.compile's OptimizedModule: its names carry "_orig_mod."
    quantized, ecs = {}, {}
    for fqn, m in model.named_modules():
        if isinstance(m, QuantLinear):
            quantized[fqn] = {"in_features": m.in_features, "out_features": m.out_features,
                              "group_size": m.group_size, "bias": m.bias is not None,
                              "dtype": str(m.scales.dtype).replace("torch.", "")}
            if m.ec is not None:
                ecs[fqn] = _ec_record(m.ec)
    tensors = _unique_state(model)
    foreign = _foreign_ecs(model)
    for fqn, ec in foreign.items():
        tensors.update({f"{FOREIGN_EC_PREFIX}{fqn}.{k}": v.detach().contiguous().cpu()
                        for k, v in ec.state_dict().items()})
    parent = os.path.dirname(os.path.abspath(path)) or "."
    os.makedirs(parent, exist_ok=True)
    new, old = _siblings(path)
    cfg = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "library_version": __version__,
        "model": _source_of(model), "architecture": _architecture(model), "quantized": quantized, "ecs": ecs,
        "foreign_ecs": {fqn: _ec_record(ec) for fqn, ec in foreign.items()},
        "tensors": {k: {"shape": list(v.shape), "dtype": str(v.dtype).replace("torch.", "")}
                    for k, v in tensors.items()},
    }
    parked = False
    try:
        _step("mkdir")
        os.mkdir(new)
        _step("write_tensors")
        save_file(tensors, os.path.join(new, TENSOR_FILE))
        _fsync(os.path.join(new, TENSOR_FILE))
        cfg["checksums"] = {TENSOR_FILE: _sha256(os.path.join(new, TENSOR_FILE))}
        cfg["checksums"]["config"] = _config_digest(json.loads(json.dumps(cfg, default=str)))
        _step("write_config")
        with open(os.path.join(new, CONFIG_FILE), "w") as f:
            json.dump(cfg, f, indent=1, default=str)
            f.flush()
            os.fsync(f.fileno())
        _fsync(new)
        if os.path.exists(path):
            _step("park_old")
            os.rename(path, old)
            parked = True
        _step("move_new_in")
        os.rename(new, path)
        _fsync(parent)
    except BaseException:
        if parked and not os.path.exists(path):
            with contextlib.suppress(OSError):
                os.rename(old, path)  # roll back: the old artifact stays the artifact
        with contextlib.suppress(OSError, ArtifactError):
            _remove_staged(new)
        raise
    if parked:
        try:
            _step("remove_old")
            shutil.rmtree(old)
        except OSError as e:  # the new artifact is in place: a failed cleanup is not a failed save
            warnings.warn(f"save: {path} is saved, but the previous artifact parked at {old} could not be removed "
                          f"({e}); the next save to {path} removes it", stacklevel=2)
    return path


def _ec_record(ec: ErrorCompensator) -> dict[str, Any]:
    return {"config": ec.cfg.to_dict(), "rank": ec.rank, "gate_hidden": ec.W1.shape[0],
            "dtype": str(ec.A.dtype).replace("torch.", ""),
            "in_features": ec.A.shape[1], "out_features": ec.B.shape[0]}


def _ec_from_record(e: dict[str, Any], in_features: int, out_features: int, map_location) -> ErrorCompensator:
    """An empty EC of the shape and config ``_ec_record`` wrote (its tensors are loaded after)."""
    cfg = ECConfig.from_dict({**e["config"], "rank": e["rank"], "gate_hidden": e["gate_hidden"]})
    return ErrorCompensator(in_features, out_features, cfg, device=map_location, dtype=getattr(torch, e["dtype"]))


def _foreign_ecs(model: nn.Module) -> dict[str, ErrorCompensator]:
    """ECs registered (``attach_`` / ``register_ec``) for the integer weight of a non-QuantLinear module."""
    out = {}
    for fqn, m in model.named_modules():
        if isinstance(m, QuantLinear):
            continue
        for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False)):
            found = lookup_ec(t) if t is not None and not t.is_floating_point() else None
            if found is not None:
                out[fqn] = found[0]
    return out


def _architecture(model: nn.Module) -> dict[str, Any]:
    """What ``load`` holds a ``model=`` (or the rebuilt skeleton) against."""
    cfg = getattr(model, "config", None)
    hf = json.loads(json.dumps(cfg.to_dict(), default=str)) if cfg is not None and hasattr(cfg, "to_dict") else None
    quantized = [f for f, m in model.named_modules() if isinstance(m, QuantLinear)]
    modules = {fqn: _qualname(m) for fqn, m in model.named_modules()
               if fqn and not any(fqn.startswith(q + ".") for q in quantized)}
    return {"class": _qualname(model), "modules": modules, "hf_config": hf}


def _qualname(m: nn.Module) -> str:
    return f"{type(m).__module__}.{type(m).__qualname__}"


def _check_architecture(path: str, cfg: dict[str, Any], skel: nn.Module) -> None:
    """Name the first way ``skel`` (before QuantLinears are put in) differs from the recorded model."""
    arch = cfg.get("architecture")
    if arch is None:  # format version 1
        return
    where = f"{path}: the model does not match the artifact"
    if _qualname(skel) != arch["class"]:
        raise ArtifactError(f"{where}: it is a {_qualname(skel)}, the artifact holds a {arch['class']}")
    mods = dict(skel.named_modules())
    for fqn, cls in arch["modules"].items():
        if _in_quantized(fqn, cfg):  # a quantized module's EC is the artifact's to add, not the model's
            continue
        m = mods.get(fqn)
        if m is None:
            raise ArtifactError(f"{where}: it has no module {fqn!r} ({cls})")
        if fqn in cfg["quantized"]:
            q = cfg["quantized"][fqn]
            if not isinstance(m, (nn.Linear, QuantLinear)):
                raise ArtifactError(f"{where}: {fqn} is a {_qualname(m)}, the artifact quantized an nn.Linear there")
            if (m.in_features, m.out_features) != (q["in_features"], q["out_features"]):
                raise ArtifactError(f"{where}: {fqn} is {m.out_features}x{m.in_features} (out x in), the artifact's "
                                    f"is {q['out_features']}x{q['in_features']}")
        elif _qualname(m) != cls:
            raise ArtifactError(f"{where}: {fqn} is a {_qualname(m)}, the artifact's is a {cls}")
    extra = [f for f in mods if f and f not in arch["modules"] and not _in_quantized(f, cfg)]
    if extra:
        raise ArtifactError(f"{where}: it has module {extra[0]!r}, which the artifact's model does not")
    got = getattr(skel, "config", None)
    want = arch.get("hf_config")
    if want is not None and got is not None and hasattr(got, "to_dict"):
        have = json.loads(json.dumps(got.to_dict(), default=str))
        for k in sorted(set(want) | set(have)):
            if k in _IGNORED_HF_KEYS:
                continue
            if want.get(k) != have.get(k):
                raise ArtifactError(f"{where}: config.{k} is {have.get(k)!r}, the artifact's is {want.get(k)!r}")


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
    version = cfg.get("format_version")
    if type(version) is not int or version not in READABLE_VERSIONS:
        raise ArtifactError(f"{cfg_path}: format_version {version!r} is not supported "
                            f"(this library reads versions {READABLE_VERSIONS})")
    keys = [("model", dict), ("quantized", dict), ("ecs", dict), ("tensors", dict), ("checksums", dict)]
    if version >= 2:
        keys += [("architecture", dict), ("foreign_ecs", dict)]
    for key, kind in keys:
        if key not in cfg:
            raise ArtifactError(f"{cfg_path}: missing key {key!r}")
        if not isinstance(cfg[key], kind):
            raise ArtifactError(f"{cfg_path}: {key!r} is a {type(cfg[key]).__name__}, expected a JSON object")
    want = cfg["checksums"].get("config")
    if want is None and version >= 2:
        raise ArtifactError(f"{cfg_path}: checksums.config is missing (required from format_version 2; "
                            f"the file was edited or corrupted)")
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
    architecture when the artifact cannot rebuild it itself, and must match the recorded one.
    When a save to ``path`` was interrupted between its two renames, the complete staged or
    parked artifact beside it is loaded instead, with a warning (module docstring)."""
    if not os.path.exists(path):
        new, old = _siblings(path)
        cands = [c for c in (new, old) if os.path.isdir(c)]
        errors = []
        for cand in cands:
            try:
                loaded = _load_dir(cand, model, map_location)
            except ArtifactError as e:
                errors.append(str(e))
                continue
            warnings.warn(f"load: {path} is missing: a save to it was interrupted; loaded the complete "
                          f"{'new' if cand == new else 'previous'} artifact {cand} (the next save to {path} "
                          f"tidies up)", stacklevel=2)
            return loaded
        if errors:
            raise ArtifactError(f"{path}: missing, and the artifacts an interrupted save left beside it are not "
                                f"complete: {'; '.join(errors)}")
    return _load_dir(path, model, map_location)


def _load_dir(path: str, model: Optional[nn.Module], map_location: str) -> nn.Module:
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
    foreign = {k: tensors.pop(k) for k in [k for k in tensors if k.startswith(FOREIGN_EC_PREFIX)]}
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
    ecs = _foreign_from(path, cfg.get("foreign_ecs", {}), foreign, skel, map_location)
    skel.load_state_dict(tensors, strict=False)
    for fqn, (weight, ec) in ecs.items():
        register_ec(weight, ec, fqn)
    skel._spear_source = cfg["model"]
    skel._spear_foreign_ecs = {fqn: ec for fqn, (_, ec) in ecs.items()}  # the registry holds ECs by weight only
    return skel.eval()


def _foreign_from(path: str, records: dict, tensors: dict, skel: nn.Module, map_location) -> dict:
    """The ECs of foreign modules, built and filled, with the weight each is registered for."""
    out = {}
    for fqn, e in records.items():
        try:
            mod = skel.get_submodule(fqn)
        except AttributeError:
            raise ArtifactError(f"{path}: EC registered for module {fqn!r}, which the model does not have") from None
        try:
            weight = _integer_weight(mod, fqn)
        except ValueError as err:
            raise ArtifactError(f"{path}: EC for {fqn!r}: {err}") from None
        ec = _ec_from_record(e, e["in_features"], e["out_features"], map_location)
        prefix = f"{FOREIGN_EC_PREFIX}{fqn}."
        state = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        try:
            ec.load_state_dict(state, strict=True)
        except RuntimeError as err:
            raise ArtifactError(f"{path}: EC for {fqn!r} does not match its tensors ({err})") from None
        out[fqn] = (weight, ec)
    return out


def _rebuild(path: str, cfg: dict[str, Any], model: Optional[nn.Module], map_location) -> nn.Module:
    """The skeleton, checked against the recorded architecture, with the config's QuantLinears and
    ECs in place (no weights loaded yet)."""
    skel = _skeleton(cfg, model)
    _check_architecture(path, cfg, skel)
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
        ql.ec = _ec_from_record(e, ql.in_features, ql.out_features, map_location)
    return skel


def _tied_elsewhere(model: nn.Module, key: str, tensors: dict) -> bool:
    """A state-dict key absent from the file because it shares storage with one that is present."""
    sd = model.state_dict()
    t = sd[key]
    return any(k in tensors and k != key and v.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
               and v.shape == t.shape for k, v in sd.items())
