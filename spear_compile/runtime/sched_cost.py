"""The scheduler's own cost per step: time ``policy.plan(state)`` over a set of states.

Not a unit test (timings on a shared CI machine are noise); the serving benchmark reports
``sched_us_p99`` with ``plan_cost_us``, and ``python -m spear_compile.runtime.sched_cost`` prints it
for a Llama-2-7B-shaped latency model at a 16 ms SLO over busy states (64 decodes, 8 waiting), with warm
caches and with cold ones (``evict_caches`` before each plan). Why both: inside the engine the plan runs
right after a forward pass, and its cost there (2-core CPU: p50 44-70 us dynamic, 28 us static; H200 host:
p99 118-150 us dynamic) was 6-8x the warm-cache figure; the cold-cache figure reproduces it (2026-12-05).
"""
from __future__ import annotations

import random
import statistics
import time
from typing import Sequence

from .latency import AttentionCost, LatencyModel, LatencyTable, LinearTable, Overhead
from .state import KVCache, RunningDecode, SchedulerState, WaitingRequest


def plan_cost_us(policy, states: Sequence[SchedulerState], repeat: int = 20, cold: bool = False) -> dict:
    """p50 / p99 / max microseconds of ``policy.plan`` per state: each state timed ``repeat`` times, the median
    kept (warm caches); with ``cold`` each state is timed once right after ``evict_caches()``, as an engine
    plans right after a forward pass has run through the caches."""
    per = []
    for s in states:
        if cold:
            policy.plan(s)  # (first-call effects are not what is measured)
            evict_caches()
            t0 = time.perf_counter()
            policy.plan(s)
            per.append((time.perf_counter() - t0) * 1e6)
            continue
        ts = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            policy.plan(s)
            ts.append(time.perf_counter() - t0)
        per.append(statistics.median(ts) * 1e6)
    per.sort()
    return {"p50_us": per[len(per) // 2], "p99_us": per[min(len(per) - 1, int(0.99 * len(per)))], "max_us": per[-1],
            "states": len(per), "caches": "cold" if cold else "warm"}


_EVICT: list = []


def evict_caches(mb: int = 64) -> None:
    """Run ``mb`` MB through the CPU's caches and a little matmul on its cores: what a forward pass between
    two plans leaves behind (on a 2-core runner the in-engine plan measured 6-8x its warm time, and this
    reproduces it)."""
    import torch

    if not _EVICT:
        _EVICT.extend([torch.empty(mb << 20, dtype=torch.uint8), torch.randn(512, 512)])
    buf, a = _EVICT
    buf.add_(1)
    for _ in range(3):
        a @ a


def example_model() -> LatencyModel:
    """A hand-written Llama-2-7B-shaped model (H200-like magnitudes), for timing the policy only."""
    b = tuple(1 << i for i in range(13))
    lin = LatencyTable(b, tuple(0.02 + 0.00004 * m for m in b))
    return LatencyModel((LinearTable("qkvo", 4 * 32, lin), LinearTable("mlp", 3 * 32, lin.scaled(2.7))),
                        LatencyTable(b, tuple(0.05 + 0.0001 * m for m in b)),
                        AttentionCost(0.002, 1e-6, 2e-6, 1e-8), 32, Overhead(0.3, 0.0, 0.0))


def example_states(n: int = 200, seed: int = 0, decodes: int = 64, waiting: int = 8) -> list:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        dec = tuple(RunningDecode(f"d{i}", rng.randint(16, 4096)) for i in range(rng.randint(0, decodes)))
        wai = tuple(WaitingRequest(f"w{i}", i, rng.randint(1, 4096), rng.choice([0, 0, 512])) for i in range(rng.randint(0, waiting)))
        out.append(SchedulerState(dec, wai, KVCache(16, rng.randint(0, 8192))))
    return out


if __name__ == "__main__":  # pragma: no cover
    import argparse
    import json
    import os
    import platform

    from .policy import SloChunkPolicy, StaticChunkPolicy

    ap = argparse.ArgumentParser(description="the step policy's planning cost, warm and cold caches")
    ap.add_argument("--out", default=None, help="also write the numbers as JSON here")
    args = ap.parse_args()
    states = example_states()
    rows = []
    # the dynamic policy on an unpadded model and on one padded as a compiled engine pads (64 tokens)
    for pol in (SloChunkPolicy(example_model(), 16.0, 2048, 32),
                SloChunkPolicy(example_model().with_token_pad(64), 16.0, 2048, 32), StaticChunkPolicy(512)):
        for cold in (False, True):
            r = {"policy": repr(pol), **plan_cost_us(pol, states, cold=cold)}
            rows.append(r)
            print(json.dumps(r))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        meta = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cpus": os.cpu_count(),
                "machine": platform.machine(), "python": platform.python_version(),
                "command": "python -m spear_compile.runtime.sched_cost --out " + args.out,
                "states": "example_states(): 200 states, up to 64 decodes and 8 waiting"}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
