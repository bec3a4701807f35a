"""Capture the post-grad graph before and after every spear pass.

``capture`` compiles the model with ``backend="spear"`` while an observer is installed
in the backend; the pass manager calls it around each pass. Inductor's caches are
bypassed for that compilation (a cache hit would skip the passes), and Dynamo is reset
first so an earlier compilation of the same model cannot be reused silently.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import os
from typing import Any, Optional, Sequence

import torch
import torch.fx as fx

from ..config import CompileConfig
from ..passes import backend as _backend
from ..passes.common import META_KEY, SPEAR_OPS
from ..passes.fuse_peer_reduce import PEER_REDUCE
from ..passes.manager import PASSES

_LAST_PASS = PASSES[-1].name  # the linears are read from the graph this pass leaves


@dataclasses.dataclass
class PassSnapshot:
    pass_name: str
    matched_count: int
    before: str
    after: str
    ops_before: dict[str, int]
    ops_after: dict[str, int]


@dataclasses.dataclass
class GraphCapture:
    index: int
    snapshots: list[PassSnapshot] = dataclasses.field(default_factory=list)
    linears: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    nodes: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    edges: list[tuple[str, str]] = dataclasses.field(default_factory=list)


def _op_counts(graph: fx.Graph) -> dict[str, int]:
    c = collections.Counter(str(n.target) for n in graph.nodes if n.op == "call_function")
    return dict(sorted(c.items()))


def _jsonable(v: Any) -> Any:
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    return str(v)


class _Observer:
    def __init__(self) -> None:
        self.graphs: list[GraphCapture] = []
        self._pending: dict[str, tuple[str, dict[str, int]]] = {}

    def __call__(self, phase: str, pass_name: str, graph: fx.Graph, pass_obj) -> None:
        if phase == "before":
            if pass_name == "match_spear_op":  # first pass: a new graph starts
                self.graphs.append(GraphCapture(index=len(self.graphs)))
            self._pending[pass_name] = (str(graph), _op_counts(graph))
            return
        before, ops_before = self._pending.pop(pass_name)
        cap = self.graphs[-1]
        cap.snapshots.append(PassSnapshot(pass_name, pass_obj.matched_count, before, str(graph), ops_before,
                                          _op_counts(graph)))
        if pass_name == _LAST_PASS:
            self._finish(cap, graph)

    @staticmethod
    def _finish(cap: GraphCapture, graph: fx.Graph) -> None:
        for n in graph.nodes:
            info = n.meta.get(META_KEY)
            attrs = {"op": n.op, "target": str(n.target)}
            v = n.meta.get("val")
            if isinstance(v, torch.Tensor):
                attrs.update(shape=[str(s) for s in v.shape], dtype=str(v.dtype))
            if n.op == "call_function" and (n.target in SPEAR_OPS or n.target is PEER_REDUCE) and info:
                rec = {"node": n.name, "op": str(n.target), "graph": cap.index, **_jsonable(info)}
                cap.linears.append(rec)
                attrs["spear"] = _jsonable(info)
            elif n.op == "call_function" and info and "members" in info:  # fuse_shared_input's concatenation
                cap.linears.extend({"graph": cap.index, **_jsonable(m)} for m in info["members"])
                attrs["spear"] = _jsonable({k: v for k, v in info.items() if k != "members"})
            cap.nodes.append({"id": f"g{cap.index}:{n.name}", **attrs})
            cap.edges.extend((f"g{cap.index}:{a.name}", f"g{cap.index}:{n.name}") for a in n.all_input_nodes)


class Report:
    """What the spear passes found and decided, for every graph Dynamo produced."""

    def __init__(self, graphs: list[GraphCapture], model_name: str = "") -> None:
        self.graphs = graphs
        self.model_name = model_name

    @property
    def linears(self) -> list[dict[str, Any]]:
        return [rec for g in self.graphs for rec in g.linears]

    def pass_counts(self) -> dict[str, int]:
        c: collections.Counter = collections.Counter()
        for g in self.graphs:
            for s in g.snapshots:
                c[s.pass_name] += s.matched_count
        return dict(c)

    def summary(self) -> dict[str, Any]:
        lin = self.linears
        return {
            "model": self.model_name,
            "graphs": len(self.graphs),
            "matched_linears": len(lin),
            "by_source_form": dict(collections.Counter(r["source_form"] for r in lin)),
            "lowering": dict(collections.Counter(r.get("lowering", "auto") for r in lin)),
            "ec_linears": sum(1 for r in lin if r.get("ec_rank")),
            "pass_counts": self.pass_counts(),
        }

    def to_networkx(self):
        """All captured final graphs as one ``networkx.DiGraph`` (node ids ``g<i>:<name>``)."""
        import networkx as nx

        G = nx.DiGraph(model=self.model_name)
        for g in self.graphs:
            for n in g.nodes:
                G.add_node(n["id"], **{k: v for k, v in n.items() if k != "id"})
            G.add_edges_from(g.edges)
        return G

    def write(self, out_dir: str) -> dict[str, str]:
        """Write ``graph.json``, ``report.html`` and ``summary.json``; returns their paths."""
        import networkx as nx

        from .report import render_html

        os.makedirs(out_dir, exist_ok=True)
        paths = {k: os.path.join(out_dir, f) for k, f in
                 (("graph", "graph.json"), ("html", "report.html"), ("summary", "summary.json"))}
        with open(paths["graph"], "w") as f:
            json.dump(nx.node_link_data(self.to_networkx(), edges="edges"), f)
        with open(paths["summary"], "w") as f:
            json.dump(self.summary(), f, indent=2)
        with open(paths["html"], "w") as f:
            f.write(render_html(self))
        return paths

    def format_summary(self) -> str:
        s = self.summary()
        lines = [f"spear inspect: {s['model'] or 'model'}  ({s['graphs']} graph(s))",
                 f"  matched linears : {s['matched_linears']}  (with EC: {s['ec_linears']})",
                 "  by source form  : " + ", ".join(f"{k}={v}" for k, v in sorted(s["by_source_form"].items())),
                 "  lowering        : " + ", ".join(f"{k}={v}" for k, v in sorted(s["lowering"].items())),
                 "  pass matches    : " + ", ".join(f"{k}={v}" for k, v in s["pass_counts"].items())]
        reasons = collections.Counter(r.get("reason", "") for r in self.linears)
        for reason, n in reasons.most_common(4):
            lines.append(f"    {n:4d} x {reason}")
        return "\n".join(lines)


def capture(model: torch.nn.Module, example_inputs: Sequence[Any], config: Optional[CompileConfig] = None,
            dynamic: Optional[bool] = None, model_name: str = "") -> Report:
    """Compile ``model`` with ``backend="spear"``, run it once on ``example_inputs``, return a :class:`Report`."""
    obs = _Observer()
    torch._dynamo.reset()
    _backend._OBSERVERS.append(obs)
    try:
        with torch.no_grad(), _backend.compile_config(config or CompileConfig()):
            compiled = torch.compile(model, backend="spear", dynamic=dynamic)
            compiled(*example_inputs)
    finally:
        _backend._OBSERVERS.remove(obs)
        torch._dynamo.reset()
    return Report(obs.graphs, model_name or type(model).__name__)
