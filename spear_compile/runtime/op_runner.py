"""Run a planned linear's compiled ops on M rows, with random weights of its shapes, for timing.

``op_runner(linear, m, device, dtype)`` builds, for each ``PlannedOp`` that runs ``m`` rows
(``plan.ops_at``), a random packed int4 weight (and EC) of the op's shapes and returns a callable that
calls the same ``torch.ops.spear`` op with the same lowering and crossover, so the dispatch takes the
route the compiled graph takes (on a GPU the Triton / Gluon kernel, on CPU the reference). Random
weights are fine here: the kernels' time does not depend on the values (the zero points are the
integral 8 of a symmetric quantizer, so the routes that ask for integral zero points see what a
quantized model gives them).
"""
from __future__ import annotations

import itertools
from typing import Callable, Optional

from .plan import PlannedLinear, PlannedOp, ops_at


def _weights(op: PlannedOp, device, dtype):
    import torch

    K, G = op.K, op.G
    ng = 1 if G <= 0 or G >= K else K // G
    out = []
    for rows, rank, gate in op.parts:
        q = torch.randint(0, 256, (rows, K // 2), dtype=torch.uint8, device=device)
        s = torch.rand(rows, ng, device=device, dtype=dtype) * 0.01 + 0.001
        z = torch.full((rows, ng), 8.0, device=device, dtype=dtype) if op.has_zeros else None
        b = torch.zeros(rows, device=device, dtype=dtype) if op.has_bias else None
        ec = None
        if rank:
            D = gate or 16
            ec = [torch.randn(rank, K, device=device, dtype=dtype) / K ** 0.5,
                  torch.randn(rows, rank, device=device, dtype=dtype) * 0.01,
                  torch.randn(D, rank, device=device, dtype=dtype) / rank ** 0.5,
                  torch.zeros(D, device=device, dtype=dtype),
                  torch.randn(rank, D, device=device, dtype=dtype) / D ** 0.5,
                  torch.zeros(rank, device=device, dtype=dtype),
                  torch.tensor(1.0, device=device, dtype=dtype)]
        out.append((q, s, z, b, ec))
    return out


def op_bytes(op: PlannedOp, dtype_bytes: int = 2) -> int:
    """Bytes of ``op``'s weights (packed int4, group scales and zeros, bias, EC factors): what one call reads
    from memory besides its activations."""
    K, G = op.K, op.G
    ng = 1 if G <= 0 or G >= K else K // G
    total = 0
    for rows, rank, gate in op.parts:
        total += rows * K // 2 + rows * ng * dtype_bytes * (2 if op.has_zeros else 1)
        total += rows * dtype_bytes if op.has_bias else 0
        if rank:
            D = gate or 16
            total += (rank * K + rows * rank + 2 * D * rank + D + rank) * dtype_bytes
    return total


def op_call(op: PlannedOp, m: int, device, dtype, weights: Optional[dict] = None, copy: int = 0) -> Callable[[], object]:
    """A zero-argument callable running ``op`` once on ``m`` rows. ``weights``: a dict that keeps each op's
    random weights across calls (every M then runs on the same weights, as the compiled model does);
    ``copy``: which of several independent weight sets (kept apart in ``weights``)."""
    import torch

    if op.layout != "spear":
        raise ValueError(f"op_runner: {op.op} has layout {op.layout!r}; only the spear layout is timed "
                         f"(write the plan's linear by hand to time it as dense F.linear)")
    ops = torch.ops.spear
    x = torch.randn(m, op.K, device=device, dtype=dtype)
    w = weights.get((op, copy)) if weights is not None else None
    if w is None:
        w = _weights(op, device, dtype)
        if weights is not None:
            weights[(op, copy)] = w
    qs, ss, zs, bs = [p[0] for p in w], [p[1] for p in w], [p[2] for p in w], [p[3] for p in w]
    G = op.G
    nw = torch.ones(op.K, device=device, dtype=dtype) if op.norm else None
    if op.op == "w4a16":
        return lambda: ops.w4a16_linear(x, qs[0], ss[0], zs[0], G, bs[0], op.layout, op.lowering, op.crossover)
    if op.op == "ec":
        e = w[0][4]
        return lambda: ops.ec_linear(x, qs[0], ss[0], zs[0], G, bs[0], *e, op.act, op.layout, op.lowering,
                                     op.crossover)
    if op.op == "w4a16_cat":
        return lambda: ops.w4a16_linear_cat(x, qs, ss, zs, G, bs, op.layout, nw)
    if op.op == "w4a16_glu":
        return lambda: ops.w4a16_linear_glu(x, qs, ss, zs, G, op.act, op.layout, nw)
    ecs = [list(t) for t in zip(*[p[4] or [None] * 7 for p in w])]  # As, Bs, W1s, b1s, W2s, b2s, alphas
    if op.op == "ec_cat":
        return lambda: ops.ec_linear_cat(x, qs, ss, zs, G, bs, *ecs, op.act, op.layout, nw)
    return lambda: ops.ec_linear_glu(x, qs, ss, zs, G, *ecs, op.act, op.layout, nw)


def linear_bytes(lin: PlannedLinear, m: int) -> int:
    """Bytes of the weights of every op of ``lin`` that runs ``m`` rows (``op_bytes``)."""
    return sum(op_bytes(o) for o in ops_at(lin.ops, m))


def op_runner(lin: PlannedLinear, m: int, device, dtype, weights: Optional[dict] = None,
              copies: int = 1) -> Callable[[], object]:
    """Run every op of ``lin`` that runs ``m`` rows (a measurement runner, ``measure.Runner``; ``weights``
    as in ``op_call``). ``copies`` > 1: each call runs on the next of ``copies`` independent weight sets
    in turn, so that calls captured back to back read their weights from memory, not from the cache the
    previous call filled (``measure.gpu_time_ms``); the runner's ``copies`` attribute says how many calls
    reach every set once (a warm-up must make each set's first-use weight layouts before a capture)."""
    if not lin.ops:
        raise ValueError(f"op_runner: {lin.name!r} has no compiled ops (a hand-written plan linear); "
                         f"time it with the reference runner")
    if isinstance(copies, bool) or not isinstance(copies, int) or copies < 1:
        raise ValueError(f"op_runner: copies={copies!r} must be an integer >= 1")
    sets = [[op_call(o, m, device, dtype, weights, j) for o in ops_at(lin.ops, m)] for j in range(copies)]
    if len(sets) == 1 and len(sets[0]) == 1:
        return sets[0][0]
    turn = itertools.cycle(sets)

    def run():
        for c in next(turn):
            c()

    run.copies = copies  # a timing's warm-up calls it at least this often (``measure.gpu_time_ms``)
    return run
