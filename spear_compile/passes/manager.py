"""The pass manager Inductor runs as its post-grad custom pass.

Order is fixed: adopt our own ops first (so foreign matchers never see them), fuse a row-parallel EC
linear with its all-reduce and gate (``fuse_peer_reduce``), then the foreign source forms, then phase
dispatch over everything that became a spear linear, then the decode fusions: linears that share an input, silu(gate) * up into the gate / up GEMV, the RMSNorm
in front of those GEMVs into their x staging, residual adds into the GEMV epilogue; last, the record of
what was compiled for the runtime (``record_plan``, which changes nothing).
Dead nodes (the dequantize chains a matcher replaced) are removed after each pass.

``uuid()`` feeds Inductor's FX graph cache key: it hashes every pass's source with the route's
(``SpearPass.source_hash``), the compile config, and what the decode passes ask at compile time on a
GPU - the tuned table with its schema version
of this GPU and ``SPEAR_NO_TMA_GEMV`` / ``SPEAR_NO_TMA_EC`` (``fuse_glu`` / ``fuse_rmsnorm`` rewrite only where
the TMA kernel runs; every kill switch of ``envs.py``) - so a cached artifact is never reused after any of them changes. (EC
parameters are graph inputs, never baked-in constants, so their values need no key.)
"""
from __future__ import annotations

import hashlib

import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from .. import envs
from ..dispatch import table as _table

from .base import SpearPass
from .context import PassContext
from .fold_residual_add import FoldResidualAdd
from .fuse_glu import FuseGLU
from .fuse_peer_reduce import FusePeerReduce
from .fuse_rmsnorm import FuseRMSNorm
from .fuse_shared_input import FuseSharedInput
from .match_dequant_linear import MatchDequantLinear
from .match_int4pack_mm import MatchInt4PackMM
from .match_spear_op import MatchSpearOp
from .phase_dispatch import PhaseDispatch
from .record_plan import RecordPlan

PASSES: tuple[type[SpearPass], ...] = (MatchSpearOp, FusePeerReduce, MatchDequantLinear, MatchInt4PackMM,
                                       PhaseDispatch, FuseSharedInput, FuseGLU, FuseRMSNorm, FoldResidualAdd, RecordPlan)


class SpearPassManager(CustomGraphPass):
    def __init__(self, ctx: PassContext) -> None:
        self.ctx = ctx
        self.matched_counts: dict[str, int] = {}

    def __call__(self, graph: fx.Graph) -> None:
        obs = self.ctx.observer
        for cls in PASSES:
            p = cls(self.ctx)
            if obs is not None:
                obs("before", p.name, graph, p)
            self.matched_counts[p.name] = p(graph)
            graph.eliminate_dead_code()
            graph.lint()
            if obs is not None:
                obs("after", p.name, graph, p)
        gm = graph.owning_module
        if gm is not None:
            gm.recompile()

    def uuid(self) -> str:
        h = hashlib.sha256()
        for cls in PASSES:
            h.update(cls.source_hash().encode())
        h.update(self.ctx.config.fingerprint().encode())
        h.update(_table.configs().fingerprint().encode())  # (covers the table's schema version)
        h.update(envs.fingerprint().encode())
        return h.hexdigest()
