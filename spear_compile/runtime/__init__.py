"""Runtime: the step-time latency model and the engine-neutral SLO chunk scheduler.

* ``state``: the scheduler's input (running decodes, waiting requests, the KV cache) and output
  (``StepPlan``), frozen and validated.
* ``plan``: what was compiled, as the latency model sees it (``Plan``, ``PlannedLinear``, ``PlannedOp``);
  ``compiled``: ``plan_of(model)`` from what the spear backend recorded, and ``scheduler_for(compiled,
  slo_itl_ms)``, the SLO policy on the plan's latency model (cached, measured on first use).
* ``latency``: per-linear tables by M bucket, attention by (new tokens, cached tokens), the head and a
  per-step overhead composed into ``LatencyModel.predict_step_ms``. ``fit``: ``check`` / ``fit_overhead`` /
  ``fit_scaled`` (robust to one-off slow steps) against measured whole steps. ``latency_cache``: the JSON cache keyed by GPU, model, config hash and version.
  ``measure``: timing those parts on this device (imports torch only when called).
* ``policy``: ``SloChunkPolicy`` (dynamic chunks under an ITL SLO) and ``StaticChunkPolicy``;
  ``sched_cost``: the per-step planning cost.
* ``online``: ``StepTimeCorrection``, the running correction of the predictions from the engine's
  measured steps, which the SLO policy plans against.
* ``calibrate``: the step overhead refitted on the serving engine's own steps (what the op tables
  cannot see: batch preparation, sampling, the engine's attention), cached per plan and engine
  configuration; the engine runs it when it starts with ``slo_itl_ms``. ``first_use``: the counters
  (CUDA graphs captured, graphs compiled) by which it leaves out steps that paid a one-off cost.
* ``engine``: ``Engine``, serving on transformers' continuous batching with a policy plugged into its
  scheduler (``hf_scheduler``) and the spear backend in its compile config. Imported on first use of
  ``Engine`` (it imports transformers).

Importing this package imports neither torch.compile machinery nor torch itself beyond what the
parent package already imported. Kernel-level measurements that drive compilation live elsewhere
(``benchmarks/kernels.py`` writes the tuned tables the dispatch layer reads).
"""
from .latency import AttentionCost, LatencyModel, LatencyTable, LinearTable, Overhead
from .fit import FitReport, StepSample, check, fit_overhead, fit_scaled
from .latency_cache import CacheKey, load, load_or_measure, save
from .compiled import PlanError, plan_of, scheduler_for
from .calibrate import calibrate
from .plan import Plan, PlannedLinear, PlannedOp
from .online import StepTimeCorrection
from .policy import SchedulingError, SloChunkPolicy, StaticChunkPolicy
from .state import KVCache, RunningDecode, SchedulerState, StepPlan, WaitingRequest

__all__ = [
    "AttentionCost", "CacheKey", "FitReport", "KVCache", "LatencyModel", "LatencyTable", "LinearTable", "Overhead",
    "Plan", "PlanError", "PlannedLinear", "PlannedOp", "RunningDecode", "SchedulerState", "SchedulingError", "SloChunkPolicy",
    "StaticChunkPolicy", "StepPlan", "StepSample", "StepTimeCorrection", "WaitingRequest", "calibrate", "check", "fit_overhead", "fit_scaled", "load",
    "load_or_measure", "plan_of", "save", "scheduler_for", "Engine",
]


def __getattr__(name):
    if name == "Engine":  # lazily: the engine imports transformers
        from .engine import Engine

        return Engine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
