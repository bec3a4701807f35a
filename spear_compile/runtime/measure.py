"""Measuring the latency model on the current device: per-route linear tables, attention, head, whole steps.

``measure_latency_model(plan)`` times, on this device, every planned linear at each M bucket with the
route the plan says it takes there, the LM head, and attention over a coarse (new tokens, cached
tokens) grid, and composes them into a ``LatencyModel``. ``measure_steps(step_fn, grid)`` times whole
steps for the top-down check (``fit.check``) and the overhead fit (``fit.fit_overhead``).

A route is measured by a runner: ``runner(linear, m, device, dtype) -> zero-argument callable`` that
runs that linear once on ``m`` rows. The ``"reference"`` runner is dense ``F.linear`` plus, with an
EC, the two skinny matmuls ``(x @ A) @ B`` (what an unfused EC costs). A linear the backend recorded
(``PlannedLinear.ops``) is timed by running its compiled spear ops (``op_runner``, on the same weights
at every M), so the dispatch takes the route the compiled graph takes; other routes plug in through
``runners={"route name": runner}``. ``SyntheticStep`` runs a whole step from the same ops, for CPU
checks; an engine's real step function replaces it on a GPU.

The parts are timed as the engine runs them: on CUDA the GPU time of each inside a CUDA graph
(``gpu_time_ms``), a compiled linear's calls cycling over enough weight copies that they read HBM, not
the L2 cache (``weight_copies``); on CPU the median wall time of ``reps`` runs after ``warmup`` (``time_ms``); whole
steps are timed by wall clock. On CPU the defaults are coarse (M up to 256, a few attention points), so
a small model measures in seconds.
"""
from __future__ import annotations

import itertools
import statistics
import time
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from .fit import StepSample, fit_overhead
from .latency import AttentionCost, LatencyModel, LatencyTable, LinearTable, Overhead
from .op_runner import linear_bytes, op_runner
from .plan import Plan, PlannedLinear

Runner = Callable[..., Callable[[], object]]
DENSE_STEP, DENSE_TO = 64, 512  # default_buckets: every multiple of 64 rows up to 512


def _torch():
    import torch

    return torch


def _sync(device) -> None:
    torch = _torch()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device="cpu", warmup: int = 2, reps: int = 5) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` runs after ``warmup`` runs, wall clock with a device
    synchronise after each run (so on CUDA it includes the host's launch work)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def gpu_time_ms(fn: Callable[[], object], device="cuda", warmup: int = 2, reps: int = 5, calls: int = 10) -> float:
    """Median GPU milliseconds of one ``fn()`` as it runs inside a CUDA graph: ``calls`` calls captured in
    one graph, replayed ``reps`` times between CUDA events, divided by ``calls``.

    This is how the serving engine runs the ops (its steps are CUDA-graph replays), so the op tables
    carry no host launch cost: timed with ``time_ms`` instead, the op tables of a Llama-2-7B-shaped W4
    model summed to 71 ms for a batch-1 decode step that the engine ran in 29 ms (H100, 2026-12-05,
    ``benchmarks/results/serving/2026-12-05_h100_llama2_partial``); timed so, the op tables alone predicted
    the engine's served steps within 10-15 % median on an H100 (``.../2026-12-05_h100_varlen_kv256``). The
    warm-up runs outside the capture (first-use allocations, layouts, autotuning). The timing is the
    kernel tuner's (``dispatch.tuning.bench_graph``). ``fn`` must be capturable: a failed capture raises
    (it would leave torch's CUDA generator unusable, so there is no eager retry). A runner that cycles over
    weight copies (``op_runner(copies=n)``, its ``copies`` attribute) is warmed up at least ``n`` times, so
    every copy's first-use layouts are made before the capture."""
    torch = _torch()
    from ..dispatch.tuning import bench_graph

    warmup = max(warmup, getattr(fn, "copies", 1))
    with torch.cuda.device(torch.device(device)):
        return bench_graph(lambda i: fn(), copies=1, calls=calls, replays=reps, warmup=warmup) / 1e3


def part_time_ms(fn: Callable[[], object], device="cpu", warmup: int = 2, reps: int = 5, calls: int = 10) -> float:
    """How a part of the step (one linear's ops, attention, the head) is timed for the tables: GPU time in
    a CUDA graph of ``calls`` calls on CUDA (``gpu_time_ms``), wall clock elsewhere (``time_ms``)."""
    torch = _torch()
    if torch.device(device).type == "cuda":
        return gpu_time_ms(fn, device, warmup, reps, calls)
    return time_ms(fn, device, warmup, reps)


def weight_copies(lin: PlannedLinear, m: int, device) -> int:
    """Independent weight sets for timing ``lin`` at ``m`` rows: on CUDA enough that one sweep of them is
    3x the L2 cache (``dispatch.tuning.copies_for``), so each call reads its weights from HBM as the
    engine's step does (every layer's weights in turn); 1 elsewhere. An H200's L2 is 50 MiB and a
    4096x4096 W4 weight 8.4 MiB: replayed on one weight set, a linear's weights stay in L2. (The 0.59 ms
    of linears that an H200's op tables once summed to for a Llama-2-7B-shaped batch-1 decode, taken for
    L2 reads, was one layer's: the plan then counted a layer frame's graph once,
    ``compiled.instance_records``.) On an H100 one set and copies measured within 0.90-1.00 of each
    other (``benchmarks/results/latency_tables_l2/2026-12-06_h100``)."""
    if _torch().device(device).type != "cuda" or not lin.ops:
        return 1
    from ..dispatch.tuning import copies_for

    return copies_for(linear_bytes(lin, m))


def _dtype(plan: Plan, device, dtype):
    torch = _torch()
    if dtype is not None:
        return dtype
    if torch.device(device).type == "cpu":
        return torch.float32  # CPU half-precision matmuls are emulated and not what a CPU deployment runs
    return getattr(torch, plan.dtype)


def reference_runner(lin: PlannedLinear, m: int, device, dtype) -> Callable[[], object]:
    """Dense ``F.linear`` on ``m`` rows, plus the unfused EC ``(x @ A) @ B`` when ``ec_rank > 0``."""
    torch = _torch()
    F = torch.nn.functional
    x = torch.randn(m, lin.in_features, device=device, dtype=dtype)
    w = torch.randn(lin.out_features, lin.in_features, device=device, dtype=dtype)
    if lin.ec_rank:
        a = torch.randn(lin.in_features, lin.ec_rank, device=device, dtype=dtype)
        b = torch.randn(lin.ec_rank, lin.out_features, device=device, dtype=dtype)
        return lambda: F.linear(x, w) + (x @ a) @ b
    return lambda: F.linear(x, w)


DEFAULT_RUNNERS: Dict[str, Runner] = {"reference": reference_runner}


def default_buckets(max_m: int, step: int = DENSE_STEP, dense_to: int = DENSE_TO) -> Tuple[int, ...]:
    """The M rows the linear tables are measured at, up to ``max_m`` (always included): powers of two
    below ``step``, every multiple of ``step`` up to ``dense_to``, then powers of two and the midpoints
    between them (768, 1024, 1536, 2048, ...).

    Why dense from 64 to 512: the kernel route keys its configuration by the next power of two of M
    (``dispatch.table.m_bucket``), so a step of 192 rows runs the 256-row kernel and costs close to it,
    not the midpoint of 128 and 256. A compiled, CUDA-graphed engine pads a step's tokens to multiples of
    64 (``LatencyModel.token_pad``), so those are the Ms its steps run at. With powers of two only, an H100
    serving run (Llama-2-7B shape, ECs on 25 %; ``benchmarks/results/serving/2026-12-06_h100_m256_table``)
    ran its steps padded to 192 tokens at a median 1.16x their prediction (64 and 128: 0.99 and 0.98x),
    and those were most of the steps over its 16 ms SLO. Above 512 the GEMMs are compute bound and near
    linear in M, so 1.5x steps suffice."""
    if isinstance(max_m, bool) or not isinstance(max_m, int) or max_m < 1:
        raise ValueError(f"default_buckets: max_m={max_m!r} must be a positive integer")
    out, m = set(), 1
    while m < min(step, max_m):
        out.add(m)
        m *= 2
    out.update(range(step, min(dense_to, max_m) + 1, step))
    m = dense_to
    while m < max_m:
        out.update(v for v in (m, m * 3 // 2) if v < max_m)
        m *= 2
    out.add(max_m)
    return tuple(sorted(out))


def default_attention_grid(max_m: int, max_context: int) -> Tuple[Tuple[int, int], ...]:
    """``(q, p)`` points: decodes (q = 1) over contexts, and chunks of a few sizes over a few contexts."""
    qs = sorted({1, min(16, max_m), min(64, max_m), max_m})
    ps = sorted({0, min(64, max_context), max_context})
    return tuple((q, p) for q in qs for p in ps)


def _attention_fn(plan: Plan, q: int, p: int, device, dtype) -> Callable[[], object]:
    torch = _torch()
    F = torch.nn.functional
    H, Hkv, D = plan.n_heads, plan.n_kv_heads, plan.head_dim
    Q = torch.randn(1, H, q, D, device=device, dtype=dtype)
    K = torch.randn(1, H, p + q, D, device=device, dtype=dtype)  # KV heads repeated to H (GQA's read is
    V = torch.randn(1, H, p + q, D, device=device, dtype=dtype)  # of Hkv heads; the fit absorbs the ratio)
    if Hkv != H:
        K, V = K[:, :Hkv].repeat_interleave(H // Hkv, 1), V[:, :Hkv].repeat_interleave(H // Hkv, 1)
    if q == 1:
        return lambda: F.scaled_dot_product_attention(Q, K, V)
    mask = torch.arange(p + q, device=device)[None, :] <= (p + torch.arange(q, device=device))[:, None]
    return lambda: F.scaled_dot_product_attention(Q, K, V, attn_mask=mask)


def _progress(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, leave=False)


def measure_latency_model(plan: Plan, device="cpu", dtype=None, max_m: Optional[int] = None,
                          buckets: Optional[Sequence[int]] = None,
                          attention_grid: Optional[Sequence[Tuple[int, int]]] = None, max_context: int = 1024,
                          runners: Optional[Dict[str, Runner]] = None, warmup: int = 2, reps: int = 5,
                          progress: bool = True, log: Callable[[str], None] = print) -> LatencyModel:
    """Time the plan's parts on ``device`` and compose them (overhead left at zero: fit it with
    ``measure_steps`` + ``fit_overhead``, or use ``measure_and_fit``)."""
    torch = _torch()
    device = torch.device(device)
    dtype = _dtype(plan, device, dtype)
    if max_m is None:
        max_m = 256 if device.type == "cpu" else 4096
    buckets = tuple(buckets) if buckets is not None else default_buckets(max_m)
    grid = tuple(attention_grid) if attention_grid is not None else default_attention_grid(buckets[-1], max_context)
    runners = {**DEFAULT_RUNNERS, **(runners or {})}
    missing = sorted({r for lin in plan.linears if not lin.ops for r in lin.route_names} - set(runners))
    if missing:
        raise ValueError(f"measure_latency_model: no runner for route(s) {missing} of {plan.model_id!r} "
                         f"(known: {sorted(runners)})")
    head_lin = PlannedLinear("lm_head", plan.hidden_size, plan.vocab_size)
    total = (len(plan.linears) + 1) * len(buckets) + len(grid)
    log(f"spear_compile: measuring the latency model of {plan.model_id!r} on {device} "
        f"({len(plan.linears)} linears + head x {len(buckets)} M buckets, {len(grid)} attention points)")
    bar = _progress(total, f"latency tables ({device.type})", progress)
    tables: List[LinearTable] = []
    try:
        with torch.inference_mode():
            for lin in plan.linears + (head_lin,):
                ms, weights = [], {}  # a recorded linear's ops keep their weights across the buckets
                for m in buckets:
                    n = weight_copies(lin, m, device)
                    fn = (op_runner(lin, m, device, dtype, weights, copies=n) if lin.ops else
                          runners[lin.route_at(m)](lin, m, device, dtype))
                    ms.append(part_time_ms(fn, device, warmup, reps, calls=max(10, n)))
                    if bar is not None:
                        bar.update(1)
                tables.append(LinearTable(lin.name, lin.count, LatencyTable.monotone(buckets, ms)))
            samples = []
            for q, p in grid:
                samples.append((q, p, part_time_ms(_attention_fn(plan, q, p, device, dtype), device, warmup, reps)))
                if bar is not None:
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    head = tables.pop().table
    return LatencyModel(tuple(tables), head, AttentionCost.fit(samples), plan.n_layers, Overhead(), plan.head_rows)


# ---------------------------------------------------------------- whole steps


class SyntheticStep:
    """A whole step built from the reference ops of a plan (random weights): every linear ``count``
    times on M rows, attention per sequence per layer, the head on one row per sequence (or all rows).
    Callable as ``step(decode_contexts, prefill_chunks)``, the protocol ``measure_steps`` times.

    The compiled linears run layer by layer (each linear's ``count`` calls interleaved with the others'),
    so each call reads its weights from memory, not from the L2 cache the previous call filled: on CUDA
    they cycle over ``_runners``' weight sets, all made and run once when the step first meets an M
    (outside any capture), so the step can be captured in a CUDA graph: ``measure_steps`` times it so
    (``graphable``), the way the engine replays its steps and the parts were timed. (Per-linear weight
    copies, each linear's calls back to back, ran an H100 out of memory beside the engine's KV cache.)
    Timed eagerly its 224 linear launches (a Llama-2-7B-shaped plan) are the host's: 45 ms of fitted
    fixed overhead for an 8.9 ms engine step on an H200 (2026-12-06)."""

    graphable = True

    def __init__(self, plan: Plan, device="cpu", dtype=None, max_m: int = 256, max_context: int = 1024) -> None:
        del max_context  # attention inputs are made per (q, p) on first use
        torch = _torch()
        self.plan, self.device = plan, torch.device(device)
        self.dtype = _dtype(plan, self.device, dtype)
        d, t = self.device, self.dtype
        self.W = [(lin.count, torch.randn(lin.out_features, lin.in_features, device=d, dtype=t),
                   (torch.randn(lin.in_features, lin.ec_rank, device=d, dtype=t),
                    torch.randn(lin.ec_rank, lin.out_features, device=d, dtype=t)) if lin.ec_rank else None)
                  for lin in plan.linears if not lin.ops]
        self.compiled = [lin for lin in plan.linears if lin.ops]  # run through their ops, per M made once
        self._calls: dict = {}
        self._weights: dict = {}  # their random weights, shared by every M
        # contiguous inputs per width and per (q, p) shape, made once (a strided view would send CPU
        # matmuls and attention down slower paths than the ones the tables timed)
        self.X = {k: torch.randn(max_m, k, device=d, dtype=t)
                  for k in {lin.in_features for lin in plan.linears} | {plan.hidden_size}}
        self.head = torch.randn(plan.vocab_size, plan.hidden_size, device=d, dtype=t)
        self._attn: dict = {}

    def _runners(self, m: int) -> list:
        """``(linear, runner)`` of every compiled linear at ``m`` rows. On CUDA each cycles over as many weight
        sets as make one layer-by-layer round of all of them 3x the L2 cache (one set where a round of
        one layer already is: a Llama-2-7B layer's W4 linears are ~100 MB), and every set is run once
        here, outside any capture, to make its first-use state."""
        n = 1
        if self.device.type == "cuda" and self.compiled:
            from ..dispatch.tuning import copies_for

            n = copies_for(sum(linear_bytes(lin, m) for lin in self.compiled))
        out = [(lin, op_runner(lin, m, self.device, self.dtype, self._weights, copies=n)) for lin in self.compiled]
        for _ in range(n if n > 1 else 0):
            for _, call in out:
                call()
        return out

    def _attention_inputs(self, q: int, p: int):
        got = self._attn.get((q, p))
        if got is None:
            torch = _torch()
            H, D, d, t = self.plan.n_heads, self.plan.head_dim, self.device, self.dtype
            mask = None
            if q > 1:
                mask = torch.arange(p + q, device=d)[None, :] <= (p + torch.arange(q, device=d))[:, None]
            got = self._attn[(q, p)] = (torch.randn(1, H, q, D, device=d, dtype=t),
                                        torch.randn(1, H, p + q, D, device=d, dtype=t), mask)
        return got

    def __call__(self, decode_contexts: Sequence[int], prefill_chunks: Sequence[Tuple[int, int]]) -> None:
        torch = _torch()
        F = torch.nn.functional
        seqs = [(1, c) for c in decode_contexts] + [(q, p) for q, p in prefill_chunks]
        m = sum(q for q, _ in seqs)
        with torch.inference_mode():
            for count, w, ec in self.W:
                x = self.X[w.shape[1]][:m]
                for _ in range(count):
                    y = F.linear(x, w)
                    if ec is not None:
                        y = y + (x @ ec[0]) @ ec[1]
            calls = self._calls.get(m)
            if calls is None:
                calls = self._calls[m] = self._runners(m)
            for layer in range(max((lin.count for lin in self.compiled), default=0)):
                for lin, call in calls:  # layer by layer, as the model runs them
                    if layer < lin.count:
                        call()
            inputs = [self._attention_inputs(q, p) for q, p in seqs]
            for _ in range(self.plan.n_layers):
                for Q, K, mask in inputs:
                    F.scaled_dot_product_attention(Q, K, K, attn_mask=mask)
            rows = len(seqs) if self.plan.head_rows == "last" else m
            F.linear(self.X[self.plan.hidden_size][:rows], self.head)


def default_step_grid(max_m: int, contexts: Sequence[int] = (64, 512), decode_batches: Sequence[int] = (0, 1, 4, 16),
                      prefill_tokens: Sequence[int] = (0, 16, 64)) -> Tuple[Tuple[Tuple[int, ...], Tuple[Tuple[int, int], ...]], ...]:
    """``(decode_contexts, prefill_chunks)`` points over (prefill tokens, decode batch, context)."""
    out = []
    for n_pre, batch, ctx in itertools.product(sorted({min(t, max_m) for t in prefill_tokens} | {max_m}),
                                               decode_batches, contexts):
        if n_pre + batch == 0 or n_pre + batch > max_m:
            continue
        out.append((tuple([ctx] * batch), ((n_pre, ctx),) if n_pre else ()))
    return tuple(out)


def measure_steps(step_fn: Callable, grid: Iterable, device="cpu", warmup: int = 1, reps: int = 3,
                  progress: bool = True) -> List[StepSample]:
    """Time ``step_fn(decode_contexts, prefill_chunks)`` at every grid point: by wall clock, or on CUDA
    as a CUDA-graph replay (``gpu_time_ms``, after ``max(warmup, 1)`` eager runs) when the step says it
    can be captured (a true ``graphable`` attribute, as ``SyntheticStep``)."""
    grid = list(grid)
    bar = _progress(len(grid), "whole steps", progress)
    graphed = _torch().device(device).type == "cuda" and getattr(step_fn, "graphable", False)
    out = []
    try:
        for dec, pre in grid:
            if graphed:
                ms = gpu_time_ms(lambda: step_fn(dec, pre), device, max(warmup, 1), reps, calls=1)
            else:
                ms = time_ms(lambda: step_fn(dec, pre), device, warmup, reps)
            out.append(StepSample(tuple(dec), tuple(pre), max(ms, 1e-6)))
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return out


def measure_and_fit(plan: Plan, step_fn: Optional[Callable] = None, device="cpu", max_m: Optional[int] = None,
                    grid: Optional[Iterable] = None, **kw) -> Tuple[LatencyModel, List[StepSample]]:
    """Measure the tables, time whole steps (``step_fn``, default a ``SyntheticStep``), fit the overhead
    on them; returns the model and the step samples (pass them to ``latency.check`` for the report; a
    held-out grid gives an honest one)."""
    torch = _torch()
    device = torch.device(device)
    if max_m is None:
        max_m = 256 if device.type == "cpu" else 4096
    progress = kw.get("progress", True)
    model = measure_latency_model(plan, device=device, max_m=max_m, **kw)
    step_fn = step_fn or SyntheticStep(plan, device, kw.get("dtype"), max_m, kw.get("max_context", 1024))
    samples = measure_steps(step_fn, grid if grid is not None else default_step_grid(max_m), device,
                            progress=progress)
    return fit_overhead(model, samples), samples
