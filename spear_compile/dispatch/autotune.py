"""Measure a model's own linear shapes on this GPU and write the user's tuned table (``spear tune``).

A job is one table entry family for one weight shape: the M = 1 GEMVs (``gemv1``: the CUDA-core tile;
``gemv1tma``: the TMA GEMV's config, written only where it beats the CUDA-core tile, so that an absent
entry keeps meaning "not faster") or the W4 GEMM at one M bucket (``gemm``: the fastest of the Triton
tiles, dequantize + cuBLAS and, at M >= 64 where this Triton has them, the wgmma GEMMs; near ties
re-timed together, ``tuning.refine``). The EC families (``gemv1pdl``, ``gemv1tmaec``, ``gemv1self``,
the prefill structures) are not measured here: a shape with its ``gemv1`` / ``gemm`` anchor written counts
as tuned (``route.tuned_key``), and their absent entries then mean the route's defaults (the pairs, the
side-stream structure).

Weights are random bytes in the spear layout (the kernels' time does not depend on the values), in as
many copies as make one sweep larger than the L2 cache (``tuning.copies_for``), timed under CUDA graphs
(``tuning.search``). Jobs run in order until ``budget_s`` is spent; those left are reported, and the
route gives their shapes the nearest tuned geometry. Entries go into the process's table at once and
are saved as this GPU's user table (``table.save``) at the end.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence

import torch

from ..lowering import w4a16_gemv_tma as _gt
from ..lowering import w4a16_triton as _t
from . import keys as _keys
from . import route as _route
from . import table as _table
from . import tuning as _tuning

DEFAULT_MS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


@dataclass(frozen=True)
class LinearShape:
    """A weight the model runs: ``N`` output rows (a concatenation's total), ``K`` inputs, group ``G``;
    ``decode``: it runs at M = 1 (its GEMV entries are wanted); ``prefill``: it runs at M > 1 (its GEMM
    entries are wanted)."""

    N: int
    K: int
    G: int
    decode: bool = True
    prefill: bool = True

    def __post_init__(self) -> None:
        for name in ("N", "K", "G"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"LinearShape: {name}={v!r} must be a positive integer")
        if self.K % 2:
            raise ValueError(f"LinearShape: K={self.K} must be even (two 4-bit values per byte)")


@dataclass(frozen=True)
class Job:
    """One measurement: ``family`` "gemv1" (M = 1: the CUDA-core tile, then the TMA GEMV against it) or
    "gemm" (the GEMM at ``M``'s bucket) for one shape."""

    family: str
    N: int
    K: int
    G: int
    M: int = 1

    def describe(self) -> str:
        return f"{self.family} {self.N}x{self.K} g{self.G}" + (f" M={self.M}" if self.family == "gemm" else "")


@dataclass
class TuneReport:
    """What ``run`` measured: ``done`` jobs with their entries and seconds, ``left`` (the budget ran out),
    ``failed`` (no config ran: reason), the saved table's path."""

    done: list = field(default_factory=list)
    left: list = field(default_factory=list)
    failed: list = field(default_factory=list)
    seconds: float = 0.0
    path: Optional[str] = None

    def summary(self) -> str:
        s = f"{len(self.done)} measured, {len(self.left)} left for lack of time, {len(self.failed)} failed, " \
            f"{self.seconds:.0f} s"
        return s + (f"; table {self.path}" if self.path else "")


def jobs_for(shapes: Iterable[LinearShape], ms: Sequence[int] = DEFAULT_MS) -> list:
    """The jobs for ``shapes`` over the M values ``ms`` (deduplicated by table key: M by its bucket), M = 1
    jobs first (decode is where serving spends its steps), then the GEMMs by increasing M."""
    if any(not isinstance(m, int) or m < 1 for m in ms):
        raise ValueError(f"jobs_for: ms={list(ms)} must be positive integers")
    shapes = list(dict.fromkeys(shapes))
    out: dict = {}
    if 1 in ms:
        for s in shapes:
            if s.decode:
                out.setdefault(("gemv1", s.N, s.K, s.G, 1), Job("gemv1", s.N, s.K, s.G))
    for m in sorted({_table.m_bucket(m) for m in ms if m > 1}):
        for s in shapes:
            if s.prefill:
                out.setdefault(("gemm", s.N, s.K, s.G, m), Job("gemm", s.N, s.K, s.G, m))
    return list(out.values())


def random_weights(N: int, K: int, G: int, copies: int, device) -> list:
    """``copies`` random spear-layout weights (qweight uint8 [N, K/2], bf16 scales and zero points)."""
    ng = 1 if G >= K else K // G
    out = []
    for _ in range(copies):
        q = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, device=device)
        s = (torch.rand(N, ng, device=device) * 0.01 + 0.001).to(torch.bfloat16)
        z = torch.full((N, ng), 8.0, device=device, dtype=torch.bfloat16)
        out.append((q, s, z))
    return out


def random_ec(N: int, K: int, r: int, device, d: int = 16, seed: int = 0) -> tuple:
    """A gated EC's operands (A, B, W1, b1, W2, b2, alpha) of rank ``r`` for an [N, K] linear, bf16, scaled like a
    fitted one (unit-variance h, gates mostly open), for timing its kernels."""
    g = torch.Generator(device=device).manual_seed(seed)
    bf = dict(device=device, dtype=torch.bfloat16)
    A = (torch.randn(r, K, device=device, generator=g) / K ** 0.5).to(**bf)
    B = (torch.randn(N, r, device=device, generator=g) * 0.02).to(**bf)
    W1 = (torch.randn(d, r, device=device, generator=g) / r ** 0.5).to(**bf)
    W2 = (torch.randn(r, d, device=device, generator=g) * 0.1).to(**bf)
    return A, B, W1, torch.zeros(d, **bf), W2, torch.full((r,), 2.0, **bf), torch.tensor(1.1, device=device)


def measure(job: Job, device=None) -> dict:
    """Run one job on the GPU: {table key: value} of the entries it decided (CUDA only)."""
    device = torch.device(device or "cuda")
    N, K, G, M = job.N, job.K, job.G, job.M
    copies = min(_tuning.copies_for(N * K // 2), 12)
    ws = random_weights(N, K, G, copies, device)
    xs = [torch.randn(M, K, device=device, dtype=torch.bfloat16) for _ in range(copies)]
    got: dict = {}
    if job.family == "gemv1":
        if not _t.gemv1_ok(1, K, G, ws[0][0]):
            raise ValueError(f"{job.describe()}: the M = 1 CUDA-core GEMV does not take this shape")
        for q, _, _ in ws:  # its layout is made once, outside the timings
            _t.gemv_words(q)
        cfg, t1 = _tuning.search(lambda c: (lambda i: _t.w4a16_gemv1(xs[i], *ws[i], G, None, config=c)),
                                 _t.GEMV1_CONFIGS, copies)
        got[_keys.gemv1_key(N, K, G, False)] = list(cfg)
        p = _route.Problem(op="w4a16", M=1, N=N, K=K, G=G, dtype=torch.bfloat16,
                           param_dtypes=(torch.bfloat16, torch.bfloat16), device=device)
        if _gt.can_implement(p)[0]:
            ok = [c for c in _gt.TMA_CONFIGS if _gt.split_fits(c, K)]
            cfg_t, tt = _tuning.search(lambda c: (lambda i: _gt.w4a16_gemv_tma(xs[i], *ws[i], G, None, config=c)),
                                       ok, copies)
            if tt < t1:
                got[_keys.tma_key(N, K, G)] = list(cfg_t)
        return got
    if job.family != "gemm":
        raise ValueError(f"measure: family {job.family!r}; expected 'gemv1' or 'gemm'")
    run = _checked_gemm(xs, ws, G)
    finalists = [_tuning.search(run, _route.gemm_choices(M, N, K, G), copies)]
    if M >= 64:  # the wgmma GEMMs never won below M = 64 (benchmarks/kernels.py)
        for choices in (_route.wgmma_choices(), _route.wgmma_ra_choices()):
            if choices:
                try:
                    finalists.append(_tuning.search(run, choices, copies))
                except RuntimeError:  # no config of this kernel ran here
                    pass
    t_min = min(t for _, t in finalists)
    close = [c for c, t in finalists if t <= 1.08 * t_min]
    cfg = _tuning.refine(run, close, copies)[0] if len(close) > 1 else min(finalists, key=lambda ct: ct[1])[0]
    got[_keys.gemm_key(M, N, K, G)] = list(cfg)
    return got


def _checked_gemm(xs: list, ws: list, G: int) -> Callable:
    """``run(config)`` for ``tuning.search``: the W4 GEMM in ``config`` on weight copy i, once it has matched the
    reference on copy 0 (relative error < 1e-2; else RuntimeError, which the search reports and skips): a
    kernel that computes wrong numbers on this GPU must never become the table's choice."""
    from ..ops.w4a16_ref import w4a16_linear_ref
    from . import cuda as _cuda

    ref = w4a16_linear_ref(xs[0], *ws[0], G, None).float()

    def run(c):
        y = _cuda.w4a16_gemm(xs[0], *ws[0], G, None, config=c).float()
        err = ((y - ref).norm() / ref.norm().clamp_min(1e-12)).item()
        if not err < 1e-2:
            raise RuntimeError(f"GEMM choice {list(c)} does not match the reference (relative error {err:.3g})")
        return lambda i: _cuda.w4a16_gemm(xs[i], *ws[i], G, None, config=c)

    return run


def run(jobs: Sequence[Job], budget_s: float = 300.0, progress: bool = True, save: bool = True,
        measure_fn: Optional[Callable[[Job], dict]] = None, clock: Callable[[], float] = time.monotonic) -> TuneReport:
    """Measure ``jobs`` in order until ``budget_s`` seconds are spent, each job's entries set in the process's
    tuned table as it finishes; save the table as this GPU's user table if anything was measured (``save``).
    ``measure_fn`` / ``clock``: what measures a job and keeps time (``measure`` and ``time.monotonic``)."""
    from tqdm.auto import tqdm

    if budget_s <= 0:
        raise ValueError(f"run: budget_s={budget_s} must be positive")
    measure_fn = measure_fn or measure
    rep = TuneReport()
    t0 = clock()
    table = _table.configs()
    bar = tqdm(total=len(jobs), desc="spear tune", disable=not progress)
    for i, job in enumerate(jobs):
        if clock() - t0 >= budget_s:
            rep.left = list(jobs[i:])
            break
        bar.set_postfix_str(job.describe())
        j0 = clock()
        try:
            got = measure_fn(job)
        except (RuntimeError, ValueError) as e:  # no config ran, or the kernel does not take the shape
            rep.failed.append((job, f"{type(e).__name__}: {e}"))
        else:
            for k, v in got.items():
                table[k] = v
            rep.done.append((job, {str(k): v for k, v in got.items()}, clock() - j0))
        bar.update(1)
    bar.close()
    rep.seconds = clock() - t0
    if save and rep.done:
        rep.path = _tuning.save_table("configs", table)
    return rep
