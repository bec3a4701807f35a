"""Step-time prediction, composed bottom-up from measured parts and checked top-down against whole steps.

A continuous-batching step flattens its decodes (one token each) and prefill pieces into M rows that go
through every linear together, then runs attention per sequence, the LM head on one row per sequence,
and a fixed amount of host and launch work. So the predicted step time is

    T = fixed + per_token * M + per_seq * S                     (overhead, fitted on whole steps)
      + per_longest_key * (the longest decode's context)        (also fitted on whole steps: ``Overhead``)
      + sum_l count_l * lin_l(M)                                 (per-linear tables, by M bucket)
      + head(S)            (or head(M) with head_rows="all")     (the LM head's table)
      + n_layers * sum_s attn(q_s, p_s)                          (attention, per sequence)

with S the sequences in the step and M the step's tokens as the engine runs them: with ``token_pad`` > 1
(an engine that pads a step's tokens to static shapes: transformers' continuous batching under
torch.compile pads to multiples of 64) M is the token count rounded up to it: a batch-1 decode runs its
linears at M = 64. Refitted with it on an H200 engine's steps (``benchmarks/serving_refit.py --steps
--token-pad 64``, 2026-12-06) the calibrated model's median error on served steps went from 16.8 / 14.2 %
to 15.2 / 13.6 %. For a sequence with q new tokens after p cached ones

    attn(q, p) = per_seq + per_query * q + per_key * (p + q) + per_pair * (q * p + q (q + 1) / 2)

(the last term counts the causal query-key pairs; a decode is q = 1, p = its context). The
coefficients are non-negative least squares over a measured (q, p) grid, which keeps ``T`` monotone
in every piece's size; the policy's binary search relies on that.

A ``LatencyTable`` is measured at M buckets (``measure.default_buckets``: powers of two below 64, every
multiple of 64 up to 512, then 1.5x steps to the largest chunk), interpolated
linearly between them and extended linearly above the top bucket (large-M GEMMs are compute bound, so
time grows linearly in M there). Tables are made non-decreasing when built from measurements (a
running maximum), since a faster bigger M is timing noise and would break the monotone search.

The top-down side (measured whole steps, the prediction's error, fits on them) is ``fit``.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, replace
from typing import Iterable, Optional, Sequence, Tuple

import numpy as np

from .plan import HEAD_ROWS

SCHEMA_VERSION = 4  # 4: tables at every multiple of 64 rows up to 512 (default_buckets); 3: compiled linears timed over weight copies past the L2 cache; 2: GPU time in CUDA graphs; 1: wall clock


def _nonneg(owner: str, name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ValueError(f"{owner}: {name}={v!r} must be a finite number >= 0")
    return float(v)


def nnls(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares for a few unknowns: every support of the columns is tried (columns
    scaled to unit range), the best feasible fit kept; exact for so few unknowns."""
    n = X.shape[1]
    scale = np.maximum(np.abs(X).max(axis=0), 1e-30)
    Xs = X / scale
    best, best_err = np.zeros(n), float(np.sum(y * y))
    for mask in range(1, 1 << n):
        cols = [j for j in range(n) if mask >> j & 1]
        coef, *_ = np.linalg.lstsq(Xs[:, cols], y, rcond=None)
        if np.any(coef < 0):
            continue
        err = float(np.sum((Xs[:, cols] @ coef - y) ** 2))
        if err < best_err:
            best_err, best = err, np.zeros(n)
            best[cols] = coef
    return best / scale


@dataclass(frozen=True)
class LatencyTable:
    """Milliseconds at M buckets: ``ms[i]`` is the time at ``buckets[i]`` rows.

    ``buckets`` strictly increasing positive integers, ``ms`` non-negative and non-decreasing. Below the
    first bucket the first time holds (M = 0 costs nothing: the op does not run); between buckets the
    time is interpolated linearly; above the last it grows along ``slope_above`` ms per row, by default
    the last segment's slope (with one bucket, proportionally to M)."""

    buckets: Tuple[int, ...]
    ms: Tuple[float, ...]
    slope_above: Optional[float] = None

    def __post_init__(self) -> None:
        b, t = tuple(self.buckets), tuple(self.ms)
        if not b or len(b) != len(t):
            raise ValueError(f"LatencyTable: buckets ({len(b)}) and ms ({len(t)}) must be non-empty and as long")
        for i, m in enumerate(b):
            if not isinstance(m, int) or isinstance(m, bool) or m < 1:
                raise ValueError(f"LatencyTable: buckets[{i}]={m!r} must be a positive integer")
        if any(b[i + 1] <= b[i] for i in range(len(b) - 1)):
            raise ValueError(f"LatencyTable: buckets must be strictly increasing, got {list(b)}")
        t = tuple(_nonneg("LatencyTable", f"ms[{i}]", v) for i, v in enumerate(t))
        for i in range(len(t) - 1):
            if t[i + 1] < t[i] * (1 - 1e-12):
                raise ValueError(f"LatencyTable: ms must be non-decreasing in M; ms[{i + 1}]={t[i + 1]} < "
                                 f"ms[{i}]={t[i]} (build from measurements with LatencyTable.monotone)")
        object.__setattr__(self, "buckets", b)
        object.__setattr__(self, "ms", t)
        if self.slope_above is not None:
            slope = _nonneg("LatencyTable", "slope_above", self.slope_above)
        else:
            slope = (t[-1] - t[-2]) / (b[-1] - b[-2]) if len(b) > 1 else t[-1] / b[-1]
        object.__setattr__(self, "_slope", slope)

    @classmethod
    def monotone(cls, buckets: Sequence[int], ms: Sequence[float]) -> "LatencyTable":
        """A table from measured times, made non-decreasing by a running maximum."""
        out, hi = [], 0.0
        for v in ms:
            hi = max(hi, float(v))
            out.append(hi)
        return cls(tuple(buckets), tuple(out))

    def __call__(self, m: float) -> float:
        if m <= 0:
            return 0.0
        b, t = self.buckets, self.ms
        if m >= b[-1]:
            return t[-1] + self._slope * (m - b[-1])
        i = bisect.bisect_right(b, m)
        if i == 0:
            return t[0]
        lo, hi = b[i - 1], b[i]
        return t[i - 1] + (t[i] - t[i - 1]) * (m - lo) / (hi - lo)

    def segment(self, m: float) -> Tuple[float, float, float]:
        """``(start, value, slope)`` of the linear piece that holds ``m`` >= 1 (up to the next bucket):
        the table equals ``value + slope * (M - start)`` from ``start`` to the next bucket."""
        b, t = self.buckets, self.ms
        if m >= b[-1]:
            return float(b[-1]), t[-1], self._slope
        i = bisect.bisect_right(b, m)
        if i == 0:
            return 1.0, t[0], 0.0
        return float(b[i - 1]), t[i - 1], (t[i] - t[i - 1]) / (b[i] - b[i - 1])

    def scaled(self, k: float) -> "LatencyTable":
        return LatencyTable(self.buckets, tuple(v * k for v in self.ms), self._slope * k)

    def __add__(self, other: "LatencyTable") -> "LatencyTable":
        """The pointwise sum, exact: both are piecewise linear on the union of their buckets and linear
        above each one's top."""
        b = tuple(sorted(set(self.buckets) | set(other.buckets)))
        return LatencyTable(b, tuple(self(m) + other(m) for m in b), self._slope + other._slope)

    def to_dict(self) -> dict:
        d = {"buckets": list(self.buckets), "ms": list(self.ms)}
        if self.slope_above is not None:
            d["slope_above"] = self.slope_above
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "LatencyTable":
        return cls(tuple(d["buckets"]), tuple(d["ms"]), d.get("slope_above"))


@dataclass(frozen=True)
class AttentionCost:
    """One layer's attention time for a sequence of ``q`` new tokens after ``p`` cached ones (module
    docstring): non-negative coefficients in milliseconds."""

    per_seq_ms: float = 0.0
    per_query_ms: float = 0.0
    per_key_ms: float = 0.0
    per_pair_ms: float = 0.0

    def __post_init__(self) -> None:
        for f in ("per_seq_ms", "per_query_ms", "per_key_ms", "per_pair_ms"):
            object.__setattr__(self, f, _nonneg("AttentionCost", f, getattr(self, f)))

    @staticmethod
    def features(q: int, p: int) -> Tuple[float, float, float, float]:
        return 1.0, float(q), float(p + q), q * p + q * (q + 1) / 2.0

    def __call__(self, q: int, p: int) -> float:
        return (self.per_seq_ms + self.per_query_ms * q + self.per_key_ms * (p + q)
                + self.per_pair_ms * (q * p + q * (q + 1) / 2.0))

    @classmethod
    def fit(cls, samples: Iterable[Tuple[int, int, float]]) -> "AttentionCost":
        """Non-negative least squares on ``(q, p, ms)`` samples (all 16 supports of the 4 coefficients
        tried, the best feasible kept: exact for so few unknowns)."""
        rows = [(cls.features(q, p), ms) for q, p, ms in samples]
        if not rows:
            raise ValueError("AttentionCost.fit: no samples")
        c = nnls(np.array([r[0] for r in rows], dtype=np.float64), np.array([r[1] for r in rows], dtype=np.float64))
        return cls(*(float(v) for v in c))

    def to_dict(self) -> dict:
        return {f: getattr(self, f) for f in ("per_seq_ms", "per_query_ms", "per_key_ms", "per_pair_ms")}


@dataclass(frozen=True)
class Overhead:
    """The terms fitted on whole steps (``fit``): the step's fixed cost plus terms per token and per sequence
    (host work, norms, launches), and per key of the step's longest decode.

    ``per_longest_key_ms``: an attention kernel that gives each (sequence, head) one program and does not
    split a sequence's keys walks the longest decode's keys alone while the other programs are done, so a
    step's attention has a term in its longest decode's context that the per-sequence ``AttentionCost``
    (measured one sequence at a time, where longest and total are the same) cannot hold. On the H200
    engine's steps (torch 2.11's varlen kernel, ``serving/2026-12-06_h200_plan_all_layers``) the served
    steps ran over the calibrated model by +0.47 / +1.22 / +2.00 ms at a longest decode of 0-1k / 1-2k /
    2-3k tokens, whatever the total context. Fitted on that run's calibration steps and checked on its served
    steps, the term took the median error from 8.5 to 6.7 % (parts' factor held at 1) and from 8.0 to 1.6 %
    (factor fitted; ``benchmarks/serving_refit.py --steps``,
    ``benchmarks/results/serving/2026-12-07_longest_decode_term/``). For a kernel that splits the keys
    (``lowering.split_kv_decode``) the term should fit near zero; that is not measured yet."""

    fixed_ms: float = 0.0
    per_token_ms: float = 0.0
    per_seq_ms: float = 0.0
    per_longest_key_ms: float = 0.0

    FIELDS = ("fixed_ms", "per_token_ms", "per_seq_ms", "per_longest_key_ms")

    def __post_init__(self) -> None:
        for f in self.FIELDS:
            object.__setattr__(self, f, _nonneg("Overhead", f, getattr(self, f)))

    def to_dict(self) -> dict:
        return {f: getattr(self, f) for f in self.FIELDS}


@dataclass(frozen=True)
class LinearTable:
    """A planned linear's measured table (one instance) and how many instances the model has."""

    name: str
    count: int
    table: LatencyTable

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"LinearTable: name={self.name!r} must be a non-empty str")
        if not isinstance(self.count, int) or isinstance(self.count, bool) or self.count < 1:
            raise ValueError(f"LinearTable {self.name!r}: count={self.count!r} must be a positive integer")


def check_chunks(decode_contexts, prefill_chunks) -> None:
    for i, c in enumerate(decode_contexts):
        if not isinstance(c, int) or isinstance(c, bool) or c < 0:
            raise ValueError(f"predict_step_ms: decode_contexts[{i}]={c!r} must be an integer >= 0")
    for i, pc in enumerate(prefill_chunks):
        if len(pc) != 2 or any(not isinstance(v, int) or isinstance(v, bool) for v in pc) or pc[0] < 1 or pc[1] < 0:
            raise ValueError(f"predict_step_ms: prefill_chunks[{i}]={pc!r} must be (tokens >= 1, prefilled >= 0)")


@dataclass(frozen=True)
class LatencyModel:
    """The composed step-time model (module docstring). ``max_bucket`` is the largest measured M."""

    linears: Tuple[LinearTable, ...]
    head: Optional[LatencyTable]
    attention: AttentionCost
    n_layers: int
    overhead: Overhead = Overhead()
    head_rows: str = "last"
    token_pad: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "linears", tuple(self.linears))
        if not isinstance(self.token_pad, int) or isinstance(self.token_pad, bool) or self.token_pad < 1:
            raise ValueError(f"LatencyModel: token_pad={self.token_pad!r} must be a positive integer")
        if not isinstance(self.attention, AttentionCost):
            raise ValueError(f"LatencyModel: attention={self.attention!r} must be an AttentionCost")
        if not isinstance(self.overhead, Overhead):
            raise ValueError(f"LatencyModel: overhead={self.overhead!r} must be an Overhead")
        if not isinstance(self.n_layers, int) or isinstance(self.n_layers, bool) or self.n_layers < 1:
            raise ValueError(f"LatencyModel: n_layers={self.n_layers!r} must be a positive integer")
        if self.head_rows not in HEAD_ROWS:
            raise ValueError(f"LatencyModel: head_rows={self.head_rows!r} must be one of {HEAD_ROWS}")
        combined = LatencyTable((1,), (0.0,))
        for lt in self.linears:
            if not isinstance(lt, LinearTable):
                raise ValueError(f"LatencyModel: linears entry {lt!r} must be a LinearTable")
            combined = combined + lt.table.scaled(lt.count)
        if self.head is not None and self.head_rows == "all":
            combined = combined + self.head
        object.__setattr__(self, "_per_m", combined)
        object.__setattr__(self, "_per_s", self.head if self.head is not None and self.head_rows == "last" else None)

    @property
    def max_bucket(self) -> int:
        return max([lt.table.buckets[-1] for lt in self.linears] or [1])

    # ---- the fast path the policy uses: running sums of a step under construction

    def decode_attention_ms(self, decode_contexts: Sequence[int]) -> float:
        return self.decodes_attention_ms(len(decode_contexts), sum(decode_contexts), max(decode_contexts, default=0))

    def decodes_attention_ms(self, n: int, total_context: int, longest: int = 0) -> float:
        """Attention of ``n`` decodes whose contexts sum to ``total_context`` (a decode is q = 1 after
        p = its context: keys and pairs p + 1 each), the longest of them ``longest`` tokens (the fitted
        ``Overhead.per_longest_key_ms`` term)."""
        a = self.attention
        return (self.n_layers * (n * (a.per_seq_ms + a.per_query_ms) + (a.per_key_ms + a.per_pair_ms) * (total_context + n))
                + self.overhead.per_longest_key_ms * longest)

    def piece_attention_ms(self, tokens: int, prefilled: int) -> float:
        return self.n_layers * self.attention(tokens, prefilled)

    def padded(self, n_tokens: int) -> int:
        """The rows a step of ``n_tokens`` tokens runs its linears on: ``n_tokens`` rounded up to a multiple
        of ``token_pad`` (the engine's padding of a step's tokens to static shapes)."""
        p = self.token_pad
        return n_tokens if p == 1 else -(-n_tokens // p) * p

    def with_token_pad(self, token_pad: int) -> "LatencyModel":
        return replace(self, token_pad=token_pad)

    def step_ms(self, n_tokens: int, n_seqs: int, attention_ms: float) -> float:
        """The step's time given its totals: rows ``n_tokens`` (run as ``padded(n_tokens)``), sequences
        ``n_seqs``, summed attention."""
        if n_tokens <= 0:
            return 0.0
        n_tokens = self.padded(n_tokens)
        o = self.overhead
        t = o.fixed_ms + o.per_token_ms * n_tokens + o.per_seq_ms * n_seqs + self._per_m(n_tokens) + attention_ms
        if self._per_s is not None:
            t += self._per_s(n_seqs)
        return t

    def piece_terms(self, n_tokens: int, n_seqs: int, attention_ms: float, prefilled: int) -> Tuple[float, float, float, LatencyTable]:
        """The step of the current totals plus one prefill piece of ``c`` tokens after ``prefilled``
        cached ones costs ``base + k1 * c + k2 * c**2 + per_m(n_tokens + c)``; returns
        ``(base, k1, k2, per_m)`` so a policy can search ``c`` (or solve for it per table segment). Unpadded
        (``token_pad`` 1) only: padded, ``per_m`` and the per-token overhead step with the pad units."""
        o, a, L = self.overhead, self.attention, self.n_layers
        s = n_seqs + 1
        base = (o.fixed_ms + o.per_token_ms * n_tokens + o.per_seq_ms * s + attention_ms
                + L * (a.per_seq_ms + a.per_key_ms * prefilled))
        if self._per_s is not None:
            base += self._per_s(s)
        k1, k2 = self.piece_attention_slopes(prefilled)
        return base, o.per_token_ms + k1, k2, self._per_m

    def piece_attention_slopes(self, prefilled: int) -> Tuple[float, float]:
        """``(k1, k2)``: a prefill piece of ``c`` tokens after ``prefilled`` cached ones has attention
        ``piece_attention_ms(0, prefilled) + k1 * c + k2 * c**2`` (all layers)."""
        a, L = self.attention, self.n_layers
        return L * (a.per_query_ms + a.per_key_ms + a.per_pair_ms * (prefilled + 0.5)), 0.5 * L * a.per_pair_ms

    # ---- the public prediction

    def predict_step_ms(self, decode_contexts: Sequence[int] = (), prefill_chunks: Sequence[Tuple[int, int]] = ()) -> float:
        """Predicted milliseconds of one step running a decode for each context length in
        ``decode_contexts`` and a prefill piece for each ``(tokens, prefilled)`` in ``prefill_chunks``.
        An empty step costs 0."""
        decode_contexts, prefill_chunks = tuple(decode_contexts), tuple(tuple(p) for p in prefill_chunks)
        check_chunks(decode_contexts, prefill_chunks)
        attn = self.decode_attention_ms(decode_contexts)
        attn += sum(self.piece_attention_ms(t, p) for t, p in prefill_chunks)
        m = len(decode_contexts) + sum(t for t, _ in prefill_chunks)
        return self.step_ms(m, len(decode_contexts) + len(prefill_chunks), attn)

    def scaled_parts(self, k: float) -> "LatencyModel":
        """The model with every measured part (linear tables, head, attention) times ``k``."""
        a = self.attention
        return replace(self, linears=tuple(replace(lt, table=lt.table.scaled(k)) for lt in self.linears),
                       head=self.head.scaled(k) if self.head is not None else None,
                       attention=AttentionCost(a.per_seq_ms * k, a.per_query_ms * k, a.per_key_ms * k,
                                               a.per_pair_ms * k))

    def with_overhead(self, overhead: Overhead) -> "LatencyModel":
        return replace(self, overhead=overhead)

    # ---- serialisation (the cache file's body; the key lives in latency_cache)

    def to_dict(self) -> dict:
        return {
            "linears": [{"name": lt.name, "count": lt.count, **lt.table.to_dict()} for lt in self.linears],
            "head": None if self.head is None else self.head.to_dict(),
            "attention": self.attention.to_dict(),
            "n_layers": self.n_layers,
            "overhead": self.overhead.to_dict(),
            "head_rows": self.head_rows,
            "token_pad": self.token_pad,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "LatencyModel":
        try:
            linears = tuple(LinearTable(e["name"], e["count"], LatencyTable.from_dict(e)) for e in d["linears"])
            head = None if d.get("head") is None else LatencyTable.from_dict(d["head"])
            return cls(linears, head, AttentionCost(**d["attention"]), d["n_layers"],
                       Overhead(**d.get("overhead", {})), d.get("head_rows", "last"), d.get("token_pad", 1))
        except (KeyError, TypeError) as e:
            raise ValueError(f"LatencyModel.from_dict: malformed model ({type(e).__name__}: {e})") from None
