"""Counters of one-off costs a serving step can pay: CUDA graphs captured and graphs compiled.

A continuous-batching engine on CUDA captures a CUDA graph the first time it meets a step shape (padded
token count x padded KV reads), and torch.compile compiles a graph the first time a guard fails. Such a step
costs 10-30x its steady time (an H100 run of a Llama-2-7B-shaped model, 2026-12-05: 185-340 ms steps
against 7-40 ms ones, ``benchmarks/results/serving/2026-12-05_h100_varlen_kv256``). Calibration excludes
the steps during which either counter moved (``calibrate``); the serving benchmark reports how many
captures each run paid and the latency model's error on the steps that paid none.
"""
from __future__ import annotations

import weakref
from typing import Tuple

import torch


def _graph_buffers(engine) -> list:
    """transformers' ``CudaGraphBuffer``s under ``engine``'s manager, found by type (their place differs
    between transformers versions; the walk stops four attributes deep)."""
    seen, todo, out = set(), [(getattr(engine, "_manager", None), 0)], []
    while todo:
        obj, depth = todo.pop()
        if obj is None or id(obj) in seen or depth > 4 or isinstance(obj, (str, bytes, int, float, torch.Tensor)):
            continue
        seen.add(id(obj))
        if type(obj).__name__ == "CudaGraphBuffer":
            out.append(obj)
            continue
        kids = (list(obj.values()) if isinstance(obj, dict) else list(obj) if isinstance(obj, (list, tuple)) else
                list(vars(obj).values()) if hasattr(obj, "__dict__") and not isinstance(obj, torch.nn.Module) else [])
        todo += [(k, depth + 1) for k in kids]
    return out


def cuda_graph_count(engine) -> int:
    """CUDA graphs transformers' continuous batching holds for ``engine``; 0 without graphs or before the
    engine started."""
    return sum(len(getattr(b, "_storage", {})) for b in _graph_buffers(engine))


def compiled_graph_count() -> int:
    """Graphs torch.compile has compiled in this process (Dynamo's ``unique_graphs`` counter)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class FirstUseMarker:
    """``marker()`` -> (CUDA graphs held, graphs compiled) for ``engine``: a step during which this changed
    paid a first-use cost. The graph buffers are looked up once (then each call is a few attribute reads,
    cheap enough to run every step); while none is found (before the engine's first step, or without CUDA
    graphs), or once the engine has dropped them, each call looks again. The buffers are held weakly: a
    marker kept by a policy must not keep a stopped engine's graphs (and their memory pool) alive; on an
    H200 a second engine then started with 126 GiB still allocated (2026-12-06)."""

    def __init__(self, engine) -> None:
        self.engine, self._refs = engine, []

    def __call__(self) -> Tuple[int, int]:
        bufs = [r() for r in self._refs]
        if not bufs or any(b is None for b in bufs):
            bufs = _graph_buffers(self.engine)
            self._refs = [weakref.ref(b) for b in bufs]
        return sum(len(getattr(b, "_storage", {})) for b in bufs), compiled_graph_count()


__all__ = ["FirstUseMarker", "compiled_graph_count", "cuda_graph_count"]
