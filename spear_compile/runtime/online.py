"""Online correction of the step-time prediction from the engine's own served steps.

The latency model is measured (op tables) and calibrated (overhead) before serving, but a served step pays
what neither saw: the host threads of the requests being streamed, the allocator's state, the kernels'
neighbours in the step. On an H200 (Llama-2-7B shape, ECs on 25 / 100 % of linears, 16 and 22 ms SLOs,
``benchmarks/results/serving/2026-12-06_h200_calibration``) the calibrated model missed the served steps
by 8-20 % median (35-40 % on the dynamic policy's mixed steps), and its error was nearly constant from one
step to the next. So the engine feeds every steady step's measured time back: ``offset_ms`` is the median
of ``measured - predicted`` over the last ``window`` steps, and ``SloChunkPolicy`` plans each step against
``slo - offset_ms`` (the prediction plus the offset stays within the SLO). Replayed causally over those
recorded steps (each step corrected only by the steps before it, the plans left as they were), the median
error fell from 6.8-20.0 % to 0.8-1.6 % on decode-only steps and 0.9-6.5 % on mixed ones with a window of 4;
1.1-1.6 % and 1.3-6.6 % with 8; 1.3-2.1 % and 1.8-6.3 % with 16 (``replay``; ``benchmarks/serving_refit.py --steps``). The default window is 8: as close as 4, and a median of 8 needs five
outliers to move.

Steps that captured a CUDA graph or compiled one (``first_use``) are not observed: they are one-off costs,
not the model's error. The correction is the median of an additive residual, so a step whose content
differs from the recent ones (a long prefill after decodes) still gets its own prediction plus the recent
host cost, not the recent steps' time.
"""
from __future__ import annotations

import collections
import statistics
from typing import Deque, Iterable, List, Optional, Tuple


class StepTimeCorrection:
    """The running additive correction of a latency model's step predictions (module docstring).

    ``observe(predicted_ms, measured_ms)`` after each steady step; ``offset_ms``: the median residual of the
    last ``window`` observed steps, 0 until ``min_steps`` have been observed. Used by one thread (the
    engine's generation loop); ``reset()`` forgets the history (a new workload, a new policy)."""

    def __init__(self, window: int = 8, min_steps: int = 3) -> None:
        for name, v in (("window", window), ("min_steps", min_steps)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"StepTimeCorrection: {name}={v!r} must be a positive integer")
        if min_steps > window:
            raise ValueError(f"StepTimeCorrection: min_steps={min_steps} must be <= window={window}")
        self.window, self.min_steps = window, min_steps
        self._residuals: Deque[float] = collections.deque(maxlen=window)
        self._offset = 0.0
        self.observed = 0

    def __repr__(self) -> str:
        return f"StepTimeCorrection(window={self.window}, offset_ms={self._offset:.3f}, observed={self.observed})"

    @property
    def offset_ms(self) -> float:
        """Milliseconds to add to a prediction (negative when the model over-predicts)."""
        return self._offset

    def observe(self, predicted_ms: Optional[float], measured_ms: float) -> None:
        """Record one steady step. A step without a prediction (a policy without a latency model) or with
        a non-finite or non-positive time is ignored."""
        if predicted_ms is None or not (0.0 < measured_ms < float("inf")) or not (predicted_ms >= 0.0):
            return
        self._residuals.append(measured_ms - predicted_ms)
        self.observed += 1
        if len(self._residuals) >= self.min_steps:
            self._offset = statistics.median(self._residuals)

    def corrected_ms(self, predicted_ms: float) -> float:
        """``predicted_ms`` plus the current offset."""
        return predicted_ms + self._offset

    def reset(self) -> None:
        self._residuals.clear()
        self._offset, self.observed = 0.0, 0


def replay(steps: Iterable[Tuple[float, float, bool]], window: int = 8, min_steps: int = 3) -> List[float]:
    """The corrected prediction of each of ``steps`` (``(predicted ms, measured ms, first use)`` in the order
    they ran) as the engine would have made it before the step ran: each step corrected by the steady steps
    before it only; first-use steps are corrected but not observed. For offline evaluation of recorded
    steps (``benchmarks/serving.py``, ``benchmarks/serving_refit.py``)."""
    c, out = StepTimeCorrection(window, min_steps), []
    for predicted, measured, first_use in steps:
        out.append(c.corrected_ms(predicted))
        if not first_use:
            c.observe(predicted, measured)
    return out


__all__ = ["StepTimeCorrection", "replay"]
