"""The prefill EC's shrink and gate in one split-K launch that lets the W4 GEMM start at once.

Reference: ``ops/ec_ref.py:ec_delta_ref`` (``h = x A^T`` in fp32, then the gate MLP).

Why: in the "in_gemm" structure (``dispatch/cuda.py:_ec_in_gemm``) the register-operand GEMM adds ``alpha g h``
as one more K step and is launched with programmatic dependent launch (PDL) behind the gate kernel, but
the shrink ran before the gate as a cuBLAS GEMM: [M, K] x [K, r] has r = 64 output columns, so cuBLAS
gets few tiles and took 10-15 us with the gate (H200, ``ec_prefill_profile.py``),
serial before the GEMM's 50-230 us. Measured there: in_gemm = shrink + gate + the GEMM with the EC step,
i.e. nothing overlapped.

Here one kernel does both, and its first instruction triggers the dependent GEMM:

* **Split-K.** Program (m, k) computes the fp32 partial ``x[m rows] A[:, k slice]^T`` [BLOCK_M, R_P] and
  stores it in a workspace. KS (the slices per row block) spreads the shrink over every SM (the first
  Triton shrink, one program per 64 rows, took ~70 us at 8192^2, ``ec_triton.py``); a program's
  registers and shared memory leave room for a GEMM CTA beside it (``BLOCK_M`` below), and
  ``PROGRAMS_PER_SM`` / ``MAX_KS`` are the measured compromise between that and the shrink's own speed.
* **Last arriver gates.** After its store a program takes a ticket on its row block's counter
  (acq_rel); the one that draws KS - 1 sums the KS partials in slice order (deterministic: the same bits
  whatever the arrival order), applies the gate MLP (``ec_triton.ec_gate_store``) and resets the counter
  to 0 for the next launch.
* **PDL.** The GEMM (launched with PDL) runs its K loop beside this grid and executes
  ``griddepcontrol.wait`` - which waits for this whole grid and its memory - only before reading
  ``alpha g h``.

Counters: one int32 per row block, per EC site (keyed by A's storage, like ``ec_self.self_workspace``),
zeroed once when made and left at zero by every launch; launches of one site are stream-ordered. Made
outside CUDA-graph capture where possible; inside a capture a zeroed one is made in the graph (a memset
node each replay: correct, one node slower).
"""
from __future__ import annotations

from typing import Optional

import torch

from ._triton import ACT_CODES, HAS_TRITON, INTERPRET, next_pow2
from .device import sm_count
from .layout_cache import outside_pools

# 32 x 64 tiles, 4 warps, 2 stages: 96 registers and 12 KB of shared memory (sm_90, offline ptxas), so a
# program fits on an SM beside one 205-register, 256-thread register-operand GEMM CTA (53,248 + 12,288 =
# the 65,536 registers); 64-row tiles took 105 registers and would keep the GEMM's CTA off that SM.
BLOCK_M = 16 if INTERPRET else 32
BLOCK_K = 32 if INTERPRET else 64
NUM_WARPS, NUM_STAGES = 4, 2
INTERPRET_PROGRAMS = 8  # (the interpreter: enough programs to exercise the split)
# Programs per SM, and at most MAX_KS slices per row block (the last arriver sums them one after another).
# Measured (H200, ec_prefill_profile.py): with 1 per SM (each fits beside a GEMM CTA)
# the split-K shrink alone took 10-30 us and in_gemm_sk overlapped nothing; 4 per SM: 15-20 us alone at
# M = 1024 (one run had in_gemm_sk at 8192^2 M = 1024 at the EC-step GEMM's own time, 229 us vs in_gemm 242;
# a later kernels.py run did not repeat it: 238.5 vs 232.5), and 64 slices at M = 256 made the last arriver's
# sum slow (24 us alone): hence the cap, which keeps M = 256 at 16 slices. Overall (that run) the structure won
# one cell of ten, within spread: the GEMM does not run beside it, for reasons not yet measured.
PROGRAMS_PER_SM = 4
MAX_KS = 16

if HAS_TRITON:
    import triton
    import triton.language as tl

    from ._triton import gdc_launch_dependents
    from .ec_triton import ec_gate_store

    @triton.jit
    def _ec_shrink_gate_splitk_kernel(
        X, A, W1, B1, W2, B2, ALPHA, PART, CNT, HG, M, K, R, D, KCHUNK, stride_xm,
        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, R_P: tl.constexpr, D_P: tl.constexpr,
        ACT: tl.constexpr, HAS_ALPHA: tl.constexpr, PDL_TRIGGER: tl.constexpr, UPCAST: tl.constexpr,
    ):
        """Program (m, k): partial h of row block m over K slice k; the last of a row block to arrive
        sums the partials in slice order and gates (``ec_gate_store``)."""
        if PDL_TRIGGER:
            gdc_launch_dependents()
        pid_m = tl.program_id(0)
        pid_k = tl.program_id(1)
        KS = tl.num_programs(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < M
        offs_r = tl.arange(0, R_P)
        mask_r = offs_r < R
        offs_k = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, R_P], dtype=tl.float32)
        k0 = pid_k * KCHUNK
        for k in range(k0, k0 + KCHUNK, BLOCK_K):
            kk = k + offs_k
            mk = kk < K
            x = tl.load(X + offs_m[:, None] * stride_xm + kk[None, :], mask=mask_m[:, None] & mk[None, :], other=0.0)
            a = tl.load(A + offs_r[:, None] * K + kk[None, :], mask=mask_r[:, None] & mk[None, :], other=0.0)
            if UPCAST:  # Triton's interpreter mishandles bf16 dots: the CPU tests use fp32 there
                acc = tl.dot(x.to(tl.float32), tl.trans(a.to(tl.float32)), acc)
            else:
                acc = tl.dot(x, tl.trans(a.to(x.dtype)), acc)
        part = PART + pid_k * M * R_P + offs_m[:, None] * R_P + offs_r[None, :]
        tl.store(part, acc, mask=mask_m[:, None])
        tl.debug_barrier()  # every thread's partial is stored before the ticket releases them
        ticket = tl.atomic_add(CNT + pid_m, 1, sem="acq_rel")
        if ticket == KS - 1:
            h = tl.zeros([BLOCK_M, R_P], dtype=tl.float32)
            for s in range(0, KS):  # slice order: the same sum whoever arrives last
                h += tl.load(PART + s * M * R_P + offs_m[:, None] * R_P + offs_r[None, :], mask=mask_m[:, None],
                             other=0.0, cache_modifier=".cg")
            ec_gate_store(h, offs_m, mask_m, W1, B1, W2, B2, ALPHA, HG, R, D, R_P, D_P, ACT, HAS_ALPHA)
            tl.store(CNT + pid_m, 0)  # every program of this block has drawn its ticket: ready for the next launch


_COUNTERS: dict = {}


def _counters(A: torch.Tensor, blocks: int) -> torch.Tensor:
    """Zeroed int32 counters [>= blocks] of one EC site (A's storage), made once per size (older ones stay
    alive: a captured graph may hold them)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    size = next_pow2(blocks)
    key = (A.untyped_storage().data_ptr(), A.storage_offset(), str(A.device), size)
    hit = _COUNTERS.get(key)
    if hit is not None and not hit[0].expired():
        return hit[1]
    if A.is_cuda and torch.cuda.is_current_stream_capturing():
        return torch.zeros(size, dtype=torch.int32, device=A.device)  # (a memset node in the graph: zero at every replay)
    cnt = outside_pools(lambda: torch.zeros(size, dtype=torch.int32, device=A.device))
    for k in [k for k, v in _COUNTERS.items() if v[0].expired()]:
        del _COUNTERS[k]
    _COUNTERS[key] = (StorageWeakRef(A.untyped_storage()), cnt)
    return cnt


def splitk_geometry(M: int, K: int, programs: int, max_ks: int = MAX_KS) -> tuple[int, int]:
    """(KS slices, KCHUNK columns per slice, a multiple of BLOCK_K): at most ``programs`` programs (unless
    the row blocks alone are more) and at most ``max_ks`` slices."""
    blocks = -(-M // BLOCK_M)
    steps = -(-K // BLOCK_K)
    ks = max(1, min(steps, programs // blocks, max_ks))
    chunk = -(-steps // ks) * BLOCK_K
    return -(-K // chunk), chunk


def ec_shrink_gate_splitk(x2: torch.Tensor, A, W1, b1, W2, b2, act: str = "silu", alpha=None,
                          dtype: Optional[torch.dtype] = None, pdl_trigger: bool = False) -> torch.Tensor:
    """``alpha g * h`` (``alpha`` when given) as [M, R_P] in ``dtype`` (x's by default; columns >= r zero),
    ``h = x A^T`` in fp32 (as ``ec_delta_ref``). ``pdl_trigger``: a PDL-launched successor may start at
    once (it must wait before reading the result; nothing may be launched in between)."""
    if x2.dim() != 2 or x2.stride(-1) != 1:
        raise ValueError(f"ec_shrink_gate_splitk: x {tuple(x2.shape)} stride {x2.stride()} must be 2-D with "
                         "contiguous rows")
    M, K = x2.shape
    R, D = A.shape[0], W1.shape[0]
    if A.shape != (R, K) or not A.is_contiguous():
        raise ValueError(f"ec_shrink_gate_splitk: A {tuple(A.shape)} must be a contiguous [r, {K}]")
    if x2.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"ec_shrink_gate_splitk: x dtype {x2.dtype}; expected float16 or bfloat16")
    r_p, d_p = max(16, next_pow2(R)), max(16, next_pow2(D))
    programs = INTERPRET_PROGRAMS if not x2.is_cuda or INTERPRET else PROGRAMS_PER_SM * sm_count(x2.device)
    ks, chunk = splitk_geometry(M, K, programs)
    blocks = -(-M // BLOCK_M)
    part = torch.empty(ks, M, r_p, dtype=torch.float32, device=x2.device)
    hg = torch.empty(M, r_p, dtype=dtype or x2.dtype, device=x2.device)
    _ec_shrink_gate_splitk_kernel[(blocks, ks)](
        x2, A, W1, b1, W2, b2, alpha if alpha is not None else b2, part, _counters(A, blocks), hg,
        M, K, R, D, chunk, x2.stride(0), BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, R_P=r_p, D_P=d_p,
        ACT=ACT_CODES[act], HAS_ALPHA=alpha is not None, PDL_TRIGGER=pdl_trigger,
        UPCAST=INTERPRET and x2.dtype == torch.bfloat16, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    return hg


def compile_sm90(dtype: str = "bf16", r_p: int = 64, d_p: int = 16):
    """Offline sm_90 compile of the kernel as the wrapper launches it on a GPU (no GPU needed): the
    compiled kernel, whose ``metadata.shared`` and PTX the tests check against the co-residency budget."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    k = _ec_shrink_gate_splitk_kernel
    ptrs = dict(X=dtype, A=dtype, W1=dtype, B1=dtype, W2=dtype, B2=dtype, ALPHA=dtype, PART="fp32", CNT="i32",
                HG=dtype)
    types = dict({n: "*" + t for n, t in ptrs.items()}, M="i32", K="i32", R="i32", D="i32", KCHUNK="i32",
                 stride_xm="i32")
    consts = dict(BLOCK_M=32, BLOCK_K=64, R_P=r_p, D_P=d_p, ACT=0, HAS_ALPHA=True, PDL_TRIGGER=True, UPCAST=False)
    sig = dict(types, **{c: "constexpr" for c in consts})
    attrs = {(k.arg_names.index(a),): [["tt.divisibility", 16]] for a in types}
    src = ASTSource(fn=k, signature=sig, constexprs={(k.arg_names.index(c),): v for c, v in consts.items()},
                    attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=NUM_WARPS,
                                                                              num_stages=NUM_STAGES))


def can_implement(p) -> tuple:
    """(ok, reason) of whether the split-K shrink + gate takes problem ``p``'s EC (a ``lowering.problem.Problem``):
    a contiguous A (``ec_shrink_gate_splitk`` reads it in K slices)."""
    if not p.a_contiguous:
        return False, "A is not contiguous"
    return True, "A contiguous"
