"""``Problem``: what one spear op call computes, as the route and the kernels' ``can_implement`` read it.

A leaf (it imports no kernel): each kernel file under ``lowering/`` checks its own constraints on a
``Problem`` (``can_implement(p, ...) -> (ok, reason)``), and ``dispatch/route.py`` chooses between the
kernels that can run. ``dispatch.route`` re-exports it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from ..config import DEFAULT_CROSSOVER_M

OPS = ("w4a16", "ec", "w4a16_cat", "w4a16_glu", "ec_cat", "ec_glu")


@dataclass(frozen=True)
class Problem:
    """What is computed. ``N``: output rows (the concatenation's total for ``*_cat``, F per half for
    ``*_glu``); ``parts``: the rows of each part of a concatenation; ``rank``: the EC's rank (the largest
    part's for concatenations; ``ranks``: every part's, summed for the block-diagonal EC); ``lowering``
    / ``crossover``: the phase-dispatch decision. The tensor facts default to what the passes' fake
    values cannot contradict; the CUDA implementations fill them from the tensors (``dispatch/route.problem_of``)."""

    op: str
    M: int
    N: int
    K: int
    G: int
    dtype: torch.dtype = torch.bfloat16
    param_dtypes: tuple = ()  # scales' and zero points' dtypes (present ones)
    bias_dtype: Optional[torch.dtype] = None
    device: torch.device = torch.device("cpu")
    layout: str = "spear"
    lowering: str = "auto"
    crossover: int = DEFAULT_CROSSOVER_M
    has_zeros: bool = True
    zeros_consistent: bool = True  # concatenations: all parts have zero points or none does
    weight_contiguous: bool = True
    params_contiguous: bool = True  # scales and zero points
    zeros_integer: Optional[bool] = None  # None: not known (fake values): taken as integral
    out_contiguous: bool = True
    parts: tuple = ()
    plain_parts: tuple = ()  # concatenations with ECs: the indices of the parts without one
    rank: Optional[int] = None  # EC rank (None: no EC)
    rank_total: Optional[int] = None  # the block-diagonal EC's rank (concatenations)
    gate_width: Optional[int] = None  # the EC gate's hidden width D
    ec_dtypes: tuple = ()  # (A, B) dtypes
    a_contiguous: bool = True
    b_contiguous: bool = True
    norm: bool = False
    act: str = "silu"
    words: bool = False  # the CUDA-core GEMV's layout is given (a concatenation's), not made from the weight
    zeros_probe: Optional[Callable] = field(default=None, compare=False, repr=False)  # zeros_integer, if asked

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"Problem: op={self.op!r}; expected one of {OPS}")

    @property
    def has_ec(self) -> bool:
        return self.rank is not None

    def replace(self, **kw) -> "Problem":
        return dataclasses.replace(self, **kw)

