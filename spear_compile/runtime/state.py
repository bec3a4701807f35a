"""The scheduler's input and output: what is running, what waits, the KV cache, and one step's plan.

All types are frozen dataclasses that validate in ``__post_init__`` and raise ``ValueError`` naming
the field at fault. They carry no tensors and no engine objects, so a policy is a pure function
``state -> plan`` that any continuous-batching engine (transformers, vLLM, a simulator) can drive.

Token and KV accounting (the contract every policy and every engine adapter shares):

* A running decode with ``context_len`` tokens in the KV cache adds one token this step; it needs a
  new KV block when ``context_len`` is a multiple of the block size (the new token opens a block).
* A prefill piece of ``tokens`` for a request that already has ``prefilled`` tokens in the cache
  needs ``ceil((prefilled + tokens) / block_size) - ceil(prefilled / block_size)`` new blocks.
* ``KVCache.free_blocks`` is what is free *before* the step; blocks freed by finishing, cancelling or
  preempting requests are the engine's to add back in the next state.
"""
from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter
from typing import Optional, Tuple, Union

RequestId = Union[int, str]


def _check_int(owner: str, name: str, v, lo: int) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise ValueError(f"{owner}: {name}={v!r} must be an integer >= {lo}")


def _check_id(owner: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, str)):
        raise ValueError(f"{owner}: request_id={v!r} must be an int or a str")


def blocks_for(tokens: int, block_size: int) -> int:
    """KV blocks that hold ``tokens`` tokens."""
    return -(-tokens // block_size)


def new_blocks(have: int, add: int, block_size: int) -> int:
    """New KV blocks needed to grow a sequence of ``have`` cached tokens by ``add`` tokens."""
    return blocks_for(have + add, block_size) - blocks_for(have, block_size)


def tokens_fitting(have: int, free_blocks: int, block_size: int) -> int:
    """The most tokens a sequence of ``have`` cached tokens can add within ``free_blocks`` new blocks
    (the slack of its last, partly filled block plus the free blocks)."""
    return blocks_for(have, block_size) * block_size - have + free_blocks * block_size


@dataclass(frozen=True)
class RunningDecode:
    """A request in its decode phase: ``context_len`` tokens (prompt + generated) are in the KV cache;
    this step generates one more. The state lists decodes in priority order (oldest first)."""

    request_id: RequestId
    context_len: int

    def __post_init__(self) -> None:
        _check_id("RunningDecode", self.request_id)
        _check_int(f"RunningDecode {self.request_id!r}", "context_len", self.context_len, 1)


@dataclass(frozen=True)
class WaitingRequest:
    """A request with prompt tokens still to prefill.

    ``arrival`` orders requests first-come first-served (smaller is older; unique within a state);
    ``remaining_prompt`` tokens are still to prefill; ``prefilled`` tokens are already in the cache
    (an earlier chunk, or a preempted request's recomputation start)."""

    request_id: RequestId
    arrival: int
    remaining_prompt: int
    prefilled: int = 0

    def __post_init__(self) -> None:
        _check_id("WaitingRequest", self.request_id)
        who = f"WaitingRequest {self.request_id!r}"
        _check_int(who, "arrival", self.arrival, 0)
        _check_int(who, "remaining_prompt", self.remaining_prompt, 1)
        _check_int(who, "prefilled", self.prefilled, 0)


@dataclass(frozen=True)
class KVCache:
    """The paged KV cache as the policy sees it: the block size in tokens and the free blocks now."""

    block_size: int
    free_blocks: int

    def __post_init__(self) -> None:
        _check_int("KVCache", "block_size", self.block_size, 1)
        _check_int("KVCache", "free_blocks", self.free_blocks, 0)


@dataclass(frozen=True)
class SchedulerState:
    """Everything a policy reads to plan one step.

    ``decodes`` in priority order (the oldest first: when KV blocks run short the youngest are the ones
    asked to be preempted); ``waiting`` in any order (the policy orders it by ``arrival``). A request
    id appears at most once across both."""

    decodes: Tuple[RunningDecode, ...]
    waiting: Tuple[WaitingRequest, ...]
    kv: KVCache

    def __post_init__(self) -> None:
        object.__setattr__(self, "decodes", tuple(self.decodes))
        object.__setattr__(self, "waiting", tuple(self.waiting))
        for i, d in enumerate(self.decodes):
            if not isinstance(d, RunningDecode):
                raise ValueError(f"SchedulerState: decodes[{i}]={d!r} must be a RunningDecode")
        for i, w in enumerate(self.waiting):
            if not isinstance(w, WaitingRequest):
                raise ValueError(f"SchedulerState: waiting[{i}]={w!r} must be a WaitingRequest")
        if not isinstance(self.kv, KVCache):
            raise ValueError(f"SchedulerState: kv={self.kv!r} must be a KVCache")
        ids = [d.request_id for d in self.decodes] + [w.request_id for w in self.waiting]
        if len(set(ids)) != len(ids):
            dup = sorted({str(i) for i in ids if ids.count(i) > 1})
            raise ValueError(f"SchedulerState: request ids appear more than once: {dup}")
        arrivals = [w.arrival for w in self.waiting]
        if len(set(arrivals)) != len(arrivals):
            raise ValueError("SchedulerState: waiting requests' arrival values must be unique (FCFS order)")

    def waiting_fcfs(self) -> Tuple[WaitingRequest, ...]:
        """The waiting requests, oldest first."""
        return tuple(sorted(self.waiting, key=_ARRIVAL))


_ARRIVAL = attrgetter("arrival")  # a C-level sort key: the plan runs right after a forward pass, with cold caches


@dataclass(frozen=True)
class StepPlan:
    """One step: the decodes that run, then the prefill pieces ``(request_id, tokens)`` in FCFS order.

    ``predicted_ms`` is the latency model's prediction of the step (None for a policy without one);
    ``kv_blocks`` the new KV blocks the step takes (at most the free blocks plus those of ``preempt_ids``);
    ``preempt_ids`` the requests to preempt before the step runs (the youngest KV holders, when the
    decodes' new blocks do not fit: the engine frees their blocks and re-queues them, keeping their
    arrival, with their whole context to prefill again);
    ``forced`` is True when the policy knowingly exceeds the SLO (see ``SloChunkPolicy``);
    ``reason`` says in words why prefill stopped where it did (for logs and tests)."""

    decode_ids: Tuple[RequestId, ...]
    prefill: Tuple[Tuple[RequestId, int], ...]
    predicted_ms: Optional[float] = None
    kv_blocks: int = 0
    preempt_ids: Tuple[RequestId, ...] = ()
    forced: bool = False
    reason: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "decode_ids", tuple(self.decode_ids))
        object.__setattr__(self, "prefill", tuple(tuple(p) for p in self.prefill))
        object.__setattr__(self, "preempt_ids", tuple(self.preempt_ids))
        if not all(type(r) in (int, str) for r in self.decode_ids + self.preempt_ids):  # fast path: plans are
            for rid in self.decode_ids + self.preempt_ids:                                 # built every step
                _check_id("StepPlan", rid)
        for i, p in enumerate(self.prefill):
            if len(p) != 2:
                raise ValueError(f"StepPlan: prefill[{i}]={p!r} must be (request_id, tokens)")
            _check_id("StepPlan", p[0])
            _check_int(f"StepPlan prefill[{i}]", "tokens", p[1], 1)
        _check_int("StepPlan", "kv_blocks", self.kv_blocks, 0)
        if self.predicted_ms is not None and not (self.predicted_ms >= 0.0):
            raise ValueError(f"StepPlan: predicted_ms={self.predicted_ms!r} must be >= 0 or None")

    @classmethod
    def unchecked(cls, decode_ids: tuple, prefill: tuple, predicted_ms: Optional[float], kv_blocks: int,
                  preempt_ids: tuple, forced: bool, reason: str) -> "StepPlan":
        """The plan without ``__post_init__``'s checks, for a policy that builds it from a checked
        ``SchedulerState``: its ids come from the state, its pieces and block counts from its own
        arithmetic, and every argument is already a tuple of the right form. The checks cost a third of a
        plan's time in the engine (2-core CPU, cold caches: 16 us p50, 33 us p99 for 64 decodes, against
        5 / 11 us without); the policies' tests compare such plans with checked ones."""
        plan = object.__new__(cls)
        object.__setattr__(plan, "__dict__", {
            "decode_ids": decode_ids, "prefill": prefill, "predicted_ms": predicted_ms, "kv_blocks": kv_blocks,
            "preempt_ids": preempt_ids, "forced": forced, "reason": reason})
        return plan

    @property
    def prefill_tokens(self) -> int:
        return sum(t for _, t in self.prefill)

    @property
    def num_tokens(self) -> int:
        """Tokens the step runs through the model: one per decode plus the prefill pieces."""
        return len(self.decode_ids) + self.prefill_tokens

    @property
    def is_empty(self) -> bool:
        return not self.decode_ids and not self.prefill
