"""Online correction of the step-time prediction from the engine's own served steps.

The latency model is measured (op tables) and calibrated (overhead) before serving, but a served step pays
what neither saw: the host threads of the requests being streamed, the allocator's state, the kernels'
neighbours in the step. On an H200 (Llama-2-7B shape, ECs on 25 / 100 % of linears, 16 and 22 ms SLOs,
``benchmarks/results/serving/2026-12-06_h200_calibration``) the calibrated model missed the served steps
by 8-20 % median (35-40 % on the dynamic policy's mixed steps), and its error was nearly constant from one
step to the next. So the engine can feed each steady step's measured time back: ``offset_ms`` is a
quantile of ``measured - predicted`` over the last ``window`` steps, and ``SloChunkPolicy`` plans each step
against ``slo - offset_ms`` (the prediction plus the offset stays within the SLO). Replayed causally over
those recorded steps with the median (each step corrected only by the steps before it, the plans left as
they were), the median error fell from 6.8-20.0 % to 0.8-1.6 % on decode-only steps and 0.9-6.5 % on mixed
ones with a window of 4; 1.1-1.6 % and 1.3-6.6 % with 8; 1.3-2.1 % and 1.8-6.3 % with 16 (``replay``;
``benchmarks/serving_refit.py --steps``).

Steps with prefill and decode-only steps keep separate windows: the policy sizes prefill pieces with the
first, and the two kinds err differently. In the first closed-loop run (H100, 2026-12-06,
``serving/2026-12-06_h100_m256_table``), one window for every step and its median, decode-only steps the
model over-predicted pulled the offset to -1.4..-1.8 ms, and the mixed steps planned with it overshot the
16 ms SLO; the corrected policy reached attainment 0.78 against 0.89 uncorrected and a 4.3x mean TTFT
(1292 against 303 ms), with the same p99 ITL (19.6 / 18.5 ms).

The offset is an upper quantile of the residuals (``quantile`` 0.9 of a ``window`` of 32), not their
median: the SLO is on the p99 inter-token latency, and a step planned right at the budget runs over it
whenever its residual exceeds the offset. On that run's uncorrected steps with prefill of up to 128 rows
(350 steps; the rows the tables then measured exactly), the residual was -12 / -1.5 / +3.3 / +15.7 % at
p10 / 50 / 90 / 99: the model over-predicts the typical step and under-predicts a tail, so the median
offset (-0.5 ms) made 49-53 % of the steps exceed their corrected prediction (9-21 % by more than 5 %),
while the 0.9 quantile of 32 (+0.25 ms on average) made 18 % exceed it (4.6 % by more than 5 %).
``Engine`` turns it on by default (``online_correction=False`` turns it off) since the closed-loop A/B of
2026-12-07 (H100, Llama-2-7B-shaped W4 g128, ECs on 25 %, 16 ms SLO, 32 requests at 2 / s, torch's varlen
attention, ``benchmarks/results/serving/2026-12-07_h100_online_correction_ab``): uncorrected p99 ITL 18.06 and
16.41 ms (attainment 0.79 / 0.95, mean TTFT 337 / 329 ms) in two runs, corrected 16.02 and 15.92 ms (0.99 /
0.99, 265 / 276 ms); corrected at 0 / 50 / 100 % EC density 16.11 / 15.97 / 17.03 ms (0.99 / 0.99 / 0.94).
Steps that captured a CUDA graph or compiled
one (``first_use``) are not observed: they are one-off costs, not the model's error. The correction is a
quantile of an additive residual, so a step whose content differs from the recent ones still gets its
own prediction plus the recent residual, not the recent steps' time.
"""
from __future__ import annotations

import collections
from typing import Deque, Iterable, List, Optional, Tuple


class StepTimeCorrection:
    """The running additive correction of a latency model's step predictions (module docstring).

    Two windows, one per kind of step: with prefill (``prefill=True``, the steps whose size the policy
    chooses) and decode-only. ``observe(predicted_ms, measured_ms, prefill)`` after each steady step;
    ``offset_ms``: the ``quantile`` of the residuals (measured - predicted) of the last ``window`` observed
    steps with prefill (what the SLO policy plans with; 0.5 is their median), ``offset_for(prefill)`` either
    kind's; 0 until ``min_steps`` of that kind have been observed. Used by one thread (the engine's
    generation loop); ``reset()`` forgets the history."""

    def __init__(self, window: int = 32, min_steps: int = 3, quantile: float = 0.9) -> None:
        for name, v in (("window", window), ("min_steps", min_steps)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"StepTimeCorrection: {name}={v!r} must be a positive integer")
        if min_steps > window:
            raise ValueError(f"StepTimeCorrection: min_steps={min_steps} must be <= window={window}")
        if isinstance(quantile, bool) or not isinstance(quantile, (int, float)) or not 0.0 <= quantile <= 1.0:
            raise ValueError(f"StepTimeCorrection: quantile={quantile!r} must be a number in [0, 1]")
        self.window, self.min_steps, self.quantile = window, min_steps, float(quantile)
        self._residuals: Tuple[Deque[float], Deque[float]] = (collections.deque(maxlen=window),
                                                              collections.deque(maxlen=window))
        self._offsets = [0.0, 0.0]  # [decode-only, with prefill]
        self.observed = 0

    def __repr__(self) -> str:
        return (f"StepTimeCorrection(window={self.window}, quantile={self.quantile:g}, offset_ms={self._offsets[1]:.3f} (prefill) / "
                f"{self._offsets[0]:.3f} (decode-only), observed={self.observed})")

    @property
    def offset_ms(self) -> float:
        """Milliseconds to add to the prediction of a step with prefill (negative when the model
        over-predicts them)."""
        return self._offsets[1]

    def offset_for(self, prefill: bool) -> float:
        """The offset of steps with prefill (True) or of decode-only steps (False)."""
        return self._offsets[bool(prefill)]

    def observe(self, predicted_ms: Optional[float], measured_ms: float, prefill: bool = True) -> None:
        """Record one steady step. A step without a prediction (a policy without a latency model) or with
        a non-finite or non-positive time is ignored."""
        if predicted_ms is None or not (0.0 < measured_ms < float("inf")) or not (predicted_ms >= 0.0):
            return
        k = bool(prefill)
        self._residuals[k].append(measured_ms - predicted_ms)
        self.observed += 1
        if len(self._residuals[k]) >= self.min_steps:
            self._offsets[k] = _quantile(self._residuals[k], self.quantile)

    def corrected_ms(self, predicted_ms: float, prefill: bool = True) -> float:
        """``predicted_ms`` plus the offset of its kind of step."""
        return predicted_ms + self._offsets[bool(prefill)]

    def reset(self) -> None:
        for r in self._residuals:
            r.clear()
        self._offsets, self.observed = [0.0, 0.0], 0


def _quantile(xs, q: float) -> float:
    """The ``q`` quantile of ``xs``, linear between order statistics (numpy's default method)."""
    s = sorted(xs)
    pos = q * (len(s) - 1)
    i = int(pos)
    return s[i] if i + 1 >= len(s) else s[i] + (s[i + 1] - s[i]) * (pos - i)


def replay(steps: Iterable[Tuple[float, float, bool, bool]], window: int = 32, min_steps: int = 3,
           quantile: float = 0.9) -> List[float]:
    """The corrected prediction of each of ``steps`` (``(predicted ms, measured ms, first use, prefill)`` in
    the order they ran) as the engine would have made it before the step ran: each step corrected by the
    steady steps of its kind before it (first-use steps are corrected but not observed). For offline
    evaluation of recorded steps (``benchmarks/serving.py``, ``benchmarks/serving_refit.py``)."""
    c, out = StepTimeCorrection(window, min_steps, quantile), []
    for predicted, measured, first_use, prefill in steps:
        out.append(c.corrected_ms(predicted, prefill))
        if not first_use:
            c.observe(predicted, measured, prefill)
    return out


__all__ = ["StepTimeCorrection", "replay"]
