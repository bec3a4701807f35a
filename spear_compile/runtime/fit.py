"""The top-down side of the latency model: measured whole steps, the prediction's error on them, and fits.

``check`` reports the prediction's absolute relative error |predicted - measured| / measured over measured
steps (median, p90, max). ``fit_overhead`` refits the model's ``Overhead`` (fixed, per token, per sequence,
per key of the longest decode; the last only where the sample spans it, ``identifiable``) on such steps; ``fit_scaled`` also scales the measured parts by one factor (for steps run where the parts
were not timed: the serving engine, ``calibrate``).

Both fits minimise the *relative* error (each step's row is divided by its measured time): the targets are
stated in relative error, and steps span 50x (a batch-1 decode against a 2048-token chunk), so an absolute
fit would serve the long steps and leave the short ones, most of a serving run, badly predicted.

``fit_scaled(..., trim=k)`` is robust to steps that paid a one-off cost the model does not describe (a
CUDA-graph capture of a new shape, a recompile, a garbage collection, another process on the CPU): it
fits, measures each step's log ratio measured / predicted, drops the steps more than ``k`` robust standard
deviations (1.4826 x the median absolute deviation) and more than ``TRIM_FLOOR`` from the median ratio,
and refits on the rest until the kept set is stable. On an H100 engine run (2026-12-05,
``benchmarks/results/serving/2026-12-05_h100_varlen_kv256``) graph captures made steps 10-30x their
steady time; the plain fit over them put 22.6 ms of fixed overhead on a 7 ms step and predicted the served
steps with a median error of 83-138 %, where the op tables alone were within 10-15 %. Trimming cannot
repair a sample where most steps are such outliers (the median is then theirs); ``calibrate`` therefore
also drops every step during which a graph was captured or compiled (``first_use``) before fitting.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import numpy as np

from .latency import LatencyModel, Overhead, check_chunks, nnls

TRIM_FLOOR = 0.15  # a step within 15 % of the fit is never trimmed, however tight the rest are
LONGEST_SPAN = 4.0  # the spread of longest decode contexts a sample needs to fit Overhead.per_longest_key_ms
LONGEST = Overhead.FIELDS.index("per_longest_key_ms")  # its column in _overhead_features


@dataclass(frozen=True)
class StepSample:
    """A measured whole step: its decodes' contexts, its prefill ``(tokens, prefilled)`` pieces, its time."""

    decode_contexts: Tuple[int, ...]
    prefill_chunks: Tuple[Tuple[int, int], ...]
    measured_ms: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "decode_contexts", tuple(self.decode_contexts))
        object.__setattr__(self, "prefill_chunks", tuple(tuple(p) for p in self.prefill_chunks))
        check_chunks(self.decode_contexts, self.prefill_chunks)
        if not self.decode_contexts and not self.prefill_chunks:
            raise ValueError("StepSample: a step needs at least one decode or prefill piece")
        v = self.measured_ms
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v) or v <= 0:
            raise ValueError(f"StepSample: measured_ms={v!r} must be a finite number > 0")


@dataclass(frozen=True)
class FitReport:
    """Absolute relative error |predicted - measured| / measured over the samples."""

    n: int
    median_abs_rel_err: float
    p90_abs_rel_err: float
    max_abs_rel_err: float
    errors: Tuple[float, ...]

    def __str__(self) -> str:
        return (f"{self.n} steps: median |err| {100 * self.median_abs_rel_err:.1f} %, "
                f"p90 {100 * self.p90_abs_rel_err:.1f} %, max {100 * self.max_abs_rel_err:.1f} %")


def _predict(model: LatencyModel, samples: Sequence[StepSample]) -> np.ndarray:
    return np.array([model.predict_step_ms(s.decode_contexts, s.prefill_chunks) for s in samples])


def _measured(samples: Sequence[StepSample]) -> np.ndarray:
    return np.array([s.measured_ms for s in samples], dtype=np.float64)


def check(model: LatencyModel, samples: Sequence[StepSample]) -> FitReport:
    """The prediction's error against measured whole steps (median and p90 by linear interpolation)."""
    if not samples:
        raise ValueError("check: no samples")
    meas = _measured(samples)
    errs = np.abs(_predict(model, samples) - meas) / meas
    return FitReport(len(errs), float(np.median(errs)), float(np.percentile(errs, 90)), float(errs.max()),
                     tuple(float(e) for e in errs))


def _overhead_features(model: LatencyModel, samples: Sequence[StepSample]):
    """Per sample: the ``Overhead`` terms' features (1, tokens as the step runs them (``padded``), sequences,
    the longest decode's context) and measured minus the prediction without overhead."""
    bare = model.with_overhead(Overhead())
    X = np.array([(1.0, model.padded(len(s.decode_contexts) + sum(t for t, _ in s.prefill_chunks)),
                   len(s.decode_contexts) + len(s.prefill_chunks), max(s.decode_contexts, default=0))
                  for s in samples], dtype=np.float64)
    return X, _measured(samples) - _predict(bare, samples)


def _terms(terms: Sequence[str], X: Optional[np.ndarray] = None) -> list:
    """The columns of ``_overhead_features`` for the ``Overhead`` fields ``terms`` (the others stay 0).
    Given the features ``X``, the longest-decode column is left out unless the sample's longest decodes
    span ``LONGEST_SPAN``x (``identifiable``)."""
    bad = [t for t in terms if t not in Overhead.FIELDS]
    if bad or not terms:
        raise ValueError(f"terms={tuple(terms)!r}: give one or more of {Overhead.FIELDS}")
    cols = [i for i, f in enumerate(Overhead.FIELDS) if f in terms]
    if X is not None and LONGEST in cols and not identifiable(X[:, LONGEST]):
        cols.remove(LONGEST)
    return cols


def identifiable(longest: np.ndarray) -> bool:
    """Whether a sample's longest decode contexts (0: no decode) can tell a per-longest-key term from a
    fixed one: they span at least ``LONGEST_SPAN``x. Steps whose decodes all have about the same context
    make the two collinear, and a term fitted there is extrapolated to served contexts far beyond them
    (a 64-token sample predicted 4096-token steps 36 % off)."""
    v = longest[longest > 0]
    return v.size > 0 and v.max() >= LONGEST_SPAN * v.min()


def _overhead_of(cols: list, c) -> Overhead:
    v = [0.0] * len(Overhead.FIELDS)
    for i, x in zip(cols, c):
        v[i] = float(x)
    return Overhead(*v)


def fit_overhead(model: LatencyModel, samples: Sequence[StepSample],
                 terms: Sequence[str] = Overhead.FIELDS) -> LatencyModel:
    """The model with its ``Overhead`` refitted on measured whole steps: non-negative least squares of the
    relative residual (measured - predicted-without-overhead) / measured on (1, tokens, sequences, longest
    decode context) / measured. ``terms``: the ``Overhead`` fields fitted (the others 0; all by default, the
    first three alone reproduce fits made before ``per_longest_key_ms`` existed)."""
    if not samples:
        raise ValueError("fit_overhead: no samples")
    X, y = _overhead_features(model, samples)
    cols = _terms(terms, X)
    w = 1.0 / _measured(samples)
    return model.with_overhead(_overhead_of(cols, nnls(X[:, cols] * w[:, None], y * w)))


def _fit_scaled_once(model: LatencyModel, samples: Sequence[StepSample], scale: Optional[float],
                     terms: Sequence[str]) -> LatencyModel:
    if scale is not None:
        return fit_overhead(model.scaled_parts(scale) if scale != 1.0 else model, samples, terms)
    X0, resid = _overhead_features(model, samples)
    cols = _terms(terms, X0)
    meas = _measured(samples)
    parts = meas - resid
    w = 1.0 / meas
    c = nnls(np.column_stack([parts, X0[:, cols]]) * w[:, None], meas * w)
    if c[0] <= 0:
        return fit_overhead(model, samples, terms)
    return model.scaled_parts(float(c[0])).with_overhead(_overhead_of(cols, c[1:]))


def outliers(model: LatencyModel, samples: Sequence[StepSample], k: float) -> np.ndarray:
    """Boolean mask of the steps whose log(measured / predicted) lies more than ``k`` robust standard
    deviations and more than ``TRIM_FLOOR`` (relative) from the median over ``samples``."""
    z = np.log(_measured(samples) / np.maximum(_predict(model, samples), 1e-12))
    med = float(np.median(z))
    dev = np.abs(z - med)
    sigma = 1.4826 * float(np.median(dev))
    return (dev > k * sigma) & (dev > np.log1p(TRIM_FLOOR))


def fit_scaled(model: LatencyModel, samples: Sequence[StepSample], trim: Optional[float] = None,
               max_rounds: int = 10, scale: Optional[float] = None,
               terms: Sequence[str] = Overhead.FIELDS) -> Tuple[LatencyModel, np.ndarray]:
    """The model with its measured parts (linear and head tables, attention) scaled by one factor ``k`` and
    its ``Overhead`` refitted, jointly by non-negative least squares of the relative error of measured on
    (parts, 1, tokens, sequences, longest decode context); and the boolean mask of the steps the fit kept.

    For steps run somewhere the parts were not timed (the serving engine: other threads, other caches, its
    own attention kernel), where the parts' times can be off by a factor that no additive overhead
    corrects. A fit that leaves the parts out (``k = 0``) keeps ``k = 1`` and refits only the overhead
    (``fit_overhead``): the parts' shape in M stays what was measured. ``trim``: drop outlier steps
    (``outliers``, ``k = trim``) and refit, up to ``max_rounds`` times, until the kept set is stable
    (module docstring); None keeps every step. ``scale``: hold the factor at this value instead of fitting it
    (only the overhead is fitted, with the same trimming): for parts known to be timed as the engine runs
    them, whose factor a sample that does not span the served steps (short contexts only) would bend.
    ``terms``: the ``Overhead`` fields fitted (``fit_overhead``)."""
    if not samples:
        raise ValueError("fit_scaled: no samples")
    if trim is not None and not trim > 0:
        raise ValueError(f"fit_scaled: trim={trim!r} must be > 0 or None")
    if scale is not None and not (isinstance(scale, (int, float)) and not isinstance(scale, bool) and scale > 0):
        raise ValueError(f"fit_scaled: scale={scale!r} must be a number > 0 or None")
    keep = np.ones(len(samples), dtype=bool)
    _terms(terms)
    fitted = _fit_scaled_once(model, samples, scale, terms)
    for _ in range(max_rounds if trim is not None else 0):
        new = ~outliers(fitted, samples, trim)
        if new.sum() < 4 or np.array_equal(new, keep):
            break
        keep = new
        fitted = _fit_scaled_once(model, [s for s, k in zip(samples, keep) if k], scale, terms)
    return fitted, keep


__all__ = ["FitReport", "LONGEST_SPAN", "StepSample", "TRIM_FLOOR", "check", "fit_overhead", "fit_scaled", "identifiable", "outliers"]
