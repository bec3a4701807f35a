"""Graph inspection: summary contract, networkx/JSON/HTML outputs, CLI."""
import json

import networkx as nx
import torch

import spear_compile as spear
from spear_compile.cli import main as spear_main
from spear_compile.inspect import capture
from tests.helpers import DequantLinear, Int4PackLinear


class Mixed(torch.nn.Module):
    """One linear of each source form, chained."""

    def __init__(self):
        super().__init__()
        self.ours = torch.nn.Linear(64, 64)
        self.deq = DequantLinear(64, 64, group_size=32)
        self.i4 = Int4PackLinear(48, 64, group_size=32)

    def forward(self, x):
        return self.i4(self.deq(self.ours(x)))


def test_summary_counts_every_form_and_decision(tmp_path):
    m = Mixed()
    spear.quantize_(m, spear.QuantConfig(), filter_fn=lambda mod, name: name == "ours", progress=False)
    rep = capture(m, (torch.randn(3, 64),))
    s = rep.summary()
    assert s["matched_linears"] == 3
    assert s["by_source_form"] == {"spear_op": 1, "dequant_linear": 1, "int4pack_mm": 1}
    assert s["lowering"] == {"overlapped": 3}  # M = 3 >= the default crossover
    assert {r["weight"] for r in rep.linears} == {"ours.qweight", "deq.q", "i4.packed"}
    paths = rep.write(str(tmp_path))
    assert json.load(open(paths["summary"])) == json.loads(json.dumps(s))
    g = nx.node_link_graph(json.load(open(paths["graph"])), edges="edges")
    spear_nodes = [n for n, a in g.nodes(data=True) if "spear" in a]
    assert len(spear_nodes) == 3 and all(g.in_degree(n) > 0 for n in spear_nodes)
    html = open(paths["html"]).read()
    for needle in ("Matched linears", "deq.q", "int4pack_mm", "M = 3 &gt;= crossover 2", "match_dequant_linear"):
        assert needle in html


def test_cli_inspect_tiny_llama_with_random_ecs(tmp_path, capsys):
    assert spear_main(["inspect", "--model", "tiny-llama", "--ec", "random", "--out", str(tmp_path)]) == 0
    s = json.load(open(tmp_path / "summary.json"))
    assert s["matched_linears"] == 14 and s["ec_linears"] == 14
    assert s["by_source_form"] == {"spear_op": 14} and sum(s["lowering"].values()) == 14
    assert (tmp_path / "report.html").exists() and (tmp_path / "graph.json").exists()
    assert "matched linears : 14" in capsys.readouterr().out
