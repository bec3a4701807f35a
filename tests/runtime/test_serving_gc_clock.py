"""The serving benchmark's account of the garbage collector (``benchmarks/serving.py``: ``GcClock``,
``TimedPolicy.gc_us``, ``gc_share``): a collection that runs inside a plan is charged to that plan and
reported apart, and every collection of a run is counted by generation."""
import gc
import importlib.util
import pathlib


def _serving():
    root = pathlib.Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("serving_bench", root / "benchmarks/serving.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _Plans:
    """The static policy, with a full collection inside the plans numbered in ``collect_on``."""

    def __init__(self, collect_on):
        from spear_compile.runtime import StaticChunkPolicy

        self.inner, self.n, self.collect_on = StaticChunkPolicy(16), 0, collect_on

    def plan(self, state):
        self.n += 1
        if self.n in self.collect_on:
            gc.collect()
        return self.inner.plan(state)


def test_a_collection_inside_a_plan_is_charged_to_it_and_counted():
    from spear_compile.runtime.state import KVCache, SchedulerState

    S = _serving()
    timed = S.TimedPolicy(_Plans(collect_on={2}))
    since = len(S.GC_CLOCK.pauses)
    state = SchedulerState((), (), KVCache(16, 8))
    was = gc.isenabled()
    gc.disable()  # only the collection the plan makes (no automatic one landing in another plan)
    try:
        for _ in range(4):
            timed.plan(state)
    finally:
        if was:
            gc.enable()
    assert len(timed.gc_us) == 4 and timed.gc_us[1] > 0 and timed.gc_us[0] == timed.gc_us[2] == 0
    share = S.gc_share(timed.us, timed.gc_us)
    assert share["sched_gc_plans"] == 1
    assert share["sched_us_p99_without_gc"] < timed.us[1], "the collecting plan's time less its collection"
    summary = S.GC_CLOCK.summary(since)
    assert summary["gc_collections"][2] >= 1 and summary["gc_max_pause_ms"] > 0


def test_the_benchmarks_step_record_ends_a_step_when_the_engine_goes_idle():
    """``TimedPolicy.idle`` (called by the scheduler when no request is left) records a call that planned
    nothing: the last step is timed up to it, and the wait after it is no step's time."""
    import time

    from spear_compile.runtime.state import KVCache, RunningDecode, SchedulerState

    S = _serving()
    timed = S.TimedPolicy(_Plans(collect_on=set()))
    busy = SchedulerState((RunningDecode("a", 9),), (), KVCache(16, 8))
    timed.plan(busy)
    timed.idle()
    time.sleep(0.05)  # the engine waits for a request
    timed.plan(busy)
    timed.plan(busy)
    steps = list(S.measured_steps(timed.steps))
    assert len(steps) == 2, "the step before the wait and the one after; the wait itself is no step"
    assert all(ms < 40 for _, _, ms, _, _ in steps), steps
