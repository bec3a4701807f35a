"""What a pass knows beyond the graph: the config and the real tensors behind inputs.

The backend sees Dynamo's graph together with the *real* example inputs (parameters
and buffers are lifted to graph inputs), so it can tell which input is which module's
weight. AOTAutograd keeps inputs in order for inference graphs, so the post-grad
graph's i-th placeholder is that i-th input; ``tensor_of`` double-checks shape and dtype
against the fake value before trusting the correspondence.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Optional

import torch
import torch.fx as fx

from ..config import CompileConfig


@dataclasses.dataclass
class InputInfo:
    tensor: Optional[torch.Tensor]
    name: str  # module-qualified name when known ("layers.0.mlp.up_proj.qweight"), else Dynamo's


@dataclasses.dataclass
class PassContext:
    config: CompileConfig = dataclasses.field(default_factory=CompileConfig)
    inputs: list[InputInfo] = dataclasses.field(default_factory=list)
    observer: Optional[Callable[[str, str, fx.Graph, "object"], None]] = None  # (phase, pass, graph, pass obj)
    # input index of a foreign integer weight -> ({EC param name: input index}, EC, EC name)
    ec_inputs: dict[int, tuple[dict[str, int], Any, str]] = dataclasses.field(default_factory=dict)
    # what was compiled (``passes/record_plan.py``); None until that pass ran on this graph
    plan_records: Optional[list[dict]] = None

    def _placeholder_index(self, node: fx.Node) -> Optional[int]:
        if node.op != "placeholder" or node.graph is None:
            return None
        for i, p in enumerate(n for n in node.graph.nodes if n.op == "placeholder"):
            if p is node:
                return i
        return None

    def input_of(self, node: fx.Node) -> Optional[InputInfo]:
        i = self._placeholder_index(node)
        if i is None or i >= len(self.inputs):
            return None
        info = self.inputs[i]
        val = node.meta.get("val")
        if info.tensor is None or not isinstance(val, torch.Tensor):
            return None
        if tuple(val.shape) != tuple(info.tensor.shape) or val.dtype != info.tensor.dtype:
            return None  # order did not survive AOT for this input: do not guess
        return info

    def tensor_of(self, node: fx.Node) -> Optional[torch.Tensor]:
        info = self.input_of(node)
        return None if info is None else info.tensor

    def ec_inputs_of(self, weight: fx.Node) -> Optional[tuple[dict[str, fx.Node], Any, str]]:
        """Placeholders holding the EC registered for the graph input ``weight``, if any."""
        i = self._placeholder_index(weight)
        if i is None or i not in self.ec_inputs or self.input_of(weight) is None:
            return None
        index_of, ec, name = self.ec_inputs[i]
        placeholders = [n for n in weight.graph.nodes if n.op == "placeholder"]
        return {p: placeholders[j] for p, j in index_of.items()}, ec, name

    def name_of(self, node: fx.Node) -> str:
        info = self.input_of(node)
        return info.name if info is not None else node.name


_PART = re.compile(r"\['([^']+)'\]|\.([A-Za-z_][A-Za-z0-9_]*)|\[(\d+)\]")


def fqn_from_source(source: str) -> str:
    """Turn Dynamo's source name ``L['self']._modules['q_proj']._buffers['qweight']`` into ``q_proj.qweight``
    (torch 2.13 names the compiled module ``L['args'][0]``: the same name)."""
    m = re.match(r"^L\['args'\]\[0\](?=\.)|^L\['[^']+'\]", source)
    rest = source[m.end():] if m else source
    parts = [a or b or c for a, b, c in _PART.findall(rest)]
    return ".".join(p for p in parts if p not in ("_modules", "_parameters", "_buffers")) or source
