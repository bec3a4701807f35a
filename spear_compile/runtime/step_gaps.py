"""Which gap between two calls of the scheduler is which step's wall time.

transformers' generation loop calls the scheduler once per step, and the engine, the calibration and the
serving benchmark time a step as a gap between two calls (nothing else in the loop is ours to time):

* synchronous loop (transformers' default without flash attention): call k plans step k, the loop runs it
  and waits for its outputs, then calls again. The gap from call k to call k + 1 is step k's wall time:
  **lag 0**;
* asynchronous batching (``ContinuousBatchingConfig.use_async_batching``, ``Engine(async_batching=True)``:
  two sets of input and output buffers on CUDA): call k plans step k while step k - 1 still runs on the
  GPU, the loop launches step k, then waits for step k - 1's outputs and calls again. The gap from call k
  to call k + 1 ends when step k - 1 has ended, one step after the gap before it ended: while the GPU is
  kept busy it is step k - 1's time, and when the host is the slower side it is the host's loop, which is
  what the streams see either way: **lag 1**.

A gap is a step's time only while the loop is busy: after a call that planned nothing the loop waits for
requests, so the gaps that touch such a call are skipped (with lag 1, the call before must have planned a
step too). When no request is left at all, transformers waits without calling the scheduler; the engine's
scheduler then ends the last step's gap itself and records the wait as a call that planned nothing
(``hf_scheduler.PolicyScheduler.has_pending_requests``; a policy's ``idle()`` is told).
"""
from __future__ import annotations

from typing import Iterator, Sequence, Tuple

LAGS = (0, 1)


def check_lag(lag: int) -> int:
    """``lag`` if it is 0 (synchronous loop) or 1 (asynchronous batching), else a ValueError."""
    if isinstance(lag, bool) or lag not in LAGS:
        raise ValueError(f"step lag={lag!r} must be 0 (synchronous loop) or 1 (asynchronous batching)")
    return int(lag)


def attributed_gaps(busy: Sequence[bool], lag: int = 0) -> Iterator[Tuple[int, int]]:
    """For each measurable step, ``(p, g)``: call ``p`` planned the step and the gap from call ``g`` to call
    ``g + 1`` is its time (``g = p + lag``). ``busy[i]``: call i planned work."""
    lag = check_lag(lag)
    for g in range(lag, len(busy) - 1):
        if all(busy[g - lag:g + 1]):
            yield g - lag, g


__all__ = ["LAGS", "attributed_gaps", "check_lag"]
