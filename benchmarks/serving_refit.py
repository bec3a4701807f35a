"""Refit a serving record's step samples offline: how the calibration's fit objective changes its error.

A serving record (``benchmarks/serving.py``) keeps, per run, a sample of the engine's steps as
(decodes, prefill tokens, op-table prediction ms, measured ms). This script pools one run per
(policy, rate), splits the steps into even (fit) and odd (held out), and fits

    measured ~ k * op_tables + fixed + per_token * tokens + per_seq * sequences

three ways, as ``runtime.calibrate`` could: non-negative least squares of the absolute error (what
``fit_scaled`` did before 2026-12-05), of the relative error, and of the relative error with the robust
trimming of ``runtime.fit`` (3 robust deviations, ``TRIM_FLOOR``). It reports each fit's held-out median
and p90 absolute relative error, beside the op tables alone. The sample has no context lengths, so the
op-table prediction stands in for every measured part and ``sequences`` counts a step's prefill as one
sequence; the numbers show the objectives' effect on real steps, not the engine's calibrated model.

    python benchmarks/serving_refit.py RECORD.json [--out OUT.json]

With ``--steps STEPS.json`` (the ``steps_<device>.json`` a serving run writes since 2026-12-06: every
calibration and served step with its decode contexts, and the op-table model per density) it refits the
real latency model instead: per density, ``runtime.fit.fit_scaled`` on the calibration steps (trimmed as
``runtime.calibrate`` trims) with the parts' factor held at 1 and fitted, each checked on every served step
that captured or compiled no graph, pooled and per run, beside the op tables alone, and the held model
corrected online (``runtime.online.replay`` over each run's steps in order: each step corrected by the
steady steps with prefill before it, as the engine's ``StepTimeCorrection`` learns; ``online_window``), and the
decode-only steps' residual under the model the run planned with, by longest and by total context
(``residual_by``); ``--token-pad 64``
predicts with the step's tokens padded as the engine pads them (runs recorded before the latency model
knew the padding):

    python benchmarks/serving_refit.py --steps STEPS.json [--token-pad 64] [--out OUT.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from typing import Optional, Sequence

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from spear_compile.runtime.fit import TRIM_FLOOR  # noqa: E402
from spear_compile.runtime.latency import nnls  # noqa: E402


def load_steps(path: str) -> np.ndarray:
    """(decodes, prefill tokens, op-table ms, measured ms) of one run per (policy, rate) in the record."""
    with open(path) as f:
        rec = json.load(f)
    seen, rows = set(), []
    for r in rec["rows"]:
        key = (r["policy_label"], r["rate"])
        sample = (r.get("prediction_op_tables_only") or {}).get("sample") or []
        if key in seen or not sample:
            continue
        seen.add(key)
        rows += [tuple(s[:4]) for s in sample]
    if len(rows) < 8:
        raise SystemExit(f"{path}: only {len(rows)} sampled steps with an op-table prediction; need 8")
    return np.array(rows, dtype=np.float64)


def fit(X: np.ndarray, y: np.ndarray, relative: bool, trim: float = 0.0) -> tuple:
    """Coefficients and the number of steps trimmed."""
    w = 1.0 / y if relative else np.ones_like(y)
    keep = np.ones(len(y), dtype=bool)
    c = nnls(X * w[:, None], y * w)
    for _ in range(10 if trim else 0):
        z = np.log(y / np.maximum(X @ c, 1e-12))
        dev = np.abs(z - np.median(z))
        new = ~((dev > trim * 1.4826 * np.median(dev)) & (dev > np.log1p(TRIM_FLOOR)))
        if new.sum() < 4 or np.array_equal(new, keep):
            break
        keep = new
        c = nnls(X[keep] * w[keep, None], y[keep] * w[keep])
    return c, int((~keep).sum())


def errors(pred: np.ndarray, y: np.ndarray) -> dict:
    e = np.abs(pred - y) / y
    return {"median_abs_err": float(np.median(e)), "p90_abs_err": float(np.percentile(e, 90))}


def refit_steps(path: str, token_pad: Optional[int] = None, window: int = 8, quantile: float = 0.5,
                terms: Optional[Sequence[str]] = None) -> dict:
    """The ``--steps`` mode (module docstring); ``token_pad``: predict with the step's tokens padded to it
    (``LatencyModel.token_pad``), instead of what the recorded model says; ``terms``: the ``Overhead``
    fields the fits fit (default all; ``fixed_ms per_token_ms per_seq_ms`` is the fit of records made before
    ``per_longest_key_ms``)."""
    from spear_compile.runtime.calibrate import TRIM
    from spear_compile.runtime.fit import StepSample, check, fit_scaled
    from spear_compile.runtime.latency import LatencyModel, Overhead
    from spear_compile.runtime.online import replay

    terms = tuple(terms or Overhead.FIELDS)

    with open(path) as f:
        rec = json.load(f)

    def samples(rows, keep=lambda r: True):
        return [StepSample(tuple(r[0]), tuple(tuple(p) for p in r[1]), r[2]) for r in rows if keep(r)]

    def report(r) -> dict:
        return {"median_abs_err": r.median_abs_rel_err, "p90_abs_err": r.p90_abs_rel_err, "steps": r.n}

    def online_errors(model, rows) -> list:
        """|corrected - measured| / measured of the run's steady steps, the corrections replayed in order."""
        preds = [model.predict_step_ms(tuple(r[0]), tuple(tuple(p) for p in r[1])) for r in rows]
        corr = replay([(p, r[2], bool(r[3]), bool(r[1])) for p, r in zip(preds, rows)], window=window,
                      quantile=quantile)
        return [abs(c - r[2]) / r[2] for c, r in zip(corr, rows) if not r[3]]

    def online_report(errs) -> dict:
        return ({"median_abs_err": float(np.median(errs)), "p90_abs_err": float(np.percentile(errs, 90)),
                 "steps": len(errs)} if errs else {})

    out = {"steps_file": path, "token_pad": token_pad, "online_window": window, "online_quantile": quantile,
           **({} if terms == Overhead.FIELDS else {"terms": list(terms)}), "densities": {}}
    def engine_of(key: str) -> str:
        """The engine a served run's key belongs to: its density, with "/async" for an asynchronous one."""
        parts = key.split("/")
        return parts[0] + ("/async" if parts[-1] == "async" else "")

    for dens, d in rec["models"].items():
        tables = LatencyModel.from_dict(d["op_tables"])
        if token_pad is not None:
            tables = tables.with_token_pad(token_pad)
        cal = samples(rec["calibration"][dens])
        runs = {k: samples(v, lambda r: not r[3]) for k, v in rec["served"].items() if engine_of(k) == dens}
        served = [s for v in runs.values() for s in v]
        models = {"op_tables_alone": tables}
        for name, k in (("scale_held", 1.0), ("scale_fitted", None)):
            models[name] = fit_scaled(tables, cal, trim=TRIM, scale=k, terms=terms)[0]
        online = {k: online_errors(models["scale_held"], v) for k, v in rec["served"].items() if engine_of(k) == dens}
        planned = LatencyModel.from_dict(d["calibrated"]) if "calibrated" in d else models["scale_held"]
        decode_only = [r for k, v in rec["served"].items() if engine_of(k) == dens for r in v if not r[3] and not r[1]]
        out["densities"][dens] = {
            "calibration_steps": len(cal),
            "decode_only_residual_ms": {by: residual_by(planned, decode_only, f) for by, f in
                                        (("longest_context", max), ("total_context", sum))},
            "served_pooled": {**{n: report(check(m, served)) for n, m in models.items()},
                              "scale_held_online": online_report([e for v in online.values() for e in v])},
            "per_run": {run: {**{n: report(check(m, v)) for n, m in models.items()},
                              "scale_held_online": online_report(online[run])} for run, v in runs.items() if v},
            "overhead": {n: m.overhead.to_dict() for n, m in models.items()}}
    return out


def residual_by(model, rows, of, width: int = 1024) -> list:
    """Measured - predicted ms of decode-only steps ``rows`` (``[contexts, [], ms, ...]``), by ``of(contexts)``
    in buckets of ``width`` tokens: ``[bucket start, steps, median ms, max ms]``. Which of the longest or the
    total context a residual follows says whether a step's attention is short of parallel work (the
    longest sequence sets it) or of bytes (the total does)."""
    by: dict = {}
    for r in rows:
        by.setdefault(of(r[0]) // width * width, []).append(r[2] - model.predict_step_ms(tuple(r[0]), ()))
    return [[b, len(v), round(float(np.median(v)), 3), round(max(v), 3)] for b, v in sorted(by.items())]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("record", nargs="?")
    ap.add_argument("--steps", help="a serving run's steps_<device>.json: refit the real latency model")
    ap.add_argument("--token-pad", type=int, default=None,
                    help="--steps: predict with the step's tokens padded to this multiple (the engine's)")
    ap.add_argument("--online-window", type=int, default=8,
                    help="--steps: the online correction's window (runtime.online.StepTimeCorrection)")
    ap.add_argument("--online-quantile", type=float, default=0.5,
                    help="--steps: the quantile of its window (0.5: the median, the prediction's accuracy; the "
                         "engine plans with 0.9)")
    ap.add_argument("--terms", nargs="+", default=None, metavar="FIELD",
                    help="--steps: the Overhead fields to fit (default all of runtime.latency.Overhead.FIELDS)")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if (args.record is None) == (args.steps is None):
        ap.error("give a RECORD.json or --steps STEPS.json (one of them)")
    if args.steps:
        out = refit_steps(args.steps, args.token_pad, args.online_window, args.online_quantile, args.terms)
        print(json.dumps(out["densities"], indent=1))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)
        return out
    n, t, tables, y = load_steps(args.record).T
    X = np.column_stack([tables, np.ones_like(y), n + t, n + (t > 0)])
    fit_i, held = np.arange(0, len(y), 2), np.arange(1, len(y), 2)
    out = {"record": args.record, "steps": len(y), "held_out": len(held),
           "op_tables_alone": errors(tables[held], y[held])}
    for name, rel, trim in (("absolute", False, 0.0), ("relative", True, 0.0), ("relative_trimmed", True, 3.0)):
        c, trimmed = fit(X[fit_i], y[fit_i], rel, trim)
        out[name] = {**errors(X[held] @ c, y[held]), "trimmed": trimmed,
                     "k": float(c[0]), "fixed_ms": float(c[1]), "per_token_ms": float(c[2]), "per_seq_ms": float(c[3])}
    print(json.dumps(out, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
