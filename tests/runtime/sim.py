"""A simulated engine loop for the policy tests: arrivals, chunked prefill, decodes, preemption, cancellation.

It keeps the KV books (free + held == capacity, checked every step) and applies each plan as an engine
would: decodes grow by one token; a prefill piece extends the cache; a request whose prompt is done
samples its first token and becomes a decode; a preempted decode frees its blocks and is re-queued with
its arrival and its whole context to recompute; a cancelled request frees its blocks.
"""
from dataclasses import dataclass, field

from spear_compile.runtime.state import KVCache, RunningDecode, SchedulerState, WaitingRequest, blocks_for


@dataclass
class Req:
    rid: int
    arrival_step: int
    prompt: int
    output: int
    remaining: int = 0
    prefilled: int = 0
    ctx: int = 0
    generated: int = 0
    phase: str = "future"   # future -> waiting -> running -> done | cancelled
    first_token_step: int = -1
    done_step: int = -1
    held: int = 0
    waited: list = field(default_factory=list)


def simulate(policy, reqs, kv_blocks, block_size, cancels=(), max_steps=None, check=None):
    """Run until every request is done or cancelled; returns (requests by id, plans). ``check(state, plan)``
    is called on every plan."""
    by_id = {r.rid: r for r in reqs}
    if max_steps is None:  # generous: every token could be recomputed a few times
        max_steps = 200 + 10 * sum(r.prompt + r.output for r in reqs) + max(r.arrival_step for r in reqs)
    cancels = dict(cancels)  # rid -> step
    free, plans, step = kv_blocks, [], 0
    prefill_done_order = []
    while any(r.phase not in ("done", "cancelled") for r in reqs):
        assert step < max_steps, "the simulation did not finish: some request starves or the loop livelocks"
        for r in reqs:
            if r.phase == "future" and r.arrival_step <= step:
                r.phase, r.remaining = "waiting", r.prompt
            if r.phase in ("waiting", "running") and cancels.get(r.rid, 1 << 60) <= step:
                free += r.held
                r.held, r.phase = 0, "cancelled"
        running = sorted((r for r in reqs if r.phase == "running"), key=lambda r: r.rid)
        waiting = [r for r in reqs if r.phase == "waiting"]
        state = SchedulerState(tuple(RunningDecode(r.rid, r.ctx) for r in running),
                               tuple(WaitingRequest(r.rid, r.rid, r.remaining, r.prefilled) for r in waiting),
                               KVCache(block_size, free))
        if not running and not waiting:
            step += 1
            continue
        plan = policy.plan(state)
        plans.append((state, plan))
        if check is not None:
            check(state, plan)
        for rid in plan.preempt_ids:  # applied before the step runs
            r = by_id[rid]
            free += r.held
            if r.phase == "running":
                r.remaining = r.ctx
            else:
                r.remaining += r.prefilled
            r.held, r.phase, r.prefilled = 0, "waiting", 0
        assert plan.kv_blocks <= free
        for rid in plan.decode_ids:
            r = by_id[rid]
            r.ctx += 1
            r.generated += 1
            need = blocks_for(r.ctx, block_size) - r.held
            free -= need
            r.held += need
            if r.generated >= r.output:
                free += r.held
                r.held, r.phase, r.done_step = 0, "done", step
        for rid, c in plan.prefill:
            r = by_id[rid]
            assert c <= r.remaining
            r.prefilled += c
            r.remaining -= c
            need = blocks_for(r.prefilled, block_size) - r.held
            free -= need
            r.held += need
            if r.remaining == 0:
                prefill_done_order.append(rid)
                r.ctx = r.prefilled
                if r.first_token_step < 0:
                    r.first_token_step = step
                    r.generated = 1
                r.phase = "running"
                if r.generated >= r.output:
                    free += r.held
                    r.held, r.phase, r.done_step = 0, "done", step
        assert free >= 0
        assert free + sum(r.held for r in reqs) == kv_blocks, "KV books do not balance"
        step += 1
    return by_id, plans, prefill_done_order
