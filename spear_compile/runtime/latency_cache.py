"""Latency models on disk: JSON in the user cache directory, keyed by GPU, model, compile config and version.

A latency model is only true for the GPU it was measured on, the model and compile config whose
routes it timed (``CompileConfig.fingerprint()`` covers the EC placement and the kernel switches),
and the library version whose kernels ran. The file lives at
``<cache>/latency/<model>_<gpu>_<config hash>.json`` (``$SPEAR_CACHE_DIR``, else
``~/.cache/spear_compile``); the name is for finding it, the key inside it is what is checked: a file
whose key differs in any field is not used, and ``load`` says which field and both values.
"""
from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import asdict, dataclass
from typing import Callable, Optional, Tuple

from .. import envs
from .latency import SCHEMA_VERSION, LatencyModel

KIND = "spear_latency_model"


def library_version() -> str:
    """``spear_compile.__version__`` without importing anything new (the package is already imported
    when this module is); falls back to the installed distribution's metadata."""
    v = getattr(sys.modules.get("spear_compile"), "__version__", None)
    if v:
        return v
    try:
        from importlib.metadata import version

        return version("spear_compile")
    except Exception:  # pragma: no cover - not installed and imported oddly
        return "unknown"


def gpu_name(device=None) -> str:
    """The device's name as cache files spell it (spaces as underscores); ``"cpu"`` without CUDA, the
    same spelling as the tuned kernel tables."""
    import torch

    if device is not None and torch.device(device).type == "cpu":
        return "cpu"
    name = torch.cuda.get_device_name(device) if torch.cuda.is_available() else "cpu"
    return name.replace(" ", "_")


@dataclass(frozen=True)
class CacheKey:
    """What a latency model is valid for."""

    gpu: str
    model_id: str
    config_hash: str
    version: str

    def __post_init__(self) -> None:
        for f in ("gpu", "model_id", "config_hash", "version"):
            v = getattr(self, f)
            if not isinstance(v, str) or not v:
                raise ValueError(f"CacheKey: {f}={v!r} must be a non-empty str")

    @classmethod
    def for_plan(cls, plan, device=None, version: Optional[str] = None) -> "CacheKey":
        return cls(gpu_name(device), plan.model_id, plan.config_hash, version or library_version())

    def mismatch(self, other: "CacheKey") -> Optional[str]:
        """Why ``other`` (a file's key) is not this key, or None when they agree."""
        for f in ("gpu", "model_id", "config_hash", "version"):
            a, b = getattr(self, f), getattr(other, f)
            if a != b:
                return f"{f} differs: the file is for {b!r}, this run needs {a!r}"
        return None


def _safe(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", s).strip("-") or "model"


def cache_path(key: CacheKey) -> str:
    return os.path.join(envs.cache_dir(), "latency",
                        f"{_safe(key.model_id)}_{_safe(key.gpu)}_{_safe(key.config_hash)}.json")


def dumps(model: LatencyModel, key: CacheKey, meta: Optional[dict] = None) -> str:
    obj = {"schema_version": SCHEMA_VERSION, "kind": KIND, "key": asdict(key), "meta": meta or {},
           "model": model.to_dict()}
    return json.dumps(obj, indent=1) + "\n"


def save(model: LatencyModel, key: CacheKey, meta: Optional[dict] = None, path: Optional[str] = None) -> str:
    """Write ``model`` for ``key`` (atomically); returns the path."""
    path = path or cache_path(key)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(dumps(model, key, meta))
    os.replace(tmp, path)
    return path


def read(path: str) -> Tuple[LatencyModel, CacheKey, dict]:
    """A cache file's model, key and metadata; ``ValueError`` naming the file when it does not validate."""
    with open(path) as f:
        try:
            obj = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON: {e}") from None
    if not isinstance(obj, dict) or obj.get("kind") != KIND:
        raise ValueError(f"{path}: not a latency model file (kind={obj.get('kind') if isinstance(obj, dict) else None!r})")
    if obj.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(f"{path}: schema_version={obj.get('schema_version')!r}, this library reads {SCHEMA_VERSION}")
    try:
        key = CacheKey(**obj["key"])
    except (KeyError, TypeError) as e:
        raise ValueError(f"{path}: bad key ({e})") from None
    try:
        model = LatencyModel.from_dict(obj["model"])
    except (KeyError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from None
    return model, key, obj.get("meta", {})


def load(key: CacheKey, path: Optional[str] = None) -> Tuple[Optional[LatencyModel], str]:
    """``(model, reason)``: the cached model for ``key``, or None and the reason it is not used (no
    file, a file that does not validate, or a file of another GPU / model / config / version)."""
    path = path or cache_path(key)
    if not os.path.exists(path):
        return None, f"no latency model cached at {path}"
    try:
        model, got, _ = read(path)
    except ValueError as e:
        return None, f"not used: {e}"
    why = key.mismatch(got)
    if why:
        return None, f"not used: {path}: {why}"
    return model, f"loaded {path}"


def load_or_measure(key: CacheKey, measure: Callable[[], LatencyModel], path: Optional[str] = None,
                    log: Callable[[str], None] = print, meta: Optional[dict] = None) -> LatencyModel:
    """The cached model for ``key``; else ``measure()`` (saying so and why), saved for next time."""
    model, reason = load(key, path)
    if model is not None:
        return model
    log(f"spear_compile: {reason}; measuring the latency model on {key.gpu} (first use, cached afterwards)")
    model = measure()
    where = save(model, key, meta, path)
    log(f"spear_compile: latency model saved to {where}")
    return model
