"""The decode EC in one launch: the GEMV's own CTAs compute ``h = A x`` in pieces and publish them tagged.

Reference: ``ops/ec_ref.py:ec_linear_ref``.

Why: the decode EC's two-launch form (the producer grid, then the GEMV launched behind it with PDL,
``ec_decode_triton.py``) pays the dependent launch - the GEMV starts 1.7-2.2 us after the producer
(docs/kernels.md), 1.2-1.4x the W4 GEMV on four of the five issue shapes. The earlier
single launches lost for other reasons: extra producer programs scheduled after or beside the GEMV's own, one hot counter every program hit twice, and a last producer whose gate
everyone waited for. Here no program is extra, and the one shared counter (a ticket) is never polled or
reset:

* **Pieces.** ``h = A x`` is cut into ``NP = R * NC`` pieces, piece ``p`` = row ``p // NC`` of A times
  x over the ``p % NC``-th chunk of ``PW`` columns. The first ``OWNERS`` programs *to start* (all of
  them, or as many as the GPU has SMs if the grid is larger) compute pieces ``role, role + OWNERS, ...``
  (``PPC`` of them) right after requesting their first weight tile - A's bytes are spread over the
  programs and their latency overlaps the weight stream's. Roles come from a ticket (one relaxed
  64-bit atomic per program, never reset): ticket ``t`` gives role ``t % grid`` and launch index ``t //
  grid``. An owner is a program that is running, so nothing waits on a program the GPU has not
  scheduled.
* **Tags, not counters.** A piece is published as one 64-bit word: its fp32 value in the low half, the
  launch's tag (launch index + 1, mod 2^31) in the high half. A reader knows a slot is this launch's by
  its tag alone; no flag, no counter to reset, no fence between value and flag. (A stale slot carries
  the previous launch's tag, never this one's.)
* **Every program gates for itself.** After its K loop a program reads the ``R x NC`` slots (one L2
  round trip, 2-6 KB), sums each row over its chunks in a fixed order (deterministic), applies the
  gate MLP (operands loaded before the loop) and adds ``alpha B (g h)`` to its rows.
* **No deadlock, whatever happens.** A program waits for others only after its own pieces are out, only
  for pieces of programs already running, and only ``SPIN`` re-reads (backing off); then it computes
  every piece itself (reading all of A: the rare path) with the same code (same shape, so the same bits)
  and publishes them too - an idempotent write. Triton's interpreter (programs run one after another,
  ``SPIN = 0``) exercises this path on the CPU.

Measured (H200, docs/kernels.md): the dependent launch is gone, but the one launch's own
operands, pieces and tail cost 1.1-2.4 us, so it beats the pairs by 0.1-0.9 us on three of the five issue
shapes (11008x4096 12.8 vs 13.7 us) and loses on the other two; the lab decides per shape.

Host side: ``self_plan`` picks the piece width and checks that a program's pieces fit in registers;
``self_workspace`` holds each site's ticket and slots (keyed by A's storage, the grid and the plan: the
launch index needs every launch on a ticket to have the same grid, and sites never share one).
Assumption: launches of one site never overlap - one stream, and no programmatic dependent launch of
the one-launch GEMV - or their tickets would interleave and a program could read another launch's
pieces. (A site is one EC on one stream, as decode runs it; the pair, ``ec_decode_triton.py``, has no
such state.)
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch

from . import device as _device
from ._triton import HAS_TRITON, INTERPRET, next_pow2
from .layout_cache import outside_pools

SPIN = 0 if INTERPRET else 4096  # re-reads of the slots before a program computes the pieces itself
MAX_SLOTS = 1024  # R * NC: what every program reads after its loop (8 KB at most)
PIECE_WIDTHS = (256, 512, 1024, 2048, 4096)


class SelfPlan(NamedTuple):
    """Pieces of ``h = A x`` for a launch: ``PW`` columns per piece, ``NC`` chunks per row of A, ``NP = R
    NC`` pieces over the first ``OWNERS`` programs, ``PPC_P`` (a power of two) each, ``NC_P`` =
    next_pow2(NC)."""

    pw: int
    nc: int
    np: int
    ppc_p: int
    nc_p: int
    owners: int


def self_plan(R: int, K: int, grid: int, threads: int, sms: Optional[int] = None,
              max_per_thread: int = 32) -> Optional[SelfPlan]:
    """The plan with the fewest slots among those whose ``PPC_P x PW`` elements of A (and as many of x)
    stay within ``max_per_thread`` per thread of a ``threads``-thread program, the pieces owned by the
    first min(grid, ``sms``) programs; None if none does (the shape's A is too large for its owners: the
    two-launch pair runs instead). Cached: the decode dispatch and the wrappers ask it on every call."""
    return _plan(R, K, grid, threads, sms, max_per_thread, INTERPRET)


@functools.lru_cache(maxsize=None)
def _plan(R: int, K: int, grid: int, threads: int, sms: Optional[int], max_per_thread: int,
          interpret: bool) -> Optional[SelfPlan]:
    owners = min(grid, sms or grid)
    best = None
    for pw in PIECE_WIDTHS:
        nc = -(-K // pw)
        np_ = R * nc
        ppc_p = next_pow2(-(-np_ // owners))
        if np_ > MAX_SLOTS or ppc_p * pw > max_per_thread * threads:
            continue
        if best is None or np_ < best.np:
            best = SelfPlan(pw, nc, np_, ppc_p, next_pow2(nc), owners)
        if interpret:  # the interpreter's cost is elementwise work: the narrowest piece that fits
            break
    return best


def slot_rows(r_p: int, warps: int, nc_p: int) -> int:
    """Rows T of the [T, NC_P] slot read in ``ec_collect``: at least R_P, and at least what a blocked layout of
    the CTA's threads covers along the rows - 32 / (threads along a row) per warp, where a row of NC_P 8-byte
    slots takes at most NC_P threads (or NC_P / 2 with 16-byte vectors) - so no thread holds a replicated copy.
    (T = the CTA's threads also works, with T / R_P copies of every slot in registers: up to 732 bytes of
    spills at NC_P = 64.)"""
    return max(r_p, warps * max(1, 64 // nc_p))


def sm_count(device: torch.device) -> Optional[int]:
    """SMs of a CUDA device (None elsewhere): how many programs own pieces (``self_plan``)."""
    if device.type != "cuda" or INTERPRET:
        return None
    return _device.sm_count(device)


_WORKSPACES: dict = {}


def site_workspace(store: dict, A: torch.Tensor, geometry: tuple, make, what: str) -> tuple:
    """``make()`` (zeroed tensors: a ticket and its flags or slots) for one EC site, cached in ``store`` under
    A's storage and the launch ``geometry`` while A lives (a ticket's launch index needs one grid size, and
    sites never share one); made outside CUDA-graph capture (the caller's first run), else a RuntimeError
    naming ``what``. Shared by the one-launch decode EC and the in-launch prefill EC (``ec_gemm_self.py``)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    key = (A.untyped_storage().data_ptr(), A.storage_offset(), str(A.device)) + tuple(geometry)
    hit = store.get(key)
    if hit is not None and not hit[0].expired():
        return hit[1]
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"{what}'s workspace (A {tuple(A.shape)}, geometry {tuple(geometry)}) is made on first use, "
                           "and this first use is inside a CUDA graph capture: run the model once first")
    for k in [k for k, v in store.items() if v[0].expired()]:
        del store[k]
    ws = outside_pools(make)
    store[key] = (StorageWeakRef(A.untyped_storage()), ws)
    return ws


def self_workspace(A: torch.Tensor, grid: int, plan: SelfPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """(ticket int64 [1], slots int64 [NP]) of one EC site, zeroed when made (tags start at 1)
    (``site_workspace``, keyed by the grid and the plan)."""
    return site_workspace(_WORKSPACES, A, (grid, plan), lambda: (
        torch.zeros(1, dtype=torch.int64, device=A.device), torch.zeros(plan.np, dtype=torch.int64, device=A.device)),
        "the one-launch decode EC")


def check_self_operands(A: torch.Tensor, K: int, x2: torch.Tensor) -> None:
    """The pieces read A as dense rows of K values and x as K contiguous values."""
    if A.dim() != 2 or A.shape[1] != K or A.stride() != (K, 1):
        raise ValueError(f"one-launch decode EC: A {tuple(A.shape)} stride {A.stride()} must be a contiguous [R, {K}]")
    if x2.shape != (1, K) or x2.stride(-1) != 1:
        raise ValueError(f"one-launch decode EC: x {tuple(x2.shape)} must be one contiguous row of {K}")


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def ec_ticket(TICKET):
        """(tag, role): this launch's tag (launch index + 1, mod 2^31) and the program's role (the order
        in which it started), from its ticket - one relaxed atomic on the site's int64 counter."""
        t = tl.atomic_add(TICKET, 1, sem="relaxed")
        grid = tl.num_programs(0)
        return ((t // grid + 1) & 0x7FFFFFFF).to(tl.int32), (t % grid).to(tl.int32)

    @triton.jit
    def ec_pieces(A, X, K, NC, p, mask_p, PW: tl.constexpr):
        """Values (fp32) of pieces ``p`` [PPC_P]: row p // NC of A times x over chunk p % NC."""
        offs = (p % NC)[:, None] * PW + tl.arange(0, PW)[None, :]
        m = mask_p[:, None] & (offs < K)
        a = tl.load(A + (p // NC)[:, None] * K + offs, mask=m, other=0.0).to(tl.float32)
        xv = tl.load(X + offs, mask=m, other=0.0).to(tl.float32)
        return tl.sum(a * xv, axis=1)

    @triton.jit
    def ec_publish(SLOTS, p, mask_p, v, tag):
        """Slots ``p`` := (tag << 32) | bits(v): value and tag in one 64-bit store."""
        bits = v.to(tl.int32, bitcast=True).to(tl.uint32, bitcast=True).to(tl.int64)
        tl.store(SLOTS + p, bits | (tag.to(tl.int64) << 32), mask=mask_p)

    @triton.jit
    def ec_produce_own(SLOTS, A, X, K, R, NC, OWNERS, role, tag, PW: tl.constexpr, PPC_P: tl.constexpr):
        """The pieces of role ``role`` (``role + i OWNERS``; none unless role < OWNERS), published under
        ``tag``."""
        p = role + tl.arange(0, PPC_P) * OWNERS
        mp = (p < R * NC) & (role < OWNERS)
        ec_publish(SLOTS, p, mp, ec_pieces(A, X, K, NC, p, mp, PW), tag)

    @triton.jit
    def _slots_missing(v, m, tag):
        return tl.sum(tl.where(m & ((v >> 32).to(tl.int32) != tag), 1, 0))

    @triton.jit
    def ec_collect(SLOTS, A, X, K, R, NC, tag, PW: tl.constexpr, PPC_P: tl.constexpr, R_P: tl.constexpr,
                   NC_P: tl.constexpr, SPIN: tl.constexpr, T: tl.constexpr):
        """h [R_P] (fp32; rows >= R zero) from this launch's slots: re-read (backing off) up to SPIN times
        while some are missing, then compute and publish every piece here (``ec_pieces``, the same shape as
        their owners', so the same bits), and sum each row over its chunks in a fixed order.

        The slots are read as [T, NC_P], row i holding A-row i % R_P, with T from ``slot_rows``: a tensor at
        least as large as the CTA's threads cover along each dimension is held without replicated copies, so
        every thread's loaded words are counted by ``missing`` (a CPU test checks the compiled layouts). Read as
        [R_P, NC_P] with fewer elements than threads, two threads would each load a copy of the same slot,
        the count would see one of them and the gate could use the other, stale one - the race an earlier version
        found in the Gluon form (docs/kernels.md). h is the max over the T // R_P copies of each row,
        which all hold this launch's bits once nothing is missing. The fallback computes every piece (not
        only those its own copy saw missing, which another thread's copy could contradict)."""
        offs_t = tl.arange(0, T)
        offs_r = offs_t % R_P
        offs_c = tl.arange(0, NC_P)
        m = (offs_r < R)[:, None] & (offs_c < NC)[None, :]
        idx = offs_r[:, None] * NC + offs_c[None, :]
        v = tl.load(SLOTS + idx, mask=m, other=0, volatile=True)
        missing = _slots_missing(v, m, tag)
        it = 0
        ns = 32
        while (missing > 0) & (it < SPIN):  # (SPIN = 0 in the interpreter, which has no inline PTX)
            # back off exponentially (32 to 512 ns): many programs re-reading the same lines in a tight loop
            # would compete with the owners' stores to them
            tl.inline_asm_elementwise("nanosleep.u32 $1; mov.u32 $0, 0;", "=r,r", [ns], dtype=tl.int32,
                                      is_pure=False, pack=1)
            v = tl.load(SLOTS + idx, mask=m, other=0, volatile=True)
            missing = _slots_missing(v, m, tag)
            ns = tl.minimum(ns * 2, 512)
            it += 1
        if missing > 0:
            NP = R * NC
            for g in range(0, NP, PPC_P):
                p = g + tl.arange(0, PPC_P)
                mp = p < NP
                ec_publish(SLOTS, p, mp, ec_pieces(A, X, K, NC, p, mp, PW), tag)
            tl.debug_barrier()  # this program's own stores are visible to all its threads
            v = tl.load(SLOTS + idx, mask=m, other=0, volatile=True)
        vals = v.to(tl.int32).to(tl.float32, bitcast=True)
        rows = tl.sum(tl.where(m, vals, 0.0), axis=1)  # [T]: T // R_P equal copies of each row's sum
        return tl.max(tl.reshape(rows, [T // R_P, R_P]), axis=0)


def can_implement(p, R: int, grid: int, warps: int) -> tuple:
    """(ok, reason) of whether the one-launch EC's pieces of A [R, K] fit ``grid`` programs of ``warps`` warps on
    problem ``p``'s device (``self_plan``; ``p`` a ``lowering.problem.Problem``)."""
    if self_plan(R, p.K, grid, 32 * warps, sm_count(p.device)) is None:
        return False, f"its pieces of A [{R}, {p.K}] do not fit {grid} programs of {warps} warps"
    return True, f"A [{R}, {p.K}] in pieces over {grid} programs"
