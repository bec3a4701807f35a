"""Quality grid for SmolLM2-135M: methods x budgets x quantized bases -> JSON, markdown, SVG.

    python benchmarks/quality.py                       # the full grid (hours on a 2-core CPU)
    python benchmarks/quality.py --bases rtn:0 --methods qera spear --budgets 0.01
    python benchmarks/quality.py --aggregate-only      # rebuild table + plot from saved runs

Every run is one ``spear eval`` (``spear_compile.evaluate``; shared reference perplexity,
calibration text and quantized bases are computed once per invocation) and is saved as
``<out>/<quant>_g<group>_<method>_<budget>.json``; a finished run is not repeated unless
``--force``. The aggregate is ``<out>/quality.md`` (the README's table), ``quality.json`` and
one ``quality_<base>.svg`` per base (gap recovered vs memory overhead, a line per method).
"""
from __future__ import annotations

try:
    from _syspath import unshadow  # run as a script: benchmarks/ is first on sys.path
except ImportError:  # loaded from elsewhere (a test, benchmarks.<name>)
    from benchmarks._syspath import unshadow
unshadow()  # before transformers is imported (benchmarks/kernels.py would shadow its ``kernels`` probe)

import argparse
import datetime
import glob
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(HERE, "results", "quality", f"{datetime.date.today()}_grid")  # <topic>/<date>_<what>
RUN_METHODS = ("lorc", "lqer", "qera", "serq", "spear")
METHOD_ORDER = RUN_METHODS + ("spear+scales",)  # table rows
COLORS = {"lorc": "#999999", "lqer": "#e69f00", "qera": "#0072b2", "serq": "#009e73", "spear": "#d55e00",
          "spear+scales": "#cc79a7"}


def row_method(method: str, train_quant: bool) -> str:
    """The table row of a run: a SPEAR run that also trained the base's scales and zeros
    (``train_quant``) changed the base, so it gets its own row, "spear+scales"."""
    return "spear+scales" if method == "spear" and train_quant else method


def tag(quant: str, group: int, method: str, budget: float) -> str:
    return f"{quant}_g{group or 'ch'}_{method}_{budget:g}"


def base_name(quant: str, group: int) -> str:
    return f"{quant.upper()} {'per-channel' if not group else f'g{group}'}"


def load_runs(out: str) -> list[dict]:
    runs = []
    for p in sorted(glob.glob(os.path.join(out, "*.json"))):
        if os.path.basename(p) == "quality.json":
            continue
        with open(p) as f:
            r = json.load(f)
        if isinstance(r, dict) and {"quant", "method", "budget", "gap_recovered"} <= set(r):  # not other JSON
            r["method"] = row_method(r["method"], bool((r.get("calibration") or {}).get("train_quant")))
            runs.append(r)
    return runs


def table(runs: list[dict]) -> str:
    """Markdown: one row per (base, method), one column per budget; cell = gap recovered
    (memory overhead), plus the base's perplexities."""
    budgets = sorted({r["budget"] for r in runs if r["method"] != "none"})
    bases = sorted({(r["quant"], r["group_size"]) for r in runs})
    lines = ["| base (ppl ref -> quant) | method | " + " | ".join(f"budget {b:.1%}" for b in budgets) + " |",
             "|---|---|" + "---|" * len(budgets)]
    for qb in bases:
        rs = [r for r in runs if (r["quant"], r["group_size"]) == qb]
        label = f"{base_name(*qb)} ({rs[0]['ppl_ref']:.2f} -> {rs[0]['ppl_quant']:.2f})"
        for m in [m for m in METHOD_ORDER if any(r["method"] == m for r in rs)]:
            cells = []
            for b in budgets:
                hit = [r for r in rs if r["method"] == m and r["budget"] == b]
                cells.append(f"{hit[0]['gap_recovered']:.1%} ({hit[0]['memory_overhead']:.2%}, "
                             f"ppl {hit[0]['ppl_method']:.2f})" if hit else "-")
            lines.append(f"| {label} | {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def svg_plot(runs: list[dict], title: str, w: int = 560, h: int = 360) -> str:
    """Gap recovered (%) vs memory overhead (%), one polyline per method; dependency-free SVG."""
    pts = {m: sorted((r["memory_overhead"] * 100, r["gap_recovered"] * 100) for r in runs if r["method"] == m)
           for m in METHOD_ORDER}
    pts = {m: p for m, p in pts.items() if p}
    xs = [x for p in pts.values() for x, _ in p] or [0.0, 1.0]
    ys = [y for p in pts.values() for _, y in p] or [0.0, 100.0]
    x0, x1 = 0.0, max(xs) * 1.1 or 1.0
    y0, y1 = min(0.0, min(ys)), max(100.0, max(ys))
    L, R, T, B = 60, 110, 30, 45
    sx = lambda x: L + (x - x0) / (x1 - x0) * (w - L - R)  # noqa: E731
    sy = lambda y: h - B - (y - y0) / (y1 - y0) * (h - T - B)  # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" '
           f'font-size="12"><rect width="{w}" height="{h}" fill="white"/>',
           f'<text x="{w / 2}" y="18" text-anchor="middle" font-size="14">{title}</text>',
           f'<line x1="{L}" y1="{h - B}" x2="{w - R}" y2="{h - B}" stroke="black"/>',
           f'<line x1="{L}" y1="{T}" x2="{L}" y2="{h - B}" stroke="black"/>',
           f'<text x="{(L + w - R) / 2}" y="{h - 8}" text-anchor="middle">memory overhead (% of fp16 bytes)</text>',
           f'<text x="14" y="{(T + h - B) / 2}" text-anchor="middle" transform="rotate(-90 14 {(T + h - B) / 2})">'
           'perplexity gap recovered (%)</text>']
    for i in range(6):
        xv, yv = x0 + (x1 - x0) * i / 5, y0 + (y1 - y0) * i / 5
        out.append(f'<text x="{sx(xv):.1f}" y="{h - B + 16}" text-anchor="middle">{xv:.2f}</text>')
        out.append(f'<text x="{L - 6}" y="{sy(yv) + 4:.1f}" text-anchor="end">{yv:.0f}</text>')
        out.append(f'<line x1="{L}" y1="{sy(yv):.1f}" x2="{w - R}" y2="{sy(yv):.1f}" stroke="#eee"/>')
    for k, (m, p) in enumerate(pts.items()):
        c = COLORS.get(m, "black")
        poly = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in p)
        out.append(f'<polyline points="{poly}" fill="none" stroke="{c}" stroke-width="2"/>')
        out += [f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3.5" fill="{c}"/>' for x, y in p]
        out.append(f'<text x="{w - R + 10}" y="{T + 16 * k + 10}" fill="{c}">{m}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def aggregate(out: str) -> dict:
    runs = load_runs(out)
    md = table(runs)
    with open(os.path.join(out, "quality.md"), "w") as f:
        f.write(md)
    with open(os.path.join(out, "quality.json"), "w") as f:
        keys = ("quant", "group_size", "method", "budget", "ppl_ref", "ppl_quant", "ppl_method", "gap_recovered",
                "memory_overhead", "calibration_seconds", "seconds", "device", "texts", "tokens")
        # a run kept only as its summary (a "note" says why) carries n_modules / ranks itself
        json.dump([{**{k: r.get(k) for k in keys},
                    "n_modules": len(r["modules"]) if "modules" in r else r.get("n_modules"),
                    "ranks": sorted({m["rank"] for m in r["modules"]}) if "modules" in r else r.get("ranks")}
                   for r in runs], f, indent=1)
    for qb in sorted({(r["quant"], r["group_size"]) for r in runs}):
        rs = [r for r in runs if (r["quant"], r["group_size"]) == qb]
        with open(os.path.join(out, f"quality_{qb[0]}_g{qb[1] or 'ch'}.svg"), "w") as f:
            f.write(svg_plot(rs, f"SmolLM2-135M, W4 {base_name(*qb)}"))
    print(md)
    return {"runs": len(runs), "table": md}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bases", nargs="+", default=["rtn:0", "rtn:128", "gptq:0"], help="quant:group (0 = per-channel)")
    ap.add_argument("--methods", nargs="+", default=list(RUN_METHODS),
                    help="spear eval methods; a SPEAR run with --set train_quant=true is reported as spear+scales")
    ap.add_argument("--budgets", nargs="+", type=float, default=[0.005, 0.01, 0.02])
    ap.add_argument("--text", nargs="+", default=None, help="default: spear eval's plays")
    ap.add_argument("--max-tokens", type=int, default=None, help="per text")
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--force", action="store_true", help="re-run runs whose JSON exists")
    ap.add_argument("--aggregate-only", action="store_true")
    ap.add_argument("--preset", default="auto", choices=["auto", "gpu", "cpu", "none"],
                    help="SPEAR settings to start from: by device (auto), GPU_PRESET, CPU_PRESET or SpearConfig()")
    ap.add_argument("--set", default="", help="SPEAR settings key=value,... (SpearConfig / CalibConfig fields)")
    ap.add_argument("--set-json", default=None, help="SPEAR settings from a JSON object (spear_sweep's best.json)")
    ap.add_argument("--device", default=None, help="default: cuda when present")
    ap.add_argument("--calib-text", default=None,
                    help="calibrate on this real text instead of self-sampled text (a baseline; use another --out)")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if not args.aggregate_only:
        sys.path[:0] = [os.path.dirname(HERE), HERE]
        from spear_compile.data import DEFAULT_EVAL_PLAYS
        from spear_compile.compensators.spear import SpearConfig, parse_overrides, preset
        from spear_compile.evaluate import EvalSession

        over = {}
        if args.set_json:
            with open(args.set_json) as f:
                over.update(json.load(f))
        over.update(parse_overrides(args.set))
        base = SpearConfig() if args.preset == "none" else preset(args.device, args.preset)
        session = EvalSession(texts=args.text or DEFAULT_EVAL_PLAYS, max_tokens=args.max_tokens,
                              spear=base.replace(**over), device=args.device, calib_text=args.calib_text)
        for b in args.bases:
            quant, group = b.split(":")
            for method in args.methods:
                for budget in args.budgets:
                    label = row_method(method, session.spear.calib.train_quant)
                    path = os.path.join(args.out, tag(quant, int(group), label, budget) + ".json")
                    if os.path.exists(path) and not args.force:
                        continue
                    r = session.run(quant, int(group), method, budget)
                    with open(path, "w") as f:
                        json.dump(r, f, indent=1)
                    print(f"{os.path.basename(path)}: gap recovered {r['gap_recovered']:.1%} at "
                          f"{r['memory_overhead']:.2%} ({r['calibration_seconds']:.0f}s)", flush=True)
    aggregate(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
