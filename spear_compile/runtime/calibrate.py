"""The step overhead, fitted on the engine's own steps.

The op tables (``measure``) time the compiled ops one by one; the overhead terms of the step-time
prediction (fixed, per token, per sequence: ``latency.Overhead``) were fitted on a synthetic step that
runs those ops back to back. A step of the serving engine also pays for what the synthetic step does not
do: transformers' batch preparation (paged-cache bookkeeping, varlen metadata), the sampler, host-device
copies, its paged attention instead of the timed SDPA, the Python between graph pieces. On the CPU
engine (SmolLM2-135M, 2026-12-03) the synthetic fit underpredicted the engine's steps 6-10x, so a
dynamic policy on it broke the SLO it planned for (``benchmarks/results/serving/2026-12-03_cpu_smollm2_eager``).

``calibrate(engine, latency_model)`` therefore runs a short workload through the engine's own generation
loop and refits the model's overhead terms on those steps (``fit.fit_scaled``; the measured parts keep
their shape in M and context and, by default, their size):

* after one unrecorded pass (first-use costs), phases of decode batch ``b`` in ``decode_batches``: ``b``
  requests that keep decoding while longer prompts are prefilled beside them, with the step's prefill
  budget cycling over ``chunks`` (a static policy per step), then a few decode-only steps; batch 1 runs
  twice, its decode at the shortest and at the longest prompt, so that a step's longest decode varies
  apart from its decode count (the fit's ``per_longest_key_ms``). The decodes'
  prompts span 64 to 1024 tokens (``decode_prompt_lengths``): calibrated on 64-token decodes only, the fit
  on an H100 (2026-12-06, ``benchmarks/results/serving/2026-12-06_h100_kv2048``) bent the parts' factor
  so far toward the fixed overhead (7.1 ms of a 7.5 ms step) that served steps, whose decodes read
  256-4096 tokens of context, were predicted with a 30 % median error (3.5 % on held-out calibration
  steps; the op tables alone: 10 %);
* every request's stream is read on a thread of its own (``_read_streams``), as a server's clients read
  them, so the steps pay the host work that served steps pay;
* every step's wall time is a gap between two successive calls of the policy inside a phase (the
  engine calls it once per step while it has work; ``step_gaps``: the gap after the planning call, or with
  asynchronous batching the one after the next call; the last step of a phase is dropped, since the gap
  after it includes the idle wait for the next phase);
* a step during which the engine captured a CUDA graph or torch.compile compiled a graph
  (``first_use.FirstUseMarker`` moved between its call and the next) is dropped: it paid a one-off
  cost of 10-30x the step, and the engine's KV padding makes new shapes appear long after a warm-up.
  On an H100 (2026-12-05) such steps were most of the calibration and the fit put 22.6 ms of fixed
  overhead on a 7 ms step;
* the fit (``fit.fit_scaled`` with ``trim``: relative error, outliers beyond 3 robust deviations
  dropped, for what the counters do not see: a collection, another process) is made on every other
  step and checked on all the rest (the held-out ``FitReport``), then made on all steps for the
  returned model.

``engine_key`` names the cache entry: the plan's key plus a fingerprint of the engine's configuration
(transformers version, block size, step token budget, request cap, compile backend), so a latency model
calibrated on one engine configuration is not used for another.
"""
from __future__ import annotations

import hashlib
import json
import threading
import time
from typing import Callable, List, Optional, Sequence, Tuple, Union

from .first_use import FirstUseMarker
from .fit import FitReport, StepSample, check, fit_scaled
from .. import envs
from .latency import LatencyModel, Overhead
from .latency_cache import CacheKey
from .policy import StaticChunkPolicy
from .step_gaps import attributed_gaps


TRIM = 3.0  # robust standard deviations beyond which a calibration step is an outlier (fit.outliers)
DECODE_PROMPT_MAX = 1024  # the longest decode prompt of the default calibration (decode_prompt_lengths)


class CyclingChunkPolicy:
    """A static chunk policy whose prefill budget cycles over ``chunks``, one per step, that records each
    call: ``(perf_counter seconds before the marker, after it, the marker, decode contexts, prefill (tokens,
    prefilled) pieces)``. ``marker``: a callable whose value changes when a step pays a first-use cost
    (``first_use.FirstUseMarker``); its own time is left out of the steps."""

    def __init__(self, chunks: Sequence[int], marker: Optional[Callable[[], object]] = None) -> None:
        if not chunks:
            raise ValueError("CyclingChunkPolicy: chunks must not be empty")
        self.policies = [StaticChunkPolicy(int(c)) for c in chunks]
        self.marker = marker
        self.calls = 0
        self.records: List[Tuple[float, float, object, Tuple[int, ...], Tuple[Tuple[int, int], ...]]] = []

    def __repr__(self) -> str:
        return f"CyclingChunkPolicy(chunks={[p.chunk for p in self.policies]})"

    def plan(self, state):
        t0 = time.perf_counter()
        mark = self.marker() if self.marker is not None else None
        t1 = time.perf_counter()
        plan = self.policies[self.calls % len(self.policies)].plan(state)
        self.calls += 1
        ctx = {d.request_id: d.context_len for d in state.decodes}
        done = {w.request_id: w.prefilled for w in state.waiting}
        self.records.append((t0, t1, mark, tuple(ctx[r] for r in plan.decode_ids),
                             tuple((c, done.get(r, 0)) for r, c in plan.prefill)))
        return plan


def step_samples(records: Sequence[tuple], lag: int = 0) -> Tuple[List[StepSample], int]:
    """Whole steps from consecutive policy calls of one busy phase, and how many were dropped as first-use
    steps: each call's work, timed by the gap ``lag`` calls later (``step_gaps``: 0 synchronous, 1 with
    asynchronous batching) from after its marker to before the next call's. Calls that planned nothing
    are skipped; the last call has no gap and is dropped; so is a gap across which the marker changed (a
    graph was captured or compiled in it)."""
    busy = [bool(r[3] or r[4]) for r in records]
    out, first_use = [], 0
    for p, g in attributed_gaps(busy, lag):
        (_, t, mark, _, _), (t2, _, mark2, _, _) = records[g], records[g + 1]
        if t2 <= t:
            continue
        if mark2 != mark:
            first_use += 1
            continue
        out.append(StepSample(records[p][3], records[p][4], (t2 - t) * 1e3))
    return out, first_use


def _read_streams(engine, rids: Sequence[str], deadline: float, timeout_s: float) -> None:
    """Read every request's stream to its end, each on a thread of its own, as a server's clients read
    them: the engine's steps then pay the host work of waking readers per token that served steps pay.
    Calibrated with one reader (``result`` of each request in turn), an H200 engine's decode-only steps
    in serving measured 1.12-1.22x its prediction, while its calibration's own were 0.89-1.15x
    (2026-12-06, ``benchmarks/results/serving/2026-12-06_h200_calibration``)."""
    errors: List[BaseException] = []

    def read(rid):
        try:
            for _ in engine.stream(rid):
                pass
        except BaseException as e:  # noqa: BLE001  (re-raised in the caller's thread)
            errors.append(e)

    threads = [threading.Thread(target=read, args=(rid,), daemon=True, name=f"calibrate-{rid}") for rid in rids]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.perf_counter()))
        if t.is_alive():
            raise TimeoutError(f"calibrate: the calibration workload took more than {timeout_s} s")
    if errors:
        raise errors[0]


def default_chunks(max_tokens: int) -> Tuple[int, ...]:
    """Prefill budgets for the calibration: 16, 64, 256, ... below ``max_tokens``, and ``max_tokens``."""
    out, c = [], 16
    while c < max_tokens:
        out.append(c)
        c *= 4
    return tuple(out) + (max_tokens,)


def decode_prompt_lengths(kv_tokens: int, batch: int, longest: int = DECODE_PROMPT_MAX) -> Tuple[int, ...]:
    """The decodes' prompt lengths of a calibration phase of ``batch`` decodes: 64, 256, 1024, ... up to
    ``longest`` and to a quarter of the KV cache shared by the batch (at least 64, the shortest)."""
    cap = max(64, min(int(longest), kv_tokens // (4 * max(1, batch))))
    out, n = [], 64
    while n <= cap:
        out.append(n)
        n *= 4
    return tuple(out)


def calibrate(engine, latency_model: LatencyModel, chunks: Optional[Sequence[int]] = None,
              decode_batches: Sequence[int] = (1, 4, 16), reps: int = 2,
              decode_prompt: Union[None, int, Sequence[int]] = None, decode_tail: int = 6, warmup: bool = True,
              vocab: Optional[int] = None, timeout_s: float = 600.0, scale: Optional[float] = 1.0,
              log: Callable[[str], None] = print) -> Tuple[LatencyModel, FitReport, List[StepSample]]:
    """``latency_model`` with its overhead (and, with ``scale=None``, its parts' factor) refitted on the steps
    of ``engine`` (started, idle), the
    held-out report, and the samples (first-use steps dropped, outliers kept). ``warmup``: run the workload
    once unrecorded first, so that fewer steps meet a shape for the first time. ``decode_prompt``: the
    decodes' prompt length(s), cycled over a phase's decodes (None: ``decode_prompt_lengths`` up to two
    steps' token budget, so the decodes' contexts span short to long and the fit sees the attention term
    grow). ``scale``: hold the
    parts' factor at this value (default 1: only the overhead is fitted), or fit it too (None;
    ``fit_scaled``). On an H200 (2026-12-06, with the model's token padding) held at 1 and fitted predicted
    the served steps alike (15.2 / 15.3 % and 13.6 / 13.6 % median at two EC densities; 16.9 / 17.1 % on
    the 2-core CPU engine); held, the parts keep the size they were measured at. The engine's policy is
    restored afterwards."""
    if not engine.running:
        raise RuntimeError("calibrate: the engine must be started (Engine.start())")
    budget = int(engine.max_batch_tokens)
    cap = engine.max_requests_per_batch or 1 << 30
    queue = int(getattr(engine, "max_queue", 1 << 30))
    batches = sorted({min(int(b), cap - 1, budget // 2, queue - 1) for b in decode_batches if b >= 1} - {0})
    if not batches:
        raise ValueError(f"calibrate: no decode batch fits (decode_batches={list(decode_batches)}, "
                         f"max_batch_tokens={budget}, max_requests_per_batch={cap})")
    chunks = tuple(chunks) if chunks else default_chunks(budget - max(batches))
    bad = [c for c in chunks if not 1 <= c <= budget - max(batches)]
    if bad:
        raise ValueError(f"calibrate: chunks {bad} must be in [1, max_batch_tokens - decode batch = "
                         f"{budget - max(batches)}]")
    vocab = int(vocab or getattr(engine.model.config, "vocab_size", 1000))
    kv_tokens = engine.kv_block_size * engine.kv_total_blocks

    def ids(n: int, seed: int) -> list:
        return [10 + (seed * 7919 + 31 * i) % max(1, vocab - 20) for i in range(n)]

    def lengths(b: int) -> Tuple[int, ...]:
        if decode_prompt is None:
            return decode_prompt_lengths(kv_tokens, b, min(DECODE_PROMPT_MAX, 2 * budget))
        return (int(decode_prompt),) if isinstance(decode_prompt, int) else tuple(int(n) for n in decode_prompt)

    def phase(b: int, first: int = 0) -> Tuple[List[StepSample], int]:
        """One phase of ``b`` decodes, their prompt lengths cycled from ``lengths(b)[first]``."""
        policy.records.clear()
        steps = len(chunks) * reps + decode_tail
        lens = lengths(b)
        short = [ids(lens[(first + s) % len(lens)], s) for s in range(b)]
        long = [ids(c, 1000 + i) for i, c in enumerate(list(chunks) * reps)]
        # the decodes outlive the prefills beside them: their own prompts take steps too (at the mean budget)
        new = steps + -(-2 * sum(map(len, short)) * len(chunks) // sum(chunks))
        need = sum(len(p) + new + 2 for p in short) + sum(len(p) + 2 for p in long)
        if need > kv_tokens:  # keep the phase inside the cache: shorter prefills
            long = [p[: max(1, len(p) * kv_tokens // (2 * need))] for p in long]
        k = queue - b  # and inside the admission queue: fewer, longer prompts
        if len(long) > k:
            flat = [t for p in long for t in p]
            long = [flat[i * len(flat) // k:(i + 1) * len(flat) // k] for i in range(k)]
        rids = [engine.add_request(p, max_new_tokens=new, eos_token_id=-1) for p in short]
        rids += [engine.add_request(p, max_new_tokens=1, eos_token_id=-1) for p in long]
        _read_streams(engine, rids, deadline, timeout_s)
        return step_samples(policy.records, getattr(engine, "step_lag", 0))

    saved, policy = engine.policy, CyclingChunkPolicy(chunks, marker=FirstUseMarker(engine))
    engine.set_policy(policy)
    samples: List[StepSample] = []
    deadline = time.perf_counter() + timeout_s
    # a lone decode at the shortest and at the longest prompt: a step's longest decode then varies apart from
    # its decode count (Overhead.per_longest_key_ms; with one phase per batch the lone decode was always the
    # shortest and every longer batch held the longest prompt)
    phases = [(b, 0) for b in batches]
    if 1 in batches and len(lengths(1)) > 1:
        phases.insert(phases.index((1, 0)) + 1, (1, len(lengths(1)) - 1))
    try:
        for b, f in phases if warmup else ():  # first runs of each shape (allocations, graph captures)
            phase(b, f)
        for b, f in phases:
            got, dropped = phase(b, f)
            samples += got
            log(f"spear_compile: calibration, decode batch {b}" + (f" (prompt {lengths(b)[f]})" if f else "")
                + f": {len(got)} steps" + (f" ({dropped} more captured or compiled a graph: left out)" if dropped else ""))
    finally:
        engine.set_policy(saved)
    if len(samples) < 8:
        raise RuntimeError(f"calibrate: only {len(samples)} steps were measured without a graph capture or "
                           f"compile; need at least 8 (more reps, or a longer warm-up)")
    report = check(fit_scaled(latency_model, samples[0::2], trim=TRIM, scale=scale)[0], samples[1::2])
    fitted, kept = fit_scaled(latency_model, samples, trim=TRIM, scale=scale)
    if not kept.all():
        log(f"spear_compile: calibration: {int((~kept).sum())} of {len(samples)} steps left out of the fit as outliers")
    return fitted, report, samples


def engine_fingerprint(engine) -> str:
    """A short hash of what shapes the engine's step cost beyond the compiled ops, and of the terms the
    calibration fits (``Overhead.FIELDS``: a calibration made before a term existed is made again)."""
    try:
        import transformers

        tv = transformers.__version__
    except ImportError:  # pragma: no cover - the engine needs transformers
        tv = "none"
    cfg = {"transformers": tv, "block_size": engine.kv_block_size, "max_batch_tokens": engine.max_batch_tokens,
           "max_requests_per_batch": engine.max_requests_per_batch, "backend": engine.backend,
           "compile_options": engine.compile_options, "attention": getattr(engine, "attention", None),
           "token_pad": getattr(engine, "token_pad", 1), "fitted": Overhead.FIELDS,
           **({"async_batching": True} if getattr(engine, "step_lag", 0) else {}),
           **({"split_kv": True} if envs.split_kv() and getattr(engine, "attention", None) == "varlen" else {})}
    return hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest()[:12]


def engine_key(plan_key: CacheKey, engine) -> CacheKey:
    """The cache key of a latency model calibrated on ``engine`` for the plan of ``plan_key``."""
    return CacheKey(plan_key.gpu, plan_key.model_id, f"{plan_key.config_hash}+engine-{engine_fingerprint(engine)}",
                    plan_key.version)


__all__ = ["CyclingChunkPolicy", "calibrate", "decode_prompt_lengths", "default_chunks", "engine_fingerprint", "engine_key", "step_samples"]
