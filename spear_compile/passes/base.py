"""Base class of the spear FX passes.

A pass is constructed per graph with the :class:`PassContext`, runs once over a
post-grad ATen graph, and reports ``matched_count``. Its ``uuid`` part is the hash of
its source file, so editing a pass invalidates Inductor's FX graph cache.
"""
from __future__ import annotations

import hashlib
import inspect

import torch.fx as fx

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
        src = inspect.getsource(inspect.getmodule(cls))  # type: ignore[arg-type]
        return hashlib.sha256(src.encode()).hexdigest()
