"""The decode EC inside the TMA GEMV (``w4a16_gemv_tma``): its epilogue, and producer CTAs in the same grid.

Reference: ``lowering/ec_linear.py:ec_linear_ref`` (y = W4 x + alpha B (g * A x), g the gate MLP of A x).

Epilogue (``_ec_operands`` before the K loop, ``_ec_rows`` after it): each CTA adds
``alpha * sum_j b[n, j] gh[off[n] + j]`` to its rows, ``b`` being B's rows (or, for a concatenation of
ECs, each row's own part of the block-diagonal B: ``w4a16_cat.ec_rows``) and ``gh`` = g * h.

Where g * h comes from - two ways, both measured on the H200 (benchmarks/NOTES.md, session 13):

* a separate producer grid (``ec_decode_triton.ec_produce``) with the GEMV launched behind it by
  programmatic dependent launch (PDL), ``griddepcontrol.wait`` before the epilogue. A torch.profiler
  trace showed the GEMV starting 1.7-2.2 us after the producer although the producer triggers at once:
  that launch latency is the pair's whole overhead over the GEMV (8192^2: pair 18.2 us, GEMV with the
  EC epilogue alone 15.8).
* producer CTAs in the GEMV's own grid (``_ec_producer_cta``): the first P programs compute the K slices
  of h = A x (x RMS-normalised first where the GEMV normalises it), the last to arrive (acq_rel counter)
  sums them, runs the gate MLP, publishes g * h in GH_COPIES copies and raises a flag (release); the
  GEMV CTAs poll the flag only before their epilogue (acquire), and the last of them to read g * h
  lowers it for the next launch. One launch, no launch latency. The producers have the lowest program
  ids, so they are dispatched first and never wait on a GEMV CTA: no deadlock however many waves the
  GEMV needs. (The CUDA-core kernel's single launch of session 2 lost to PDL because its GEMVs were
  shorter than the producers; the TMA GEMVs this runs are >= 12 us, the producers ~5-7 us.)
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
    def _ec_rows(b, gc, m2, alpha, GH, CNT, R, GHS, pid, ROWS, out_layout: gl.constexpr, GH_COPIES: gl.constexpr,
                 WAIT: gl.constexpr, IN_GRID: gl.constexpr):
        """The decode EC's term of the CTA's rows, ``alpha * sum_j b[n, j] gh[gc[n, j]]`` (fp32, in
        ``out_layout``), reading copy pid % GH_COPIES of g * h (copies GHS apart). WAIT: first
        ``griddepcontrol.wait`` (launched with PDL behind the producer grid). IN_GRID: the producers are
        CTAs of this grid: poll their flag (CNT[1]) before, and count the readers after (CNT[2]; the last
        of the ROWS GEMV CTAs lowers the flag and the count for the next launch)."""
        if WAIT:
            gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False,
                                      pack=1)
        if IN_GRID:
            f = gl.load(CNT + 1, volatile=True)
            while f == 0:
                f = gl.load(CNT + 1, volatile=True)
            gl.atomic_add(CNT + 1, 0, sem="acquire")
            gl.thread_barrier()
        gh = gl.load(GH + (pid % GH_COPIES) * GHS + gc, mask=m2 & (gc < R), other=0.0, cache_modifier=".cg")
        e = gl.convert_layout(gl.sum(b.to(gl.float32) * gh, axis=1) * alpha, out_layout)
        if IN_GRID:
            gl.thread_barrier()  # every thread has read g * h before this CTA counts as done
            done = gl.atomic_add(CNT + 2, 1, sem="acq_rel")
            if done == ROWS - 1:
                gl.atomic_xchg(CNT + 2, 0)
                gl.atomic_xchg(CNT + 1, 0)
        return e

    @gluon.jit
    def _gate_act(z, ACT: gl.constexpr):
        if ACT == 0:
            return z / (1.0 + gl.exp(-z))
        elif ACT == 1:
            return gl.maximum(z, 0.0)
        else:  # exact (erf) GELU, as torch's default
            return 0.5 * z * (1.0 + gl.erf(z * 0.7071067811865476))

    @gluon.jit
    def _ec_producer_cta(X, NW, EPS, A, W1, B1, W2, B2, HP, GH, CNT, K, R, D, GHS, pid, P: gl.constexpr,
                         BK: gl.constexpr, R_P: gl.constexpr, D_P: gl.constexpr, ACT: gl.constexpr,
                         GH_COPIES: gl.constexpr, NORM: gl.constexpr, KP: gl.constexpr, WARPS: gl.constexpr):
        """Producer CTA ``pid`` < P: its K slice of h = A x (x RMS-normalised as the GEMV CTAs normalise it
        when NORM; KP: K padded to a multiple of 1024) into row pid of HP; the last to arrive (CNT[0],
        acq_rel; it resets it) sums the rows, runs the gate MLP, stores g * h in GH_COPIES copies and
        raises the flag CNT[1] (release). Every block is chunked to at most 32 values per thread: the
        kernel's register count is the largest over its branches, and the GEMV CTAs must keep theirs."""
        lp: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [WARPS, 1], [1, 0])  # [R_P, BK]
        offs_r = gl.arange(0, R_P, layout=gl.SliceLayout(1, lp))
        offs_k = gl.arange(0, BK, layout=gl.SliceLayout(0, lp))
        mr = gl.expand_dims(offs_r < R, 1)
        if NORM:  # sum of squares of all of x (2K bytes, L2-resident), every load issued before the sum
            ls: gl.constexpr = gl.BlockedLayout([8], [32], [WARPS], [0])
            ss = gl.zeros([1024], gl.float32, layout=ls)
            for i in gl.static_range(KP // 1024):
                o = i * 1024 + gl.arange(0, 1024, layout=ls)
                xs = gl.load(X + o, mask=o < K, other=0.0).to(gl.float32)
                ss += xs * xs
            rstd = gl.rsqrt(gl.sum(ss, axis=0) / K + EPS)
        chunk = gl.cdiv(gl.cdiv(K, P), BK) * BK
        k_lo = pid * chunk
        h = gl.zeros([R_P], gl.float32, layout=gl.SliceLayout(1, lp))
        for k0 in range(k_lo, gl.minimum(k_lo + chunk, K), BK):
            kk = k0 + offs_k
            mk = kk < K
            a = gl.load(A + gl.expand_dims(offs_r, 1) * K + gl.expand_dims(kk, 0), mask=mr & gl.expand_dims(mk, 0),
                        other=0.0).to(gl.float32)
            xv = gl.load(X + kk, mask=mk, other=0.0)
            if NORM:  # as the model's RMSNorm rounds: fp32, to x's dtype, times the weight, to x's dtype
                wv = gl.load(NW + kk, mask=mk, other=0.0).to(gl.float32)
                xn = (xv.to(gl.float32) * rstd).to(xv.dtype).to(gl.float32)
                xf = (xn * wv).to(xv.dtype).to(gl.float32)
            else:
                xf = xv.to(gl.float32)
            h += gl.sum(a * gl.expand_dims(xf, 0), axis=1)
        gl.store(HP + pid * R_P + offs_r, h)
        gl.thread_barrier()
        old = gl.atomic_add(CNT, 1, sem="acq_rel")
        if old == P - 1:  # the last producer: every partial row is visible after the acq_rel above
            gl.atomic_xchg(CNT, 0)
            gl.thread_barrier()
            C: gl.constexpr = 8  # rows of each [C, R_P] block below
            lh: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, WARPS], [1, 0])  # R over all threads
            rr = gl.arange(0, R_P, layout=gl.SliceLayout(0, lh))
            cc = gl.arange(0, C, layout=gl.SliceLayout(1, lh))
            ht = gl.zeros([R_P], gl.float32, layout=gl.SliceLayout(0, lh))
            for p0 in gl.static_range(0, P, C):
                pp = p0 + cc
                ht += gl.sum(gl.load(HP + gl.expand_dims(pp, 1) * R_P + gl.expand_dims(rr, 0),
                                     mask=gl.expand_dims(pp < P, 1), other=0.0, cache_modifier=".cg"), axis=0)
            u = gl.load(B2 + rr, mask=rr < R, other=0.0).to(gl.float32)
            for d0 in gl.static_range(0, D_P, C):  # u = W2 act(W1 h + b1) + b2, C gate units at a time
                dd = d0 + cc
                mg = gl.expand_dims(dd < D, 1) & gl.expand_dims(rr < R, 0)
                w1 = gl.load(W1 + gl.expand_dims(dd, 1) * R + gl.expand_dims(rr, 0), mask=mg, other=0.0)
                b1 = gl.load(B1 + dd, mask=dd < D, other=0.0).to(gl.float32)
                z = _gate_act(gl.sum(w1.to(gl.float32) * gl.expand_dims(ht, 0), axis=1) + b1, ACT)
                w2t = gl.load(W2 + gl.expand_dims(rr, 0) * D + gl.expand_dims(dd, 1), mask=mg, other=0.0)
                u += gl.sum(w2t.to(gl.float32) * gl.expand_dims(z, 1), axis=0)
            gh = ht / (1.0 + gl.exp(-u))  # sigmoid(u) * h
            for c in gl.static_range(GH_COPIES):
                gl.store(GH + c * GHS + rr, gh)
            gl.thread_barrier()  # every copy stored before the flag goes up
            gl.atomic_xchg(CNT + 1, 1, sem="release")


class EcEpilogue:
    """The decode EC's operands for the TMA kernel (module docstring): ``b`` [N, RC] each row's EC
    columns (B itself, or ``w4a16_cat.ec_rows`` of a concatenation), ``roff`` [N] int32 each row's first
    column of g * h (None: 0 for every row), ``gh`` the fp32 [copies, >= r] rows g * h is published in,
    ``alpha`` a one-element tensor, ``r`` the length of g * h. Then where g * h comes from: ``wait`` -
    a producer grid launched just before (``ec_decode_triton.ec_produce``), the GEMV launched with PDL
    behind it; ``producer`` - producer CTAs in the GEMV's grid, ``(A, W1, b1, W2, b2, act, hp, cnt)``
    with ``hp`` the fp32 [>= P, R_P] partial rows and ``cnt`` three zeroed int32 counters the kernel
    leaves zeroed; neither: g * h was published before, in stream order."""

    def __init__(self, b, roff, gh, alpha, r: int, copies: int, wait: bool = False, producer=None):
        self.b, self.roff, self.gh, self.alpha, self.r, self.copies = b, roff, gh, alpha, r, copies
        self.wait, self.producer = wait, producer

    def check(self, N: int, config: tuple) -> None:
        from .w4a16_gemv_tma import ec_ok

        if not ec_ok(config):
            raise ValueError(f"w4a16_gemv_tma: the EC epilogue needs SPLIT 1 and no persistence, not config {config}")
        if self.b.dim() != 2 or self.b.shape[0] != N or not self.b.is_contiguous():
            raise ValueError(f"w4a16_gemv_tma: EC rows {tuple(self.b.shape)} must be a contiguous [{N}, RC] matrix")
        if self.roff is not None and (tuple(self.roff.shape) != (N,) or self.roff.dtype != torch.int32):
            raise ValueError(f"w4a16_gemv_tma: EC row offsets {tuple(self.roff.shape)} {self.roff.dtype} must be int32 "
                             f"[{N}]")
        if self.gh.dim() != 2 or self.gh.shape[0] < self.copies or self.gh.dtype != torch.float32:
            raise ValueError(f"w4a16_gemv_tma: g * h {tuple(self.gh.shape)} {self.gh.dtype} must be fp32 with "
                             f"{self.copies} rows")
        if self.alpha.numel() != 1:
            raise ValueError(f"w4a16_gemv_tma: EC alpha has {self.alpha.numel()} elements, expected 1")
        if self.wait and self.producer is not None:
            raise ValueError("w4a16_gemv_tma: g * h comes from a producer grid (wait) or from producer CTAs, not both")


def in_grid_epilogue(b: torch.Tensor, roff, ec: tuple, act: str) -> EcEpilogue:
    """The EC epilogue with producer CTAs in the GEMV's grid for ``ec = (A, B, W1, b1, W2, b2, alpha)``
    (``b`` / ``roff``: B's rows as the GEMV reads them, see ``EcEpilogue``): g * h and the partial rows
    live in the fused kernels' shared workspace (``w4a16_triton.ec_workspace``), the counters in
    ``w4a16_gemv_tma.ec_counters``."""
    from ._triton import next_pow2
    from .w4a16_gemv_tma import ec_counters
    from .w4a16_triton import GEMV_MAX_M, GH_COPIES, MAX_PRODUCERS, ec_workspace

    A, _, W1, b1, W2, b2, alpha = ec
    ws, _ = ec_workspace(A.device, next_pow2(A.shape[0]))
    gh, hp = ws[GEMV_MAX_M:GEMV_MAX_M + GH_COPIES], ws[GEMV_MAX_M + GH_COPIES:GEMV_MAX_M + GH_COPIES + MAX_PRODUCERS]
    return EcEpilogue(b, roff, gh, alpha, A.shape[0], GH_COPIES,
                      producer=(A, W1, b1, W2, b2, act, hp, ec_counters(A.device)))
