"""Decode (M = 1) EC as two launches joined by programmatic dependent launch (PDL).

Reference: ``ops/ec_ref.py:ec_linear_ref``.

An earlier single launch (producer programs inside the GEMV's grid, a last producer gating once and
raising a flag) paid ~5 us of cross-program waiting at 4096^2; the producers became their own small
kernel (an earlier one-launch form without producer programs is ``ec_self.py``):

``_ec_decode_producer_kernel`` - P programs, each a K slice of ``h = A x`` stored to its
own workspace row; the last to arrive (acq_rel counter, which it resets) sums the rows,
runs the gate MLP once and publishes ``g * h`` in ``GH_COPIES`` copies. Its first
instruction is ``griddepcontrol.launch_dependents``.

The GEMV is then launched with the PDL attribute: its programs start while the producers
run, stream their weights (and prefetch the EC's B rows), and execute
``griddepcontrol.wait`` only before the epilogue reads ``g * h``; the wait returns once
the producer grid has finished and its writes are visible. Everything the GEMV reads
before the wait (x, weights, B) was complete before the producer kernel started.
Without PDL (Triton's interpreter, a GPU before Hopper) the two launches simply run in
stream order, with the same result.

The GEMV of the pair is the CUDA-core kernel (``w4a16_triton._w4a16_gemv1_kernel``) or, where the
tuned table runs the shape on the TMA kernel, that kernel with its EC epilogue
(``w4a16_gemv_tma_ec._ec_rows``). With an RMSNorm fused in front (``norm``: the producer and the TMA
GEMV each normalise x themselves as they read it, so neither waits for the other), every producer
program first sums the squares of all of x (2K bytes, L2-resident) - the norm costs no extra launch
and no ordering between the two grids.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import device as _device
from ._triton import HAS_TRITON, INTERPRET, gdc_wait, next_pow2
from ._triton import ACT_CODES
from .w4a16_triton import GH_COPIES, GEMV_MAX_M, MAX_PRODUCERS, ec_workspace
from .w4a16_triton import w4a16_gemv1

if HAS_TRITON:
    import triton
    import triton.language as tl

    from ._triton import gdc_launch_dependents
    from .w4a16_triton import _ec_gate_operands, _ec_gate_publish, _ec_h_partial

    @triton.jit
    def _rms_rstd(X, EPS, K, SS_BLOCK: tl.constexpr):
        """1 / rms(x) over all of x [K] (2K bytes, L2-resident: every producer reads it before its own
        slice), SS_BLOCK values per load (all of x at once up to 8192: one round trip on the producer's
        critical path)."""
        ss = tl.zeros([SS_BLOCK], dtype=tl.float32)
        for k0 in range(0, K, SS_BLOCK):
            offs_k = k0 + tl.arange(0, SS_BLOCK)
            xv = tl.load(X + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
            ss += xv * xv
        return tl.rsqrt(tl.sum(ss, axis=0) / K + EPS)

    @triton.jit
    def _ec_decode_producer_kernel(
        X, A, W1, B1, W2, B2, HBUF, GH, CNT, NW, EPS, K, R, D,
        P_H: tl.constexpr, P_HP: tl.constexpr, BLOCK_KH: tl.constexpr, R_P: tl.constexpr, D_P: tl.constexpr,
        ACT: tl.constexpr, GH_COPIES: tl.constexpr, PDL: tl.constexpr, NORM: tl.constexpr = False,
        SS_BLOCK: tl.constexpr = 64,
    ):
        if PDL:  # the GEMV may start now: it waits for this grid only before its epilogue
            gdc_launch_dependents()
        pid = tl.program_id(0)
        offs_r = tl.arange(0, R_P)
        if NORM:  # x RMS-normalised (weight NW, epsilon EPS) as it is read
            h = _ec_h_partial(X, A, K, R, pid, P_H, BLOCK_KH, R_P, NW, _rms_rstd(X, EPS, K, SS_BLOCK), True)
        else:
            h = _ec_h_partial(X, A, K, R, pid, P_H, BLOCK_KH, R_P)
        tl.store(HBUF + pid * R_P + offs_r, h)
        tl.debug_barrier()
        old = tl.atomic_add(CNT, 1, sem="acq_rel")
        if old == P_H - 1:  # last producer: every partial row is visible after the acq_rel above
            tl.atomic_xchg(CNT, 0)  # reset for the next launch (no other program touches it now)
            w1, b1, w2, b2 = _ec_gate_operands(W1, B1, W2, B2, R, D, R_P, D_P)
            _ec_gate_publish(HBUF, GH, w1, b1, w2, b2, P_H, P_HP, R_P, ACT, GH_COPIES)

PRODUCER_BLOCK_K = 32 if INTERPRET else 64  # K columns per producer step
def pdl_ok(device: torch.device) -> bool:
    """Whether launches on this device can use PDL (``device.pdl``)."""
    return _device.pdl(device)


def pdl_launch_ok(device: torch.device) -> bool:
    """Whether the decode EC's GEMV is launched with PDL behind its producer grid (``device.pdl_launch``)."""
    return _device.pdl_launch(device)


def ec_produce(x2: torch.Tensor, ec: tuple, act: str = "silu", norm: Optional[tuple] = None,
               producers: Optional[int] = None) -> tuple[torch.Tensor, bool]:
    """Launch the producer grid of a decode EC: g * h of x2 [1, K] (RMS-normalised first with ``norm`` =
    (weight [K], eps)) published in ``GH_COPIES`` rows of the returned fp32 [GH_COPIES, R_P] view of the
    shared workspace. Returns (that view, whether the grid was launched for PDL: then the consuming GEMV
    must be launched with PDL and wait before it reads the view)."""

    K = x2.shape[1]
    A, B, W1, b1, W2, b2, alpha = ec
    R, D = A.shape[0], W1.shape[0]
    if norm is not None and (tuple(norm[0].shape) != (K,) or norm[0].dtype != x2.dtype or not norm[0].is_contiguous()):
        raise ValueError(f"ec_produce: norm weight {tuple(norm[0].shape)} {norm[0].dtype} must be a contiguous vector of "
                         f"x's K={K} and dtype {x2.dtype}")
    r_p, d_p = next_pow2(R), next_pow2(D)
    ws, cnt = ec_workspace(x2.device, r_p)
    gh = ws[GEMV_MAX_M:GEMV_MAX_M + GH_COPIES]
    hbuf = ws[GEMV_MAX_M + GH_COPIES:]
    p_h = producers or max(1, min(MAX_PRODUCERS, triton.cdiv(K, PRODUCER_BLOCK_K)))
    pdl = pdl_launch_ok(x2.device)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    _ec_decode_producer_kernel[(p_h,)](
        x2, A, W1, b1, W2, b2, hbuf, gh, cnt, norm[0] if norm is not None else x2,
        float(norm[1]) if norm is not None else 0.0, K, R, D,
        P_H=p_h, P_HP=next_pow2(p_h), BLOCK_KH=PRODUCER_BLOCK_K, R_P=r_p, D_P=d_p, ACT=ACT_CODES[act],
        GH_COPIES=GH_COPIES, PDL=pdl, NORM=norm is not None,
        SS_BLOCK=min(next_pow2(K), 8192) if norm is not None else 64, num_warps=4,
    )
    return gh, pdl


def w4a16_gemv1_ec_pdl(x2, qweight, scales, zeros, G: int, bias, ec: tuple, act: str = "silu",
                       config: Optional[tuple] = None, out: Optional[torch.Tensor] = None,
                       nib: Optional[str] = None, producers: Optional[int] = None,
                       words: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Y[1, N] = W4 GEMV + EC, as a producer launch and a PDL-launched GEMV (see module docstring).
    ``config`` is the GEMV's (BLOCK_N, BLOCK_W, num_warps, prefetch); ``words``: the GEMV layout
    itself (``qweight`` unused), as ``w4a16_gemv1`` takes it (``w4a16_cat``'s concatenations)."""

    _, pdl = ec_produce(x2, ec, act, producers=producers)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    return w4a16_gemv1(x2, qweight, scales, zeros, G, bias, ec=ec, act=act, config=config, out=out, nib=nib,
                       pair=True, launch_pdl=pdl, words=words)
