"""The one weight-layout cache: operands derived from a weight (GEMV word layouts, TMA tiles, padded or
concatenated operands, row parameters), made on first use and kept while the weight lives.

A derived tensor is keyed by the identity of its sources (storage, offset, shape, stride, dtype,
device) and their version counters, so an in-place update of a weight remakes what was derived from
it, and entries whose sources were freed are dropped. Making one while a CUDA graph is being
captured raises: the re-layout would be recorded and re-run at every replay (a decode benchmark that
did so timed an 8192 x 8192 GEMV at 98 us instead of 15 on an H200).

Everything kept across calls (these layouts, and the kernels' workspaces: counters, tickets, slots) is
made by ``outside_pools``: on a helper thread, so that a CUDA memory pool the caller holds does not
apply. transformers' continuous batching runs the eager warm-up before each CUDA-graph capture inside
the graphs' shared pool (``torch.cuda.use_mem_pool``, thread-local); state made there was clobbered by
the graphs' own buffers: the one-launch decode EC found its slots' tags wrong and spun to its limit
(4.28 ms per launch instead of ~10 us, H200, ``benchmarks/experimental/engine_graph_lab.py``), and a
compiled engine hit illegal memory accesses.
"""
from __future__ import annotations

import threading

import torch


def outside_pools(make):
    """``make()`` (no autograd) run where no caller's CUDA memory pool applies: on a helper thread (pools
    are per thread), on the current device, after the caller's stream has finished its pending work (the
    helper's stream does not order with it) and with the helper's stream drained before returning. For
    state kept across calls and CUDA-graph captures (module docstring); on CPU ``make()`` runs here."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        with torch.no_grad():
            return make()
    dev = torch.cuda.current_device()
    torch.cuda.current_stream(dev).synchronize()
    box: dict = {}

    def run():
        try:
            torch.cuda.set_device(dev)
            with torch.no_grad():
                box["out"] = make()
            torch.cuda.current_stream(dev).synchronize()
        except BaseException as e:  # re-raised on the caller's thread
            box["err"] = e

    t = threading.Thread(target=run, name="spear-outside-pools", daemon=True)
    t.start()
    t.join()
    if "err" in box:
        raise box["err"]
    return box["out"]


_GROWN_ALL: list = []  # every grown workspace ever made: a CUDA graph may hold a pointer to an outgrown one


def grown_workspace(store: dict, device: torch.device, floats: int, counters: int, what: str) -> tuple:
    """A kernel's fp32 workspace of at least ``floats`` elements and int32 counters of at least ``counters``, zeroed
    once per device (``store``: the kernel's own dict) and grown when a larger launch comes; the kernels keep
    the counters zero. Shared by launches on the device, which serialize on one stream. Made ``outside_pools``;
    growing one while a CUDA graph is being captured raises (its memset would be captured, not run), naming
    ``what`` needed it."""
    cuda = device.type == "cuda"
    idx = (device.index if device.index is not None else torch.cuda.current_device()) if cuda else str(device)
    have = store.get(idx)
    if have is None or have[0].numel() < floats or have[1].numel() < counters:
        if cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{what} needs a larger workspace ({floats} floats, {counters} counters) while a "
                               "CUDA graph is being captured; run the model once eagerly before capturing "
                               "(the usual warm-up does)")
        n = max(floats, have[0].numel() if have else 0)
        r = max(counters, have[1].numel() if have else 0)
        have = outside_pools(lambda: (torch.zeros(n, dtype=torch.float32, device=device),
                                      torch.zeros(r, dtype=torch.int32, device=device)))
        store[idx] = have
        _GROWN_ALL.append(have)
    return have


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # inference tensors have no version counter
        return -1


def _derived_key(sources: list) -> tuple:
    key = tuple(None if t is None else (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
                                        tuple(t.stride()), t.dtype, str(t.device)) for t in sources)
    return key, tuple(None if t is None else _version(t) for t in sources)


def _derived_hit(cache: dict, key: tuple, versions: tuple):
    hit = cache.get(key)
    if hit is not None and not any(r.expired() for r in hit[0]) and hit[1] == versions:
        return hit[2]
    return None


def derived_peek(cache: dict, sources: list):
    """What ``derived_cached`` holds for ``sources`` if it is current, else None (nothing is made)."""
    return _derived_hit(cache, *_derived_key(sources))


def derived_cached(cache: dict, sources: list, make):
    """``make()``, cached in ``cache`` under the identity of ``sources`` (tensors or None) while every
    source's storage lives and its version is unchanged: an in-place update remakes it, and entries
    whose sources were freed are dropped when a new one is made. Making one while a CUDA graph is
    being captured raises (module docstring)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    key, versions = _derived_key(sources)
    hit = _derived_hit(cache, key, versions)
    if hit is not None:
        return hit
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        shapes = [tuple(t.shape) for t in sources if t is not None]
        raise RuntimeError(f"a W4A16 kernel's weight layout (derived from tensors of shapes {shapes}) is made on first "
                           "use, and this first use is inside a CUDA graph capture, which would record the re-layout "
                           "and re-run it at every replay: run the model (or op) once before capturing")
    for k in [k for k, v in cache.items() if any(r.expired() for r in v[0])]:  # sources freed since
        del cache[k]
    out = outside_pools(make)
    cache[key] = ([StorageWeakRef(t.untyped_storage()) for t in sources if t is not None], versions, out)
    return out
