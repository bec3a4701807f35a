"""The online correction of step-time predictions (``runtime.online``) and the SLO policy planning with it."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spear_compile.runtime import (AttentionCost, KVCache, LatencyModel, LatencyTable, LinearTable, RunningDecode,
                                   SchedulerState, SloChunkPolicy, StepTimeCorrection, WaitingRequest)
from spear_compile.runtime.online import replay


def test_offset_is_the_median_residual_of_the_window_after_min_steps():
    c = StepTimeCorrection(window=4, min_steps=3, quantile=0.5)
    assert c.offset_ms == 0.0
    c.observe(10.0, 12.0)
    c.observe(10.0, 11.0)
    assert c.offset_ms == 0.0                       # fewer than min_steps: no correction yet
    c.observe(10.0, 15.0)
    assert c.offset_ms == 2.0                       # median of 2, 1, 5
    c.observe(10.0, 9.0)                            # residuals 2, 1, 5, -1
    assert c.offset_ms == 1.5
    for _ in range(4):                              # the window forgets the old steps
        c.observe(20.0, 19.0)
    assert c.offset_ms == -1.0 and c.corrected_ms(20.0) == 19.0 and c.observed == 8
    c.reset()
    assert c.offset_ms == 0.0 and c.observed == 0


def test_the_default_offset_is_the_upper_decile_of_32_steps():
    """The SLO is on p99 ITL: the offset covers the residuals of 9 in 10 recent steps, not half of them."""
    c = StepTimeCorrection()
    assert (c.window, c.quantile) == (32, 0.9)
    for r in range(40):                             # residuals 0..39 ms; the window keeps 8..39
        c.observe(10.0, 10.0 + r)
    assert c.offset_ms == pytest.approx(8 + 0.9 * 31)  # numpy's linear quantile of 8..39
    q = StepTimeCorrection(window=5, min_steps=1, quantile=1.0)
    for r in (3.0, -1.0, 7.0, 2.0):
        q.observe(10.0, 10.0 + r)
    assert q.offset_ms == 7.0                       # quantile 1: the window's largest residual


def test_decode_only_steps_have_their_own_window():
    """The policy plans prefill with the prefill steps' offset; decode-only steps the model over-predicts
    must not pull it down (they did in one window: H100, 2026-12-06)."""
    c = StepTimeCorrection(window=4, min_steps=2)
    for _ in range(4):
        c.observe(10.0, 12.0, prefill=True)
        c.observe(10.0, 8.0, prefill=False)
    assert c.offset_ms == c.offset_for(True) == 2.0 and c.offset_for(False) == -2.0
    assert c.corrected_ms(10.0, prefill=False) == 8.0 and c.corrected_ms(10.0) == 12.0


def test_steps_without_a_prediction_or_a_time_are_ignored():
    c = StepTimeCorrection(window=2, min_steps=1)
    c.observe(None, 5.0)
    c.observe(3.0, float("inf"))
    c.observe(3.0, 0.0)
    assert c.observed == 0 and c.offset_ms == 0.0


@pytest.mark.parametrize("kw", [dict(window=0), dict(min_steps=0), dict(window=2, min_steps=3), dict(window=True),
                                dict(quantile=1.5), dict(quantile=True)])
def test_bad_arguments_are_named(kw):
    with pytest.raises(ValueError, match=next(iter(kw)) if "min_steps" not in kw else "min_steps"):
        StepTimeCorrection(**kw)


def test_replay_is_causal_skips_first_use_steps_and_keeps_the_kinds_apart():
    # prefill steps under-predicted by 2 ms, one capture step of +100 ms in the middle, decode-only steps
    # over-predicted by 3 ms between
    steps = ([(10.0, 12.0, False, True)] * 3 + [(10.0, 110.0, True, True)] + [(10.0, 7.0, False, False)] * 5
             + [(10.0, 12.0, False, True)] * 2)
    out = replay(steps, window=8, min_steps=3, quantile=0.5)
    assert out[:3] == [10.0, 10.0, 10.0]            # no history before them
    assert out[3] == 12.0                          # learnt from the steps before; the capture never counted
    assert out[4:9] == [10.0, 10.0, 10.0, 7.0, 7.0]  # decode-only: their own window, from its third step
    assert out[9:] == [12.0, 12.0]


def _model(per_token=1.0, overhead=0.0):
    t = LatencyTable((1, 256), (per_token, 256 * per_token))
    return LatencyModel((LinearTable("all", 1, t),), LatencyTable((1, 256), (overhead, overhead)),
                        AttentionCost(), 1)


@settings(deadline=None, max_examples=60)
@given(offset=st.floats(-3.0, 12.0), decodes=st.integers(0, 6), prompt=st.integers(1, 200))
def test_the_policy_plans_the_corrected_prediction_within_the_slo(offset, decodes, prompt):
    """With a correction, the plan is the plan of the same policy at ``slo - offset`` (so prediction +
    offset <= SLO unless forced), and ``predicted_ms`` stays the model's own prediction."""
    m = _model()
    corr = StepTimeCorrection(window=1, min_steps=1)
    corr.observe(10.0, 10.0 + offset)
    state = SchedulerState(tuple(RunningDecode(f"d{i}", 8) for i in range(decodes)),
                           (WaitingRequest("w", 0, prompt),), KVCache(16, 1000))
    got = SloChunkPolicy(m, 20.0, max_chunk=128, min_chunk=4, correction=corr).plan(state)
    want = SloChunkPolicy(m, 20.0 - corr.offset_ms, max_chunk=128, min_chunk=4).plan(state) \
        if 20.0 - corr.offset_ms > 0 else None
    if want is not None:
        assert (got.decode_ids, got.prefill, got.predicted_ms, got.forced) == \
            (want.decode_ids, want.prefill, want.predicted_ms, want.forced)
    assert got.predicted_ms == pytest.approx(m.predict_step_ms([8] * decodes, [(n, 0) for _, n in got.prefill]))
    if not got.forced and got.prefill:
        assert got.predicted_ms + corr.offset_ms <= 20.0 + 1e-9


def test_policy_rejects_a_correction_without_an_offset():
    with pytest.raises(ValueError, match="correction"):
        SloChunkPolicy(_model(), 20.0, correction=object())
