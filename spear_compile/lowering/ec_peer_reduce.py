"""Row-parallel EC linear without a collective: a GEMV whose epilogue writes its partial into every peer's
staging buffer, and a post kernel that sums the partials and applies the gate on the reduced ``A x``.

Reference: ``ops/peer_reduce_ref.py`` (``ec_partial_ref``, ``peer_sum_ref``, ``ec_reduced_apply_ref``).

Rank ``i`` of ``W`` computes the stacked partial ``[y_i | h_i] = [Q(W_i) x_i | A_i x_i]`` (``N + r`` fp32
columns per row) in ``T = cdiv(N, BLOCK_N) + cdiv(r, BLOCK_N)`` column tiles, one program each
(``_ec_partial_store_kernel``), and stores each tile into slot ``i`` of every rank's staging buffer
``[W, M_CAP, N + r]`` (its own included), with P2P stores into the peers' symmetric memory
(``torch.distributed._symmetric_memory``). ``_ec_peer_post_kernel`` then runs one program per y tile: it
sums its tile over the ``W`` slots in rank order (every rank computes bit-identical outputs), sums the
``h`` columns the same way, runs the gate MLP on that global ``h`` and writes
``y + bias + alpha * B (g * h)`` in the activation dtype. No NCCL call; NVLink multicast stays off
(``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``): P2P only.

Signal pad (int32 per rank, itself symmetric memory): ``ready[src, t]`` (``W * T``), ``free[dst, t]``
(``W * T``), ``hdone``, ``err``. Every flag returns to its initial value (ready 0, free 1, hdone 0) by the
end of each call, so the same launches replay under a CUDA graph:

* a writer program ``t`` on rank ``i`` takes ``free[q, t]`` (compare-and-swap 1 -> 0: rank ``q`` finished
  reading tile ``t`` of the previous call from slot ``i``), stores its tile into ``q``'s slot ``i``, and sets
  ``q``'s ``ready[i, t] = 1`` (release, system scope);
* a post program ``t`` on rank ``q`` takes ``ready[src, t]`` (1 -> 0) of its own y tile for every ``src``, and
  waits to see every ``src``'s h tiles; after its loads it hands ``free[q, t]`` back to every ``src``; the last
  post program to finish (``hdone`` counter, which it resets) resets the h tiles' ``ready`` and hands their
  ``free`` back.

A wait that spins ``max_spin`` times without its flag writes ``1 + the rank it waited for`` into ``err``
and goes on (a wrong result, never a hang); ``PeerStaging.check()`` raises ``PeerTimeoutError`` naming that
rank. On CPU under ``TRITON_INTERPRET=1`` the tests emulate the peers (``PeerStaging.emulated``: plain
tensors standing in for the peers' buffers and signal pads; the ranks' launches run one after another).
World size 1 runs the same kernels with one slot (``PeerStaging.local``), so one GPU tests the path.

NOTE: not yet measured on GPUs; the GEMV is a plain CUDA-core tile loop (fp32 math), chosen for
correctness first. ``benchmarks/tp_decode.py`` measures it against W4 + NCCL.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from ..errors import PeerTimeoutError

from ._triton import ACT_CODES, HAS_TRITON, INTERPRET, next_pow2
from ._triton import can_implement as _triton_can_implement

M_CAP = 16  # rows a staging slot holds: decode batches; larger M takes the host all-reduce path
MAX_RANK = 128
MAX_GATE = 64
# NOTE: ptxas for sm_90 (offline, bf16, M <= 2): BLOCK_N 16 x BLOCK_K 128 uses 80 registers, no spills; 32 x 64
# 166, and 64 x 64 255 with spills. Narrow tiles also give a 4096-row GEMV 256 programs, not 64, on 132 SMs.
BLOCK_N = 32 if INTERPRET else 16
BLOCK_K = 32 if INTERPRET else 128  # the largest K step; the launch takes the largest power of 2 <= it dividing G


def block_k_for(G: int, most: int = 0) -> int:
    """The K step of the GEMV tile for group size G: a power of 2 dividing G (so that a tile reads one scale
    per row), at most ``BLOCK_K``; 0 if G has no such divisor of at least 16."""
    b = most or BLOCK_K
    while b >= 16 and G % b:
        b //= 2
    return b if b >= 16 else 0
MAX_SPIN = 1 << 10 if INTERPRET else 1 << 26  # spins before a wait gives up and records the missing rank

if HAS_TRITON:
    import triton
    import triton.language as tl

    from ._triton import gate_act

    @triton.jit
    def _take(ptr, ERR, who, MAX_SPIN: tl.constexpr):
        """Consume a token: spin until ``*ptr`` is 1 and set it to 0; on giving up record ``who``."""
        v = tl.atomic_cas(ptr, 1, 0, sem="acquire", scope="sys")
        i = 0
        while (v != 1) & (i < MAX_SPIN):
            v = tl.atomic_cas(ptr, 1, 0, sem="acquire", scope="sys")
            i += 1
        if v != 1:
            tl.atomic_xchg(ERR, who + 1)

    @triton.jit
    def _see(ptr, ERR, who, MAX_SPIN: tl.constexpr):
        """Wait until ``*ptr`` is 1 without consuming it; on giving up record ``who``."""
        v = tl.atomic_add(ptr, 0, sem="acquire", scope="sys")
        i = 0
        while (v != 1) & (i < MAX_SPIN):
            v = tl.atomic_add(ptr, 0, sem="acquire", scope="sys")
            i += 1
        if v != 1:
            tl.atomic_xchg(ERR, who + 1)

    @triton.jit
    def _ec_partial_store_kernel(
        X, QW, S, Z, A, BUF_PTRS, FLAG_PTRS, M, N, K, R, G, NG, stride_x, RANK, T, C,
        WORLD: tl.constexpr, M_CAP: tl.constexpr, HAS_Z: tl.constexpr, M_P: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MAX_SPIN: tl.constexpr,
    ):
        pid = tl.program_id(0)
        n_y = tl.cdiv(N, BLOCK_N)
        is_y = pid < n_y
        offs_m = tl.arange(0, M_P)
        offs_k = tl.arange(0, BLOCK_K)
        t0 = tl.where(is_y, pid * BLOCK_N, (pid - n_y) * BLOCK_N)
        rows = t0 + tl.arange(0, BLOCK_N)  # rows of W (y tile) or of A (h tile)
        rmask = rows < tl.where(is_y, N, R)
        acc = tl.zeros([M_P, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            kmask = kk < K
            wmask = rmask[:, None] & kmask[None, :]
            if is_y:  # BLOCK_K divides G: the tile lies in one quantization group per row
                kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
                byte = tl.load(QW + rows[:, None] * (K // 2) + kb[None, :],
                               mask=rmask[:, None] & (kb < K // 2)[None, :], other=0)
                q = tl.join(byte & 0xF, byte >> 4).reshape(BLOCK_N, BLOCK_K).to(tl.float32)  # k = 2j + nibble
                gi = rows * NG + k0 // G
                s = tl.load(S + gi, mask=rmask, other=0.0).to(tl.float32)
                if HAS_Z:
                    q = q - tl.load(Z + gi, mask=rmask, other=0.0).to(tl.float32)[:, None]
                w = q * s[:, None]
            else:
                w = tl.load(A + rows[:, None] * K + kk[None, :], mask=wmask, other=0.0).to(tl.float32)
            for m in tl.static_range(M_P):  # row by row: one [BLOCK_N, BLOCK_K] product live, not M_P of them
                xm = tl.load(X + m * stride_x + kk, mask=kmask & (m < M), other=0.0).to(tl.float32)
                acc = tl.where((offs_m == m)[:, None], acc + tl.sum(w * xm[None, :], axis=1)[None, :], acc)
        cols = tl.where(is_y, rows, N + rows)
        smask = (offs_m < M)[:, None] & rmask[None, :]
        own = tl.load(FLAG_PTRS + RANK).to(tl.pointer_type(tl.int32))
        err = own + 2 * WORLD * T + 1
        for q in tl.static_range(WORLD):
            _take(own + WORLD * T + q * T + pid, err, q, MAX_SPIN)  # q has read our slot's tile of the last call
            tl.debug_barrier()  # every thread's stores come after the token (the scalar atomic ran on one)
            buf = tl.load(BUF_PTRS + q).to(tl.pointer_type(tl.float32))
            tl.store(buf + (RANK * M_CAP + offs_m[:, None]) * C + cols[None, :], acc, mask=smask)
            tl.debug_barrier()
            peer = tl.load(FLAG_PTRS + q).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(peer + RANK * T + pid, 1, sem="release", scope="sys")

    @triton.jit
    def _ec_peer_post_kernel(
        BUF, FLAG_PTRS, BIAS, B, W1, B1, W2, B2, ALPHA, OUT, M, N, R, D, stride_o, RANK, T, C,
        WORLD: tl.constexpr, M_CAP: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, M_P: tl.constexpr,
        R_P: tl.constexpr, D_P: tl.constexpr, BLOCK_N: tl.constexpr, MAX_SPIN: tl.constexpr,
    ):
        pid = tl.program_id(0)
        n_y = tl.cdiv(N, BLOCK_N)
        n_h = T - n_y
        own = tl.load(FLAG_PTRS + RANK).to(tl.pointer_type(tl.int32))
        err = own + 2 * WORLD * T + 1
        for src in tl.static_range(WORLD):
            _take(own + src * T + pid, err, src, MAX_SPIN)
            for j in range(n_h):
                _see(own + src * T + n_y + j, err, src, MAX_SPIN)
        tl.debug_barrier()  # every thread's loads come after the acquires
        offs_m = tl.arange(0, M_P)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_r = tl.arange(0, R_P)
        mmask = offs_m < M
        ymask = mmask[:, None] & (offs_n < N)[None, :]
        hmask = mmask[:, None] & (offs_r < R)[None, :]
        y = tl.zeros([M_P, BLOCK_N], dtype=tl.float32)
        h = tl.zeros([M_P, R_P], dtype=tl.float32)
        for src in tl.static_range(WORLD):  # rank order: every rank sums the same way
            row = (src * M_CAP + offs_m[:, None]) * C
            y += tl.load(BUF + row + offs_n[None, :], mask=ymask, other=0.0)
            h += tl.load(BUF + row + N + offs_r[None, :], mask=hmask, other=0.0)
        tl.debug_barrier()  # every load of this program is done: the slots may be written again
        for src in tl.static_range(WORLD):
            peer = tl.load(FLAG_PTRS + src).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(peer + WORLD * T + RANK * T + pid, 1, sem="release", scope="sys")
        old = tl.atomic_add(own + 2 * WORLD * T, 1, sem="acq_rel", scope="sys")
        if old == n_y - 1:  # the last reader of the h tiles: reset them and hand them back
            tl.atomic_xchg(own + 2 * WORLD * T, 0)
            for src in tl.static_range(WORLD):
                peer = tl.load(FLAG_PTRS + src).to(tl.pointer_type(tl.int32))
                for j in range(n_h):
                    tl.atomic_xchg(own + src * T + n_y + j, 0)
                    tl.atomic_xchg(peer + WORLD * T + RANK * T + n_y + j, 1, sem="release", scope="sys")
        # the gate on the reduced h: z = act(W1 h + b1), g = sigmoid(W2 z + b2)
        offs_d = tl.arange(0, D_P)
        dmask, rmask = offs_d < D, offs_r < R
        w1 = tl.load(W1 + offs_d[:, None] * R + offs_r[None, :], mask=dmask[:, None] & rmask[None, :], other=0.0)
        z = tl.sum(h[:, None, :] * w1.to(tl.float32)[None, :, :], axis=2)
        z = gate_act(z + tl.load(B1 + offs_d, mask=dmask, other=0.0).to(tl.float32)[None, :], ACT)
        w2 = tl.load(W2 + offs_r[:, None] * D + offs_d[None, :], mask=rmask[:, None] & dmask[None, :], other=0.0)
        u = tl.sum(z[:, None, :] * w2.to(tl.float32)[None, :, :], axis=2)
        g = tl.sigmoid(u + tl.load(B2 + offs_r, mask=rmask, other=0.0).to(tl.float32)[None, :])
        gh = tl.where(hmask, g * h, 0.0)
        bt = tl.load(B + offs_n[:, None] * R + offs_r[None, :], mask=(offs_n < N)[:, None] & rmask[None, :], other=0.0)
        out = y + tl.load(ALPHA).to(tl.float32) * tl.sum(gh[:, None, :] * bt.to(tl.float32)[None, :, :], axis=2)
        if HAS_BIAS:
            out += tl.load(BIAS + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(OUT + offs_m[:, None] * stride_o + offs_n[None, :], out.to(OUT.dtype.element_ty), mask=ymask)


def tiles(N: int, R: int, block_n: int = BLOCK_N) -> int:
    """T, the column tiles of the stacked ``[N + r]`` partial (y tiles, then h tiles)."""
    return -(-N // block_n) + -(-R // block_n)


class PeerStaging:
    """One rank's view of the staging buffers and signal pads of a tensor-parallel group for layers of
    ``N`` outputs and EC rank ``R``: its own buffer ``[W, M_CAP, N + R]`` fp32 and signal pad, and the
    addresses of every rank's (``buf_ptrs`` / ``flag_ptrs``, int64 on the device)."""

    def __init__(self, rank: int, world: int, N: int, R: int, buf: torch.Tensor, flags: torch.Tensor,
                 buf_ptrs: torch.Tensor, flag_ptrs: torch.Tensor, keep: tuple = ()) -> None:
        self.rank, self.world, self.N, self.R = rank, world, N, R
        self.T = tiles(N, R)
        self.buf, self.flags, self.buf_ptrs, self.flag_ptrs = buf, flags, buf_ptrs, flag_ptrs
        self._keep = keep  # symmetric-memory handles (or the emulated peers' tensors) stay alive

    @staticmethod
    def fresh_flags(world: int, T: int, device) -> torch.Tensor:
        """A signal pad in its initial state: ready 0, free 1 (the slots start empty), hdone 0, err 0."""
        f = torch.zeros(2 * world * T + 2, dtype=torch.int32, device=device)
        f[world * T:2 * world * T] = 1
        return f

    @classmethod
    def emulated(cls, world: int, N: int, R: int, device="cpu") -> list["PeerStaging"]:
        """Every rank's view, in one process: plain tensors standing in for the peers' symmetric memory."""
        T = tiles(N, R)
        bufs = [torch.zeros(world, M_CAP, N + R, device=device) for _ in range(world)]
        flags = [cls.fresh_flags(world, T, device) for _ in range(world)]
        bp = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64, device=device)
        fp = torch.tensor([f.data_ptr() for f in flags], dtype=torch.int64, device=device)
        return [cls(i, world, N, R, bufs[i], flags[i], bp, fp, keep=(bufs, flags)) for i in range(world)]

    @classmethod
    def local(cls, N: int, R: int, device) -> "PeerStaging":
        """World size 1: the same kernels, one slot, no peer."""
        return cls.emulated(1, N, R, device)[0]

    @classmethod
    def symmetric(cls, group_name: str, N: int, R: int, device) -> "PeerStaging":
        """Allocate this rank's buffer and signal pad in symmetric memory and exchange the addresses with the
        group (a collective: every rank of the group calls it, in the same order)."""
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        check_no_multicast()
        pg = dist.distributed_c10d._resolve_process_group(group_name)
        world, rank = pg.size(), pg.rank()
        T = tiles(N, R)
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(group_name)
        buf = symm_mem.empty((world, M_CAP, N + R), dtype=torch.float32, device=device)
        flags = symm_mem.empty(2 * world * T + 2, dtype=torch.int32, device=device)
        flags.copy_(cls.fresh_flags(world, T, device))
        hb, hf = symm_mem.rendezvous(buf, group_name), symm_mem.rendezvous(flags, group_name)
        bp = torch.tensor(list(hb.buffer_ptrs), dtype=torch.int64, device=device)
        fp = torch.tensor(list(hf.buffer_ptrs), dtype=torch.int64, device=device)
        torch.cuda.synchronize(device)
        dist.barrier(group=pg)  # every pad initialised before any peer writes into it
        return cls(rank, world, N, R, buf, flags, bp, fp, keep=(hb, hf))

    def initial_state(self) -> bool:
        """Whether the signal pad is back in its initial state (what CUDA-graph replay relies on)."""
        return bool(torch.equal(self.flags.cpu(), self.fresh_flags(self.world, self.T, "cpu")))

    def check(self, where: str = "ec_peer_reduce") -> None:
        """Raise ``PeerTimeoutError`` if a wait of this rank gave up (synchronises; not on the decode path)."""

        bad = int(self.flags[-1].item())
        if bad:
            raise PeerTimeoutError(f"{where}: rank {self.rank} of {self.world} gave up waiting for rank {bad - 1}'s "
                                   f"partial or its read of the staging slot (peer-write signal pad)",
                                   rank=self.rank, missing=(bad - 1,))


def check_no_multicast() -> None:
    """NVLink multicast stays off: P2P stores only. Set the two switches where unset; refuse them on."""
    for var in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST"):
        want = "0" if var == "NCCL_NVLS_ENABLE" else "1"
        have = os.environ.setdefault(var, want)
        if have != want:
            raise RuntimeError(f"ec_peer_reduce: {var}={have!r}; the peer-write path needs {var}={want} "
                               "(NVLink multicast off, P2P only)")


def _check(x2: torch.Tensor, st: PeerStaging, N: int, R: int, where: str) -> None:
    if x2.dim() != 2 or x2.shape[0] > M_CAP or x2.shape[0] < 1:
        raise ValueError(f"{where}: x must be [M, K] with 1 <= M <= {M_CAP} (a staging slot's rows), got "
                         f"{tuple(x2.shape)}")
    if (st.N, st.R) != (N, R):
        raise ValueError(f"{where}: staging is for N={st.N}, rank={st.R}, the layer has N={N}, rank={R}")


def ec_partial_store(x2, qweight, scales, zeros, G: int, A, st: PeerStaging, max_spin: Optional[int] = None) -> None:
    """Launch the epilogue-store kernel: this rank's ``[y_i | A_i x_i]`` of ``x2 [M, K]`` into slot ``rank``
    of every rank's staging buffer, signalled. ``max_spin``: a wait's spins before it gives up (default
    ``MAX_SPIN``)."""
    N, K = qweight.shape[0], x2.shape[1]
    R = A.shape[0]
    _check(x2, st, N, R, "ec_partial_store")
    if qweight.shape[1] * 2 != K or A.shape[1] != K:
        raise ValueError(f"ec_partial_store: x has K={K}, qweight {tuple(qweight.shape)} and A {tuple(A.shape)} differ")
    for name, t in (("qweight", qweight), ("scales", scales), ("zeros", zeros), ("A", A)):
        if t is not None and not t.is_contiguous():
            raise ValueError(f"ec_partial_store: {name} must be contiguous")
    bk = block_k_for(G)
    if not bk:
        raise ValueError(f"ec_partial_store: group size G={G} has no power-of-2 divisor >= 16 (the GEMV tile's K step)")
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    _ec_partial_store_kernel[(st.T,)](
        x2, qweight, scales, zeros if zeros is not None else scales, A, st.buf_ptrs, st.flag_ptrs,
        x2.shape[0], N, K, R, G, K // G, x2.stride(0), st.rank, st.T, N + R,
        WORLD=st.world, M_CAP=M_CAP, HAS_Z=zeros is not None, M_P=max(2, next_pow2(x2.shape[0])),
        BLOCK_N=BLOCK_N, BLOCK_K=bk, MAX_SPIN=max_spin or MAX_SPIN, num_warps=4)


def ec_peer_post(M: int, st: PeerStaging, bias, B, W1, b1, W2, b2, alpha, act: str, dtype: torch.dtype,
                 out: Optional[torch.Tensor] = None, max_spin: Optional[int] = None) -> torch.Tensor:
    """Launch the post kernel: ``[M, N]`` = the sum of the staged partials, gated on the reduced ``h``."""
    N, R = B.shape
    D = W1.shape[0]
    if (st.N, st.R) != (N, R):
        raise ValueError(f"ec_peer_post: staging is for N={st.N}, rank={st.R}, B is {tuple(B.shape)}")
    if R > MAX_RANK or D > MAX_GATE:
        raise ValueError(f"ec_peer_post: EC rank {R} / gate width {D} above {MAX_RANK} / {MAX_GATE}")
    out = out if out is not None else torch.empty(M, N, dtype=dtype, device=B.device)
    _ec_peer_post_kernel[(-(-N // BLOCK_N),)](
        st.buf, st.flag_ptrs, bias if bias is not None else B, B, W1, b1, W2, b2, alpha, out, M, N, R, D,
        out.stride(0), st.rank, st.T, N + R,
        WORLD=st.world, M_CAP=M_CAP, HAS_BIAS=bias is not None, ACT=ACT_CODES[act], M_P=max(2, next_pow2(M)),
        R_P=max(2, next_pow2(R)), D_P=max(2, next_pow2(D)), BLOCK_N=BLOCK_N, MAX_SPIN=max_spin or MAX_SPIN,
        num_warps=4)
    return out


def can_implement(p) -> tuple:
    """(ok, reason) of the peer-write pair for a row-parallel EC problem ``p`` (``lowering.problem.Problem``,
    op "ec"; ``M`` its rows, ``rank`` / ``gate_width`` the EC's)."""
    ok, why = _triton_can_implement(p)
    if not ok:
        return ok, why
    if p.op != "ec" or p.rank is None:
        return False, f"op {p.op!r} without an EC (the peer-write pair reduces an EC's [y | A x])"
    if p.M > M_CAP:
        return False, f"M={p.M} rows above a staging slot's {M_CAP} (prefill takes the host all-reduce)"
    if p.rank > MAX_RANK or (p.gate_width or 0) > MAX_GATE:
        return False, f"EC rank {p.rank} / gate width {p.gate_width} above {MAX_RANK} / {MAX_GATE}"
    if not block_k_for(p.G):
        return False, f"group size {p.G} has no power-of-2 divisor >= 16 (the GEMV tile's K step)"
    if not (p.weight_contiguous and p.params_contiguous and p.a_contiguous):
        return False, "non-contiguous weight, scales, zero points or A"
    return True, f"M={p.M} <= {M_CAP}, EC rank {p.rank}: peer-write epilogue + post kernel"


_STAGING: dict = {}  # (group name, device, N, R) -> PeerStaging, allocated once per group and layer shape


def staging_for(group_name: str, N: int, R: int, device) -> PeerStaging:
    """The group's staging for layers of (N, R); shared by every layer of that shape (the signal pads order
    the reuse). Allocating it is a collective the first time (outside CUDA-graph capture)."""
    key = (group_name, str(device), N, R)
    st = _STAGING.get(key)
    if st is None:
        world = 1
        if group_name:
            import torch.distributed as dist

            world = dist.distributed_c10d._resolve_process_group(group_name).size()
        st = PeerStaging.local(N, R, device) if world == 1 else PeerStaging.symmetric(group_name, N, R, device)
        _STAGING[key] = st
    return st


def ec_linear_peer_reduce_gpu(x, qweight, scales, zeros, group_size, bias, A, B, W1, b1, W2, b2, alpha, act, st):
    """The row-parallel EC layer on ``x [..., K]`` through the peer-write pair over staging ``st``."""
    x2 = x.reshape(-1, x.shape[-1])
    ec_partial_store(x2, qweight, scales, zeros, group_size, A, st)
    out = ec_peer_post(x2.shape[0], st, bias, B, W1, b1, W2, b2, alpha, act, x.dtype)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def compile_sm90(world: int = 2, dtype: str = "bf16") -> dict:
    """Offline sm_90 compiles of both kernels as the wrappers launch them at decode (no GPU needed):
    ``{"store": compiled, "post": compiled}``; the tests read their PTX (system-scope atomics, no spills)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def build(k, ptrs: dict, ints: tuple, consts: dict):
        types = dict({n: "*" + t for n, t in ptrs.items()}, **{n: "i32" for n in ints})
        sig = dict(types, **{c: "constexpr" for c in consts})
        attrs = {(k.arg_names.index(a),): [["tt.divisibility", 16]] for a in ptrs}
        src = ASTSource(fn=k, signature=sig, constexprs={(k.arg_names.index(c),): v for c, v in consts.items()},
                        attrs=attrs)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))

    store = build(_ec_partial_store_kernel,
                  dict(X=dtype, QW="u8", S=dtype, Z=dtype, A=dtype, BUF_PTRS="i64", FLAG_PTRS="i64"),
                  ("M", "N", "K", "R", "G", "NG", "stride_x", "RANK", "T", "C"),
                  dict(WORLD=world, M_CAP=M_CAP, HAS_Z=True, M_P=2, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                       MAX_SPIN=MAX_SPIN))
    post = build(_ec_peer_post_kernel,
                 dict(BUF="fp32", FLAG_PTRS="i64", BIAS=dtype, B=dtype, W1=dtype, B1=dtype, W2=dtype, B2=dtype,
                      ALPHA="fp32", OUT=dtype),
                 ("M", "N", "R", "D", "stride_o", "RANK", "T", "C"),
                 dict(WORLD=world, M_CAP=M_CAP, HAS_BIAS=True, ACT=0, M_P=2, R_P=64, D_P=16, BLOCK_N=BLOCK_N,
                      MAX_SPIN=MAX_SPIN))
    return {"store": store, "post": post}
