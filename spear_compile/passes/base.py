"""Base class of the spear FX passes.

A pass is constructed per graph with the :class:`PassContext`, runs once over a
post-grad ATen graph, and reports ``matched_count``. Its ``uuid`` part is the hash of
its source file and of the route and table code its decisions read, so editing any of them
invalidates Inductor's FX graph cache.
"""
from __future__ import annotations

import hashlib
import inspect

import torch.fx as fx

from ..dispatch import keys as _keys
from ..dispatch import route as _route
from ..dispatch import table as _table
from .context import PassContext


class SpearPass:
    name: str = "spear_pass"

    def __init__(self, ctx: PassContext) -> None:
        self.ctx = ctx
        self.matched_count = 0

    def __call__(self, graph: fx.Graph) -> int:
        self.matched_count = self.run(graph)
        return self.matched_count

    def run(self, graph: fx.Graph) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    @classmethod
    def source_hash(cls) -> str:
        """The pass's own source, with the code every rewrite decision depends on: the route (which
        kernel runs a node), the table's keys and the tuned table's module with its schema version."""
        h = hashlib.sha256()
        for mod in (inspect.getmodule(cls), _route, _keys, _table):
            h.update(inspect.getsource(mod).encode())  # type: ignore[arg-type]
        h.update(f"table schema {_table.SCHEMA_VERSION}".encode())
        return h.hexdigest()
