"""The serving engine on transformers' continuous batching.

Real parts: SmolLM2-135M quantized W4 with (random, cheap) error compensators attached, compiled with the
spear backend through transformers' compile config; the reference is plain greedy ``model.generate`` on
the same quantized + EC model, eagerly. One compiled engine serves the module's tests (compiling is the
expensive part); its KV cache is small (8 blocks of 16 tokens) so that concurrent requests compete for
it. The scheduler adapter is also tested on its own, with a scripted policy and transformers' real
scheduler and paged cache (a tiny random Llama, no generation thread).
"""
import asyncio
import contextlib
import time

import pytest
import torch

import spear_compile as spear
from spear_compile.compensators.init import random_ecs
from spear_compile.errors import AdmissionError
from spear_compile.runtime import (AttentionCost, Engine, LatencyModel, LatencyTable, LinearTable, SloChunkPolicy,
                                   StaticChunkPolicy, StepPlan)
from spear_compile.runtime import latency_cache as lc

PROMPTS = ["The capital of France is",
           "Once upon a time, in a land far away, there lived a",
           "1, 2, 3,",
           "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer the slings"]
NEW = 6
BLOCK, BLOCKS = 16, 8


@pytest.fixture(scope="module")
def smol():
    from spear_compile.models import load

    torch.manual_seed(0)
    model, tok = load("smollm2-135m")
    spear.quantize_(model, spear.QuantConfig(group_size=None), progress=False)
    spear.attach_(model, random_ecs(model, spear.ECConfig(rank=4, gate_hidden=4), seed=0))
    ids = [tok(p).input_ids for p in PROMPTS]
    refs = []
    with torch.no_grad():  # eager greedy reference on the same quantized + EC model
        for x in ids:
            out = model.generate(torch.tensor([x]), max_new_tokens=NEW, do_sample=False)
            refs.append(out[0, len(x):].tolist())
    return model, tok, ids, refs


class _Hold:
    """A policy that schedules nothing: requests stay queued."""

    def plan(self, state):
        return StepPlan((), ())


def _shape(node):
    """A graph node's shape as ints (parameter shapes are symbolic under dynamic=True: take their hints)."""
    v = node.meta.get("example_value", node.meta.get("val"))
    if v is None:
        return (None,)
    return tuple(d if isinstance(d, int) else d.node.hint for d in v.shape)


@pytest.fixture(scope="module")
def engine(smol):
    """The compiled engine, and what the spear backend was given to compile while it started: per graph,
    the spear ops in it (Inductor's ``compile_fx`` is watched for the spear pass manager; the FX graph
    cache stays on, so identical layer graphs compile once)."""
    import torch._inductor.compile_fx as cfx

    from spear_compile.passes.manager import SpearPassManager

    model, tok, _, _ = smol
    real, graphs = cfx.compile_fx, []

    def watch(gm, inputs, *a, **kw):
        if isinstance((kw.get("config_patches") or {}).get("post_grad_custom_post_pass"), SpearPassManager):
            graphs.append([(str(n.target), _shape(n.args[0])[-1], _shape(n)[-1])
                           for n in gm.graph.nodes if str(n.target).startswith("spear.")])
        return real(gm, inputs, *a, **kw)

    cfx.compile_fx = watch
    eng = Engine(model, tok, compile=True, block_size=BLOCK, num_blocks=BLOCKS, max_batch_tokens=64, max_queue=8)
    try:
        eng.start()
    finally:
        cfx.compile_fx = real
    eng.record_steps = True
    yield eng, graphs
    eng.stop()
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """The shared engine's compiled code must survive between tests (the package conftest resets Dynamo)."""
    yield


def _steps_match_plans(steps):
    """Every recorded step scheduled exactly its plan: one token per planned decode, then each planned
    prefill piece at its planned size, in the plan's order."""
    assert steps
    for state, plan, scheduled in steps:
        assert scheduled == tuple((r, 1) for r in plan.decode_ids) + plan.prefill, (state, plan, scheduled)


@pytest.mark.slow
def test_compiled_engine_greedy_equals_generate(engine, smol):
    eng, graphs = engine
    _, _, ids, refs = smol
    assert eng.backend == "spear" and isinstance(eng.policy, StaticChunkPolicy) and eng.policy.chunk == 64
    # the forward transformers runs went through the spear backend: its graphs hold the EC linears of
    # every shape of the decoder (q/o, k/v, gate/up, down; Dynamo reuses a layer's graph for the layers
    # whose guards it passes, so there are fewer graphs than layers)
    ops = {op for g in graphs for op in g}
    assert {name for name, _, _ in ops} == {"spear.ec_linear"}, ops
    assert {(i, o) for _, i, o in ops} == {(576, 576), (576, 192), (576, 1536), (1536, 576)}, ops
    eng.steps.clear()
    assert eng.generate(ids, max_new_tokens=NEW) == refs
    _steps_match_plans(eng.steps)
    assert max(len(plan.decode_ids) for _, plan, _ in eng.steps) == len(ids)  # they ran side by side
    texts = eng.generate([PROMPTS[0]], max_new_tokens=NEW, output="text")
    assert texts == [smol[1].decode(refs[0], skip_special_tokens=True)]
    # the plan of what the engine compiled counts each layer's linears, though a layer's graph ran for all
    from spear_compile.runtime import plan_of

    plan = plan_of(smol[0])
    assert sum(lin.count for lin in plan.linears) == 210 and {lin.ec_rank for lin in plan.linears} == {4}
    assert all(lin.name.startswith("model.layers.*.") for lin in plan.linears)


@pytest.mark.slow
@pytest.mark.parametrize("policy", [
    StaticChunkPolicy(8),
    # ~1 ms per token, SLO 12 ms: pieces of about 12 tokens minus the decodes
    SloChunkPolicy(LatencyModel((LinearTable("all", 1, LatencyTable((1, 64), (1.0, 64.0))),),
                                LatencyTable((1, 64), (0.0, 0.0)), AttentionCost(), 1), 12.0, max_chunk=64, min_chunk=4),
], ids=["static8", "slo12ms"])
def test_concurrent_requests_with_chunked_prefill_give_the_same_tokens(engine, smol, policy):
    eng, _ = engine
    _, _, ids, refs = smol
    eng.set_policy(policy)
    eng.steps.clear()
    try:
        rids = [eng.add_request(x, max_new_tokens=NEW) for x in ids]
        assert [eng.result(r) for r in rids] == refs
    finally:
        eng.set_policy(StaticChunkPolicy(64))
    _steps_match_plans(eng.steps)
    pieces = [n for _, plan, _ in eng.steps for _, n in plan.prefill]
    assert max(pieces) <= (8 if isinstance(policy, StaticChunkPolicy) else 12)
    # the long prompt (22 tokens) was cut: some piece was shorter than what its request had left
    assert any(n < w.remaining_prompt for state, plan, _ in eng.steps for rid, n in plan.prefill
               for w in state.waiting if w.request_id == rid)


@pytest.mark.slow
def test_online_correction_learns_from_the_engines_steps_and_keeps_the_tokens(engine, smol):
    """An SLO policy that reads the engine's correction (``online_correction``, on by default; here a fresh
    one on the shared engine): the engine feeds it each prefill step's wall time (its 1 ms-per-token model
    under-predicts CPU steps of tens of ms, so the offset grows positive and the pieces shrink to forced
    minimal ones), and the tokens stay those of ``generate``. A policy that does not read this correction
    leaves it untouched."""
    from spear_compile.runtime import StepTimeCorrection

    eng, _ = engine
    _, _, ids, refs = smol
    lm = LatencyModel((LinearTable("all", 1, LatencyTable((1, 64), (1.0, 64.0))),),
                      LatencyTable((1, 64), (0.0, 0.0)), AttentionCost(), 1)
    assert isinstance(eng.correction, StepTimeCorrection)  # on by default
    default, eng.correction = eng.correction, StepTimeCorrection()
    eng.set_policy(SloChunkPolicy(lm, 12.0, max_chunk=64, min_chunk=4))
    try:
        assert eng.generate(ids[:1], max_new_tokens=4) == [refs[0][:4]]
        assert eng.correction.observed == 0
        eng.set_policy(SloChunkPolicy(lm, 12.0, max_chunk=64, min_chunk=4, correction=eng.correction))
        eng.steps.clear()
        assert eng.generate(ids, max_new_tokens=NEW) == refs
    finally:
        eng.set_policy(StaticChunkPolicy(64))
        corr, eng.correction = eng.correction, default
    assert corr.observed >= 3 and corr.offset_ms > 0 and corr.offset_for(False) > 0
    assert any(plan.forced for _, plan, _ in eng.steps)
    _steps_match_plans(eng.steps)


def test_streaming_yields_the_same_tokens_sync_and_async(engine, smol):
    eng, _ = engine
    _, _, ids, refs = smol
    rid = eng.add_request(ids[1], max_new_tokens=NEW)
    it = eng.stream(rid)
    first = next(it)
    assert not eng._requests[rid].done.is_set()  # the first token came while the request still ran
    assert [first] + list(it) == refs[1]

    async def collect(prompt):
        return [t async for t in eng.astream(prompt, max_new_tokens=NEW)]

    async def both():
        return await asyncio.gather(collect(ids[0]), collect(PROMPTS[2]))

    assert asyncio.run(both()) == [refs[0], refs[2]]


@pytest.mark.slow
def test_cancel_stops_a_request_and_frees_its_kv_for_the_others(engine, smol):
    eng, _ = engine
    _, tok, ids, refs = smol
    long_prompt = tok(" ".join(PROMPTS) * 3).input_ids[:100]  # 7 of the 8 blocks, the 8th at 112 tokens
    hog = eng.add_request(long_prompt, max_new_tokens=24)
    it = eng.stream(hog)
    got = [next(it)]
    assert len(ids[3]) > BLOCK
    other = eng.add_request(ids[3], max_new_tokens=NEW)  # needs 2 blocks: at most one is ever free
    time.sleep(1.0)
    assert not eng._requests[other].done.is_set()  # it cannot finish beside the hog
    assert eng.cancel(hog) is True
    got += list(it)  # the hog's stream ends
    assert len(got) < 24
    assert eng.result(other) == refs[3]
    deadline = time.time() + 10
    while eng.stats()["kv_free_blocks"] != BLOCKS and time.time() < deadline:
        time.sleep(0.05)
    assert eng.stats()["kv_free_blocks"] == BLOCKS and eng.stats()["scheduler_requests"] == 0
    assert eng.cancel(hog) is False


@pytest.mark.slow
def test_admission_rejects_at_once_with_the_limit_and_the_value(engine, smol):
    eng, _, = engine
    _, _, ids, _ = smol
    with pytest.raises(AdmissionError, match=r"needs 208 tokens of KV cache \(prompt 8 \+ max_new_tokens 200\), "
                                             r"more than the whole cache holds: 128 tokens \(8 blocks of 16\)") as e:
        eng.add_request(list(range(10, 18)), max_new_tokens=200)
    assert e.value.limit == "kv_tokens" and e.value.value == 208
    with pytest.raises(ValueError, match="the prompt is empty"):
        eng.add_request([], max_new_tokens=2)
    eng.set_policy(_Hold())
    eng.max_queue = 1
    try:
        first = eng.add_request(ids[0], max_new_tokens=2)
        t0 = time.perf_counter()
        with pytest.raises(AdmissionError, match=r"queue full: 1 requests wait to start, max_queue=1") as e:
            eng.add_request(ids[1], max_new_tokens=2)
        assert time.perf_counter() - t0 < 1.0 and e.value.limit == "max_queue"
        assert eng.cancel(first)
        eng.add_request(ids[1], max_new_tokens=2, request_id="after-cancel")  # the queue has room again
        assert eng.cancel("after-cancel")
    finally:
        eng.max_queue = 8
        eng.set_policy(StaticChunkPolicy(64))


def test_engine_arguments_are_checked():
    with pytest.raises(TypeError, match="plan"):
        Engine(object(), policy=object())
    with pytest.raises(ValueError, match="slo_itl_ms"):
        Engine(object(), slo_itl_ms=0)
    with pytest.raises(ValueError, match="max_queue"):
        Engine(object(), max_queue=0)
    with pytest.raises(ValueError, match="async_batching"):
        Engine(object(), async_batching="yes")
    with pytest.raises(ValueError, match="not both"):
        Engine(object(), async_batching=True, cb_config={"use_async_batching": True})


def test_async_batching_is_refused_off_cuda_and_with_a_masked_attention(monkeypatch):
    """transformers' asynchronous batching needs CUDA and an attention without a step mask: named at start(),
    before transformers is asked."""
    import spear_compile.runtime.engine as engine_mod
    from spear_compile.models.tiny import tiny_llama

    model = tiny_llama(hidden=64, layers=1, heads=2, kv_heads=1, intermediate=128, vocab=128)
    eng = Engine(model, None, policy=StaticChunkPolicy(8), async_batching=True, attention="varlen")
    assert eng.step_lag == 1
    with pytest.raises(ValueError, match="needs the model on CUDA.*cpu"):
        eng.start()
    assert not eng.running
    monkeypatch.setattr(engine_mod, "_device_of", lambda m: "cuda:0")  # as if on CUDA: the attention is next
    with pytest.raises(ValueError, match="without a step mask"):
        Engine(model, None, policy=StaticChunkPolicy(8), async_batching=True)._check_async()
    Engine(model, None, policy=StaticChunkPolicy(8), async_batching=True, attention="varlen")._check_async()
    assert Engine(model, None, policy=StaticChunkPolicy(8)).step_lag == 0


def test_compiled_engine_pads_kv_reads_to_one_block_unless_told():
    """transformers pads a compiled step's KV reads to 16384 tokens (26.0 ms of a 28.3 ms batch-1 step on an
    H200); the engine pads them to one KV block, and a ``cb_config`` key of the caller's wins."""
    from spear_compile.models.tiny import tiny_llama

    m = tiny_llama()
    cc = Engine(m, compile=True)._compile_config()
    assert Engine(m, compile=True, block_size=16)._cb_defaults(cc) == {"kv_padding_interval_size": 16}
    assert Engine(m, compile=True)._cb_defaults(cc) == {"kv_padding_interval_size": 256}
    told = Engine(m, compile=True, block_size=16, cb_config={"kv_padding_interval_size": 64})
    assert told._cb_defaults(cc) == {}
    # varlen attention reads only each sequence's keys: coarser padding, fewer CUDA-graph shapes
    from spear_compile.runtime.engine import VARLEN_KV_PADDING

    assert Engine(m, compile=True, block_size=16, attention="varlen")._cb_defaults(cc) == {
        "kv_padding_interval_size": VARLEN_KV_PADDING}
    assert Engine(m, compile=True, block_size=4096, attention="varlen")._cb_defaults(cc) == {
        "kv_padding_interval_size": 4096}
    assert Engine(m)._cb_defaults(Engine(m)._compile_config()) == {}  # eager: transformers pads nothing


def test_the_latency_model_pads_tokens_as_the_engine_does():
    """Compiled, transformers pads a step's tokens to 64 (or the cb_config's interval): the engine says so,
    and its calibration key changes with it."""
    from spear_compile.models.tiny import tiny_llama
    from spear_compile.runtime.calibrate import engine_fingerprint
    from spear_compile.runtime.engine import TRANSFORMERS_Q_PADDING

    m = tiny_llama()
    assert Engine(m).token_pad == 1
    assert Engine(m, compile=True).token_pad == TRANSFORMERS_Q_PADDING == 64
    assert Engine(m, compile=True, cb_config={"q_padding_interval_size": 16}).token_pad == 16
    assert Engine(m, cb_config={"use_cuda_graph": True}).token_pad == 64
    assert engine_fingerprint(Engine(m, compile=True)) != engine_fingerprint(
        Engine(m, compile=True, cb_config={"q_padding_interval_size": 16}))


def test_the_split_kv_switch_changes_the_calibration_key_of_a_varlen_engine(monkeypatch):
    """``SPEAR_SPLIT_KV`` changes what a varlen engine's decode attention costs (the longest decode no longer
    sets it), so a calibration made with it off is not used with it on; an engine of another attention is
    untouched by the switch."""
    from spear_compile.models.tiny import tiny_llama
    from spear_compile.runtime.calibrate import engine_fingerprint

    m = tiny_llama()
    monkeypatch.delenv("SPEAR_SPLIT_KV", raising=False)
    off = engine_fingerprint(Engine(m, compile=True, attention="varlen"))
    sdpa_off = engine_fingerprint(Engine(m))
    monkeypatch.setenv("SPEAR_SPLIT_KV", "1")
    assert engine_fingerprint(Engine(m, compile=True, attention="varlen")) != off
    assert engine_fingerprint(Engine(m)) == sdpa_off


@pytest.mark.slow
def test_slo_without_a_policy_builds_the_slo_policy_from_the_cached_latency_model(smol, tmp_path, monkeypatch):
    from spear_compile.runtime import plan_of
    from spear_compile.runtime.engine import default_policy

    monkeypatch.setenv("SPEAR_CACHE_DIR", str(tmp_path))
    model = smol[0]
    plan = plan_of(model, eager=True)
    assert sum(lin.count for lin in plan.linears) == 210
    assert {lin.name.split(".")[-1] for lin in plan.linears} >= {"q_proj", "down_proj"}
    assert all(lin.ec_rank == 4 for lin in plan.linears)
    assert (plan.n_layers, plan.n_heads, plan.n_kv_heads, plan.head_dim) == (30, 9, 3, 64)
    t = LatencyTable((1, 128), (0.5, 5.0))
    lm = LatencyModel((LinearTable("all", 1, t),), t, AttentionCost(0.01), 30)
    lc.save(lm, lc.CacheKey.for_plan(plan, "cpu"))
    logs = []
    pol = default_policy(model, 40.0, compiled=False, max_chunk=64, device="cpu", log=logs.append)
    assert isinstance(pol, SloChunkPolicy) and pol.model == lm and pol.slo == 40.0 and pol.max_chunk == 64
    assert not any("measuring" in m for m in logs)  # loaded from the cache, not measured


def test_default_policy_of_a_model_nothing_was_compiled_for_plans_it_eagerly(tmp_path, monkeypatch):
    import spear_compile as spear
    from spear_compile.models.tiny import tiny_llama
    from spear_compile.runtime.engine import default_policy

    monkeypatch.setenv("SPEAR_CACHE_DIR", str(tmp_path))
    model = tiny_llama()
    spear.quantize_(model, spear.QuantConfig(group_size=32), progress=False)
    logs = []
    pol = default_policy(model, 40.0, compiled=True, max_chunk=16, device="cpu", log=logs.append)
    assert any("planning the model as it runs eagerly" in m for m in logs)
    assert any("measuring the latency model" in m for m in logs) and pol.max_chunk == 16


# ------------------------------------------------------------------ the adapter on its own


@contextlib.contextmanager
def _bare_scheduler(cls):
    """transformers' batch processor on the tiny model with scheduler class ``cls`` registered (blocks of 16
    tokens, 16 blocks, 64 tokens a step), warmed up so that its scheduler exists; no generation thread."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from spear_compile.models import load
    from spear_compile.runtime.hf_scheduler import config_kwargs, register_scheduler, unregister_scheduler

    name = register_scheduler(cls)
    model, _ = load("tiny-llama")
    try:
        cb = ContinuousBatchingConfig(**config_kwargs(16, num_blocks=16, max_batch_tokens=64, scheduler_type=name,
                                                      allow_block_sharing=False))
        gc = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=-1)
        manager = model.init_continuous_batching(generation_config=gc, continuous_batching_config=cb)
        manager.warmup()  # builds the batch processor (cache and our scheduler); no generation thread
        yield manager.batch_processor.scheduler
        manager.destroy()
    finally:
        unregister_scheduler(name)


@pytest.mark.parametrize("lag", [0, 1])
def test_scheduler_adapter_schedules_exactly_the_planned_pieces(lag):
    from transformers.generation.continuous_batching import RequestState, RequestStatus

    from spear_compile.runtime.hf_scheduler import PolicyScheduler, SchedulerHooks, make_scheduler_class

    class Scripted:
        def __init__(self, plans):
            self.plans, self.states = list(plans), []

        def plan(self, state):
            self.states.append(state)
            return self.plans.pop(0)

    policy = Scripted([
        StepPlan((), (("a", 20),)),                        # a partial first piece
        StepPlan((), (("a", 20), ("b", 7))),               # a's rest, a partial piece of b
        StepPlan(("a",), (("b", 23), ("c", 3))),           # a decodes, b's rest, c partial
        StepPlan(("a", "b"), (), preempt_ids=("c",)),       # c preempted
        StepPlan(("a", "b"), (("c", 10),)),                 # the token budget clips this piece
    ])
    plans, ticks = list(policy.plans), []
    cls = make_scheduler_class(policy, SchedulerHooks(on_tick=lambda plan, ms: ticks.append((plan, ms))), lag=lag)
    with _bare_scheduler(cls) as sched:
        assert isinstance(sched, cls) and isinstance(sched, PolicyScheduler)
        for rid, n in (("a", 40), ("b", 30), ("c", 10)):
            sched.add_waiting_request(RequestState(request_id=rid, initial_tokens=list(range(1, n + 1)),
                                                   max_new_tokens=4, eos_token_id=-1))

        def step(token_budget=64):
            batch, _, q_tokens, _ = sched.schedule_batch(token_budget, 10_000)
            for fs in batch:  # what the batch processor does after the forward: advance, append a token
                fs.state.position_offset += fs.query_length
                if fs.has_new_token:
                    fs.state.update_and_check_completion(7, None)
            return [(fs.state.request_id, fs.query_length) for fs in batch], q_tokens

        assert step() == ([("a", 20)], 20)
        assert sched.active_requests["a"].status == RequestStatus.PREFILLING
        assert step() == ([("a", 20), ("b", 7)], 27)
        s = policy.states[1]
        assert [(w.request_id, w.arrival, w.remaining_prompt, w.prefilled) for w in s.waiting_fcfs()] == \
            [("a", 0, 20, 20), ("b", 1, 30, 0), ("c", 2, 10, 0)]
        assert s.kv.block_size == 16 and s.kv.free_blocks == 16 - 2  # a's 20 tokens hold 2 blocks
        assert step() == ([("a", 1), ("b", 23), ("c", 3)], 27)
        s = policy.states[2]
        assert [(d.request_id, d.context_len) for d in s.decodes] == [("a", 40)]
        batch, q = step()
        assert batch == [("a", 1), ("b", 1)] and q == 2
        s = policy.states[3]
        assert [(d.request_id, d.context_len) for d in s.decodes] == [("a", 41), ("b", 30)]
        free_before = s.kv.free_blocks
        c = sched.waiting_requests["c"]  # soft reset: queued again with its whole prompt, same arrival
        assert c.status == RequestStatus.PENDING and len(c.remaining_prefill_tokens) == 10 and c.position_offset == 0
        assert step(token_budget=6) == ([("a", 1), ("b", 1), ("c", 4)], 6)
        s = policy.states[4]
        assert [(w.request_id, w.arrival, w.prefilled) for w in s.waiting] == [("c", 2, 0)]
        assert s.kv.free_blocks == free_before + 1  # c's block came back
        # every call reported the time since the previous call and the plan of the step that gap times
        # (step_gaps): the previous call's, or with asynchronous batching (lag 1) the one before it
        assert [p for p, _ in ticks] == [None] * (1 + lag) + plans[:4 - lag] and all(ms >= 0 for _, ms in ticks)


def test_the_wait_after_the_last_request_is_no_steps_time():
    """transformers checks ``has_pending_requests`` before each ``schedule_batch`` and, with no request left,
    waits without calling the scheduler. The scheduler ends the last step's gap at that check (``on_tick``
    with its plan, well under the wait), reports the gap that holds the wait with no plan, and tells a
    policy with ``idle()`` once per wait. Before, the last decode of a request was recorded at 50-1273 ms."""
    from transformers.generation.continuous_batching import RequestState

    from spear_compile.runtime.hf_scheduler import SchedulerHooks, make_scheduler_class

    class Scripted:
        def __init__(self):
            self.idles = 0

        def plan(self, state):
            return StepPlan((), tuple((w.request_id, w.remaining_prompt) for w in state.waiting))

        def idle(self):
            self.idles += 1

    policy, ticks, wait_s = Scripted(), [], 0.2
    cls = make_scheduler_class(policy, SchedulerHooks(on_tick=lambda plan, ms: ticks.append((plan, ms))))
    with _bare_scheduler(cls) as sched:
        for rid in ("a", "b"):
            sched.add_waiting_request(RequestState(request_id=rid, initial_tokens=[1, 2, 3], max_new_tokens=4,
                                                   eos_token_id=-1))
            assert sched.has_pending_requests()
            batch, _, _, _ = sched.schedule_batch(64, 10_000)
            assert [fs.state.request_id for fs in batch] == [rid]
            sched.finish_request(rid)  # the request ends with this step
            assert not sched.has_pending_requests() and not sched.has_pending_requests()  # the loop polls
            time.sleep(wait_s)
        assert policy.idles == 2, "idle() once per wait"
        # call a; a's step ends at the first empty check; the wait; call b; b's step; the wait
        assert [p is not None for p, _ in ticks] == [False, True, False, True]
        assert ticks[1][0].prefill == (("a", 3),) and ticks[3][0].prefill == (("b", 3),)
        assert ticks[1][1] < 1e3 * wait_s / 2 and ticks[2][1] >= 1e3 * wait_s, ticks
