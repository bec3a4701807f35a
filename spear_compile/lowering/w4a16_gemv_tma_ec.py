"""The decode EC inside the TMA GEMV (``w4a16_gemv_tma``): its epilogue, behind the EC's producer grid.

Reference: ``ops/ec_ref.py:ec_linear_ref`` (y = W4 x + alpha B (g * A x), g the gate MLP of A x).

Epilogue (``_ec_operands`` before the K loop, ``_ec_rows`` after it): each CTA adds
``alpha * sum_j b[n, j] gh[off[n] + j]`` to its rows, ``b`` being B's rows (or, for a concatenation of
ECs, each row's own part of the block-diagonal B: ``ec_cat.ec_rows``) and ``gh`` = g * h.

g * h comes from the EC's producer grid (``ec_decode_triton.ec_produce``, launched just before); the
GEMV is launched behind it by programmatic dependent launch (PDL) and executes ``griddepcontrol.wait``
only before its epilogue. Measured on the H200 (docs/kernels.md): the epilogue itself
costs 0.4-1.4 us over the plain TMA GEMV; a torch.profiler trace shows the GEMV starting 1.7-2.2 us
after the producer (the dependent launch's latency, although the producer triggers at once), which is
most of the pair's remaining overhead. Producer CTAs inside the GEMV's own grid (one launch, a flag
polled before the epilogue) were built and measured slower (8192^2 18.7 vs 18.4 us, q/k/v 17.7 vs
15.2; E2E +25 us): they take SM slots from the GEMV's single wave; removed.
"""
from __future__ import annotations

from typing import Optional

import torch

from ._triton import ACT_CODES
from . import device as _device
from . import ec_self as _es
from .ec_self import check_self_operands, self_plan, self_workspace
from .w4a16_words import HAS_GLUON
from .w4a16_gemv_tma_configs import ec_ok, norm_ok

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

    # ---- the one-launch form (``ec_self.py``, whose Triton helpers these mirror with explicit layouts) ----

    @gluon.jit
    def _self_ticket(TICKET):
        """(tag, role) of this CTA in this launch from its ticket (``ec_self.ec_ticket``)."""
        t = gl.atomic_add(TICKET, 1, sem="relaxed")
        grid = gl.num_programs(0)
        return ((t // grid + 1) & 0x7FFFFFFF).to(gl.int32), (t % grid).to(gl.int32)

    @gluon.jit
    def _self_load(A, X, K, NC, p, mask_p, PW: gl.constexpr, WARPS: gl.constexpr):
        """Pieces ``p`` [PPC_P]' operands: rows p // NC of A and x over chunks p % NC ([PPC_P, PW] each),
        requested now and consumed by ``_self_publish`` after the first K step (their latency overlaps x's
        staging and that step). NOTE: with PPC_P < WARPS this layout repeats the rows in several warps, so
        a thread holds up to WARPS / PPC_P times the ``self_plan`` budget (offline: 144-189 registers, no
        spills, on the shipped plans; the measured kernel - spreading PW over the spare warps is untried)."""
        pl: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [WARPS, 1], [1, 0])
        pp = gl.convert_layout(p, gl.SliceLayout(1, pl))
        mp = gl.convert_layout(mask_p, gl.SliceLayout(1, pl))
        offs = gl.expand_dims((pp % NC) * PW, 1) + gl.expand_dims(gl.arange(0, PW, layout=gl.SliceLayout(0, pl)), 0)
        m = gl.expand_dims(mp, 1) & (offs < K)
        a = gl.load(A + gl.expand_dims(pp // NC, 1) * K + offs, mask=m, other=0.0)
        xv = gl.load(X + offs, mask=m, other=0.0)
        return a, xv

    @gluon.jit
    def _self_publish(SLOTS, p, mask_p, a, xv, tag):
        """Slots ``p`` := (tag << 32) | bits(sum_k a x): value and tag in one 64-bit store."""
        v = gl.sum(a.to(gl.float32) * xv.to(gl.float32), axis=1)
        bits = v.to(gl.int32, bitcast=True).to(gl.uint32, bitcast=True).to(gl.int64)
        pv = gl.convert_layout(p, v.type.layout)
        mv = gl.convert_layout(mask_p, v.type.layout)
        gl.store(SLOTS + pv, bits | (tag.to(gl.int64) << 32), mask=mv)

    @gluon.jit
    def _self_own(SLOTS, A, X, K, R, NC, OWNERS, role, PW: gl.constexpr, PPC_P: gl.constexpr, WARPS: gl.constexpr):
        """The pieces of the CTA with ticket role ``role`` (``role + i OWNERS``; none unless role <
        OWNERS): their indices, mask and requested operands."""
        l1: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
        p = role + gl.arange(0, PPC_P, layout=l1) * OWNERS
        mp = (p < R * NC) & (role < OWNERS)
        a, xv = _self_load(A, X, K, NC, p, mp, PW, WARPS)
        return p, mp, a, xv

    @gluon.jit
    def _self_missing(v, m, tag):
        return gl.sum(gl.sum(gl.where(m & ((v >> 32).to(gl.int32) != tag), 1, 0), axis=1), axis=0)

    @gluon.jit
    def _self_slots(SLOTS, R, NC, R_P: gl.constexpr, NC_P: gl.constexpr, WARPS: gl.constexpr):
        """The slot addresses [T, NC_P] and their mask, T = max(R_P, 32 WARPS): row i reads A-row i % R_P's
        NC chunks, one thread per row, so each row's sum is in one thread, in a fixed order. Where R_P is
        smaller than the CTA the rows are read by T / R_P threads each *as distinct elements*: a replicated
        layout would let those threads load a slot at different times and disagree (one this launch's
        piece, one stale), and the CTA-wide count of missing pieces, which reduces over one replica only,
        would call the slots complete while the gate took the stale copy - wrong rows in that CTA, seen on
        the H200 (docs/kernels.md)."""
        T: gl.constexpr = R_P if R_P > 32 * WARPS else 32 * WARPS
        cl: gl.constexpr = gl.BlockedLayout([1, NC_P], [32, 1], [WARPS, 1], [1, 0])
        offs_t = gl.arange(0, T, layout=gl.SliceLayout(1, cl))
        offs_r = offs_t % R_P
        offs_c = gl.arange(0, NC_P, layout=gl.SliceLayout(0, cl))
        m = gl.expand_dims(offs_r < R, 1) & gl.expand_dims(offs_c < NC, 0)
        return SLOTS + gl.expand_dims(offs_r * NC, 1) + gl.expand_dims(offs_c, 0), m

    @gluon.jit
    def _self_collect(v, ptrs, m, SLOTS, A, X, K, R, NC, tag, PW: gl.constexpr, PPC_P: gl.constexpr,
                      SPIN: gl.constexpr, WARPS: gl.constexpr, R_P: gl.constexpr):
        """h [R_P] from this launch's slots (``ec_self.ec_collect``), starting from ``v``, the slots as
        read during the last K step: re-read (with a back-off, so that waiting CTAs do not flood the
        slots' L2 lines: ``ec_self.ec_collect``) while some are missing, at most SPIN times, then compute
        all pieces here (every one, not only those this thread saw missing: a mask decided per replica
        could load zeros and store them under this launch's tag)."""
        missing = _self_missing(v, m, tag)
        it = 0
        ns = 32
        while (missing > 0) & (it < SPIN):
            gl.inline_asm_elementwise("nanosleep.u32 $1; mov.u32 $0, 0;", "=r,r", [ns], dtype=gl.int32,
                                      is_pure=False, pack=1)
            v = gl.load(ptrs, mask=m, other=0, volatile=True)
            missing = _self_missing(v, m, tag)
            ns = gl.minimum(ns * 2, 512)
            it += 1
        if missing > 0:  # compute and publish the pieces here: same code, same bits as their owners'
            l1: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
            NP = R * NC
            for g in range(0, NP, PPC_P):
                p = g + gl.arange(0, PPC_P, layout=l1)
                mp = p < NP
                a, xv = _self_load(A, X, K, NC, p, mp, PW, WARPS)
                _self_publish(SLOTS, p, mp, a, xv, tag)
            gl.thread_barrier()
            v = gl.load(ptrs, mask=m, other=0, volatile=True)
        vals = v.to(gl.int32).to(gl.float32, bitcast=True)
        hs = gl.sum(gl.where(m, vals, 0.0), axis=1)  # [T]: every copy of a row holds this launch's piece
        T: gl.constexpr = hs.shape[0]
        return gl.max(gl.reshape(hs, [T // R_P, R_P]), axis=0)  # (equal copies: any one, bit for bit)

    @gluon.jit
    def _self_gate_operands(W1, B1, W2, B2, R, D, R_P: gl.constexpr, D_P: gl.constexpr, WARPS: gl.constexpr):
        """The gate MLP's weights (fp32, in the gate's layout), requested before the K loop."""
        gl_: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [WARPS, 1], [1, 0])
        rr = gl.arange(0, R_P, layout=gl.SliceLayout(0, gl_))
        dd = gl.arange(0, D_P, layout=gl.SliceLayout(1, gl_))
        w1 = gl.load(W1 + gl.expand_dims(dd, 1) * R + gl.expand_dims(rr, 0),
                     mask=gl.expand_dims(dd < D, 1) & gl.expand_dims(rr < R, 0), other=0.0).to(gl.float32)
        b1 = gl.load(B1 + dd, mask=dd < D, other=0.0).to(gl.float32)
        rc = gl.arange(0, R_P, layout=gl.SliceLayout(1, gl_))
        dc = gl.arange(0, D_P, layout=gl.SliceLayout(0, gl_))
        w2 = gl.load(W2 + gl.expand_dims(rc, 1) * D + gl.expand_dims(dc, 0),
                     mask=gl.expand_dims(rc < R, 1) & gl.expand_dims(dc < D, 0), other=0.0).to(gl.float32)
        b2 = gl.load(B2 + rc, mask=rc < R, other=0.0).to(gl.float32)
        return w1, b1, w2, b2

    @gluon.jit
    def gate_act_gl(z, ACT: gl.constexpr):
        """The gate's activation in Gluon (``_triton.gate_act``'s codes: 0 silu, 1 relu, 2 exact GELU), shared by
        the Gluon EC kernels."""
        if ACT == 0:
            z = z / (1.0 + gl.exp(-z))
        elif ACT == 1:
            z = gl.maximum(z, 0.0)
        else:
            z = 0.5 * z * (1.0 + gl.erf(z * 0.7071067811865476))
        return z

    @gluon.jit
    def _self_rows(h, w1, b1, w2, b2, b, alpha, out_layout: gl.constexpr, ACT: gl.constexpr):
        """``alpha sum_j b[n, j] (g h)[j]`` of the CTA's rows, g = sigmoid(W2 act(W1 h + b1) + b2)."""
        hz = gl.convert_layout(h, gl.SliceLayout(0, w1.type.layout))
        z = gate_act_gl(gl.sum(w1 * gl.expand_dims(hz, 0), axis=1) + b1, ACT)
        zz = gl.convert_layout(z, gl.SliceLayout(0, w2.type.layout))
        u = gl.sum(w2 * gl.expand_dims(zz, 0), axis=1) + b2
        gh = gl.convert_layout(h, u.type.layout) / (1.0 + gl.exp(-u))
        ghb = gl.convert_layout(gh, gl.SliceLayout(0, b.type.layout))
        return gl.convert_layout(gl.sum(b.to(gl.float32) * gl.expand_dims(ghb, 0), axis=1) * alpha, out_layout)

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
        if not ec_ok(config):
            raise ValueError(f"w4a16_gemv_tma: the EC epilogue needs SPLIT 1 (no K-split), not config {config}")
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


class EcSelf:
    """The one-launch decode EC's operands for the TMA kernel (``ec_self.py``): ``ec = (A, B, W1, b1, W2,
    b2, alpha)`` of one EC (no concatenation's row offsets), the gate activation ``act``; the kernel's
    CTAs compute h's pieces themselves and each gates for itself. ``publish`` (tests): off, no CTA publishes
    its own pieces, so every CTA takes the path that computes missing ones itself (the same result)."""

    self = True

    def __init__(self, ec: tuple, act: str = "silu", publish: bool = True):
        self.a, self.b, self.w1, self.b1, self.w2, self.b2, self.alpha = ec
        self.act, self.publish = ACT_CODES[act], bool(publish)

    def plan(self, rows: int, warps: int):
        """The piece plan for ``rows`` CTAs of ``warps`` warps (``ec_self.self_plan``), or None."""
        return self_plan(self.a.shape[0], self.a.shape[1], rows, 32 * warps, _es.sm_count(self.a.device))

    def workspace(self, rows: int, warps: int):
        return self_workspace(self.a, rows, self.plan(rows, warps))

    def check(self, N: int, K: int, config: tuple, rows: int, x2: torch.Tensor) -> None:
        if not ec_ok(config):
            raise ValueError(f"w4a16_gemv_tma: the EC epilogue needs SPLIT 1 (no K-split), not config {config}")
        R = self.a.shape[0]
        if tuple(self.b.shape) != (N, R) or not self.b.is_contiguous():
            raise ValueError(f"w4a16_gemv_tma: EC B {tuple(self.b.shape)} must be a contiguous [{N}, {R}] matrix")
        D = self.w1.shape[0]
        if (tuple(self.w1.shape) != (D, R) or tuple(self.w2.shape) != (R, D) or tuple(self.b1.shape) != (D,)
                or tuple(self.b2.shape) != (R,) or not (self.w1.is_contiguous() and self.w2.is_contiguous())):
            raise ValueError(f"w4a16_gemv_tma: EC gate W1 {tuple(self.w1.shape)}, b1 {tuple(self.b1.shape)}, W2 "
                             f"{tuple(self.w2.shape)}, b2 {tuple(self.b2.shape)} do not make an MLP on {R} values")
        if self.alpha.numel() != 1:
            raise ValueError(f"w4a16_gemv_tma: EC alpha has {self.alpha.numel()} elements, expected 1")
        check_self_operands(self.a, K, x2)
        if self.plan(rows, config[0]) is None:
            raise ValueError(f"w4a16_gemv_tma: the one-launch EC's pieces of A {tuple(self.a.shape)} do not fit "
                             f"{rows} CTAs of {config[0]} warps (ec_self.self_plan): use the two-launch pair")


EC_RC_MAX = 64  # the most EC columns per row the epilogue takes (its [BN, RC] operands live in registers)


def can_implement(p, config: tuple, norm: bool = False, rc: Optional[int] = None) -> tuple:
    """(ok, reason) of whether the TMA GEMV in ``config`` adds a decode EC of ``rc`` columns per row (None: not
    known) in its epilogue for problem ``p`` (a ``lowering.problem.Problem``): at most EC_RC_MAX columns, PDL
    runs here (sm_90+), the config has no K-split, and with ``norm`` it stages x in shared memory."""
    if rc is not None and rc > EC_RC_MAX:
        return False, f"EC rank {rc} > {EC_RC_MAX} columns per row"
    if not _device.pdl(p.device):
        return False, "no PDL here (needs sm_90+)"
    if not ec_ok(config):
        return False, f"TMA config {list(config)} has a K-split"
    if norm and not norm_ok(config):
        return False, f"TMA config {list(config)} does not stage x in shared memory without a K-split (RMSNorm)"
    return True, f"the TMA GEMV {list(config)} adds the EC in its epilogue"
