"""Timing under CUDA graphs, config search, and the per-GPU tables they produce.

Decode kernels run for ~10 us, less than a Python launch; timing them with plain events
would measure the host. ``bench_graph`` captures ``calls`` invocations (cycling through
input copies larger than L2, so HBM and not the cache is measured) into one CUDA graph
and reports the median replay time per call, the way a compiled decode step runs.

Tuned kernel configs and measured crossovers are typed tables (``table.py``): the shipped ones
are package data, the ones a user measures go to the user cache directory.
"""
from __future__ import annotations

import statistics
from typing import Callable, Iterable, Optional

import torch

from . import table as _table
from .table import gpu_key  # noqa: F401  (the benchmarks name their results by it)


def capture_graph(fn: Callable[[int], object], copies: int = 1, calls: int = 20,
                  warmup: int = 3) -> "torch.cuda.CUDAGraph":
    """A CUDA graph of ``calls`` calls ``fn(i)``, ``i`` cycling over ``copies``, replayed once. The
    warm-up calls every copy at least once, so that whatever a kernel derives from its inputs on first
    use (weight layouts, TMA tiles) is made before the capture, not recorded into the graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(max(warmup, copies)):
            fn(i % copies)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(i % copies)
    g.replay()
    torch.cuda.synchronize()
    return g


def bench_graph(fn: Callable[[int], object], copies: int = 1, calls: int = 20, replays: int = 15,
                warmup: int = 3) -> float:
    """Median microseconds per ``fn(i)`` call, ``i`` cycling over ``copies``, inside a CUDA graph
    (``capture_graph``)."""
    g = capture_graph(fn, copies, calls, warmup)
    times = []
    for _ in range(replays):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / calls)
    del g
    return statistics.median(times)


def copies_for(bytes_per_copy: int, l2_bytes: int = 60 << 20, min_total: int = 3) -> int:
    """How many input copies make one sweep at least ``min_total`` x the L2 size."""
    return max(1, -(-min_total * l2_bytes // max(1, bytes_per_copy)))


def search(run: Callable[[tuple], Callable[[int], object]], configs: Iterable[tuple], copies: int) -> tuple[tuple, float]:
    """Fastest config under ``bench_graph``; configs that fail to compile/launch are skipped."""
    best, best_t = None, float("inf")
    for cfg in configs:
        try:
            t = bench_graph(run(cfg), copies, calls=10, replays=5)
        except Exception as e:  # too much shared memory / registers for this GPU
            torch.cuda.synchronize()
            print(f"  config {cfg} skipped: {type(e).__name__}: {str(e)[:160]}", flush=True)
            continue
        if t < best_t:
            best, best_t = cfg, t
    if best is None:
        raise RuntimeError("no kernel config ran")
    return best, best_t


def refine(run: Callable[[tuple], Callable[[int], object]], configs: list, copies: int,
           rounds: int = 3) -> tuple[tuple, float]:
    """The fastest of a few near-tied finalists (e.g. the best of each kernel family from ``search``), re-timed
    with the full ``bench_graph`` in ``rounds`` interleaved rounds, by median. Why: ``search``'s short timings
    flipped a table choice between runs on a 1-2 % tie, and once took a config that the same run's full timing
    put 10 % behind (28672x8192 M = 1024 on an H200: 754 us in the search, 830 after); interleaving spreads a
    drift of the GPU's clock over every finalist alike. Configs are compared as tuples (lists are converted)."""
    configs = [tuple(c) for c in configs]
    times: dict = {c: [] for c in configs}
    for _ in range(rounds):
        for c in configs:
            times[c].append(bench_graph(run(c), copies))
    med = {c: statistics.median(v) for c, v in times.items()}
    best = min(med, key=med.get)
    return best, med[best]


def save_table(name: str, table, device=None) -> str:
    """Write a tuned table as this GPU's user table (``dispatch.table.save``; never into the package)."""
    return _table.save(name, table, device)


def load_table(name: str, device=None) -> Optional[_table.TunedTable]:
    """This GPU's ``name`` table: the user's, else the shipped one (``dispatch.table.load``)."""
    return _table.load(name, device)
