"""What the spear backend compiled, kept for the runtime: the records of ``record_plan``, per graph.

Every ``backend="spear"`` compilation registers one ``CompiledGraph``: its key, the records of its
spear linears, weak references to the real tensors Dynamo lifted as its inputs (the model's weights)
and their names, shapes and dtypes, so ``graphs_of(model)`` finds the graphs a model runs without
holding the model alive (also for a second instance of a model, which Dynamo runs through the first
one's code without calling the backend again).

Inductor's FX graph cache and AOTAutograd's cache skip the passes on a hit, so the records are also
written to ``<cache dir>/plans/<key>.json`` (``SPEAR_CACHE_DIR``, else ``~/.cache/spear_compile``) and
read back on a hit. The key hashes what decides the compiled graph: the pass manager's ``uuid()`` (every
pass's source, the route, the tuned table, the compile config, the kill switches), Dynamo's graph code
and its inputs' shapes, strides and dtypes.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import weakref
from typing import Iterable, Optional

import torch

from .. import envs

SCHEMA_VERSION = 1


@dataclasses.dataclass
class CompiledGraph:
    key: str
    records: list[dict]
    config_fingerprint: str
    tensors: list  # weakref.ref to the graph's real input tensors
    source: str  # "passes" (recorded now) or "cache" (read from the plans directory)
    signature: dict = dataclasses.field(default_factory=dict)  # input name -> (shape, dtype), named inputs

    def reads(self, ids: set) -> bool:
        """Whether any live input tensor of this graph has an id in ``ids``."""
        for r in self.tensors:
            t = r()
            if t is not None and id(t) in ids:
                return True
        return False

    def fits(self, named: dict) -> bool:
        """Whether a model with these named tensors (name -> (shape, dtype)) has every named input of this
        graph, with its shape and dtype: Dynamo runs such a model through this graph's code (it guards on
        shapes and dtypes, not on which module object it is)."""
        return bool(self.signature) and all(named.get(k) == v for k, v in self.signature.items())


_GRAPHS: list[CompiledGraph] = []


def graph_key(manager_uuid: str, gm: torch.fx.GraphModule) -> str:
    """The key of a Dynamo graph compiled under a pass manager of ``manager_uuid``."""
    h = hashlib.sha256(manager_uuid.encode())
    h.update(gm.code.encode())
    for n in gm.graph.find_nodes(op="placeholder"):
        v = n.meta.get("example_value", n.meta.get("val"))
        if isinstance(v, torch.Tensor):
            h.update(f"{n.name}:{tuple(v.shape)}:{v.stride()}:{v.dtype}".encode())
        else:
            h.update(f"{n.name}:{type(v).__name__}".encode())
    return h.hexdigest()[:32]


def _path(key: str) -> str:
    return os.path.join(envs.cache_dir(), "plans", f"{key}.json")


def save(key: str, records: list[dict], config_fingerprint: str) -> Optional[str]:
    """Write the records of graph ``key`` (atomically); None (and nothing written) if the directory
    cannot be written: the plan is a convenience for the runtime, never a reason to fail compiling."""
    path = _path(key)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"schema_version": SCHEMA_VERSION, "key": key, "config_fingerprint": config_fingerprint,
                       "records": records}, f)
        os.replace(tmp, path)
    except OSError:
        return None
    return path


def load(key: str) -> Optional[list[dict]]:
    """The records saved for ``key``, or None (no file, another schema, or not readable)."""
    try:
        with open(_path(key)) as f:
            obj = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(obj, dict) or obj.get("schema_version") != SCHEMA_VERSION or obj.get("key") != key:
        return None
    recs = obj.get("records")
    return recs if isinstance(recs, list) else None


def _meta(t: torch.Tensor) -> tuple:
    return tuple(t.shape), str(t.dtype)


def register(key: str, records: list[dict], config_fingerprint: str, inputs: Iterable[tuple], source: str
             ) -> CompiledGraph:
    """Keep graph ``key``'s records; ``inputs``: ``(name, tensor)`` of its real inputs (the name None
    when Dynamo's source did not give a module path)."""
    refs, signature = [], {}
    for name, t in inputs:
        if not isinstance(t, torch.Tensor):
            continue
        try:
            refs.append(weakref.ref(t))
        except TypeError:
            pass
        if name and "[" not in name and not name.split(".")[0].isdigit():  # a module path, not L['x'] / args[1]
            signature[name] = _meta(t)
    g = CompiledGraph(key, list(records), config_fingerprint, refs, source, signature)
    _GRAPHS.append(g)
    return g


def graphs_of(model: torch.nn.Module) -> list[CompiledGraph]:
    """The graphs compiled by the spear backend that ``model`` (an ``nn.Module``, or ``torch.compile``'s
    wrapper of one) runs, oldest first: those that read its tensors, and those whose named inputs it has
    with the same shapes and dtypes (Dynamo reuses a graph's code for another instance of a model)."""
    model = getattr(model, "_orig_mod", model)
    ids = {id(t) for t in model.parameters()} | {id(t) for t in model.buffers()}
    named = {n: _meta(t) for n, t in list(model.named_parameters()) + list(model.named_buffers())}
    return [g for g in _GRAPHS if g.reads(ids) or g.fits(named)]
