"""Choose SPEAR's settings on development plays, never on the evaluation plays.

    python benchmarks/spear_sweep.py --out DIR --variant base --variant lr1e-3:lr_ab=1e-3 \\
        --variant all:select=all,steps=240 [--jobs 3] [--budget 0.01]

Each ``--variant NAME[:key=value,...]`` is ``SpearConfig().replace(**overrides)`` (keys of
``SpearConfig`` or ``CalibConfig``; values parsed as JSON, else kept as strings). Every variant is
one ``spear eval`` on the development plays (default: Lear, The Tempest, Twelfth Night, none of
which is in ``DEFAULT_EVAL_PLAYS``), saved as ``DIR/<name>.json``. ``--jobs N`` runs N worker
processes side by side (on one GPU: the 135M model leaves it mostly idle), so the timings of a
parallel sweep are not the isolated timings the 3-minute target is about. The parent writes
``DIR/summary.json`` (variants by gap recovered) and ``DIR/best.json`` (the winner's overrides),
which ``benchmarks/quality.py --set-json`` takes for the report on the evaluation plays.
"""
from __future__ import annotations

try:
    from _syspath import unshadow  # run as a script: benchmarks/ is first on sys.path
except ImportError:  # loaded from elsewhere (a test, benchmarks.<name>)
    from benchmarks._syspath import unshadow
unshadow()  # before transformers is imported (benchmarks/kernels.py would shadow its ``kernels`` probe)

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DEV_PLAYS = ("lear_gut", "tempest_gut", "twelfth_night_gut")


def parse_variant(spec: str) -> tuple[str, dict]:
    from spear_compile.compensators.spear import parse_overrides

    name, _, rest = spec.partition(":")
    if not name or not all(c.isalnum() or c in "._-" for c in name):
        raise SystemExit(f"spear_sweep: variant name {name!r} must be letters, digits, '.', '_' or '-'")
    return name, parse_overrides(rest)


def run_variants(variants: list[tuple[str, dict]], args) -> None:
    from spear_compile.compensators.spear import SpearConfig
    from spear_compile.evaluate import EvalSession

    for name, over in variants:
        path = os.path.join(args.out, f"{name}.json")
        if os.path.exists(path) and not args.force:
            continue
        cfg = SpearConfig().replace(**over)  # the original defaults, not a preset; raises on an unknown key
        t0 = time.time()
        r = EvalSession(texts=args.text, max_tokens=args.max_tokens, spear=cfg, progress=False).run(
            "rtn", 0, "spear", args.budget)
        r.update(variant=name, overrides=over, wall_seconds=time.time() - t0, parallel_jobs=args.jobs)
        with open(path, "w") as f:
            json.dump(r, f, indent=1)
        print(f"{name}: gap recovered {r['gap_recovered']:.1%} at {r['memory_overhead']:.2%}, "
              f"{len(r['modules'])} modules, calibration {r['calibration_seconds']:.0f}s", flush=True)


def summarize(out: str, variants: list[tuple[str, dict]]) -> list[dict]:
    rows = []
    for name, over in variants:
        p = os.path.join(out, f"{name}.json")
        if os.path.exists(p):
            with open(p) as f:
                r = json.load(f)
            rows.append({"variant": name, "overrides": over, "gap_recovered": r["gap_recovered"],
                         "ppl_method": r["ppl_method"], "memory_overhead": r["memory_overhead"],
                         "n_modules": len(r["modules"]), "calibration_seconds": r["calibration_seconds"],
                         "seconds": r.get("seconds"), "final_loss": (r.get("calibration_losses") or [None])[-1]})
    rows.sort(key=lambda x: -x["gap_recovered"])
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(rows, f, indent=1)
    if rows:
        with open(os.path.join(out, "best.json"), "w") as f:
            json.dump(rows[0]["overrides"], f)
    for x in rows:
        print(f"{x['variant']:>16}  {x['gap_recovered']:.1%}  ppl {x['ppl_method']:.2f}  {x['n_modules']:>3} modules  "
              f"{x['calibration_seconds']:.0f}s  {x['overrides']}")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", action="append", default=[], help="NAME[:key=value,...]")
    ap.add_argument("--text", nargs="+", default=list(DEV_PLAYS))
    ap.add_argument("--max-tokens", type=int, default=32768, help="per play")
    ap.add_argument("--budget", type=float, default=0.01)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="stop unfinished workers after this many seconds and summarize what finished")
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", required=True)
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.dirname(HERE))
    from spear_compile.data import DEFAULT_EVAL_PLAYS

    overlap = sorted(set(args.text) & set(DEFAULT_EVAL_PLAYS))
    if overlap:
        raise SystemExit(f"spear_sweep: {overlap} are evaluation plays; choose settings on other text")
    try:
        variants = [parse_variant(v) for v in args.variant] or [("base", {})]
    except ValueError as e:
        raise SystemExit(f"spear_sweep: {e}")
    if len({n for n, _ in variants}) != len(variants):
        raise SystemExit("spear_sweep: variant names must be unique")
    os.makedirs(args.out, exist_ok=True)
    if args.worker is not None:
        import torch

        # N workers x torch's default threads (one per core) would oversubscribe the cores, and
        # OpenMP's spinning threads then slow every worker far more than N-fold
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.jobs))
        run_variants(variants[args.worker::args.jobs], args)
        return 0
    if args.jobs == 1:
        run_variants(variants, args)
    else:
        argv = list(argv if argv is not None else sys.argv[1:])
        procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv, "--worker", str(w)],
                                  stdout=open(os.path.join(args.out, f"worker{w}.log"), "w"), stderr=subprocess.STDOUT)
                 for w in range(args.jobs)]
        t0 = time.time()
        while any(p.poll() is None for p in procs):
            if args.deadline_s is not None and time.time() - t0 > args.deadline_s:
                for p in procs:
                    p.kill()
                print(f"spear_sweep: deadline of {args.deadline_s:.0f}s reached; unfinished variants dropped")
                break
            time.sleep(2)
    summarize(args.out, variants)
    return 0


if __name__ == "__main__":
    sys.exit(main())
