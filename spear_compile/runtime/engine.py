"""The serving engine: transformers' continuous batching with our step policy and the spear backend.

``Engine(model, tokenizer, policy=..., slo_itl_ms=..., compile=True)`` wraps a transformers
``ContinuousBatchingManager`` (``model.init_continuous_batching``): its paged KV cache, its generation
thread, its varlen forward and sampler. It adds three things and nothing else:

* the scheduler: every step is planned by ``policy.plan(SchedulerState) -> StepPlan`` through
  ``hf_scheduler.PolicyScheduler`` (registered in transformers' scheduler mapping and selected by the
  ``ContinuousBatchingConfig``'s ``scheduler_type``);
* the compiler: ``compile=True`` gives transformers' own compile hook (``ContinuousBatchingConfig``'s
  ``varlen_compile_config`` / ``decode_compile_config``, a transformers ``CompileConfig``) the spear
  backend, so transformers compiles its forward-and-sample function with ``backend="spear"``;
* the front end: admission control, per-request token streams (sync and async), cancellation.

Contract:

* ``generate(prompts, max_new_tokens)`` blocks and returns, per prompt, the generated token ids (or the
  decoded texts with ``output="text"``); greedy by default (``do_sample=False``), so the tokens are
  those of ``model.generate`` with the same model, up to floating-point ties.
* ``add_request(prompt, max_new_tokens) -> request_id`` returns at once; ``stream(request_id)`` yields
  that request's new token ids as they are generated (one consumer per request), ``result(request_id)``
  blocks for all of them; ``astream(prompt, ...)`` is the ``async for`` form (leaving the loop early
  cancels the request); ``cancel(request_id)`` stops a request and frees its KV blocks at the next step.
* Admission is decided at once, in the caller's thread: ``AdmissionError`` (naming the limit and the
  value) when ``max_queue`` requests already wait to start, or when the prompt plus ``max_new_tokens``
  needs more KV than the whole cache holds (it could never run). A prompt must be non-empty.
* ``start()`` / ``stop()`` or ``with Engine(...) as engine``; ``add_request`` starts a stopped engine.
  ``stop()`` lets the running requests finish (``stop(wait=False)``: they fail with "engine stopped").

The policy: ``policy=`` any object with ``plan(state) -> StepPlan``. Without one, ``slo_itl_ms=`` builds
a ``SloChunkPolicy`` from a latency model measured on this device for the model's plan (cached, see
``latency_cache``): after the warm-up has compiled the forward, the plan is what the spear backend
recorded (``runtime.plan_of``: every op with its kernel route per M bucket); without compiling, the eager
plan of the model's ``QuantLinear``s. Until then (the warm-up itself) a static chunk plans. With
neither, a ``StaticChunkPolicy`` whose chunk is the step's token budget: transformers' FIFO behaviour (decodes first, then prefill in arrival order up to the budget).

What transformers' continuous batching does not offer here: parallel sampling (``num_return_sequences``
> 1 is refused), prefix sharing and CPU offloading (turned off: the policy does not model them). Dynamo
specialises on each layer's index where transformers' paged-cache update breaks the graph, so a model
with more layers than ``torch._dynamo.config.recompile_limit`` would run the rest eagerly; with
``compile`` on, the engine raises that limit to cover every layer (``recompile_limit=``; process-wide).
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import queue
import threading
from typing import Any, AsyncIterator, Callable, Dict, Iterator, List, Optional, Sequence, Union

from ..errors import AdmissionError, EngineError
from . import latency_cache
from .calibrate import calibrate, engine_key
from .compiled import PlanError, _device_of, plan_of, scheduler_for
from .latency_cache import CacheKey
from .online import StepTimeCorrection
from .policy import SloChunkPolicy, StaticChunkPolicy
from .state import blocks_for

logger = logging.getLogger(__name__)

_END = object()
Prompt = Union[str, Sequence[int]]


# ------------------------------------------------------------------ the default policy


def _plan(model, compiled: bool, log: Callable[[str], None]):
    try:
        return plan_of(model, eager=not compiled)
    except PlanError as e:
        log(f"spear_compile: {e}; planning the model as it runs eagerly")
        return plan_of(model, eager=True)


def default_policy(model, slo_itl_ms: float, compiled: bool, max_chunk: int = 2048, device=None,
                   log: Callable[[str], None] = print) -> SloChunkPolicy:
    """``SloChunkPolicy`` for ``model`` under ``slo_itl_ms`` (``compiled.scheduler_for``): the latency model
    of the model's plan on this device, from the cache or measured once. ``compiled``: the plan is what
    the spear backend recorded for the graphs the engine's warm-up compiled (``plan_of``); else, or when
    nothing was recorded, the eager plan of the model's ``QuantLinear``s (``plan_of(eager=True)``).
    The engine then refits its overhead on the engine's own steps (``calibrate``)."""
    return scheduler_for(model, slo_itl_ms, max_chunk=max_chunk, min_chunk=min(32, max_chunk), device=device,
                         log=log, plan=_plan(model, compiled, log))


# ------------------------------------------------------------------ requests


@dataclasses.dataclass
class _Request:
    request_id: str
    prompt_len: int
    max_new_tokens: int
    tokens: List[int] = dataclasses.field(default_factory=list)
    status: str = "queued"  # queued -> running -> finished | cancelled | failed
    error: Optional[BaseException] = None
    sync: "queue.Queue" = dataclasses.field(default_factory=queue.Queue)
    sink: Optional[tuple] = None  # (asyncio loop, asyncio.Queue) of an astream consumer
    done: threading.Event = dataclasses.field(default_factory=threading.Event)

    def push(self, item) -> None:
        if self.sink is not None:
            loop, aq = self.sink
            try:
                loop.call_soon_threadsafe(aq.put_nowait, item)
            except RuntimeError:  # the consumer's loop is closed: nobody listens any more
                pass
        else:
            self.sync.put(item)

    def close(self, status: str, error: Optional[BaseException] = None) -> bool:
        if self.done.is_set():
            return False
        self.status, self.error = status, error
        self.done.set()
        self.push(_END)
        return True


# KV-read padding (tokens) under attention="varlen": fewer CUDA-graph shapes for a bounded gather (_cb_defaults)
VARLEN_KV_PADDING = 2048
# transformers' padding of a compiled (or CUDA-graphed) step's tokens when cb_config does not set
# q_padding_interval_size (5.17: continuous_batching/initialization.py's fallback)
TRANSFORMERS_Q_PADDING = 64


class Engine:
    """Continuous batching for a (quantized, EC-carrying, spear-compiled) causal LM (module docstring).

    ``block_size``: KV block (page) size in tokens (transformers' default when None: 256);
    ``num_blocks`` / ``max_batch_tokens``: the cache's blocks and the most tokens in one step (sized by
    transformers from free memory when None: 90 % of it for the cache, which left too little for the CUDA
    graphs' pools on an H200 with a 7B model, out of memory at 17.7 GiB of pools; give ``num_blocks``, or
    ``cb_config={"max_memory_percent": ...}``, there); ``max_requests_per_batch``: the most sequences in a step;
    ``compile``: False, True (``backend="spear"``) or a backend name; ``compile_options``: the spear
    backend's options (``CompileConfig`` fields); ``generation_config``: a transformers
    ``GenerationConfig`` (default: the model's, greedy); ``cb_config``: further
    ``ContinuousBatchingConfig`` fields; ``calibrate``: with ``slo_itl_ms`` and no policy, refit the
    latency model's step overhead on the engine's own steps when it starts (``runtime.calibrate``; a
    few dozen steps, cached per plan and engine configuration); ``attention``: None keeps transformers'
    choice (without flash-attn ``paged|sdpa``: one masked attention over the whole step), ``"varlen"``
    runs ``runtime.attention.paged_varlen_attention`` (each sequence against its own keys; the model's
    attention implementation is restored when the engine stops); ``online_correction``: the SLO policy the
    engine builds plans against its latency model corrected online by the engine's measured steps
    (``online.StepTimeCorrection``, ``Engine.correction``; steps that captured or compiled a graph
    are left out). On by default: on an H100 (Llama-2-7B-shaped W4, ECs on 25 %, 16 ms SLO) it took p99 ITL
    from 16.4-18.1 to 15.9-16.0 ms and attainment from 0.79-0.95 to 0.99 (``runtime.online``);
    ``async_batching``: transformers' asynchronous batching (``use_async_batching``: two sets of step
    buffers on CUDA, so the host prepares, plans and launches step k while the GPU runs step k - 1; the
    engine then times each step by the gap one call later, ``step_gaps``). Needs CUDA and an attention
    without a step mask (``attention="varlen"`` or flash attention); off by default, since transformers
    turns it off for a masked attention (its ``paged|sdpa``)."""

    def __init__(self, model, tokenizer=None, policy=None, slo_itl_ms: Optional[float] = None,
                 max_queue: int = 256, compile: Union[bool, str] = False, compile_options: Optional[dict] = None,
                 block_size: Optional[int] = None, num_blocks: Optional[int] = None,
                 max_batch_tokens: Optional[int] = None, max_requests_per_batch: Optional[int] = None,
                 generation_config=None, cb_config: Optional[dict] = None,
                 recompile_limit: Optional[int] = None, calibrate: bool = True, attention: Optional[str] = None,
                 online_correction: bool = True, async_batching: bool = False,
                 log: Callable[[str], None] = logger.info) -> None:
        if policy is not None and not callable(getattr(policy, "plan", None)):
            raise TypeError(f"Engine: policy={policy!r} must have a plan(state) -> StepPlan method")
        if slo_itl_ms is not None and (isinstance(slo_itl_ms, bool) or not isinstance(slo_itl_ms, (int, float))
                                       or not slo_itl_ms > 0):
            raise ValueError(f"Engine: slo_itl_ms={slo_itl_ms!r} must be a positive number of milliseconds")
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 1:
            raise ValueError(f"Engine: max_queue={max_queue!r} must be an integer >= 1")
        if attention not in (None, "varlen"):
            raise ValueError(f"Engine: attention={attention!r} must be None (transformers' choice) or 'varlen'")
        if not isinstance(async_batching, bool):
            raise ValueError(f"Engine: async_batching={async_batching!r} must be True or False")
        if async_batching and "use_async_batching" in (cb_config or {}):
            raise ValueError("Engine: give async_batching=True or cb_config['use_async_batching'], not both")
        if compile not in (False, True) and not isinstance(compile, str):
            raise ValueError(f"Engine: compile={compile!r} must be False, True (backend 'spear') or a backend name")
        self.model, self.tokenizer = model, tokenizer
        self.policy, self.slo_itl_ms, self.max_queue = policy, slo_itl_ms, max_queue
        self._user_policy = policy is not None
        self.backend = "spear" if compile is True else (compile or None)
        self.compile_options = dict(compile_options or {})
        self.block_size, self.num_blocks, self.max_batch_tokens = block_size, num_blocks, max_batch_tokens
        self.max_requests_per_batch = max_requests_per_batch
        self.extra_cb = dict(cb_config or {})
        self.recompile_limit, self.log = recompile_limit, log
        self.attention, self._saved_attention = attention, None
        self.generation_config = self._generation_config(generation_config)
        self.steps: List[tuple] = []  # (SchedulerState, StepPlan, scheduled) per step when record_steps is on
        self.record_steps = False
        self._manager = None
        self._scheduler_name: Optional[str] = None
        self._scheduler_cls: Optional[type] = None
        self._requests: Dict[str, _Request] = {}
        self._queued: set = set()
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._dispatcher: Optional[threading.Thread] = None
        self._stop_dispatch = threading.Event()
        self.kv_block_size = self.kv_total_blocks = None
        self._calibrate_on = calibrate
        self.calibration = None  # the calibrated LatencyModel, once made or loaded
        self._plan_key = None
        self.correction = StepTimeCorrection() if online_correction else None
        if async_batching:
            self.extra_cb["use_async_batching"] = True
        # calls between a step's planning call and the gap that times it (step_gaps): 1 with async batching
        self.step_lag = 1 if self.extra_cb.get("use_async_batching") else 0
        self._marker, self._tick_mark = None, None

    # -- configuration

    def _generation_config(self, gc):
        import copy

        from transformers import GenerationConfig

        if gc is None:
            base = getattr(self.model, "generation_config", None)
            gc = copy.deepcopy(base) if base is not None else GenerationConfig()
            gc.do_sample = False  # greedy unless the caller's config says otherwise
            for k in ("temperature", "top_p", "top_k"):  # sampling knobs would only warn under greedy
                if hasattr(gc, k):
                    setattr(gc, k, None)
        if getattr(gc, "num_return_sequences", None) not in (None, 1):
            raise ValueError(f"Engine: num_return_sequences={gc.num_return_sequences} is not supported "
                             f"(one sequence per request)")
        if gc.eos_token_id is None:
            gc.eos_token_id = getattr(self.model.config, "eos_token_id", None)
        if gc.max_new_tokens is None:
            gc.max_new_tokens = 20
        return gc

    def _compile_config(self):
        if self.backend is None:
            return None
        from transformers import CompileConfig

        # mode "default": the spear backend runs Inductor with its defaults (another mode only warns there);
        # dynamic: the token count changes every step; fullgraph off: the paged cache update is a graph break
        return CompileConfig(backend=self.backend, mode="default", dynamic=True, fullgraph=False,
                             options=self.compile_options or None)

    def _resolve_policy(self):
        """The policy the engine starts with. With ``slo_itl_ms`` and no policy, a static one until the
        warm-up has compiled the model (``_slo_policy`` then replaces it, before the first request)."""
        if self.policy is not None:
            return self.policy
        return StaticChunkPolicy(self.max_batch_tokens or 1 << 30)

    def _slo_policy(self) -> None:
        """With ``slo_itl_ms`` and no policy of the user's: the SLO policy on the plan's latency model (op
        tables measured or cached); ``_calibrate`` then refits its overhead on this engine's steps."""
        if self.slo_itl_ms is not None and isinstance(self.policy, StaticChunkPolicy) and not self._user_policy:
            plan = _plan(self.model, self.backend == "spear", self.log)
            self._plan_key = CacheKey.for_plan(plan, _device_of(self.model))
            self.set_policy(scheduler_for(self.model, self.slo_itl_ms, max_chunk=self.max_batch_tokens or 2048,
                                          min_chunk=min(32, self.max_batch_tokens or 2048), log=self.log, plan=plan,
                                          token_pad=self.token_pad, correction=self.correction))

    def _calibrate(self) -> None:
        """Refit the SLO policy's step overhead on the engine's own steps (``calibrate.calibrate``), or load
        that calibration from the cache (keyed by the plan and the engine's configuration)."""
        if self._plan_key is None or not self._calibrate_on:
            return
        key = engine_key(self._plan_key, self)
        model, reason = latency_cache.load(key)
        if model is None:
            self.log(f"spear_compile: {reason}; calibrating the step overhead on this engine's own steps "
                     f"(first use, cached afterwards)")
            model, report, samples = calibrate(self, self.policy.model, log=self.log)
            where = latency_cache.save(model, key, meta={"held_out": str(report), "steps": len(samples),
                                                         "overhead": model.overhead.to_dict()})
            self.log(f"spear_compile: step overhead calibrated (held out: {report}); saved to {where}")
        self.calibration = model
        p = self.policy
        if self.correction is not None:
            self.correction.reset()  # the calibration's steps ran under another model
        self.set_policy(SloChunkPolicy(model, p.slo, max_chunk=p.max_chunk, min_chunk=p.min_chunk,
                                       correction=self.correction))
        why = self.policy.infeasible()
        if why is not None:  # a clear word at start rather than a queue that silently grows
            logger.warning("spear_compile: %s", why)
            self.log(f"spear_compile: warning: {why}")

    @property
    def token_pad(self) -> int:
        """The multiple transformers pads a step's token count to, which the latency model must predict
        with (``LatencyModel.token_pad``): compiled or CUDA-graphed, ``q_padding_interval_size`` of
        ``cb_config`` or transformers' default (``TRANSFORMERS_Q_PADDING``); eager, 1 (no padding)."""
        if self.backend is None and not self.extra_cb.get("use_cuda_graph"):
            return 1
        return int(self.extra_cb.get("q_padding_interval_size") or TRANSFORMERS_Q_PADDING)

    def _cb_defaults(self, cc) -> dict:
        """Compiled: the step shapes transformers pads to, and on CUDA its CUDA graphs on, unless ``cb_config``
        says otherwise (each key apart). Measured on one H200 (Llama-2-7B-shaped W4 g128, ECs r64 on 25 % of
        the linears, transformers 5.17, ``benchmarks/engine_profile.py``; records in
        ``benchmarks/results/engine_profile/2026-12-04_h200/``):

        * ``use_cuda_graph=True`` on CUDA. transformers infers them off for a compile config without its fast
          decode path (flash-attn's KV-cache kernel); the batch-1 decode step was 87.0 ms without them and
          26.6 ms with them (2026-12-03: host work of 32 layers replayed).
        * ``kv_padding_interval_size`` = one KV block. When it compiles, transformers pads a step's KV reads
          to a multiple of 16384 tokens: with CUDA graphs the batch-1 decode step (at most 72 tokens of context) then
          spent 26.0 of its 28.3 ms on the GPU, 12.4 ms of it attention over the padded positions and 2.1 ms
          gathering them. Reads padded to whole pages (what the paged cache holds anyway) cost one CUDA graph
          per distinct number of pages read instead.
        * The step's tokens keep transformers' padding (a multiple of 64, so at most 2048 / 64 graphs per KV
          size). With it the batch-1 decode step is 14.4 ms wall (12.9 ms GPU, most of it the W4 GEMM at
          M = 64) and batch 16 16.5 ms (``2026-12-04_h200_graph_pool/``). Exact token counts
          (``cb_config={"q_padding_interval_size": 1}``) give batch-1 decode the M = 1 GEMV (11 us per launch
          in the engine's graphs on 4 layers), but compile and capture a graph per distinct token count:
          the 32-layer model did not finish its first 40 tokens in 280 s. (An earlier measurement of 0.49 ms
          per GEMV launch was the one-launch EC spinning on state clobbered by transformers' graph pool,
          fixed in ``lowering/layout_cache.outside_pools``.)
        * With ``attention="varlen"`` the KV reads are padded to ``VARLEN_KV_PADDING`` tokens instead. That
          attention reads only each sequence's own keys (``cu_seq_lens_k``), so a padded read costs only
          transformers' gather of the padding rows (read from one trash slot, written once: at most 2047 rows x
          16 KiB = 32 MiB a layer on Llama-2-7B, ~10 us at 3.3 TB/s). Padded to one page, every new total of
          pages read across the batch captured a new CUDA graph: 55-83 captures of 100-500 ms each in a timed
          32-request H100 run (``serving/2026-12-05_h100_varlen_kv256``), which set its p99 ITL. Padded to
          2048 the same run captured 48 graphs in its timed runs against 148, and its mean TTFT fell 1.6-8x
          (``serving/2026-12-06_h100_kv2048``); the captures left still set its p99 ITL."""
        if cc is None:
            return {}
        kv = self.block_size or 256
        if self.attention == "varlen":
            kv = max(kv, VARLEN_KV_PADDING)
        out = {"kv_padding_interval_size": kv}
        if str(_device_of(self.model)).split(":")[0] == "cuda":
            out["use_cuda_graph"] = True
        return {k: v for k, v in out.items() if k not in self.extra_cb}

    def _check_async(self) -> None:
        """Asynchronous batching's requirements, named before transformers is asked: CUDA (its buffers
        and streams), and an attention that needs no step mask."""
        dev = str(_device_of(self.model))
        if not dev.startswith("cuda"):
            raise ValueError(f"Engine: async_batching needs the model on CUDA (transformers' double-buffered "
                             f"steps run on CUDA streams); the model is on {dev}")
        impl = str(getattr(self.model.config, "_attn_implementation", None))
        if self.attention != "varlen" and "flash" not in impl:
            raise ValueError(f"Engine: async_batching needs an attention without a step mask: attention='varlen' "
                             f"or flash attention (the model's attention is {impl!r}, which transformers runs "
                             f"as a masked paged|sdpa)")

    def _raise_recompile_limit(self) -> None:
        import torch._dynamo

        cfg = self.model.config.get_text_config() if hasattr(self.model.config, "get_text_config") else self.model.config
        want = self.recompile_limit or 2 * int(getattr(cfg, "num_hidden_layers", 8)) + 8
        if torch._dynamo.config.recompile_limit < want:
            self.log(f"spear_compile: torch._dynamo.config.recompile_limit {torch._dynamo.config.recompile_limit}"
                     f" -> {want}, so that every layer's graph is compiled (process-wide)")
            torch._dynamo.config.recompile_limit = want

    # -- lifecycle

    @property
    def running(self) -> bool:
        return self._manager is not None and self._manager.is_running()

    def start(self) -> "Engine":
        """Create the transformers manager with our scheduler and compile config, warm it up (this is when
        the forward is first compiled), and start its generation thread and our output dispatcher."""
        if self.running:
            return self
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        from .hf_scheduler import SchedulerHooks, config_kwargs, kv_geometry, make_scheduler_class, register_scheduler

        policy = self._resolve_policy()
        self.policy = policy
        hooks = SchedulerHooks(on_start=self._on_start, on_fail=self._on_fail, on_step=self._on_step,
                               on_tick=self._on_tick)
        if self.step_lag:
            self._check_async()
        self._scheduler_cls = make_scheduler_class(policy, hooks, lag=self.step_lag)
        self._scheduler_name = register_scheduler(self._scheduler_cls)
        cc = self._compile_config()
        if cc is not None:
            self._raise_recompile_limit()
        kw = dict(num_blocks=self.num_blocks, max_batch_tokens=self.max_batch_tokens,
                  max_requests_per_batch=self.max_requests_per_batch, scheduler_type=self._scheduler_name,
                  allow_block_sharing=False, cpu_offload_space=0.0, varlen_compile_config=cc,
                  decode_compile_config=cc, **self._cb_defaults(cc), **self.extra_cb)
        kw.setdefault("use_async_batching", False)  # ours to decide: it sets how steps are timed (step_lag)
        if self.block_size is not None:
            kw = config_kwargs(self.block_size, **kw)
        cb = ContinuousBatchingConfig(**kw)
        try:
            self._switch_attention()
            manager = self.model.init_continuous_batching(generation_config=self.generation_config,
                                                          continuous_batching_config=cb)
            # warmup() builds the batch processor (the paged cache, the scheduler) here, and with compile
            # on runs the forward once at the largest step: the first compilation happens now
            manager.warmup()
            ran_async = bool(getattr(manager.batch_processor, "use_async_batching", False))
            if ran_async != bool(self.step_lag):
                raise EngineError(f"Engine: asked for use_async_batching={bool(self.step_lag)}, transformers "
                                  f"runs {ran_async}")
            bs, total, _ = kv_geometry(manager.batch_processor.cache)
            self.kv_block_size, self.kv_total_blocks = bs, total
            self.max_batch_tokens = manager.batch_processor.cache.max_batch_tokens
            self._manager = manager
            self._slo_policy()  # the warm-up compiled the model: its plan is known now
            manager.start()
        except BaseException:
            self._unregister()
            self._restore_attention()
            raise
        self._stop_dispatch.clear()
        self._dispatcher = threading.Thread(target=self._dispatch, name="spear-engine-dispatch", daemon=True)
        self._dispatcher.start()
        try:
            self._calibrate()
        except BaseException:
            self.stop(wait=False)
            raise
        self.log(f"spear_compile: engine started ({self.policy!r}; KV {total} blocks of {bs} tokens; "
                 f"{self.max_batch_tokens} tokens per step; compile={self.backend or 'off'})")
        return self

    def stop(self, wait: bool = True, timeout: Optional[float] = None) -> None:
        """Stop the generation thread. ``wait``: let queued and running requests finish first; else they
        fail with ``EngineError('engine stopped')``."""
        manager = self._manager
        if manager is None:
            return
        try:
            manager.stop(block=True, timeout=timeout, hard_stop=not wait)
        finally:
            self._stop_dispatch.set()
            if self._dispatcher is not None:
                self._dispatcher.join(timeout=5)
            self._dispatcher = None
            for req in list(self._requests.values()):
                req.close("failed", EngineError(f"request {req.request_id!r}: engine stopped before it finished"))
            with self._lock:
                self._queued.clear()
            try:
                manager.destroy()
            finally:
                self._manager = None
                self._unregister()
                self._restore_attention()

    def _switch_attention(self) -> None:
        if self.attention == "varlen" and self._saved_attention is None:
            from .attention import register

            name = register()  # a transformers that cannot run it refuses here, the model untouched
            self._saved_attention = self.model.config._attn_implementation
            self.model.set_attn_implementation(name)

    def _restore_attention(self) -> None:
        if self._saved_attention is not None:
            self.model.set_attn_implementation(self._saved_attention)
            self._saved_attention = None

    def _unregister(self) -> None:
        if self._scheduler_name is not None:
            from .hf_scheduler import unregister_scheduler

            unregister_scheduler(self._scheduler_name)
            self._scheduler_name = None

    def __enter__(self) -> "Engine":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop(wait=exc[0] is None)

    # -- hooks from the generation thread

    def _on_start(self, request_id: str) -> None:
        with self._lock:
            self._queued.discard(request_id)
            req = self._requests.get(request_id)
            if req is not None and req.status == "queued":
                req.status = "running"

    def _on_fail(self, request_id: str, message: str) -> None:
        with self._lock:
            self._queued.discard(request_id)
            req = self._requests.get(request_id)
        if req is not None:
            req.close("failed", AdmissionError(f"request {request_id!r} cannot be scheduled: {message}",
                                               limit="kv_blocks", value=req.prompt_len + req.max_new_tokens))

    def _on_step(self, state, plan, scheduled) -> None:
        if self.record_steps:
            self.steps.append((state, plan, scheduled))

    def _first_use_mark(self):
        """What moves when a step captures or compiles a graph (``first_use``): CUDA graphs held and graphs
        compiled with CUDA graphs on, graphs compiled when compiled, nothing (None) in eager."""
        if self._marker is None:
            from .first_use import FirstUseMarker, compiled_graph_count

            graphs = self.extra_cb.get("use_cuda_graph", self._cb_defaults(self._compile_config()).get("use_cuda_graph"))
            self._marker = (FirstUseMarker(self) if graphs else compiled_graph_count if self.backend is not None
                            else (lambda: None))
        return self._marker()

    def _on_tick(self, plan, ms: float) -> None:
        """The last step's wall time (``SchedulerHooks.on_tick``) into the online correction, when the
        planning policy reads this correction and the step captured or compiled no graph."""
        if self.correction is None or getattr(self.policy_inner(), "correction", None) is not self.correction:
            return  # (a static policy: no graph walk per step; a stale mark at worst makes the next step unsteady)
        mark = self._first_use_mark()
        steady, self._tick_mark = mark == self._tick_mark, mark
        if plan is not None and steady:
            self.correction.observe(plan.predicted_ms, ms, prefill=bool(plan.prefill))

    def policy_inner(self):
        """The policy that plans, under any wrappers (an object's ``inner`` attribute, as a timing wrapper
        has)."""
        p = self.policy
        while hasattr(p, "inner"):
            p = p.inner
        return p

    def set_policy(self, policy) -> None:
        """Plan the following steps with ``policy`` (an object with ``plan(state) -> StepPlan``); takes effect
        at the next step of a running engine."""
        if not callable(getattr(policy, "plan", None)):
            raise TypeError(f"Engine.set_policy: policy={policy!r} must have a plan(state) -> StepPlan method")
        self.policy = policy
        if self._scheduler_cls is not None:
            self._scheduler_cls.policy = policy

    # -- the output dispatcher

    def _dispatch(self) -> None:
        """Route transformers' outputs (full token lists so far, one per step per streaming request) to
        each request's stream as the new tokens."""
        manager = self._manager
        while True:
            out = manager.get_result(timeout=0.05)
            if out is None:
                if self._stop_dispatch.is_set() or not manager.is_running():
                    if manager.output_router.output_queue.empty():
                        break
                continue
            with self._lock:
                req = self._requests.get(out.request_id)
            if req is None or req.done.is_set():
                continue  # cancelled, or failed by the scheduler: late outputs are dropped
            new = list(out.generated_tokens[len(req.tokens):])
            req.tokens.extend(new)
            for t in new:
                req.push(int(t))
            if out.is_finished():
                with self._lock:
                    self._queued.discard(out.request_id)
                if out.error is not None:
                    req.close("failed", EngineError(f"request {out.request_id!r} failed: {out.error}"))
                else:
                    req.close("finished")
        if not self._stop_dispatch.is_set():  # the generation loop died: nothing will come for the others
            why = getattr(manager.background_thread_status, "fatal_error", None)
            for req in list(self._requests.values()):
                req.close("failed", EngineError(f"request {req.request_id!r}: the generation loop stopped"
                                                + (f" ({why})" if why else "")))

    # -- requests

    def _encode(self, prompt: Prompt) -> List[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("Engine: a text prompt needs the tokenizer (Engine(model, tokenizer, ...))")
            ids = self.tokenizer(prompt).input_ids
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("Engine: the prompt is empty")
        return list(ids)

    def add_request(self, prompt: Prompt, max_new_tokens: Optional[int] = None, request_id: Optional[str] = None,
                    eos_token_id=None, _sink: Optional[tuple] = None) -> str:
        """Queue a request; returns its id. Raises ``AdmissionError`` at once when ``max_queue`` requests
        already wait to start or when it needs more KV than the cache holds."""
        ids = self._encode(prompt)
        m = self.generation_config.max_new_tokens if max_new_tokens is None else max_new_tokens
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"Engine: max_new_tokens={m!r} must be an integer >= 1")
        if not self.running:
            self.start()
        bs, total = self.kv_block_size, self.kv_total_blocks
        need = len(ids) + m
        if blocks_for(need, bs) > total:
            raise AdmissionError(
                f"request needs {need} tokens of KV cache (prompt {len(ids)} + max_new_tokens {m}), more than "
                f"the whole cache holds: {total * bs} tokens ({total} blocks of {bs}); shorten it or give the "
                f"engine more num_blocks", limit="kv_tokens", value=need)
        with self._lock:
            if len(self._queued) >= self.max_queue:
                raise AdmissionError(
                    f"queue full: {len(self._queued)} requests wait to start, max_queue={self.max_queue}; "
                    f"retry later", limit="max_queue", value=len(self._queued) + 1)
            rid = request_id or f"spear-{next(self._ids)}"
            if rid in self._requests:
                raise ValueError(f"Engine: request_id {rid!r} is already in use")
            req = _Request(rid, len(ids), m, sink=_sink)
            self._requests[rid] = req
            self._queued.add(rid)
        got = self._manager.add_request(ids, request_id=rid, max_new_tokens=m, streaming=True,
                                        eos_token_id=eos_token_id)
        if got is None:  # transformers drops requests when its loop is stopping or died
            with self._lock:
                self._requests.pop(rid, None)
                self._queued.discard(rid)
            raise EngineError(f"request {rid!r} was not accepted: the generation loop is not running")
        return rid

    def stream(self, request_id: str) -> Iterator[int]:
        """The request's new token ids as they come; raises the request's error (``EngineError``,
        ``AdmissionError``) if it failed; ends quietly when it finished or was cancelled. A request is
        kept (with its tokens) until its stream has been read to the end."""
        with self._lock:
            req = self._requests.get(request_id)
        if req is None:
            raise KeyError(f"Engine: no request {request_id!r} (unknown, cancelled, or its stream was read)")
        if req.sink is not None:
            raise ValueError(f"Engine: request {request_id!r} is consumed by astream")
        return self._iter(req)

    def _iter(self, req: _Request) -> Iterator[int]:
        while True:
            item = req.sync.get()
            if item is _END:
                with self._lock:
                    self._requests.pop(req.request_id, None)
                if req.status == "failed" and req.error is not None:
                    raise req.error
                return
            yield item

    def result(self, request_id: str) -> List[int]:
        """Block until the request ends; all its generated token ids."""
        return list(self.stream(request_id))

    def cancel(self, request_id: str) -> bool:
        """Cancel a request: its stream ends, transformers drops it and frees its KV blocks before the next
        step. False when it had already ended."""
        with self._lock:
            req = self._requests.pop(request_id, None)
            self._queued.discard(request_id)
        if req is None:
            return False
        if self._manager is not None:
            self._manager.cancel_request(request_id)
        return req.close("cancelled")

    def generate(self, prompts: Sequence[Prompt], max_new_tokens: Optional[int] = None,
                 output: str = "tokens") -> List[Union[List[int], str]]:
        """Run ``prompts`` to completion (concurrently) and return, in order, each one's generated token
        ids (``output="tokens"``) or decoded text (``output="text"``, needs the tokenizer)."""
        if output not in ("tokens", "text"):
            raise ValueError(f"Engine.generate: output={output!r} must be 'tokens' or 'text'")
        if isinstance(prompts, str):
            raise TypeError("Engine.generate takes a list of prompts")
        ids = [self.add_request(p, max_new_tokens) for p in prompts]
        outs = [self.result(r) for r in ids]
        if output == "text":
            if self.tokenizer is None:
                raise ValueError("Engine.generate(output='text') needs the tokenizer")
            return [self.tokenizer.decode(o, skip_special_tokens=True) for o in outs]
        return outs

    async def astream(self, prompt: Prompt, max_new_tokens: Optional[int] = None,
                      request_id: Optional[str] = None) -> AsyncIterator[int]:
        """``async for token in engine.astream(prompt)``: the new token ids of a new request. Leaving the
        loop early (break, task cancellation, a client gone) cancels the request, also when the task is
        cancelled while the request is being admitted."""
        loop = asyncio.get_running_loop()
        aq: asyncio.Queue = asyncio.Queue()
        admit = loop.run_in_executor(None, lambda: self.add_request(prompt, max_new_tokens, request_id,
                                                                    _sink=(loop, aq)))
        try:
            rid = await asyncio.shield(admit)
        except asyncio.CancelledError:  # cancelled while admitting: cancel the request once it is admitted
            admit.add_done_callback(lambda f: f.cancelled() or f.exception() is not None or self.cancel(f.result()))
            raise
        req = self._requests.get(rid)
        finished = False
        try:
            while True:
                item = await aq.get()
                if item is _END:
                    finished = True
                    with self._lock:
                        self._requests.pop(rid, None)
                    if req is not None and req.status == "failed" and req.error is not None:
                        raise req.error
                    return
                yield item
        finally:
            if not finished:
                self.cancel(rid)

    # -- introspection

    def stats(self) -> Dict[str, Any]:
        """Queue and cache now: requests waiting to start and live, free / total KV blocks; whether the loop
        runs asynchronously."""
        from .hf_scheduler import kv_geometry

        out = {"queued": len(self._queued), "live": len(self._requests), "kv_block_size": self.kv_block_size,
               "kv_total_blocks": self.kv_total_blocks, "async_batching": bool(self.step_lag)}
        bp = getattr(self._manager, "batch_processor", None) if self._manager is not None else None
        if bp is not None:
            out["kv_free_blocks"] = kv_geometry(bp.cache)[2]
            out["scheduler_requests"] = len(bp.scheduler.active_requests) + len(bp.scheduler.waiting_requests)
        return out


__all__ = ["Engine", "default_policy"]
