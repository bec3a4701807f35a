"""Render a :class:`~spear_compile.inspect.capture.Report` as one self-contained HTML page:
summary, per-pass match counts and op deltas, every matched linear (weight, shapes,
source form, EC rank, lowering and why, the kernel ``dispatch.route`` runs it on and the route's reasons),
and the graph text before/after each pass."""
from __future__ import annotations

import html

_CSS = """body{font:14px system-ui,sans-serif;margin:2em;max-width:1400px}table{border-collapse:collapse;margin:1em 0}
td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}th{background:#f3f3f3}pre{background:#fafafa;
padding:8px;overflow:auto;max-height:400px;font-size:12px}.fused{color:#06c}.overlapped{color:#a50}.dispatch{color:#692}"""


def _table(headers, rows) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _reasons(reasons: list) -> str:
    """The route's reasons (``dispatch.route.Route.all_reasons``), folded."""
    if not reasons:
        return "-"
    items = "".join(f"<li>{html.escape(str(r))}</li>" for r in reasons)
    return f"<details><summary>{len(reasons)}</summary><ul>{items}</ul></details>"


def render_html(report) -> str:
    e = html.escape
    s = report.summary()
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>spear inspect: {e(s['model'])}</title>"
             f"<style>{_CSS}</style></head><body><h1>spear inspect: {e(s['model'])}</h1>"]
    parts.append(_table(["graphs", "matched linears", "with EC", "by source form", "lowering"],
                        [[s["graphs"], s["matched_linears"], s["ec_linears"],
                          e(", ".join(f"{k}: {v}" for k, v in sorted(s["by_source_form"].items()))),
                          e(", ".join(f"{k}: {v}" for k, v in sorted(s["lowering"].items())))]]))
    parts.append("<h2>Passes</h2>")
    rows = []
    for g in report.graphs:
        for snap in g.snapshots:
            delta = {k: snap.ops_after.get(k, 0) - snap.ops_before.get(k, 0)
                     for k in set(snap.ops_before) | set(snap.ops_after)}
            changed = ", ".join(f"{k}: {v:+d}" for k, v in sorted(delta.items()) if v)
            rows.append([g.index, e(snap.pass_name), snap.matched_count, e(changed or "-")])
    parts.append(_table(["graph", "pass", "matched_count", "op count changes"], rows))
    parts.append("<h2>Matched linears</h2>")
    rows = [[r["graph"], e(str(r.get("weight", ""))), e(r["source_form"]), e(str(r.get("M", "?"))), r.get("N"),
             r.get("K"), r.get("group_size"), e(str(r.get("layout"))), r.get("ec_rank") or "-",
             f"<span class='{e(str(r.get('lowering')))}'>{e(str(r.get('lowering')))}</span>", e(str(r.get("reason", ""))),
             e(str(r.get("kernel", ""))), _reasons(r.get("route_reasons") or [])]
            for r in report.linears]
    parts.append(_table(["graph", "weight", "source form", "M", "N", "K", "group", "layout", "EC rank", "lowering",
                         "why", "kernel (route)", "route reasons"], rows))
    parts.append("<h2>Graphs before / after each pass</h2>")
    for g in report.graphs:
        for snap in g.snapshots:
            parts.append(f"<details><summary>graph {g.index}: {e(snap.pass_name)} "
                         f"(matched {snap.matched_count})</summary><h4>before</h4><pre>{e(snap.before)}</pre>"
                         f"<h4>after</h4><pre>{e(snap.after)}</pre></details>")
    parts.append("</body></html>")
    return "\n".join(parts)
