"""The prefill EC inside the register-operand GEMM's own launch: shrink roles ("in_gemm_self").

Reference: ``ops/ec_ref.py:ec_linear_ref``.

Why: the "in_gemm" structure (``dispatch/cuda.py:_ec_in_gemm``) adds ``alpha g h`` B^T to the register-operand GEMM
(``w4a16_gemm_wgmma_ra.py``) as one more K step, but its shrink ``h = x A^T`` (cuBLAS: [M, K] x [K, r] has
few output tiles) and gate run before the GEMM, serially: 10-15 us of 43-240 (docs/kernels.md, session
H200). Nothing overlapped them - neither a PDL-launched GEMM behind a split-K shrink nor the side
stream. Here the GEMM's launch has ``num_m * split`` more CTAs, ``split`` per block of BMX rows of x, whose
*role* is the shrink and gate of BMX / split of that block's tokens; the GEMM tiles wait for their block's
``alpha g h`` only before their last (EC) K step. A shrink role's K loop is one [64, BMX / split, 64] wgmma per
step from its own TMA-fed x box, with no weight expansion.
* **Split** (``self_split``): with one role per block (split 1) the role streams the block's BMX x
  rows and A's 64 rows per K step through one SM - more bytes than a tile - so where the grid is one wave the
  tiles waited for it (8192^2 M = 256 on the 4-warp tile: 89 us against the GEMM's 58). Split 2-4 roles per
  block, as many as fit beside the tiles in the first wave, end well before the tiles (59.7 us there); where
  the tiles fill a wave or more, one role per block starts first and is hidden (extra roles would push tiles
  into another wave).

* **Roles by ticket** (as ``ec_self.py``; the Gluon ticket ``w4a16_gemv_tma_ec._self_ticket``): every CTA
  takes one relaxed atomic on the site's ticket; ticket ``t`` gives the launch's tag ``t // grid + 1`` and
  the role ``t % grid``. Roles below ``num_m * split`` are shrink roles (block ``role // split``, part
  ``role % split``); the others are GEMM tiles (``role - num_m * split``, in the kernel's usual order). A
  shrink role is held by a CTA that started before every GEMM tile CTA, so a tile never waits for a CTA the
  GPU has not scheduled (the H200 does not dispatch a grid in program-id order) and there is no
  deadlock whatever the residency - given one stream per site (below). Should that assumption break (two streams on one site, tickets out of step), a tile would
  wait for a tag that never comes: it gives up after SPIN_MAX polls (seconds) with ``trap``, so the launch
  fails with a CUDA error instead of hanging.
* **Publish**: the shrink role stores ``alpha g h`` [BMX / split, R_P] (bf16, rows < M) with generic stores,
  then - after a CTA barrier - one release store of the tag into its own flag (``FLAGS[role]``). A tile spins
  on an acquire read of each of its block's ``split`` flags (backing off with ``nanosleep``) and reads the
  rows with generic loads into the shared tile its EC step multiplies. No reset: a flag only ever holds an
  older launch's tag or this one's.
* **The gate** runs one token per thread: h (fp32, the MMA's accumulator) goes through the idle ring's
  shared memory into a layout where each thread holds all 64 values of its token (rows >= R are zero), so
  both gate layers are per-thread FMAs on weights staged in shared memory (no cross-thread reduction);
  fp32 as the reference.
* **Gate widths.** The kernel takes gates up to D_MAX = 16 wide (one loop over ``d < D`` for every width);
  the GPU tests have run widths 5, 8 (SPEAR's default) and 16, so the dispatch routes
  every width up to 16 here.

Measured (H200, docs/kernels.md): 4096^2 M = 1024 53-54 us against the register-operand GEMM's
51-52 alone and "in_gemm"'s 61; with split roles, kernels.py M = 256 / 1024 on the five issue shapes:
EC64 / W4 within 1.10x on 8 of 10 cells in each of three runs; 4096^2 M = 256 missed (1.18-1.27x: the roles' K
loop); with the deeper role ring (each role's ring STAGES x split deep): that cell 1.05x, and 10 of 10 cells within 1.10x in
both runs. The first version loaded the gate's weights from global memory row by row (2-byte scalars, ~60 us per
gate); they are staged in shared memory now.

Assumption (as ``ec_self.py``): launches of one site never overlap (one stream), or their tickets would
interleave. The workspace (ticket, flags) is per site and geometry, made on first use outside graph capture (a
prefill of a new length makes one more: 8 + 4 num_m split bytes).
Gluon kernels do not run in Triton's interpreter: the CPU tests compile this for sm_90 offline; the GPU
tests (``tests/lowering/test_gemm_wgmma.py``) check it against the reference.
"""
from __future__ import annotations

from typing import Optional

import torch

from .w4a16_gemm_wgmma import HAS_WGMMA
from .ec_self import site_workspace

R_SHRINK = 64  # rows of the shrink MMA (one warpgroup's M): ranks up to 64 take this structure
D_MAX = 16  # gate widths up to this take it (the first layer's outputs are kept in the A ring: 16 x BMX fp32)
SPIN_MAX = 1 << 22  # polls of a block's flag (each <= ~1 us) before a tile traps
SPLITS = (1, 2, 4)  # shrink roles per x block (each BMX / split tokens)
# A role's ring is STAGES x split deep (its x slots are 1 / split of the tile ring's, so the ring has room; its A ring
# and barriers grow), where the shared memory allows. Why: a role's K loop is latency-bound like a tile's (a step per
# ~(TMA latency / slots in flight), whatever its bytes), so with as many steps as a tile it ends no earlier - on the
# 64 x 128 tile at 4096^2 M = 256 the roles took ~27 us against the tiles' 24. Measured
# that cell 30.6 -> 25.8 us (its GEMM 24.5); where the roles were already hidden, unchanged. (The launch
# wrapper, ``w4a16_gemm_wgmma_ra._launch``, deepens it whenever the config's shared memory allows.)

if HAS_WGMMA:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)

    from .w4a16_gemm_wgmma import _BK
    from .w4a16_gemv_tma_ec import gate_act_gl

    _D_MAX = gl.constexpr(D_MAX)
    _SPIN_MAX = gl.constexpr(SPIN_MAX)

    @gluon.jit
    def _shrink_request(x_desc, a_desc, bar, xs_slot, as_slot, off_m, k, pred):
        mbarrier.expect(bar, x_desc.block_type.nbytes + a_desc.block_type.nbytes, pred=pred)
        tma.async_copy_global_to_shared(x_desc, [off_m, k * _BK], bar, xs_slot, pred=pred)
        tma.async_copy_global_to_shared(a_desc, [0, k * _BK], bar, as_slot, pred=pred)

    @gluon.jit
    def ec_shrink_role(xr_desc, a_desc, xs, as_, w1s, w2s, rbars, role, M, K, W1, B1, W2, B2, ALPHA, HG, FLAGS, tag,
                       R, D,
                       RP_HG: gl.constexpr, STAGES: gl.constexpr, WARPS: gl.constexpr, ACT: gl.constexpr,
                       SPLIT: gl.constexpr = 1):
        """Shrink role ``role``: part ``role % SPLIT`` (BXS = BMX / SPLIT tokens, ``xr_desc``'s box) of x block
        ``role // SPLIT``: h^T = A x^T [64, BXS] by wgmma over K (A padded to 64 rows with zeros on the host), the
        gate per token (its weights staged in ``w1s`` / ``w2s``, fp32 [64, D_MAX]), ``alpha g h`` stored into HG
        [M, RP_HG] (bf16), then the part's flag (``FLAGS[role]``) := tag. The role's ring has NS slots (``as_``'s
        first dimension, with one barrier each in ``rbars``): STAGES, or STAGES x SPLIT where the shared memory
        allows; its x slots are the tile ring ``xs`` ([STAGES, BMX, BK]) taken as [STAGES SPLIT, BXS, BK] (same
        128-byte swizzle), of which it uses the first NS."""
        BMX: gl.constexpr = xs.type.shape[1]
        BXS: gl.constexpr = xr_desc.block_type.shape[0]
        gl.static_assert(BXS * SPLIT == BMX, "the shrink role's x box must be the tile's x rows / SPLIT")
        RS: gl.constexpr = a_desc.block_type.shape[0]
        WN: gl.constexpr = WARPS // 4
        NS: gl.constexpr = as_.type.shape[0]
        gl.static_assert(NS <= STAGES * SPLIT, "the role's ring must fit in the tile's x ring")
        xq = xs._reinterpret(gl.bfloat16, [STAGES * SPLIT, BXS, _BK], xr_desc.layout)
        off_m = (role // SPLIT) * BMX + (role % SPLIT) * BXS
        KT = K // _BK
        for i in gl.static_range(NS):
            _shrink_request(xr_desc, a_desc, rbars.index(i), xq.index(i), as_.index(i), off_m, i, i < KT)
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WN],
                                                      instr_shape=[16, BXS // WN, 16])
        acc = gl.zeros([RS, BXS], gl.float32, layout=mma)
        for i in range(KT):
            slot = i % NS
            mbarrier.wait(rbars.index(slot), (i // NS) & 1)
            acc = warpgroup_mma(as_.index(slot), xq.index(slot).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))  # step i - 1's MMA is done ...
            gl.thread_barrier()  # ... in both warpgroups: its slot can be refilled
            prev = gl.maximum(i - 1, 0)
            nt = prev + NS
            ps = prev % NS
            _shrink_request(xr_desc, a_desc, rbars.index(ps), xq.index(ps), as_.index(ps), off_m, nt,
                            (i > 0) & (nt < KT))
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        gl.thread_barrier()  # every MMA has read its ring slots: the ring's memory holds h^T now
        hs = xs._reinterpret(gl.float32, [RS, BXS], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
        hs.store(acc)
        gl.thread_barrier()
        tok: gl.constexpr = gl.BlockedLayout([RS, 1], [1, 32], [1, WARPS], [0, 1])  # a token per thread
        lr: gl.constexpr = gl.SliceLayout(1, tok)
        lt: gl.constexpr = gl.SliceLayout(0, tok)
        offs_r = gl.arange(0, RS, layout=lr)
        mask_r = offs_r < R
        # The gate's weights go to shared memory once, [r, d] with r contiguous: each row of a layer is then a
        # few vector loads that every thread reads at the same address. (Loaded from global memory per row,
        # 2-byte scalars at an unknown alignment, the gate took ~60 us on an H200.)
        lw: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [WARPS, 1], [0, 1])
        wr = gl.arange(0, RS, layout=gl.SliceLayout(1, lw))
        wd = gl.arange(0, _D_MAX, layout=gl.SliceLayout(0, lw))
        wm = gl.expand_dims(wr < R, 1) & gl.expand_dims(wd < D, 0)
        w1s.store(gl.load(W1 + gl.expand_dims(wd, 0) * R + gl.expand_dims(wr, 1), mask=wm, other=0.0).to(gl.float32))
        w2s.store(gl.load(W2 + gl.expand_dims(wr, 1) * D + gl.expand_dims(wd, 0), mask=wm, other=0.0).to(gl.float32))
        # first layer: u_d = act(W1[d] . h + b1[d]) per token, kept in the idle A ring ([D_MAX, BMX] fp32), so
        # h and z are never live together (the per-thread rows are 64 registers each)
        us = as_._reinterpret(gl.float32, [_D_MAX, BXS], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
        gl.thread_barrier()
        h = hs.load(tok)
        for d in gl.static_range(_D_MAX):  # (unrolled: a shared-memory row's slice needs a constant start)
            if d < D:
                w1d = w1s.slice(d, 1, dim=1).load(tok)  # [RS, 1]
                u = gate_act_gl(gl.sum(h * w1d, axis=0) + gl.load(B1 + d).to(gl.float32), ACT)
                us.slice(d, 1).store(gl.expand_dims(u, 0))
        gl.thread_barrier()
        # second layer: z = W2 u + b2, then alpha g h with h read back
        z2 = gl.zeros([RS, BXS], gl.float32, layout=tok)
        for d in gl.static_range(_D_MAX):
            if d < D:
                z2 += w2s.slice(d, 1, dim=1).load(tok) * us.slice(d, 1).load(tok)
        z2 += gl.expand_dims(gl.load(B2 + offs_r, mask=mask_r, other=0.0).to(gl.float32), 1)
        hg = hs.load(tok) / (1.0 + gl.exp(-z2)) * gl.load(ALPHA).to(gl.float32)
        offs_t = off_m + gl.arange(0, BXS, layout=lt)
        m2 = gl.expand_dims(offs_r < RP_HG, 1) & gl.expand_dims(offs_t < M, 0)
        gl.store(HG + gl.expand_dims(offs_t, 0) * RP_HG + gl.expand_dims(offs_r, 1), hg.to(gl.bfloat16), mask=m2)
        gl.thread_barrier()  # every thread's rows are written before the (cumulative) release below
        gl.atomic_xchg(FLAGS + role, tag, sem="release")

    @gluon.jit
    def _wait_flag(flag, tag):
        """Spin until ``*flag == tag`` (acquire; 32 ns to 1 us back-off; after SPIN_MAX polls ``trap``: the
        one-stream assumption broke)."""
        f = gl.atomic_add(flag, 0, sem="acquire")
        ns = 32
        polls = 0
        while f != tag:
            gl.inline_asm_elementwise("nanosleep.u32 $1; mov.u32 $0, 0;", "=r,r", [ns], dtype=gl.int32,
                                      is_pure=False, pack=1)
            f = gl.atomic_add(flag, 0, sem="acquire")
            ns = gl.minimum(ns * 2, 1024)
            polls += 1
            if polls > _SPIN_MAX:
                gl.inline_asm_elementwise("trap; mov.u32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def ec_wait_hg(HG, FLAGS, hgs, m_blk, M, tag, WARPS: gl.constexpr, SPLIT: gl.constexpr = 1):
        """This launch's ``alpha g h`` of block ``m_blk`` into the shared tile ``hgs`` [BMX, RP_HG], once the
        block's SPLIT shrink roles have published their parts (each its own flag, ``_wait_flag``)."""
        BMX: gl.constexpr = hgs.type.shape[0]
        RP: gl.constexpr = hgs.type.shape[1]
        for p in gl.static_range(SPLIT):
            _wait_flag(FLAGS + m_blk * SPLIT + p, tag)
        lh: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (RP // 8), RP // 8], [WARPS, 1], [1, 0])
        rows = m_blk * BMX + gl.arange(0, BMX, layout=gl.SliceLayout(1, lh))
        cols = gl.arange(0, RP, layout=gl.SliceLayout(0, lh))
        v = gl.load(HG + gl.expand_dims(rows, 1) * RP + gl.expand_dims(cols, 0),
                    mask=gl.expand_dims(rows < M, 1), other=0.0, cache_modifier=".cg")
        hgs.store(v)


_WORKSPACES: dict = {}


def self_workspace(A: torch.Tensor, grid: int, roles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ticket int64 [1], flags int32 [roles]) of one EC site and launch geometry, zeroed when made (tags
    start at 1): ``ec_self.site_workspace``, keyed by the grid and the number of shrink roles (x blocks x
    split), one flag per role."""

    return site_workspace(_WORKSPACES, A, (grid, roles), lambda: (
        torch.zeros(1, dtype=torch.int64, device=A.device), torch.zeros(roles, dtype=torch.int32, device=A.device)),
        "the in-launch prefill EC")


def split_ok(split: int, bmx: int) -> bool:
    """Whether ``split`` roles per block of ``bmx`` x rows is a valid geometry: one of ``SPLITS``, each role at least
    64 tokens (its TMA box and MMA width)."""
    return split in SPLITS and bmx % split == 0 and bmx // split >= 64


def self_split(tiles: int, num_m: int, bmx: int, sms: int) -> int:
    """Shrink roles per x block: the largest of ``SPLITS`` (each role at least 64 tokens) whose roles fit in the
    first wave beside the ``tiles`` output tiles (one CTA per SM: these configs' shared memory allows no more),
    else 1. Why: one role per block streams the block's x rows *and* A each K step - more bytes per step than a
    tile, so where the grid is one wave the tiles wait for it (8192^2 M = 256, 4-warp tile: 1.5x the GEMM,
    H200); split over tokens, a role streams A and BMX / split rows. Where the tiles fill a wave or more,
    the roles start first and the tiles' first wave hides them, and extra roles would push tiles into a
    later wave."""
    split = 1
    for s in SPLITS:
        if split_ok(s, bmx) and tiles + num_m * s <= sms:
            split = s
    return split


def self_takes(A: torch.Tensor, B: torch.Tensor, W1: torch.Tensor, K: int) -> Optional[str]:
    """Why the in-launch structure cannot take this EC (None if it can): A must be a bf16 [R <= 64, K]
    contiguous tensor (TMA-read in [64, 64] boxes), B bf16, the gate at most D_MAX wide."""
    if A.dtype != torch.bfloat16 or B.dtype != torch.bfloat16:
        return f"A {A.dtype} / B {B.dtype} (needs bf16)"
    if W1.dim() != 2 or W1.shape[0] > D_MAX:
        return f"gate W1 {tuple(W1.shape)} (needs at most {D_MAX} hidden units)"
    if A.dim() != 2 or A.shape[0] > R_SHRINK or A.shape[1] != K or not A.is_contiguous():
        return f"A {tuple(A.shape)} (needs a contiguous [R <= {R_SHRINK}, K = {K}])"
    return None


def can_implement(p) -> tuple:
    """(ok, reason) of whether the in-launch shrink roles take problem ``p``'s EC (a ``lowering.problem.Problem``;
    ``self_takes`` on its facts, B being padded to bf16 by the dispatch): bf16 A, a gate at most D_MAX wide,
    a contiguous A [R <= R_SHRINK, K]. (The host GEMM's own constraints: ``w4a16_gemm_wgmma_ra.can_implement``.)"""
    a_dtype = p.ec_dtypes[0] if p.ec_dtypes else torch.bfloat16
    if a_dtype != torch.bfloat16:
        return False, f"A {a_dtype} (needs bf16)"
    if p.gate_width is not None and p.gate_width > D_MAX:
        return False, f"gate of {p.gate_width} hidden units (needs at most {D_MAX})"
    if p.rank > R_SHRINK or not p.a_contiguous:
        return False, f"A [{p.rank}, K] (needs a contiguous [R <= {R_SHRINK}, K])"
    return True, f"A [{p.rank}, K] bf16 contiguous, gate of at most {D_MAX}"
