"""Engine-neutral step policies: ``plan(state) -> StepPlan``, decodes first, then prefill chunks.

The idea is Sarathi-Serve's stall-free batching: every step runs all ongoing decodes (a decode is never
paused for a prefill) and fills the rest of the step with prefill chunks, so a long prompt is spread over
steps instead of stalling everyone's next token. Sarathi-Serve and vLLM size that fill with a fixed
per-step token budget (vLLM's ``max_num_batched_tokens``), chosen offline by profiling. A fixed budget is
wrong for a model compiled with selective error compensators: which linears carry an EC, at which rank
and through which kernel route changes what a token costs, so the same budget either breaks the
inter-token-latency (ITL) SLO or leaves time unused (longer time to first token). ``SloChunkPolicy``
therefore asks the compiled model's own latency model, each step, for the largest prefill that keeps the
*predicted* step time within the SLO (the token budget becomes a time budget). ``StaticChunkPolicy`` is
the fixed-budget baseline.

Contract of ``SloChunkPolicy.plan`` (the Hypothesis tests check each point):

1. Decodes first, in the state's order; a decode that needs a new KV block when none is left is not run
   and is listed in ``preempt_ids`` (the youngest ones, since the older got the blocks first); the engine
   preempts them (frees their blocks, re-queues them with their arrival, to be recomputed).
2. Prefill pieces go to waiting requests in arrival order (FCFS). A request gets a piece only if every
   older waiting request got its whole remaining prompt this step, so the oldest is never overtaken and
   at most one request is ever partly prefilled. The oldest progresses whenever its piece fits; when it
   does not fit beside the decodes, nothing is admitted, so the decodes drain and it fits later: no
   starvation.
3. Each piece is the largest that keeps the predicted step time <= ``slo_itl_ms``, the KV blocks within
   the free ones, and the step's prefill tokens <= ``max_chunk`` (found by binary search over the
   prediction, which is monotone in the piece size).
4. No tiny tail: a piece shorter than the request's remainder must leave at least ``min_chunk`` tokens;
   if the cut would leave fewer, the remainder is merged into this piece when that fits, else the piece
   shrinks to leave exactly ``min_chunk``; a partial piece shorter than ``min_chunk`` is not planned (the
   request waits). A whole remainder shorter than ``min_chunk`` (a short prompt) is planned as it is.
5. Forced admission: when the oldest request's minimal piece (``min_chunk``, or its whole remainder when
   that is shorter, or when the cut would leave a tiny tail) would exceed the SLO even in a step of its
   own, it can never fit; it is then planned at that minimal size beside the decodes, and the plan is
   marked ``forced`` (its predicted time exceeds the SLO knowingly). This is the only case a plan's
   prediction exceeds the SLO because of prefill.
6. Decodes alone over the SLO (a decode batch too large for the SLO): all decodes still run (stalling
   some would not meet their SLO either), no prefill is admitted except a forced one (5.), and the plan's
   ``predicted_ms`` states the overrun. Admissions pause, so the decode batch drains back under the SLO.
7. KV: a plan never takes more blocks than are free. If nothing can run at all (no decodes, and the
   oldest request's next piece cannot get a block), the request needs more KV than the cache has and
   ``SchedulingError`` says so (admission control should have refused it).

The policy is stateless (state in, plan out): cancellation is the engine removing the request from the
next state and adding its blocks back to ``free_blocks``. Cost: one prediction is a few additions and a
bisect on the combined M table; a piece needs one prediction when the whole remainder fits and about
log2(max_chunk) otherwise (``sched_cost.py`` measures it).
"""
from __future__ import annotations

import bisect
import math
from typing import List, Optional, Tuple

from .latency import LatencyModel
from .state import SchedulerState, StepPlan, new_blocks, tokens_fitting


class SchedulingError(RuntimeError):
    """No step can be planned: a request needs more KV cache than exists."""


def _check_pos(owner: str, name: str, v) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{owner}: {name}={v!r} must be a positive integer")


def _decodes(state: SchedulerState):
    """Decodes that get their KV block (in order) and those that do not (to preempt); blocks left."""
    bs, free = state.kv.block_size, state.kv.free_blocks
    ctxs = [d.context_len for d in state.decodes]
    need = sum(1 for c in ctxs if c % bs == 0)
    if need <= free:  # the common case: every decode gets its block
        return [d.request_id for d in state.decodes], [], sum(ctxs), free - need
    run, preempt, ctx = [], [], 0
    for d in state.decodes:
        need = 1 if d.context_len % bs == 0 else 0
        if need > free:
            preempt.append(d.request_id)
            continue
        free -= need
        run.append(d.request_id)
        ctx += d.context_len
    return run, preempt, ctx, free


def _stuck(state: SchedulerState, w) -> None:
    raise SchedulingError(
        f"request {w.request_id!r} cannot get the KV blocks for its prompt and nothing is running to free "
        f"any ({state.kv.free_blocks} free blocks of {state.kv.block_size} tokens, {w.prefilled} tokens cached, "
        f"{w.remaining_prompt} to prefill): it needs more KV cache than the engine has")


class SloChunkPolicy:
    """Dynamic prefill chunks under an ITL SLO, from the compiled model's latency model (module docstring).

    ``max_chunk`` caps the step's prefill tokens (keep it within the latency model's measured M range);
    ``min_chunk`` is the smallest partial piece worth a step (the no-tiny-tail rule)."""

    def __init__(self, latency_model: LatencyModel, slo_itl_ms: float, max_chunk: int = 2048, min_chunk: int = 32) -> None:
        if not isinstance(latency_model, LatencyModel):
            raise ValueError(f"SloChunkPolicy: latency_model={latency_model!r} must be a LatencyModel")
        if isinstance(slo_itl_ms, bool) or not isinstance(slo_itl_ms, (int, float)) or not (0 < slo_itl_ms < math.inf):
            raise ValueError(f"SloChunkPolicy: slo_itl_ms={slo_itl_ms!r} must be a positive finite number")
        _check_pos("SloChunkPolicy", "max_chunk", max_chunk)
        _check_pos("SloChunkPolicy", "min_chunk", min_chunk)
        if min_chunk > max_chunk:
            raise ValueError(f"SloChunkPolicy: min_chunk={min_chunk} must be <= max_chunk={max_chunk}")
        self.model, self.slo, self.max_chunk, self.min_chunk = latency_model, float(slo_itl_ms), max_chunk, min_chunk

    def __repr__(self) -> str:
        return f"SloChunkPolicy(slo_itl_ms={self.slo}, max_chunk={self.max_chunk}, min_chunk={self.min_chunk})"

    def _largest(self, hi: int, tokens: int, seqs: int, attn: float, prefilled: int) -> int:
        """The largest c in [0, hi] whose step (the current one plus a piece of c) fits the SLO.

        The step time is ``base + k1 c + k2 c^2 + per_m(tokens + c)`` with ``per_m`` piecewise linear:
        bisect over the table's buckets inside the range for the last piece that still fits, then
        solve that piece's quadratic in closed form and correct the rounding by a step."""
        if hi <= 0:
            return 0
        base, k1, k2, per_m = self.model.piece_terms(tokens, seqs, attn, prefilled)
        slo = self.slo

        def T(c):
            return base + (k1 + k2 * c) * c + per_m(tokens + c)

        if T(hi) <= slo:
            return hi
        if T(1) > slo:
            return 0
        # breakpoints c where tokens + c is a bucket, strictly inside (1, hi)
        b = per_m.buckets
        lo_i, hi_i = bisect.bisect_right(b, tokens + 1), bisect.bisect_left(b, tokens + hi)
        lo_c, top_i = 1, hi_i  # lo_c fits
        while lo_i < hi_i:  # find the last breakpoint that fits
            mid = (lo_i + hi_i) // 2
            c = b[mid] - tokens
            if T(c) <= slo:
                lo_c, lo_i = c, mid + 1
            else:
                hi_i = mid
        start, v, s = per_m.segment(tokens + lo_c)
        # k2 c^2 + B c + C0 <= 0 on this segment
        B = k1 + s
        C0 = base + v + s * (tokens - start) - slo
        if k2 > 0:
            disc = B * B - 4 * k2 * C0
            c = int((-B + math.sqrt(max(disc, 0.0))) / (2 * k2)) if disc >= 0 else lo_c
        else:
            c = int(-C0 / B) if B > 0 else hi
        up = b[lo_i] - tokens - 1 if lo_i < top_i else hi - 1  # the next breakpoint (or hi) does not fit
        c = max(lo_c, min(c, up))
        while c < hi and T(c + 1) <= slo:
            c += 1
        while c > 0 and T(c) > slo:
            c -= 1
        return c

    def _shape(self, c: int, remaining: int) -> int:
        """The no-tiny-tail rule on the largest fitting piece ``c`` of a ``remaining`` prompt."""
        if c >= remaining:
            return remaining
        if remaining - c < self.min_chunk:
            c = remaining - self.min_chunk  # merging the rest does not fit (c is the largest that does)
        return c if c >= self.min_chunk else 0

    def _minimal(self, remaining: int) -> int:
        f = min(remaining, self.min_chunk)
        return remaining if 0 < remaining - f < self.min_chunk else f

    def plan(self, state: SchedulerState) -> StepPlan:
        model, bs = self.model, state.kv.block_size
        run, preempt, ctx, free = _decodes(state)
        blocks = state.kv.free_blocks - free
        tokens = seqs = len(run)
        attn = model.decodes_attention_ms(len(run), ctx)
        budget = self.max_chunk
        pieces: List[Tuple[object, int]] = []
        forced, reason = False, "no request waits"
        for i, w in enumerate(state.waiting_fcfs()):
            R, p = w.remaining_prompt, w.prefilled
            kv_cap = tokens_fitting(p, free, bs)
            hi = min(R, budget, kv_cap)
            c = self._shape(self._largest(hi, tokens, seqs, attn, p), R)
            if c == 0 and i == 0:
                f = self._minimal(R)
                if f <= kv_cap and model.step_ms(f, 1, model.piece_attention_ms(f, p)) > self.slo:
                    c, forced = f, True
                elif not run and not preempt and kv_cap < R:
                    _stuck(state, w)
            if c == 0:
                reason = (f"{w.request_id!r} waits: " +
                          ("KV blocks" if kv_cap < min(R, self.min_chunk) else
                           "token budget" if budget < min(R, self.min_chunk) else "the SLO"))
                break
            pieces.append((w.request_id, c))
            b = new_blocks(p, c, bs)
            free, blocks = free - b, blocks + b
            tokens, seqs, budget = tokens + c, seqs + 1, budget - c
            attn += model.piece_attention_ms(c, p)
            if c < R:
                reason = f"{w.request_id!r} continues next step ({R - c} tokens left)"
                break
            reason = "every waiting request fits"
        return StepPlan(tuple(run), tuple(pieces), model.step_ms(tokens, seqs, attn), blocks, tuple(preempt),
                        forced, reason)


class StaticChunkPolicy:
    """The fixed-budget baseline (Sarathi-Serve / vLLM style): decodes first (same KV rule as above),
    then FCFS prefill pieces with at most ``chunk`` prefill tokens per step in all, each piece the largest
    the budget and the free KV blocks allow. No latency model decides anything; when one is given, the
    plan carries its prediction (for reporting)."""

    def __init__(self, chunk: int, latency_model: Optional[LatencyModel] = None) -> None:
        _check_pos("StaticChunkPolicy", "chunk", chunk)
        if latency_model is not None and not isinstance(latency_model, LatencyModel):
            raise ValueError(f"StaticChunkPolicy: latency_model={latency_model!r} must be a LatencyModel or None")
        self.chunk, self.model = chunk, latency_model

    def __repr__(self) -> str:
        return f"StaticChunkPolicy(chunk={self.chunk})"

    def plan(self, state: SchedulerState) -> StepPlan:
        bs = state.kv.block_size
        run, preempt, ctx, free = _decodes(state)
        blocks = state.kv.free_blocks - free
        budget, pieces, chunks, reason = self.chunk, [], [], "no request waits"
        for w in state.waiting_fcfs():
            c = min(w.remaining_prompt, budget, tokens_fitting(w.prefilled, free, bs))
            if c == 0:
                if not run and not preempt and not pieces:
                    _stuck(state, w)
                reason = f"{w.request_id!r} waits: " + ("token budget" if budget == 0 else "KV blocks")
                break
            pieces.append((w.request_id, c))
            chunks.append((c, w.prefilled))
            b = new_blocks(w.prefilled, c, bs)
            free, blocks, budget = free - b, blocks + b, budget - c
            if c < w.remaining_prompt:
                reason = f"{w.request_id!r} continues next step"
                break
            reason = "every waiting request fits"
        pred = None
        if self.model is not None:
            pred = self.model.step_ms(len(run) + sum(c for c, _ in chunks), len(run) + len(chunks),
                                      self.model.decodes_attention_ms(len(run), ctx)
                                      + sum(self.model.piece_attention_ms(c, p) for c, p in chunks))
        return StepPlan(tuple(run), tuple(pieces), pred, blocks, tuple(preempt), False, reason)
