"""The transformers adapter: our step policy as a continuous-batching ``Scheduler`` of transformers.

transformers' ``ContinuousBatchingManager`` runs a generation loop that, every step, asks its scheduler
``schedule_batch(token_budget, cache_budget)`` which requests run and how many tokens each processes.
:class:`PolicyScheduler` subclasses its ``FIFOScheduler`` and overrides that method (and, to time steps,
``has_pending_requests``, which it only observes):

1. translate the scheduler's request states and the paged cache into our :class:`SchedulerState`
   (``scheduler_state``): ``DECODING`` requests become :class:`RunningDecode` (context = the tokens in
   the KV cache), ``PREFILLING`` (a prompt cut by an earlier chunk) and waiting ``PENDING`` requests
   become :class:`WaitingRequest` (remaining prompt, tokens already cached, arrival order), and the cache
   becomes :class:`KVCache` (``kv_geometry``: block size in tokens, free blocks of the whole model);
2. call ``policy.plan(state)`` (any object with that method: ``SloChunkPolicy``, ``StaticChunkPolicy``);
3. soft-reset the requests the plan preempts (their blocks freed, re-queued with prompt + generated
   tokens, as transformers' own offloading does), then schedule exactly the planned decodes and prefill
   pieces through the base class's ``_process_candidates``: the decodes in one call with a budget of one
   token each, each prefill piece in its own call with the piece size as the token budget, so a piece
   gets its planned size and no more (``_schedule_request`` cuts the prompt there).

The plan is clipped only by what transformers sizes itself: the step's ``token_budget`` (its
``max_batch_tokens``: the input buffers have that many rows) and ``max_requests_per_batch``. A planned
request whose KV allocation transformers refuses (its block accounting can round up by a block) is left
out of the step and reported as starved, and transformers' offloading then frees room, as it would for
its own FIFO scheduler. transformers' safety margin is set to 0: admission is the policy's decision.

``make_scheduler_class`` binds a policy (and the engine's hooks) to a subclass;
``register_scheduler`` enters it in transformers' ``SCHEDULER_MAPPING`` under a fresh name, which the
``ContinuousBatchingConfig(scheduler_type=name)`` then selects (the mapping is how transformers looks
schedulers up; there is no other registration call). The policy is engine-neutral and never sees a
transformers object: a vLLM adapter would translate vLLM's scheduler state the same way.

Supported: transformers 5.17 to 5.x (the GPU image has 5.17, the CPU environment the newest), models
whose layers are all full attention (Llama-like); the few places where 5.17 and later versions differ
(the cache's block accounting) are in ``kv_geometry`` and ``config_kwargs``. Prefix sharing, CPU
offloading and parallel sampling (``num_return_sequences``) are not modelled by the policy: the engine
turns the first two off and refuses the third.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

from transformers.generation.continuous_batching import FIFOScheduler, RequestStatus
from transformers.generation.continuous_batching import scheduler as _hf_scheduler_module
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from .policy import SchedulingError
from .step_gaps import check_lag
from .state import KVCache, RunningDecode, SchedulerState, StepPlan, WaitingRequest

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------ version-dependent pieces


def config_kwargs(block_size: int, **kw) -> dict:
    """``ContinuousBatchingConfig`` keyword arguments for a KV block of ``block_size`` tokens: the field is
    ``block_size`` in transformers 5.17 and ``page_size`` from 5.2x on (``block_size`` deprecated)."""
    names = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    key = "page_size" if "page_size" in names else "block_size"
    unknown = set(kw) - names
    if unknown:
        raise ValueError(f"ContinuousBatchingConfig of this transformers has no field(s) {sorted(unknown)}")
    return {key: block_size, **kw}


def kv_geometry(cache) -> Tuple[int, int, int]:
    """``(block_size, total_blocks, free_blocks)`` of a transformers ``PagedAttentionCache``, in blocks of
    ``block_size`` tokens for every layer of the model (what one sequence of the policy's accounting uses).

    This reads the cache's own bookkeeping, which changed between versions (kept in this one function):

    * 5.17: one block manager; a sequence block takes one block per full-attention layer group
      (``get_num_free_blocks() // num_full_attention_groups``).
    * 5.2x: sectors shared by per-attention-type allocators; the full-attention allocator's free blocks
      plus the free sectors it could take. Sliding-window allocators are not modelled (their requests
      need fewer blocks than the policy counts, so the count is conservative).
    """
    if hasattr(cache, "get_num_free_blocks"):  # transformers 5.17
        groups = max(1, int(getattr(cache, "num_full_attention_groups", 1) or 1))
        return int(cache.block_size), int(cache.num_blocks) // groups, int(cache.get_num_free_blocks()) // groups
    allocators = cache.cache_allocators
    full = allocators.get("full_attention") or next(iter(allocators.values()))
    pool = cache.pool
    free = pool.count_free_blocks(full.index) + pool.num_free_sectors * full.blocks_per_sector
    return int(full.tokens_per_page), int(cache.num_blocks), int(free)


# ------------------------------------------------------------------ the scheduler


@dataclasses.dataclass
class SchedulerHooks:
    """Callbacks from the generation thread to the engine (each must be quick and thread-safe).

    ``on_start(request_id)``: a request got its first prefill piece (it left the queue);
    ``on_fail(request_id, message)``: the policy found a request that can never be scheduled (it needs
    more KV than the cache has); the scheduler cancels it and the engine reports the message;
    ``on_step(state, plan, scheduled)``: every planned step, with what was scheduled as
    ``((request_id, tokens), ...)`` in batch order (for tests and statistics);
    ``on_tick(plan, ms)``: at every call of ``schedule_batch`` and when the loop goes idle (``PolicyScheduler.
    has_pending_requests``), the milliseconds since the previous of those and the plan of the step that gap
    measures (``step_gaps``: the previous call's plan, or with asynchronous batching (``PolicyScheduler.lag``
    1) the plan of the call before it), or None when the gap measures no step (a call in between planned
    nothing, or the gap is an idle wait). The engine's online correction of the latency model reads it."""

    on_start: Optional[Callable[[str], None]] = None
    on_fail: Optional[Callable[[str, str], None]] = None
    on_step: Optional[Callable[[SchedulerState, StepPlan, tuple], None]] = None
    on_tick: Optional[Callable[[Optional[StepPlan], float], None]] = None


class PolicyScheduler(FIFOScheduler):
    """transformers' FIFO scheduler with ``schedule_batch`` replaced by our policy and ``has_pending_requests``
    observed for the step timing (module docstring).
    Instantiated by transformers (``cache, safety_margin, max_requests_per_batch``); the policy and the
    hooks are class attributes set by :func:`make_scheduler_class`."""

    policy = None
    hooks: SchedulerHooks = SchedulerHooks()
    lag = 0  # calls between a step's planning call and the call whose gap to the next one is its time

    def __init__(self, cache, safety_margin: Optional[float], max_requests_per_batch: int) -> None:
        if self.policy is None:
            raise TypeError("PolicyScheduler has no policy: build the class with make_scheduler_class(policy)")
        # admission is the policy's decision: no FIFO safety margin on top of it
        super().__init__(cache, 0.0 if safety_margin is None else safety_margin, max_requests_per_batch)
        self._arrival: Dict[str, int] = {}
        self._arrivals = itertools.count()
        self._started: set = set()
        self.last_state: Optional[SchedulerState] = None
        self.last_plan: Optional[StepPlan] = None
        self._tick_t, self._recent = time.perf_counter(), collections.deque(maxlen=check_lag(self.lag) + 1)
        self._idle = True  # (no step has run: the first call's gap measures nothing)

    # -- translation

    def _arrival_of(self, request_id: str) -> int:
        a = self._arrival.get(request_id)
        if a is None:
            a = self._arrival[request_id] = next(self._arrivals)
        return a

    def scheduler_state(self) -> Tuple[SchedulerState, Dict[str, object]]:
        """The policy's view of this scheduler now, and the request states by id."""
        for rid in self.waiting_requests_order:  # first sight assigns the arrival (FCFS order of submission)
            self._arrival_of(rid)
        live = set(self.active_requests) | set(self.waiting_requests)
        if len(self._arrival) > 2 * len(live) + 64:  # forget finished requests now and then
            self._arrival = {r: a for r, a in self._arrival.items() if r in live}
            self._started &= live
        by_id: Dict[str, object] = {}
        decodes, waiting = [], []
        for rid, st in self.active_requests.items():
            by_id[rid] = st
            if st.status == RequestStatus.DECODING:
                decodes.append((self._arrival_of(rid), RunningDecode(rid, max(1, st.current_len()))))
            elif st.status == RequestStatus.PREFILLING and st.remaining_prefill_tokens:
                waiting.append(WaitingRequest(rid, self._arrival_of(rid), len(st.remaining_prefill_tokens),
                                              st.current_len()))
        if not self.block_new_requests:  # transformers sets it after offloading, as FIFO honours it
            for rid in self.waiting_requests_order:
                st = self.waiting_requests.get(rid)
                if st is None or not st.remaining_prefill_tokens:
                    continue
                by_id[rid] = st
                waiting.append(WaitingRequest(rid, self._arrival_of(rid), len(st.remaining_prefill_tokens),
                                              st.current_len()))
        decodes.sort(key=lambda x: x[0])
        bs, _, free = kv_geometry(self.cache)
        return SchedulerState(tuple(d for _, d in decodes), tuple(waiting), KVCache(bs, max(0, free))), by_id

    # -- preemption

    def _soft_reset(self, state) -> None:
        """Preempt ``state``: free its blocks and queue an equivalent request that recomputes its prompt
        and generated tokens. This mirrors the soft-reset branch of transformers' OffloadingManager
        (``offload_requests``), for which transformers has no call taking a chosen request: the old state is
        marked finished (an in-flight asynchronous update skips it), then ``finish_request`` frees its
        blocks and ``add_waiting_request`` queues ``create_equivalent_initial_request()``. The request id,
        hence the arrival, is kept."""
        new_state = state.create_equivalent_initial_request()
        state.status = RequestStatus.FINISHED
        self.finish_request(state.request_id)
        self.add_waiting_request(new_state)

    # -- the overridden methods

    def schedule_batch(self, token_budget: int, cache_budget: int):
        self._tick()
        self._idle = False
        out = self._schedule(token_budget, cache_budget)
        self._recent.append(self._tick_plan)
        return out

    def has_pending_requests(self) -> bool:
        """transformers' check before each ``schedule_batch``; when it finds no request the loop waits for
        one without calling ``schedule_batch``, so the gap from the last step's call to the next call would
        hold that wait. The first False after a step therefore ends the step's gap here (``on_tick``), marks
        the next gap as no step's, and tells a policy with an ``idle()`` method (the serving benchmark's
        timer) that the engine went idle. Measured before this (H100 and H200, 2026-12-06/07 serving records):
        a request's last decode step, followed by an idle wait, was recorded at 50-1273 ms."""
        pending = super().has_pending_requests()
        if not pending and not self._idle:
            self._idle = True
            self._tick()
            self._recent.append(None)  # the next gap is the wait: no step's time
            idle = getattr(self.policy, "idle", None)
            if callable(idle):
                idle()
        return pending

    def _tick(self) -> None:
        """A gap ends now: ``on_tick`` with the plan it measures (``step_gaps``) or None."""
        now = time.perf_counter()
        if self.hooks.on_tick is not None:
            recent = self._recent
            measured = recent[0] if len(recent) == recent.maxlen and all(p is not None for p in recent) else None
            self.hooks.on_tick(measured, (now - self._tick_t) * 1e3)
        self._tick_t = now

    def _schedule(self, token_budget: int, cache_budget: int):
        self._tick_plan = None  # the plan, once something is scheduled by it
        state, by_id = self.scheduler_state()
        if not state.decodes and not state.waiting:
            return [], False, 0, 0
        try:
            plan = self.policy.plan(state)
        except SchedulingError as e:
            return self._refuse(state, str(e))
        self.last_state, self.last_plan = state, plan
        for rid in plan.preempt_ids:
            st = by_id.get(rid)
            if st is not None and rid in self.active_requests:
                self._soft_reset(st)

        to_remove: set = set()
        scheduled: List[object] = []
        self.starved_requests, starved = [], []
        failed, fast_path = False, self.cache.max_blocks_per_request > 0
        q_tokens = kv_read = 0
        requests_left, tokens_left = self.max_requests_per_batch, token_budget
        decodes = [by_id[r] for r in plan.decode_ids if r in by_id][:requests_left]
        groups: List[Tuple[list, int]] = [(decodes, len(decodes))] if decodes else []
        groups += [([by_id[rid]], n) for rid, n in plan.prefill if rid in by_id]
        for i, (cands, n) in enumerate(groups):
            n = min(n, tokens_left)
            if n <= 0 or requests_left <= 0:
                if i < len(groups):
                    logger.debug("spear scheduler: plan clipped to token_budget=%d / max_requests_per_batch=%d",
                                 token_budget, self.max_requests_per_batch)
                break
            got, one_failed, fast, q, kv = self._process_candidates(cands, n, cache_budget, to_remove)
            starved += self.starved_requests
            scheduled += got
            failed |= one_failed
            fast_path &= fast
            q_tokens, kv_read = q_tokens + q, kv_read + kv
            tokens_left, cache_budget, requests_left = tokens_left - q, cache_budget - kv, requests_left - len(got)
        self.starved_requests = starved
        self._cleanup_waiting_queue(to_remove)
        if self.hooks.on_step is not None:
            self.hooks.on_step(state, plan, tuple((fs.state.request_id, fs.query_length) for fs in scheduled))
        if self.hooks.on_start is not None:
            for fs in scheduled:
                rid = fs.state.request_id
                if rid not in self._started:
                    self._started.add(rid)
                    self.hooks.on_start(rid)
        if not scheduled and failed:
            return None, fast_path, 0, 0
        if scheduled:
            self._tick_plan = plan
        return scheduled, fast_path, q_tokens, kv_read

    def _refuse(self, state: SchedulerState, message: str):
        """The policy says the oldest waiting request can never get its KV: cancel it (the engine reports
        ``message`` to its caller) and run nothing this step; the next step plans without it."""
        head = state.waiting_fcfs()[0].request_id if state.waiting else None
        if head is not None:
            self.set_request_cancellation(head)
            if self.hooks.on_fail is not None:
                self.hooks.on_fail(head, message)
        logger.warning("spear scheduler: %s", message)
        return [], False, 0, 0


def make_scheduler_class(policy, hooks: Optional[SchedulerHooks] = None, name: str = "PolicyScheduler",
                         lag: int = 0) -> type:
    """A :class:`PolicyScheduler` subclass bound to ``policy`` (an object with ``plan(state) -> StepPlan``);
    ``lag``: 1 when transformers runs the loop with asynchronous batching (``step_gaps``), else 0."""
    if not callable(getattr(policy, "plan", None)):
        raise TypeError(f"policy={policy!r} must have a plan(state) -> StepPlan method")
    return type(name, (PolicyScheduler,), {"policy": policy, "hooks": hooks or SchedulerHooks(),
                                           "lag": check_lag(lag)})


_names = itertools.count()
_lock = threading.Lock()


def register_scheduler(cls: type) -> str:
    """Enter ``cls`` in transformers' ``SCHEDULER_MAPPING`` under a fresh name and return the name (for
    ``ContinuousBatchingConfig(scheduler_type=name)``)."""
    with _lock:
        name = f"spear_policy_{next(_names)}"
        _hf_scheduler_module.SCHEDULER_MAPPING[name] = cls
    return name


def unregister_scheduler(name: str) -> None:
    with _lock:
        _hf_scheduler_module.SCHEDULER_MAPPING.pop(name, None)


__all__ = ["PolicyScheduler", "SchedulerHooks", "config_kwargs", "kv_geometry", "make_scheduler_class",
           "register_scheduler", "unregister_scheduler"]
