"""The policies' contracts (policy.py's docstring), as Hypothesis properties and worked cases."""
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from spear_compile.runtime.latency import AttentionCost, LatencyModel, LatencyTable, LinearTable, Overhead
from spear_compile.runtime.online import StepTimeCorrection
from spear_compile.runtime.policy import SchedulingError, SloChunkPolicy, StaticChunkPolicy
from spear_compile.runtime.state import (KVCache, RunningDecode, SchedulerState, StepPlan, WaitingRequest, new_blocks,
                                         tokens_fitting)

from .sim import Req, simulate

TOL = 1e-9
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def models(draw):
    n = draw(st.integers(1, 8))
    buckets = tuple(1 << i for i in range(n + 3))
    incs = draw(st.lists(st.floats(0, 2.0), min_size=len(buckets), max_size=len(buckets)))
    ms, acc = [], 0.0
    for v in incs:
        acc += v
        ms.append(acc)
    lin = LatencyTable(tuple(buckets), tuple(ms))
    head = draw(st.one_of(st.none(), st.just(LatencyTable((1, 64), (0.1, 0.5)))))
    attn = AttentionCost(*[draw(st.floats(0, c)) for c in (0.05, 0.01, 0.001, 1e-4)])
    over = Overhead(draw(st.floats(0, 2)), draw(st.floats(0, 0.01)), draw(st.floats(0, 0.05)),
                    draw(st.sampled_from([0.0, 0.0, 0.001, 0.01])))
    return LatencyModel((LinearTable("all", 1, lin),), head, attn, draw(st.integers(1, 4)), over,
                        draw(st.sampled_from(["last", "all"])), draw(st.sampled_from([1, 1, 8, 64])))


@st.composite
def states(draw, block_size=None):
    bs = block_size or draw(st.sampled_from([1, 4, 16]))
    dec = draw(st.lists(st.integers(1, 300), max_size=12))
    wai = draw(st.lists(st.tuples(st.integers(1, 400), st.integers(0, 64)), max_size=6))
    arrivals = draw(st.permutations(range(len(wai))))
    return SchedulerState(tuple(RunningDecode(f"d{i}", c) for i, c in enumerate(dec)),
                          tuple(WaitingRequest(f"w{i}", a, r, p) for i, ((r, p), a) in enumerate(zip(wai, arrivals))),
                          KVCache(bs, draw(st.integers(0, 120))))


def plan_contexts(state, plan):
    ctx = {d.request_id: d.context_len for d in state.decodes}
    pre = {w.request_id: w.prefilled for w in state.waiting}
    return [ctx[i] for i in plan.decode_ids], [(c, pre[i]) for i, c in plan.prefill]


def check_common(state, plan, max_prefill):
    """Decodes first and complete, KV within capacity, FCFS prefix, one partial piece at most, the budget; and
    the plan, built without ``StepPlan``'s checks, is one the checked constructor accepts and equals."""
    fields = (plan.decode_ids, plan.prefill, plan.predicted_ms, plan.kv_blocks, plan.preempt_ids, plan.forced, plan.reason)
    assert StepPlan(*fields) == plan and all(type(f) is tuple for f in fields[:2] + fields[4:5])
    assert all(type(c) is int for _, c in plan.prefill) and type(plan.kv_blocks) is int
    ids = [d.request_id for d in state.decodes]
    waiting = {w.request_id: w for w in state.waiting}
    if plan.preempt_ids and not state.decodes:  # unblocking: younger partial prefills give their KV back
        assert plan.is_empty and all(waiting[i].prefilled > 0 for i in plan.preempt_ids)
        assert state.waiting_fcfs()[0].request_id not in plan.preempt_ids
        return
    pre_dec = [i for i in plan.preempt_ids if i not in waiting]
    pre_wait = [i for i in plan.preempt_ids if i in waiting]
    assert list(plan.decode_ids) + sorted(pre_dec, key=ids.index) == ids  # order kept, the youngest preempted
    bs = state.kv.block_size
    need = sum(1 for d in state.decodes if d.request_id in plan.decode_ids and d.context_len % bs == 0)
    need += sum(new_blocks(waiting[i].prefilled, c, bs) for i, c in plan.prefill)
    held = sum(-(-d.context_len // bs) for d in state.decodes if d.request_id in pre_dec)
    held += sum(-(-waiting[i].prefilled // bs) for i in pre_wait)
    assert plan.kv_blocks == need <= state.kv.free_blocks + held
    if plan.preempt_ids:  # only when the decodes' blocks did not fit, partial prefills first
        assert sum(1 for d in state.decodes if d.context_len % bs == 0) > state.kv.free_blocks
        assert all(waiting[i].prefilled > 0 for i in pre_wait)
        assert not pre_dec or len(pre_wait) == sum(1 for w in state.waiting if w.prefilled > 0)
    if pre_wait:
        assert not plan.prefill
    fcfs = state.waiting_fcfs()
    assert [i for i, _ in plan.prefill] == [w.request_id for w in fcfs[: len(plan.prefill)]]
    for (i, c) in plan.prefill[:-1]:
        assert c == waiting[i].remaining_prompt  # only the last piece may be partial
    assert plan.prefill_tokens <= max_prefill


def check_slo(policy, state, plan):
    check_common(state, plan, policy.max_chunk)
    m, slo = policy.model, policy.slo
    dec, pre = plan_contexts(state, plan)
    assert plan.predicted_ms == pytest.approx(m.predict_step_ms(dec, pre), rel=1e-9, abs=1e-12)
    waiting = {w.request_id: w for w in state.waiting}
    if plan.forced:
        (rid, c), = plan.prefill
        w = state.waiting_fcfs()[0]
        assert rid == w.request_id and c == policy._minimal(w.remaining_prompt)
        assert m.predict_step_ms([], [(c, w.prefilled)]) > slo  # it could never fit, even alone
    elif plan.prefill:
        assert plan.predicted_ms <= slo * (1 + TOL)  # never past the SLO prediction
    for rid, c in plan.prefill:
        R = waiting[rid].remaining_prompt
        if c < R and not policy.max_chunk < R < 2 * policy.min_chunk:  # no tiny pieces, no tiny tails
            assert c >= policy.min_chunk and R - c >= policy.min_chunk  # (where some cut allows it)
    check_headroom(policy, state, plan)


def check_headroom(policy, state, plan):
    """Rule 8: a request starts its prefill only where the decode-only step it joins (the plan's decodes and
    every request before it given a piece, each at its whole prompt) is predicted within the decode budget,
    unless no decode runs or the decodes without it are over that budget already. A plan stopped by the rule
    names it, and the request it stopped would indeed break it."""
    if not policy.decode_headroom:
        return
    m, budget = policy.model, policy.decode_budget_ms()
    waiting = {w.request_id: w for w in state.waiting}
    ctxs = plan_contexts(state, plan)[0]
    for rid, _ in plan.prefill:
        w = waiting[rid]
        if w.prefilled == 0 and ctxs and m.predict_step_ms(ctxs) <= budget:
            assert m.predict_step_ms(ctxs + [w.remaining_prompt]) <= budget * (1 + TOL)
        ctxs.append(w.prefilled + w.remaining_prompt)
    if "decode headroom" in plan.reason:
        w = state.waiting_fcfs()[len(plan.prefill)]
        assert w.prefilled == 0 and ctxs and m.predict_step_ms(ctxs) <= budget * (1 + TOL)
        assert m.predict_step_ms(ctxs + [w.remaining_prompt]) > budget * (1 - TOL)


@SETTINGS
@given(models(), states(), st.floats(0.5, 40), st.integers(1, 64), st.integers(0, 512), st.booleans())
def test_plan_never_exceeds_the_slo_or_the_kv_and_keeps_fcfs(model, state, slo, min_chunk, extra, headroom):
    policy = SloChunkPolicy(model, slo, max_chunk=min_chunk + extra, min_chunk=min_chunk, decode_headroom=headroom)
    try:
        plan = policy.plan(state)
    except SchedulingError:
        assert not state.decodes  # only when nothing runs that could free KV
        return
    check_slo(policy, state, plan)


@SETTINGS
@given(models(), st.integers(0, 40), st.integers(0, 30), st.floats(0, 30), st.integers(0, 500), st.integers(0, 700),
       st.floats(0.5, 40))
def test_the_largest_piece_is_the_largest(model, tokens, seqs, attn, prefilled, hi, slo):
    seqs = max(seqs, 0)
    policy = SloChunkPolicy(model, slo, max_chunk=max(hi, 1), min_chunk=1)
    got = policy._largest(hi, tokens, seqs, attn, prefilled)

    def T(c):
        return model.step_ms(tokens + c, seqs + 1, attn + model.piece_attention_ms(c, prefilled))

    assert 0 <= got <= hi
    if got:
        assert T(got) <= slo * (1 + TOL)
    if got < hi:
        assert T(got + 1) > slo * (1 - TOL)  # monotone, so every larger piece is over too


@st.composite
def workloads(draw):
    n = draw(st.integers(1, 12))
    reqs = [Req(i, draw(st.integers(0, 30)), draw(st.integers(1, 300)), draw(st.integers(1, 12))) for i in range(n)]
    reqs.sort(key=lambda r: r.arrival_step)
    for i, r in enumerate(reqs):
        r.rid = i  # ids in arrival order (the simulator uses the id as the arrival)
    cancels = draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, 40)), max_size=3, unique_by=lambda t: t[0]))
    return reqs, cancels


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(models(), workloads(), st.floats(1.0, 30), st.sampled_from([1, 8, 16]), st.integers(4, 40), st.booleans())
def test_every_request_finishes_first_come_first_served(model, work, slo, bs, min_chunk, static):
    reqs, cancels = work
    cap_tokens = max(r.prompt + r.output for r in reqs)
    kv_blocks = -(-cap_tokens // bs) + 4  # every request fits alone; several compete for the cache
    policy = StaticChunkPolicy(64) if static else SloChunkPolicy(model, slo, max_chunk=256, min_chunk=min_chunk)
    check = (lambda s, p: check_common(s, p, 64)) if static else (lambda s, p: check_slo(policy, s, p))
    by_id, plans, order = simulate(policy, reqs, kv_blocks, bs, cancels, check=check)
    cancelled = {rid for rid, _ in cancels}
    for r in by_id.values():
        assert r.phase == ("cancelled" if r.rid in cancelled and r.phase == "cancelled" else "done"), r
    # no starvation, no overtaking: prompts finish prefilling in arrival order (a re-queued, preempted
    # request is older than everyone behind it, so it may appear again later)
    firsts = [rid for i, rid in enumerate(order) if rid not in order[:i]]
    assert firsts == sorted(firsts)


def _model(per_token=0.01, fixed=1.0):
    b = (1, 2048)
    return LatencyModel((LinearTable("all", 1, LatencyTable(b, (per_token, per_token * 2048))),), None,
                        AttentionCost(), 1, Overhead(fixed))


def test_a_worked_case_sizes_the_chunk_from_the_slo():
    # step = 1 ms + 0.01 ms per token: a 5 ms SLO holds 400 tokens; 10 decodes leave 390 for prefill
    policy = SloChunkPolicy(_model(), 5.0, max_chunk=2048, min_chunk=16)
    state = SchedulerState(tuple(RunningDecode(i, 100) for i in range(10)), (WaitingRequest("a", 0, 1000),
                                                                              WaitingRequest("b", 1, 10)), KVCache(16, 1000))
    plan = policy.plan(state)
    assert plan.decode_ids == tuple(range(10)) and plan.prefill == (("a", 390),)
    assert plan.predicted_ms == pytest.approx(5.0)
    # the rest of "a" fits whole next time, then "b" joins behind it
    nxt = SchedulerState(state.decodes, (WaitingRequest("a", 0, 610, 390), WaitingRequest("b", 1, 10)), KVCache(16, 1000))
    assert SloChunkPolicy(_model(), 9.0, 2048, 16).plan(nxt).prefill == (("a", 610), ("b", 10))


def test_no_tiny_tail():
    policy = SloChunkPolicy(_model(), 5.0, max_chunk=2048, min_chunk=32)
    dec = tuple(RunningDecode(i, 100) for i in range(10))
    # 400 remaining, 390 fit: a 10-token tail would remain -> cut to leave exactly min_chunk
    plan = policy.plan(SchedulerState(dec, (WaitingRequest("a", 0, 400),), KVCache(16, 1000)))
    assert plan.prefill == (("a", 368),)
    # 40 remaining: the cut would be 8 -> waits (no tiny piece) while the decodes run
    plan = policy.plan(SchedulerState(tuple(RunningDecode(i, 100) for i in range(395)), (WaitingRequest("a", 0, 40),),
                                      KVCache(16, 1000)))
    assert plan.prefill == () and "waits" in plan.reason


def test_a_remainder_no_cut_can_keep_at_min_chunk_still_progresses():
    # max_chunk 4, min_chunk 4, a 5-token prompt: 4 + 1 or 1 + 4 are the only cuts; refusing both would starve it
    policy = SloChunkPolicy(_model(), 50.0, max_chunk=4, min_chunk=4)
    plan = policy.plan(SchedulerState((), (WaitingRequest("a", 0, 5),), KVCache(4, 2)))
    assert plan.prefill == (("a", 4),) and not plan.forced
    assert policy.plan(SchedulerState((), (WaitingRequest("a", 0, 1, 4),), KVCache(4, 1))).prefill == (("a", 1),)


def test_forced_admission_when_a_piece_can_never_fit():
    policy = SloChunkPolicy(_model(fixed=10.0), 5.0, max_chunk=256, min_chunk=16)  # even one token is 10 ms
    plan = policy.plan(SchedulerState((RunningDecode("d", 5),), (WaitingRequest("a", 0, 100), WaitingRequest("b", 1, 5)),
                                      KVCache(16, 100)))
    assert plan.forced and plan.prefill == (("a", 16),) and plan.decode_ids == ("d",)
    assert plan.predicted_ms > 5.0


def test_decodes_alone_over_the_slo_run_and_admit_nothing():
    policy = SloChunkPolicy(_model(), 5.0, max_chunk=256, min_chunk=16)
    dec = tuple(RunningDecode(i, 100) for i in range(600))  # 1 + 6 ms > 5 ms
    plan = policy.plan(SchedulerState(dec, (WaitingRequest("a", 0, 100),), KVCache(16, 100)))
    assert plan.decode_ids == tuple(range(600)) and plan.prefill == () and not plan.forced
    assert plan.predicted_ms == pytest.approx(7.0)


def test_decode_headroom_holds_a_new_request_until_the_decode_step_fits():
    # decode-only step = 1 ms + 0.01 ms per decode + 0.001 ms per key of context (one layer): three decodes at
    # 1000 keys are 1 + 0.03 + 3.003 = 4.03 ms; a fourth at a 1000-token prompt makes it 5.04 > 5 ms
    m = LatencyModel((LinearTable("all", 1, LatencyTable((1, 2048), (0.01, 20.48))),), None,
                     AttentionCost(per_key_ms=0.001), 1, Overhead(1.0))
    dec = tuple(RunningDecode(i, 1000) for i in range(3))
    wait = (WaitingRequest("long", 0, 1000), WaitingRequest("short", 1, 10))
    state = SchedulerState(dec, wait, KVCache(16, 1000))
    plan = SloChunkPolicy(m, 5.0, 2048, 16, decode_headroom=True).plan(state)
    assert plan.prefill == () and "decode headroom" in plan.reason  # FCFS: "short" does not overtake it
    assert m.predict_step_ms([1000] * 4) > 5.0 >= m.predict_step_ms([1000] * 3)
    # without the rule the step with prefill alone decides: a piece of "long" fits beside the decodes
    assert SloChunkPolicy(m, 5.0, 2048, 16).plan(state).prefill[0][0] == "long"  # the default: rule 8 off
    # once a decode finishes there is room, and a started (partly prefilled) request is never held back
    on = SloChunkPolicy(m, 5.0, 2048, 16, decode_headroom=True)
    assert on.plan(SchedulerState(dec[:2], wait, KVCache(16, 1000))).prefill[0][0] == "long"
    started = SchedulerState(dec, (WaitingRequest("long", 0, 600, 400),), KVCache(16, 1000))
    assert on.plan(started).prefill[0][0] == "long"
    # the online correction's decode-only offset tightens it: +1 ms leaves room for two long decodes, not three
    corr = StepTimeCorrection(min_steps=1)
    corr.observe(1.0, 2.0, prefill=False)
    held = SloChunkPolicy(m, 5.0, 2048, 16, correction=corr, decode_headroom=True).plan(SchedulerState(dec[:2], wait, KVCache(16, 1000)))
    assert held.prefill == () and "decode headroom" in held.reason


@st.composite
def near_the_decode_budget(draw):
    """A model whose decode-only step grows with the context, decodes and unstarted long prompts beside them, and an
    SLO a little above the decodes' own step: where rule 8 decides (the generic states rarely reach it)."""
    lin = LatencyTable((1, 4096), (0.01, 4.0))
    m = LatencyModel((LinearTable("all", 1, lin),), None, AttentionCost(per_key_ms=draw(st.floats(1e-4, 1e-3))), 1,
                     Overhead(draw(st.floats(0.5, 2.0))), "last", draw(st.sampled_from([1, 64])))
    dec = tuple(RunningDecode(f"d{i}", c) for i, c in enumerate(draw(st.lists(st.integers(200, 3000), min_size=1,
                                                                                max_size=6))))
    prompts = draw(st.lists(st.integers(16, 3000), min_size=1, max_size=4))
    state = SchedulerState(dec, tuple(WaitingRequest(f"w{i}", i, r) for i, r in enumerate(prompts)), KVCache(16, 4000))
    own = m.predict_step_ms([d.context_len for d in dec])
    return m, state, own + draw(st.floats(0.0, 4.0))


@SETTINGS
@given(near_the_decode_budget())
def test_decode_headroom_holds_exactly_the_requests_it_must(case):
    """Rule 8 where it binds: the oldest request, unstarted, is held (and nothing is prefilled) exactly when the
    decode-only step it would join is predicted over the SLO; the plan keeps every other rule (``check_slo``)."""
    m, state, slo = case
    policy = SloChunkPolicy(m, slo, max_chunk=4096, min_chunk=16, decode_headroom=True)
    plan = policy.plan(state)
    check_slo(policy, state, plan)
    ctxs = [d.context_len for d in state.decodes]
    head = state.waiting_fcfs()[0]
    held = m.predict_step_ms(ctxs + [head.remaining_prompt]) > slo
    assert (plan.prefill == () and "decode headroom" in plan.reason) == held
    if not held:
        assert plan.prefill and plan.prefill[0][0] == head.request_id or "waits" in plan.reason


def test_cancellation_frees_capacity():
    policy = SloChunkPolicy(_model(), 50.0, max_chunk=2048, min_chunk=16)
    full = SchedulerState((RunningDecode("x", 64),), (WaitingRequest("a", 0, 64),), KVCache(16, 1))
    assert policy.plan(full).prefill == ()  # "x" takes the last block; "a" waits for KV
    # the engine cancels "x": it leaves the state and its 4 (+1 free) blocks come back
    after = SchedulerState((), (WaitingRequest("a", 0, 64),), KVCache(16, 1 + 4))
    assert policy.plan(after).prefill == (("a", 64),)
    assert StaticChunkPolicy(64).plan(after).prefill == (("a", 64),)


def test_preempts_the_youngest_decode_when_blocks_run_short():
    plan = SloChunkPolicy(_model(), 50.0, 64, 16).plan(
        SchedulerState((RunningDecode("old", 16), RunningDecode("young", 32)), (), KVCache(16, 1)))
    assert plan.decode_ids == ("old",) and plan.preempt_ids == ("young",) and plan.kv_blocks == 1
    # a younger partial prefill holding blocks goes first, and "old" gets its block from it
    plan = SloChunkPolicy(_model(), 50.0, 64, 16).plan(
        SchedulerState((RunningDecode("old", 16),), (WaitingRequest("p", 0, 40, 32),), KVCache(16, 0)))
    assert plan.decode_ids == ("old",) and plan.preempt_ids == ("p",) and plan.prefill == ()


def test_a_request_larger_than_the_cache_is_an_error():
    with pytest.raises(SchedulingError, match="'big'"):
        SloChunkPolicy(_model(), 50.0, 64, 16).plan(SchedulerState((), (WaitingRequest("big", 0, 100),), KVCache(16, 2)))
    with pytest.raises(SchedulingError, match="'big'"):
        StaticChunkPolicy(64).plan(SchedulerState((), (WaitingRequest("big", 0, 100, 32),), KVCache(16, 0)))


@SETTINGS
@given(states(), st.integers(1, 300))
def test_static_policy_fills_its_chunk_fcfs(state, chunk):
    try:
        plan = StaticChunkPolicy(chunk).plan(state)
    except SchedulingError:
        assert not state.decodes
        assume(False)
    check_common(state, plan, chunk)
    assert plan.predicted_ms is None and not plan.forced
    # as much as the budget, the prompts and the KV allow: the step stops only at one of those limits
    bs = state.kv.block_size
    assume(not any(w.request_id in plan.preempt_ids for w in state.waiting) and not (plan.preempt_ids and not state.decodes))  # then no prefill (checked above)
    free = (state.kv.free_blocks + sum(-(-d.context_len // bs) for d in state.decodes if d.request_id in plan.preempt_ids)
            - sum(1 for d in state.decodes if d.request_id in plan.decode_ids and d.context_len % bs == 0))
    left = chunk
    for w in state.waiting_fcfs():
        want = min(w.remaining_prompt, left, tokens_fitting(w.prefilled, free, state.kv.block_size))
        got = dict(plan.prefill).get(w.request_id, 0)
        assert got == want
        if want < w.remaining_prompt:
            break
        free -= new_blocks(w.prefilled, want, state.kv.block_size)
        left -= want


@pytest.mark.parametrize("kw, field", [(dict(slo_itl_ms=0), "slo_itl_ms"), (dict(max_chunk=0), "max_chunk"),
                                       (dict(min_chunk=100, max_chunk=50), "min_chunk"), (dict(slo_itl_ms=True), "slo_itl_ms"),
                                       (dict(decode_headroom=1), "decode_headroom")])
def test_policy_arguments_are_checked(kw, field):
    args = dict(latency_model=_model(), slo_itl_ms=5.0, max_chunk=64, min_chunk=16, **{})
    args.update(kw)
    with pytest.raises(ValueError, match=field):
        SloChunkPolicy(**args)
    with pytest.raises(ValueError, match="chunk"):
        StaticChunkPolicy(0)


def test_state_types_validate_naming_the_field():
    with pytest.raises(ValueError, match="context_len"):
        RunningDecode("a", 0)
    with pytest.raises(ValueError, match="remaining_prompt"):
        WaitingRequest("a", 0, 0)
    with pytest.raises(ValueError, match="request_id"):
        WaitingRequest(1.5, 0, 3)
    with pytest.raises(ValueError, match="block_size"):
        KVCache(0, 3)
    with pytest.raises(ValueError, match="more than once"):
        SchedulerState((RunningDecode("a", 3),), (WaitingRequest("a", 0, 3),), KVCache(16, 3))
    with pytest.raises(ValueError, match="arrival"):
        SchedulerState((), (WaitingRequest("a", 0, 3), WaitingRequest("b", 0, 3)), KVCache(16, 3))
    with pytest.raises(ValueError, match="tokens"):
        StepPlan((), (("a", 0),))
    with pytest.raises(ValueError, match="request_id"):
        StepPlan((True,), ())
    unchecked = StepPlan.unchecked(("a",), (("b", 3),), 1.5, 1, (), False, "why")  # the policies' constructor
    assert unchecked == StepPlan(("a",), (("b", 3),), 1.5, 1, (), False, "why") and unchecked.num_tokens == 4
    with pytest.raises(AttributeError):
        unchecked.kv_blocks = 2  # frozen all the same


def test_plan_cost_is_measured_warm_and_cold_over_every_state():
    """``sched_cost.plan_cost_us`` times every state (warm: the median of repeats; cold: once after the caches
    were run through) and says which; its numbers are for the benchmark, not asserted here."""
    from spear_compile.runtime.policy import StaticChunkPolicy
    from spear_compile.runtime.sched_cost import example_states, plan_cost_us

    states = example_states(n=5, decodes=8, waiting=3)
    warm = plan_cost_us(StaticChunkPolicy(64), states, repeat=2)
    cold = plan_cost_us(StaticChunkPolicy(64), states, cold=True)
    assert (warm["caches"], cold["caches"]) == ("warm", "cold") and warm["states"] == cold["states"] == 5
    assert 0 < warm["p50_us"] <= warm["p99_us"] <= warm["max_us"] and 0 < cold["p50_us"] <= cold["max_us"]


def test_an_slo_below_the_cheapest_step_is_named_infeasible():
    model = _model()
    floor = model.step_ms(1, 1, model.decodes_attention_ms(1, 1))
    policy = SloChunkPolicy(model, floor * 0.9, 64, 16)
    assert policy.floor_ms() == floor
    why = policy.infeasible()
    assert why is not None and f"slo_itl_ms={floor * 0.9:g}" in why and f"{floor:.2f} ms" in why
    assert SloChunkPolicy(model, floor * 1.01, 64, 16).infeasible() is None
    # served all the same: the oldest request progresses in forced minimal pieces
    plan = policy.plan(SchedulerState((), (WaitingRequest("a", 0, 100),), KVCache(16, 100)))
    assert plan.forced and plan.prefill == (("a", 16),)


def test_the_padded_search_follows_a_replaced_latency_model():
    """``SloChunkPolicy`` keeps the padded model's per-unit costs in a list: a policy whose model is replaced
    (a calibration refits the overhead) must plan with the new costs, not the list of the old model."""
    t = LatencyTable((1, 2048), (0.01, 20.48))
    cheap = LatencyModel((LinearTable("all", 1, t),), None, AttentionCost(), 1, token_pad=64)
    pol = SloChunkPolicy(cheap, 10.0, max_chunk=2048, min_chunk=1)
    state = SchedulerState((), (WaitingRequest("w", 0, 2000),), KVCache(16, 1000))
    assert pol.plan(state).prefill == (("w", 960),)          # 960 rows: 9.6 ms, 1024 would be 10.24
    pol.model = cheap.with_overhead(Overhead(fixed_ms=5.0))
    assert pol.plan(state).prefill == (("w", 448),)          # 5 ms + 4.48 ms
