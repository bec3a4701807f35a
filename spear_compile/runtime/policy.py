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

1. Decodes first, in the state's order. When the free KV blocks do not cover the decodes' new blocks,
   the youngest KV holders are preempted until they do: first the partly prefilled waiting request (its
   prefill restarts later), then decodes from the youngest. They are listed in ``preempt_ids``; the
   engine frees their blocks *before* running the step (the plan counts them as free) and re-queues them
   with their arrival, to be recomputed. Preempting by age keeps the oldest request progressing, so a
   prefill that grabbed the last blocks cannot starve an older decode (nor loop with it). No prefill is
   planned in a step that preempts the partly prefilled request.
2. Prefill pieces go to waiting requests in arrival order (FCFS). A request gets a piece only if every
   older waiting request got its whole remaining prompt this step, so the oldest is never overtaken and
   at most one request is ever partly prefilled. The oldest progresses whenever its piece fits; when it
   does not fit beside the decodes, nothing is admitted, so the decodes drain and it fits later: no
   starvation.
3. Each piece is the largest that keeps the predicted step time <= ``slo_itl_ms`` (less the online
   correction's offset when the policy has one: ``SloChunkPolicy``, ``online``), the KV blocks within
   the free ones, and the step's prefill tokens <= ``max_chunk`` (found by binary search over the
   prediction, which is monotone in the piece size).
4. No tiny tail: a piece shorter than the request's remainder must leave at least ``min_chunk`` tokens;
   if the cut would leave fewer, the remainder is merged into this piece when that fits, else the piece
   shrinks to leave exactly ``min_chunk``; a partial piece shorter than ``min_chunk`` is not planned (the
   request waits). A whole remainder shorter than ``min_chunk`` (a short prompt) is planned as it is.
   A remainder longer than ``max_chunk`` but shorter than ``2 * min_chunk`` has no cut that keeps both
   sides at ``min_chunk`` (only when ``min_chunk > max_chunk / 2``): it gets the largest piece that fits.
5. Forced admission: when the oldest request's minimal piece (``min_chunk``; its whole remainder when
   that is shorter, or when a ``min_chunk`` cut would leave a tiny tail and the whole remainder is within
   ``max_chunk``) would exceed the SLO even in a step of its own, it can never fit; it is then planned
   at that minimal size beside the decodes, and the plan is marked ``forced`` (its predicted time
   exceeds the SLO knowingly). This is the only case a plan's prediction exceeds the SLO because of
   prefill.
6. Decodes alone over the SLO (a decode batch too large for the SLO): all decodes still run (stalling
   some would not meet their SLO either), no prefill is admitted except a forced one (5.), and the plan's
   ``predicted_ms`` states the overrun. Admissions pause, so the decode batch drains back under the SLO.
7. KV: a plan never takes more blocks than are free (plus those it preempts). If the oldest request is
   the only KV holder (nothing runs) and the free blocks cannot hold the rest of its prompt, it needs
   more KV than the cache has and ``SchedulingError`` says so (admission control should have refused
   it).
8. Decode headroom (``decode_headroom=True``; off by default): a request whose prefill has not started
   starts only when the decode-only step it will join is predicted within the SLO (less the online
   correction's decode-only offset): the running decodes, the requests already given a piece this step,
   and it, each at its whole prompt's context. Rules 3-5 size a step *with* prefill; a step of decodes
   alone, which no chunk size can cut, ran over the SLO once enough long requests ran together (H100, ECs
   on every linear, 16 ms SLO: 12 decode-only steps of 4 decodes with the longest near 2.8k tokens took
   16.0-16.8 ms, ``benchmarks/results/serving/2026-12-07_h100_online_correction_ab``). With no decode
   running the request starts regardless (a decode batch of one that breaks the SLO is rule 6's case, and
   nothing would ever drain), so the rule cannot starve anyone; nor does it apply when the decodes alone
   are predicted over the SLO already (rules 5 and 6 decide then). It projects contexts at the prompt's
   end, not at the end of the output the request will decode (the state does not carry it). Why off:
   served A/B on one H200 (Llama-2-7B-shaped W4, ECs on 25 / 100 %, 16 and 22 ms SLOs,
   ``benchmarks/results/serving/2026-12-07_h200_static_vs_dynamic``) it changed neither p99 ITL (16.41 /
   16.66 / 22.54 / 21.93 ms with it, 16.83 / 16.74 / 21.41 / 21.83 without) nor the share of decode-only
   steps over a 16 ms SLO (34 of 630 and 35 of 597 with it, 40 of 664 and 33 of 539 without): it plans the
   decode batch right at the budget, and steps planned at the budget run over it about as often as not
   (4 decodes near 2.5k context: median 15.97 ms, 20 of 45 over 16).

The policy is stateless (state in, plan out): cancellation is the engine removing the request from the
next state and adding its blocks back to ``free_blocks``. Cost: the step time of a piece of c tokens is a
quadratic in c plus the combined per-M table, so a piece needs one prediction when the whole remainder
fits, and otherwise a bisection over the table's buckets in range plus a closed-form root on one
segment; with a padded model (``LatencyModel.token_pad``) a bisection over the pad units, on a list of
the per-unit costs, and a closed-form root inside one (2-core CPU, ``sched_cost``'s states, the padded
search before and after that list, in one process: p50 25-27 -> 17.5 us with warm caches, 76 -> 65 us
planned 2 ms after the last plan). In the engine the plan runs right after a forward pass, with the CPU's
caches cold, which made it 3-8x its warm-cache time (a 2 ms sleep between plans does the same: it is the
CPU's idle state, not the policy's work, and the static policy pays it too, 54 us p50); so it walks the decodes once and builds its plan without re-checking what
the checked state guarantees (``StepPlan.unchecked``). ``python -m spear_compile.runtime.sched_cost``
measures it over states of up to 64 decodes and 8 waiting (records under
``benchmarks/results/serving/*_cpu_plan_*``).
"""
from __future__ import annotations

import bisect
import math
from typing import List, Optional, Tuple

from .latency import LatencyModel
from .state import SchedulerState, StepPlan, blocks_for, new_blocks, tokens_fitting


class SchedulingError(RuntimeError):
    """No step can be planned: a request needs more KV cache than exists."""


def _check_pos(owner: str, name: str, v) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{owner}: {name}={v!r} must be a positive integer")


def _decodes(state: SchedulerState):
    """Which decodes run and which requests to preempt so that they get their KV blocks.

    Returns ``(run ids, preempt ids, summed context of run, longest context of run, free blocks left,
    partial head preempted)``.
    When blocks run short, the youngest KV holders are preempted first: the partly prefilled waiting
    request (younger than every decode, FCFS admitted it last), then decodes from the youngest; their
    blocks count as free in this step (the engine frees them before it runs the step)."""
    bs, free = state.kv.block_size, state.kv.free_blocks
    ids, ctx, need, longest = [], 0, 0, 0
    for d in state.decodes:  # one pass: the plan runs with cold caches, each walk over the decodes costs
        c = d.context_len
        ids.append(d.request_id)
        ctx += c
        need += c % bs == 0
        if c > longest:
            longest = c
    if need <= free:  # the common case: every decode gets its block
        return ids, [], ctx, longest, free - need, False
    preempt, head_out = [], False
    partial = [w for w in state.waiting if w.prefilled > 0]
    for w in sorted(partial, key=lambda w: -w.arrival):
        if need <= free:
            break
        preempt.append(w.request_id)
        free += blocks_for(w.prefilled, bs)
        head_out = True
    run = list(state.decodes)
    while need > free:
        d = run.pop()
        preempt.append(d.request_id)
        free += blocks_for(d.context_len, bs)
        need -= 1 if d.context_len % bs == 0 else 0
    return ([d.request_id for d in run], preempt, sum(d.context_len for d in run),
            max((d.context_len for d in run), default=0), free - need, head_out)


def _unblock_plan(state: SchedulerState, run, preempt, free: int, predicts: bool) -> Optional[StepPlan]:
    """The step that only preempts younger partial prefills to free KV for the oldest request
    (``_unblock``), or None when nothing needs preempting; shared by both policies."""
    unblock = _unblock(state, run, preempt, free)
    if not unblock:
        return None
    return StepPlan.unchecked((), (), 0.0 if predicts else None, 0, tuple(unblock), False,
                    "younger partial prefills preempted to free KV for the oldest")


def _unblock(state: SchedulerState, run, preempt, free) -> list:
    """Nothing runs and the oldest request cannot get the KV for the rest of its prompt while younger
    partial prefills hold blocks: preempt those (the youngest first), or nothing could ever progress."""
    if run or preempt or not state.waiting:
        return []
    fcfs = state.waiting_fcfs()
    head, bs = fcfs[0], state.kv.block_size
    out = []
    for w in reversed(fcfs[1:]):
        if tokens_fitting(head.prefilled, free, bs) >= head.remaining_prompt:
            break
        if w.prefilled:
            out.append(w.request_id)
            free += blocks_for(w.prefilled, bs)
    return out


def _held(state: SchedulerState, ids) -> int:
    """KV blocks held by the requests ``ids`` (decodes: their context; waiting: what they prefilled)."""
    if not ids:
        return 0
    ids, bs = set(ids), state.kv.block_size
    return (sum(blocks_for(d.context_len, bs) for d in state.decodes if d.request_id in ids)
            + sum(blocks_for(w.prefilled, bs) for w in state.waiting if w.request_id in ids))


def _alone(state: SchedulerState, w) -> bool:
    """``w`` is the only KV holder: nothing will ever free blocks for it."""
    return not state.decodes and all(o.prefilled == 0 for o in state.waiting if o is not w)


def _stuck(state: SchedulerState, w) -> None:
    raise SchedulingError(
        f"request {w.request_id!r} cannot get the KV blocks for its prompt and nothing is running to free "
        f"any ({state.kv.free_blocks} free blocks of {state.kv.block_size} tokens, {w.prefilled} tokens cached, "
        f"{w.remaining_prompt} to prefill): it needs more KV cache than the engine has")


class SloChunkPolicy:
    """Dynamic prefill chunks under an ITL SLO, from the compiled model's latency model (module docstring).

    ``max_chunk`` caps the step's prefill tokens (keep it within the latency model's measured M range);
    ``min_chunk`` is the smallest partial piece worth a step (the no-tiny-tail rule); ``correction``: an
    online correction of the predictions (``online.StepTimeCorrection``, fed by the engine with its
    measured steps): each step is planned so that the prediction plus its ``offset_ms`` stays within the
    SLO (every rule above reads ``slo - offset_ms`` for the SLO). ``StepPlan.predicted_ms`` stays the
    model's own prediction, which the correction compares with the measured step. ``decode_headroom``:
    rule 8 (a new request starts only where the decode-only step it joins is predicted within the SLO)."""

    def __init__(self, latency_model: LatencyModel, slo_itl_ms: float, max_chunk: int = 2048, min_chunk: int = 32,
                 correction=None, decode_headroom: bool = False) -> None:
        if not isinstance(latency_model, LatencyModel):
            raise ValueError(f"SloChunkPolicy: latency_model={latency_model!r} must be a LatencyModel")
        if isinstance(slo_itl_ms, bool) or not isinstance(slo_itl_ms, (int, float)) or not (0 < slo_itl_ms < math.inf):
            raise ValueError(f"SloChunkPolicy: slo_itl_ms={slo_itl_ms!r} must be a positive finite number")
        _check_pos("SloChunkPolicy", "max_chunk", max_chunk)
        _check_pos("SloChunkPolicy", "min_chunk", min_chunk)
        if min_chunk > max_chunk:
            raise ValueError(f"SloChunkPolicy: min_chunk={min_chunk} must be <= max_chunk={max_chunk}")
        corrects = hasattr(correction, "offset_ms") and callable(getattr(correction, "offset_for", None))
        if correction is not None and not corrects:
            raise ValueError(f"SloChunkPolicy: correction={correction!r} must have offset_ms and offset_for(prefill) "
                             f"(an online.StepTimeCorrection) or be None")
        self.model, self.slo, self.max_chunk, self.min_chunk = latency_model, float(slo_itl_ms), max_chunk, min_chunk
        if not isinstance(decode_headroom, bool):
            raise ValueError(f"SloChunkPolicy: decode_headroom={decode_headroom!r} must be a bool")
        self.correction, self.decode_headroom = correction, decode_headroom
        self._units: List[float] = []
        self._units_of: Optional[LatencyModel] = None

    def __repr__(self) -> str:
        return (f"SloChunkPolicy(slo_itl_ms={self.slo}, max_chunk={self.max_chunk}, min_chunk={self.min_chunk}"
                + (", decode_headroom=True" if self.decode_headroom else "") + ")")

    def floor_ms(self) -> float:
        """The predicted time of the cheapest step with work (one decode of one token of context): no plan
        can be predicted under it, so an SLO below it is met by no step."""
        return self.model.step_ms(1, 1, self.model.decodes_attention_ms(1, 1, 1))

    def infeasible(self) -> Optional[str]:
        """Why no step can meet the SLO (it is below ``floor_ms``), in words, or None. Under such an SLO the
        policy still serves every request (rules 5 and 6: decodes run, prefill goes in forced minimal pieces),
        but every step misses it and prompts are cut into ``min_chunk`` pieces: time to first token grows
        with the queue (an H100 run at 16 ms against a 27 ms step: mean TTFT 23.9 s, against 0.4 s for a
        static 2048 chunk)."""
        floor = self.floor_ms()
        if floor <= self.slo:
            return None
        return (f"slo_itl_ms={self.slo:g} is below the predicted time of the cheapest step ({floor:.2f} ms: one "
                f"decode): every step will miss it, and prefill runs in forced pieces of {self.min_chunk} tokens; "
                f"raise the SLO above the batch-1 decode step")

    def budget_ms(self) -> float:
        """The predicted step time this step is planned within: the SLO less the online correction's offset."""
        return self.slo - self.correction.offset_ms if self.correction is not None else self.slo

    def decode_budget_ms(self) -> float:
        """The predicted time a decode-only step must stay within (rule 8): the SLO less the online
        correction's decode-only offset."""
        return self.slo - self.correction.offset_for(False) if self.correction is not None else self.slo

    def _joins(self, n: int, ctx: int, longest: int, length: int, slo: float) -> bool:
        """Rule 8: may a request of ``length`` context tokens join ``n`` decodes of ``ctx`` summed and
        ``longest`` context (the running decodes and the requests already given a piece this step, each at its
        whole prompt)? Yes when their decode-only step with it is predicted within ``slo``, when there are
        none, or when they alone are over it already (rule 6 and the forced admission of rule 5 decide then:
        under an SLO no decode batch meets, the rule would only serialise the requests)."""
        if n == 0:
            return True
        m, k = self.model, n + 1
        if m.step_ms(k, k, m.decodes_attention_ms(k, ctx + length, max(longest, length))) <= slo:
            return True
        return m.step_ms(n, n, m.decodes_attention_ms(n, ctx, longest)) > slo

    def _largest(self, hi: int, tokens: int, seqs: int, attn: float, prefilled: int,
                 slo: Optional[float] = None) -> int:
        """The largest c in [0, hi] whose step (the current one plus a piece of c) fits ``slo`` (default the
        SLO).

        The step time is ``base + k1 c + k2 c^2 + per_m(tokens + c)`` with ``per_m`` piecewise linear:
        bisect over the table's buckets inside the range for the last piece that still fits, then
        solve that piece's quadratic in closed form and correct the rounding by a step."""
        if hi <= 0:
            return 0
        slo = self.slo if slo is None else slo
        if self.model.token_pad > 1:
            return self._largest_padded(hi, tokens, seqs, attn, prefilled, slo)
        base, k1, k2, per_m = self.model.piece_terms(tokens, seqs, attn, prefilled)

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

    def _unit_costs(self, units: int) -> List[float]:
        """``U[u]``: the padded model's cost of running its linears, head rows and per-token overhead on
        ``u`` pad units (``u * token_pad`` rows), for u up to at least ``units``; built once per latency
        model and extended on demand, so the padded search indexes a list instead of composing the model."""
        m = self.model
        if self._units_of is not m:
            self._units, self._units_of = [], m
        U = self._units
        if len(U) <= units:
            o, pad, per_m = m.overhead, m.token_pad, m._per_m
            U.extend(o.fixed_ms + o.per_token_ms * (u * pad) + per_m(u * pad)
                     for u in range(len(U), max(units + 1, 2 * len(U), 64)))
        return U

    def _largest_padded(self, hi: int, tokens: int, seqs: int, attn: float, prefilled: int, slo: float) -> int:
        """``_largest`` for a model whose steps run on tokens padded to ``token_pad``: the step costs the
        same linears for every piece that ends in one pad unit, so the search bisects over the units' ends
        (the largest piece of each unit), then solves the piece's attention quadratic inside the first unit
        whose end does not fit.

        The search runs on one flat expression, ``U[units(tokens + c)] + k1 c + k2 c^2 <= slo - rest``
        (``_unit_costs``; everything else in the step is constant in c), because in the engine the plan
        runs with cold CPU caches and every method call of the composed model costs there; the answer is
        settled against the model's own ``step_ms`` where the two could disagree: their sums are ordered
        differently and can differ in the last bits, so ``step_ms`` is asked only where the flat expression is
        within ``eps`` of the limit (2-core CPU, ``sched_cost``'s 200 padded states, warm caches, both versions
        in one process, same plans: p50 28.1 -> 23.3 us, p99 40.4 -> 33.0)."""
        m, pad = self.model, self.model.token_pad
        o, a, L, s = m.overhead, m.attention, m.n_layers, seqs + 1
        U = self._unit_costs(-(-(tokens + hi) // pad))
        k1, k2 = m.piece_attention_slopes(prefilled)
        rest = o.per_seq_ms * s + attn + L * (a.per_seq_ms + a.per_key_ms * prefilled)
        if m._per_s is not None:
            rest += m._per_s(s)
        lim = slo - rest

        if U[-(-(tokens + hi) // pad)] + (k1 + k2 * hi) * hi <= lim:
            c = hi
        elif U[-(-(tokens + 1) // pad)] + k1 + k2 > lim:
            c = 0
        else:
            lo, top = 1, hi  # lo fits, top does not
            u_lo, u_hi = (tokens + 1) // pad + 1, (tokens + hi - 1) // pad  # units ending strictly inside (1, hi)
            while u_lo <= u_hi:
                u = (u_lo + u_hi) // 2
                c = u * pad - tokens
                if U[u] + (k1 + k2 * c) * c <= lim:
                    lo, u_lo = c, u + 1
                else:
                    top, u_hi = c, u - 1
            c = lo
            if top - lo > 1:
                # (lo, top] lies in one unit: its linears and overhead are fixed, T is the attention quadratic
                base = U[-(-(tokens + top) // pad)] - lim
                if k2 > 0:
                    disc = k1 * k1 - 4 * k2 * base
                    c = int((-k1 + math.sqrt(disc)) / (2 * k2)) if disc >= 0 else lo
                else:
                    c = int(-base / k1) if k1 > 0 else top - 1
                c = max(lo, min(c, top - 1))

        eps = 1e-9 * (abs(lim) + slo)  # far above the sums' rounding (~1e-15 relative), far below a token's cost

        def fits(c):  # the flat expression decides unless it is within eps of the limit; then the model's own
            f = U[-(-(tokens + c) // pad)] + (k1 + k2 * c) * c  # prediction settles the last bits
            if f <= lim - eps:
                return True
            if f > lim + eps:
                return False
            return m.step_ms(tokens + c, s, attn + m.piece_attention_ms(c, prefilled)) <= slo

        while c < hi and fits(c + 1):
            c += 1
        while c > 0 and not fits(c):
            c -= 1
        return c

    def _shape(self, c: int, remaining: int) -> int:
        """The no-tiny-tail rule on the largest fitting piece ``c`` of a ``remaining`` prompt."""
        if c >= remaining:
            return remaining
        if self.max_chunk < remaining < 2 * self.min_chunk:
            return c  # no cut of this remainder keeps both sides >= min_chunk: the largest piece that fits
        if remaining - c < self.min_chunk:
            c = remaining - self.min_chunk  # merging the rest does not fit (c is the largest that does)
        return c if c >= self.min_chunk else 0

    def _minimal(self, remaining: int) -> int:
        """The smallest piece the no-tiny-tail rule allows: ``min_chunk`` (the whole remainder when that
        is shorter, or when it would leave a tail under ``min_chunk`` and still fits ``max_chunk``)."""
        f = min(remaining, self.min_chunk)
        if 0 < remaining - f < self.min_chunk and remaining <= self.max_chunk:
            return remaining
        return f

    def plan(self, state: SchedulerState) -> StepPlan:
        model, bs = self.model, state.kv.block_size
        run, preempt, ctx, longest, free, head_out = _decodes(state)
        stalled = _unblock_plan(state, run, preempt, free, self.model is not None)
        if stalled is not None:
            return stalled
        blocks = state.kv.free_blocks + _held(state, preempt) - free
        tokens = seqs = len(run)
        attn = model.decodes_attention_ms(len(run), ctx, longest)
        slo = self.budget_ms()
        budget = self.max_chunk
        pieces: List[Tuple[object, int]] = []
        forced, reason = False, "no request waits"
        head = self.decode_headroom
        if head:  # rule 8's decode batch: the running decodes, then every request given a piece
            dslo, fn, fctx, flong = self.decode_budget_ms(), len(run), ctx, longest
        for i, w in enumerate(() if head_out else state.waiting_fcfs()):
            R, p = w.remaining_prompt, w.prefilled
            if head:
                if p == 0 and not self._joins(fn, fctx, flong, R, dslo):
                    reason = f"{w.request_id!r} waits: decode headroom (the decode-only step it joins is over the SLO)"
                    break
                fn, fctx, flong = fn + 1, fctx + p + R, max(flong, p + R)
            kv_cap = tokens_fitting(p, free, bs)
            hi = min(R, budget, kv_cap)
            if i == 0 and kv_cap < R and _alone(state, w):
                _stuck(state, w)
            c = self._shape(self._largest(hi, tokens, seqs, attn, p, slo), R)
            if c == 0 and i == 0:
                f = self._minimal(R)
                if f <= kv_cap and model.step_ms(f, 1, model.piece_attention_ms(f, p)) > slo:
                    c, forced = f, True
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
        return StepPlan.unchecked(tuple(run), tuple(pieces), model.step_ms(tokens, seqs, attn), blocks, tuple(preempt),
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
        run, preempt, ctx, longest, free, head_out = _decodes(state)
        stalled = _unblock_plan(state, run, preempt, free, self.model is not None)
        if stalled is not None:
            return stalled
        blocks = state.kv.free_blocks + _held(state, preempt) - free
        budget, pieces, chunks, reason = self.chunk, [], [], "no request waits"
        for w in () if head_out else state.waiting_fcfs():
            cap = tokens_fitting(w.prefilled, free, bs)
            if not pieces and cap < w.remaining_prompt and _alone(state, w):
                _stuck(state, w)
            c = min(w.remaining_prompt, budget, cap)
            if c == 0:
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
                                      self.model.decodes_attention_ms(len(run), ctx, longest)
                                      + sum(self.model.piece_attention_ms(c, p) for c, p in chunks))
        return StepPlan.unchecked(tuple(run), tuple(pieces), pred, blocks, tuple(preempt), False, reason)
