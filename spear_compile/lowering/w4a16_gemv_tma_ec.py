"""The decode EC inside the TMA GEMV (``w4a16_gemv_tma``): its epilogue, behind the EC's producer grid.

Reference: ``lowering/ec_linear.py:ec_linear_ref`` (y = W4 x + alpha B (g * A x), g the gate MLP of A x).

Epilogue (``_ec_operands`` before the K loop, ``_ec_rows`` after it): each CTA adds
``alpha * sum_j b[n, j] gh[off[n] + j]`` to its rows, ``b`` being B's rows (or, for a concatenation of
ECs, each row's own part of the block-diagonal B: ``ec_cat.ec_rows``) and ``gh`` = g * h.

g * h comes from the EC's producer grid (``ec_decode_triton.ec_produce``, launched just before); the
GEMV is launched behind it by programmatic dependent launch (PDL) and executes ``griddepcontrol.wait``
only before its epilogue. Measured on the H200 (benchmarks/NOTES.md, session 13): the epilogue itself
costs 0.4-1.4 us over the plain TMA GEMV; a torch.profiler trace shows the GEMV starting 1.7-2.2 us
after the producer (the dependent launch's latency, although the producer triggers at once), which is
most of the pair's remaining overhead. Producer CTAs inside the GEMV's own grid (one launch, a flag
polled before the epilogue) were built and measured slower (8192^2 18.7 vs 18.4 us, q/k/v 17.7 vs
15.2; E2E +25 us): they take SM slots from the GEMV's single wave; removed.
"""
from __future__ import annotations

import torch

from .w4a16_gemv_gluon import HAS_GLUON

if HAS_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    @gluon.jit
    def _ec_operands(EB, ROFF, ALPHA, N, RC, pid, BN: gl.constexpr, RC_P: gl.constexpr, HAS_ROFF: gl.constexpr,
                     WARPS: gl.constexpr):
        """The decode EC's operands of the CTA's BN rows that do not depend on g * h, requested before the
        K loop (at its end they would be one more dependent round trip on every CTA's tail): ``(b, gc, m2,
        alpha)``: EB's rows [BN, RC_P] (as stored), the column of g * h each entry multiplies, its mask,
        and alpha. ROFF absent: every row reads gh[0:RC]."""
        l2: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [WARPS, 1], [1, 0])
        rows = pid * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, l2))
        mrow = rows < N
        cols = gl.arange(0, RC_P, layout=gl.SliceLayout(0, l2))
        m2 = gl.expand_dims(mrow, 1) & gl.expand_dims(cols < RC, 0)
        b = gl.load(EB + gl.expand_dims(rows, 1) * RC + gl.expand_dims(cols, 0), mask=m2, other=0.0)
        if HAS_ROFF:
            gc = gl.expand_dims(gl.load(ROFF + rows, mask=mrow, other=0), 1) + gl.expand_dims(cols, 0)
        else:
            gc = gl.expand_dims(rows * 0, 1) + gl.expand_dims(cols, 0)
        return b, gc, m2, gl.load(ALPHA).to(gl.float32)

    @gluon.jit
    def _ec_rows(b, gc, m2, alpha, GH, R, GHS, pid, out_layout: gl.constexpr, GH_COPIES: gl.constexpr,
                 WAIT: gl.constexpr):
        """The decode EC's term of the CTA's rows, ``alpha * sum_j b[n, j] gh[gc[n, j]]`` (fp32, in
        ``out_layout``), reading copy pid % GH_COPIES of g * h (copies GHS apart). WAIT: first
        ``griddepcontrol.wait`` (launched with PDL behind the producer grid: it returns once that grid
        has finished and its writes are visible)."""
        if WAIT:
            gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False,
                                      pack=1)
        gh = gl.load(GH + (pid % GH_COPIES) * GHS + gc, mask=m2 & (gc < R), other=0.0, cache_modifier=".cg")
        return gl.convert_layout(gl.sum(b.to(gl.float32) * gh, axis=1) * alpha, out_layout)

class EcEpilogue:
    """The decode EC's operands for the TMA kernel (module docstring): ``b`` [N, RC] each row's EC
    columns (B itself, or ``ec_cat.ec_rows`` of a concatenation), ``roff`` [N] int32 each row's first
    column of g * h (None: 0 for every row), ``gh`` the fp32 [copies, >= r] rows the producer publishes
    g * h in (``ec_decode_triton.ec_produce``), ``alpha`` a one-element tensor, ``r`` the length of
    g * h, and ``wait``: the GEMV is launched with PDL behind the producer grid and waits for it before
    reading ``gh`` (False: the producer ran before, in stream order)."""

    def __init__(self, b, roff, gh, alpha, r: int, copies: int, wait: bool = False):
        self.b, self.roff, self.gh, self.alpha, self.r, self.copies, self.wait = b, roff, gh, alpha, r, copies, wait

    def check(self, N: int, config: tuple) -> None:
        from .w4a16_gemv_tma import ec_ok

        if not ec_ok(config):
            raise ValueError(f"w4a16_gemv_tma: the EC epilogue needs SPLIT 1 and no persistence, not config {config}")
        if self.b.dim() != 2 or self.b.shape[0] != N or not self.b.is_contiguous():
            raise ValueError(f"w4a16_gemv_tma: EC rows {tuple(self.b.shape)} must be a contiguous [{N}, RC] matrix")
        if self.roff is not None and (tuple(self.roff.shape) != (N,) or self.roff.dtype != torch.int32):
            raise ValueError(f"w4a16_gemv_tma: EC row offsets {tuple(self.roff.shape)} {self.roff.dtype} must be int32 "
                             f"[{N}]")
        if (self.gh.dim() != 2 or self.gh.shape[0] < self.copies or self.gh.shape[1] < self.r
                or self.gh.stride(1) != 1 or self.gh.dtype != torch.float32):
            raise ValueError(f"w4a16_gemv_tma: g * h {tuple(self.gh.shape)} {self.gh.dtype} must be fp32 rows of at "
                             f"least {self.r} contiguous values, {self.copies} of them")
        devs = {str(t.device) for t in (self.b, self.gh, self.alpha) + ((self.roff,) if self.roff is not None else ())}
        if len(devs) != 1:
            raise ValueError(f"w4a16_gemv_tma: EC operands on several devices {sorted(devs)}")
        if self.alpha.numel() != 1:
            raise ValueError(f"w4a16_gemv_tma: EC alpha has {self.alpha.numel()} elements, expected 1")


def tma_ec_gemv(x2, qweight, scales, zeros, G: int, bias, ec: tuple, act: str, config: tuple, b, roff,
                norm=None, descs=None, glu: bool = False, out=None) -> torch.Tensor:
    """The decode EC pair on the TMA kernel: the producer grid for ``ec = (A, B, W1, b1, W2, b2, alpha)``
    (x RMS-normalised first with ``norm``), then ``w4a16_gemv_tma`` PDL-launched behind it with the EC
    epilogue reading B's rows ``b`` (and row offsets ``roff``, see ``EcEpilogue``). The other arguments
    are ``w4a16_gemv_tma``'s."""
    from .ec_decode_triton import ec_produce
    from .w4a16_gemv_tma import w4a16_gemv_tma
    from .w4a16_triton import GH_COPIES

    gh, pdl = ec_produce(x2, ec, act, norm)
    epi = EcEpilogue(b, roff, gh, ec[6], ec[0].shape[0], GH_COPIES, wait=pdl)
    return w4a16_gemv_tma(x2, qweight, scales, zeros, G, bias, config=config, out=out, descs=descs, glu=glu,
                          norm=norm, ec=epi)

