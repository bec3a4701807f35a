"""CUDA implementations of ``spear::w4a16_linear`` / ``spear::ec_linear``: pick a kernel.

``lowering`` (set by the phase-dispatch pass) decides how the EC runs:

* "fused" (decode): the EC in the W4 GEMV's epilogue (``w4a16_triton.w4a16_gemv``), for
  M <= GEMV_MAX_M: on Hopper a producer grid + the PDL-launched GEMV (``ec_decode_triton.py``),
  elsewhere producers inside the GEMV launch; beyond GEMV_MAX_M the GEMM with the EC on a side stream.
* "overlapped" (prefill): W4 GEMM (Triton, or from M = 256 dequantize + cuBLAS or on Hopper the
  wgmma in-loop-dequant GEMM, per the tuned table) with the EC in one of several structures, the one
  measured fastest for the shape (``ec_overlapped``): shrink (cuBLAS) + gate on a side stream beside
  the GEMM, then ``y += alpha * hg B^T`` in place; or the EC first, beside the dequantize, into the C
  operand of the cuBLAS GEMM; each optionally with the EC's stream at high priority; or the expand as
  one more K step of the wgmma GEMM. Every fork/join uses stream waits, so the whole step is capturable
  in a CUDA graph.
* "dispatch": branch on M at run time against ``crossover``; "auto": like dispatch.

Anything the Triton kernels do not cover (fp32 activations, the tinygemm / unpacked
layouts, no Triton installed) runs the PyTorch reference, so results never depend on
what is installed, only speed does.
"""
from __future__ import annotations

from typing import Optional

import torch

from ._triton import HAS_TRITON
from .ec_linear import ec_linear_ref
from .w4a16 import w4a16_linear_ref

_TRITON_DTYPES = (torch.float16, torch.bfloat16)
_SIDE_STREAMS: dict[tuple[int, int], "torch.cuda.Stream"] = {}


HIGH_PRIORITY = -1  # CUDA stream priorities: lower is higher; 0 is the default, -1 exists on every GPU


def _side_stream(device: torch.device, priority: int = 0) -> "torch.cuda.Stream":
    """One side stream per (device, priority), made once (so captured graphs and eager calls share it)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    s = _SIDE_STREAMS.get((idx, priority))
    if s is None:
        s = _SIDE_STREAMS[(idx, priority)] = torch.cuda.Stream(device=idx, priority=priority)
    return s


# NOTE (H200): without an EC the GEMVs beat the small-M GEMM only at M = 1 (the M = 1 kernel vs the
# GEMM: benchmarks/results/kernels/2026-12-01_h200_all_providers.json; M = 2 and 4, where the M > 1 GEMV loses:
# benchmarks/results/kernels/2026-11-29_h200_all_providers_first.json).
W4_GEMV_MAX_M = 1


def use_fused(lowering: str, M: int, crossover: int) -> bool:
    """Whether the fused (GEMV-epilogue) path runs for M rows under this lowering decision."""
    from .w4a16_triton import GEMV_MAX_M

    if M > GEMV_MAX_M:
        return False
    if lowering == "fused":
        return True
    if lowering == "overlapped":
        return False
    return M < crossover  # "dispatch" / "auto": the runtime branch


def _dense(bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The kernels read the bias as N consecutive values; a bias folded in from a residual
    (``passes/fold_residual_add.py``) is a view of an activation and may have any stride."""
    return bias.contiguous() if bias is not None else None


def _triton_ok(x: torch.Tensor, layout: str) -> bool:
    return HAS_TRITON and x.is_cuda and layout == "spear" and x.dtype in _TRITON_DTYPES


def w4a16_linear_cuda(x, qweight, scales, zeros, group_size, bias, layout="spear", lowering="auto",
                      crossover=16):
    if not _triton_ok(x, layout):
        return w4a16_linear_ref(x, qweight, scales, zeros, group_size, bias, layout)
    from .w4a16_triton import w4a16_gemm, w4a16_gemv

    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    bias = _dense(bias)
    if x2.shape[0] <= W4_GEMV_MAX_M:
        y = w4a16_gemv(x2, qweight, scales, zeros, group_size, bias)
    else:
        y = w4a16_gemm(x2, qweight, scales, zeros, group_size, bias)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def ec_linear_cuda(x, qweight, scales, zeros, group_size, bias, A, B, W1, b1, W2, b2, alpha, act="silu",
                   layout="spear", lowering="auto", crossover=16):
    if not _triton_ok(x, layout):
        return ec_linear_ref(x, qweight, scales, zeros, group_size, bias, A, B, W1, b1, W2, b2, alpha, act, layout)
    from .w4a16_triton import w4a16_gemv

    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    bias = _dense(bias)
    if use_fused(lowering, x2.shape[0], crossover):
        y = w4a16_gemv(x2, qweight, scales, zeros, group_size, bias, ec=(A, B, W1, b1, W2, b2, alpha), act=act)
    else:
        y = ec_overlapped(x2, qweight, scales, zeros, group_size, bias, A, B, W1, b1, W2, b2, alpha, act)
    return y.reshape(*x.shape[:-1], y.shape[-1])


OVERLAP_STRUCTURES = ("auto", "side", "side_hi", "c_operand", "c_operand_hi", "in_gemm", "in_gemm_sk",
                      "in_gemm_self")


def ec_overlapped(x2, qweight, scales, zeros, group_size, bias, A, B, W1, b1, W2, b2, alpha, act,
                  side: Optional["torch.cuda.Stream"] = None, structure: str = "auto") -> torch.Tensor:
    """The prefill EC, in one of several structures (``_hi``: the EC's stream has high priority, so
    its small kernels are scheduled ahead of the big kernel's pending CTAs):

    * "side" / "side_hi": W4 GEMM on the current stream, EC shrink + gate on a side stream, join,
      expand-add into Y (``y += alpha * hg B^T``, reading and writing Y once more);
    * "c_operand" / "c_operand_hi": the EC first, into the C operand of a dequantize + cuBLAS
      GEMM, beside the dequantize (``dequant_cublas.ec_dequant_cublas``);
    * "in_gemm": shrink + gate first, then the Hopper warpgroup-MMA GEMM adds ``(alpha g h) B^T`` as one
      more K step (``w4a16_gemm_wgmma``, or ``w4a16_gemm_wgmma_ra`` where the table runs the shape on it:
      then launched with PDL behind the gate kernel, its K loop overlapping the gate): no pass over Y,
      no second stream (where neither kernel can take the call - not sm_90, fp16, an unaligned shape -
      "side" runs instead, "c_operand" on CPU);
    * "in_gemm_sk": "in_gemm" with the shrink and the gate in one split-K kernel
      (``ec_shrink_splitk.py``) that triggers the PDL-launched GEMM first thing, so the shrink runs
      beside the GEMM's K loop instead of before it;
    * "in_gemm_self": one launch of the register-operand GEMM with 1-4 more CTAs per block of x rows that
      compute that block's shrink (wgmma) and gate while the output tiles run their K loops, which wait
      for it only before their EC step (``ec_gemm_self.py``; rank <= 64, gate <= 16 wide, bf16; on that
      launch's own tuned config, ``w4a16_triton.ec_self_config``; where it has none or the EC does not fit,
      "in_gemm");
    * "auto": the structure measured fastest for this (M, N, K, G) on this GPU
      (``w4a16_triton.ec_structure``, written by ``benchmarks/kernels.py``), else "side".

    (The structure decides speed only: each computes the reference's numbers within bf16 rounding.)"""
    from .ec_triton import ec_expand_add_, ec_shrink_gate
    from .w4a16_triton import ec_structure, w4a16_gemm

    if structure not in OVERLAP_STRUCTURES:
        raise ValueError(f"ec_overlapped: structure={structure!r}; expected one of {OVERLAP_STRUCTURES}")
    M, K = x2.shape
    if structure == "auto":
        structure = ec_structure(M, qweight.shape[0], K, group_size)
    if structure.startswith("c_operand"):
        from .dequant_cublas import ec_dequant_cublas

        return ec_dequant_cublas(x2, qweight, scales, zeros, group_size, bias, A, B, W1, b1, W2, b2, alpha, act,
                                 side=side, high_priority_ec=structure == "c_operand_hi")
    if structure.startswith("in_gemm"):
        y = _ec_in_gemm(x2, qweight, scales, zeros, group_size, bias, A, B, W1, b1, W2, b2, alpha, act,
                        splitk=structure == "in_gemm_sk", self_=structure == "in_gemm_self")
        if y is not None:
            return y
        if not x2.is_cuda:  # (CPU: Triton's interpreter in tests) the structure that runs there
            from .dequant_cublas import ec_dequant_cublas

            return ec_dequant_cublas(x2, qweight, scales, zeros, group_size, bias, A, B, W1, b1, W2, b2, alpha, act)
        structure = "side"

    main = torch.cuda.current_stream(x2.device)
    side = side or _side_stream(x2.device, HIGH_PRIORITY if structure == "side_hi" else 0)
    side.wait_stream(main)  # x2 is ready on main
    with torch.cuda.stream(side):
        hg = ec_shrink_gate(x2, A, W1, b1, W2, b2, act)
    y = w4a16_gemm(x2, qweight, scales, zeros, group_size, bias)
    main.wait_stream(side)
    x2.record_stream(side)
    hg.record_stream(main)
    return ec_expand_add_(y, hg, B, alpha)


_PADDED_B: dict = {}


def _ec_in_gemm(x2, qweight, scales, zeros, group_size, bias, A, B, W1, b1, W2, b2, alpha, act, splitk=False,
                self_=False):
    """The "in_gemm" structure, or None where no warpgroup-MMA GEMM can take the call. Where the tuned table
    runs this shape on the register-operand GEMM, that kernel takes the EC step and is launched with PDL
    behind the gate kernel: its K loop runs while the gate finishes, and it waits only before reading
    alpha g h. ``splitk``: shrink and gate in one split-K kernel that triggers the GEMM at once
    (``ec_shrink_splitk.py``); else cuBLAS's shrink runs first, then the gate kernel. ``self_``: shrink and gate
    in the GEMM's own launch (``ec_gemm_self.py``) where the register-operand GEMM has a measured config for the
    shape (``wgmma_ra_config``: the table's GEMM, or that kernel's fastest) and the EC fits it."""
    from . import w4a16_gemm_wgmma as wg
    from . import w4a16_gemm_wgmma_ra as ra
    from .ec_decode_triton import pdl_launch_ok
    from .ec_gemm_self import self_takes
    from .ec_shrink_splitk import ec_shrink_gate_splitk
    from .ec_triton import ec_shrink_gate
    from .w4a16_triton import WGMMA_RA, derived_cached, ec_self_config, gemm_config, wgmma_config

    M, K = x2.shape
    N = qweight.shape[0]
    if not (wg.takes(x2, N, group_size, scales, zeros, bias) and A.shape[0] <= 128):
        return None
    cfg = gemm_config(M, N, K, group_size)
    use_ra = cfg[0] == WGMMA_RA and ra.takes(x2, N, group_size, scales, zeros, bias)
    x2 = x2.contiguous()  # (here, before the gate: nothing may run between the gate and a PDL launch)
    R = B.shape[1]

    def padded():  # bf16 [N, R8]: the TMA copy needs 16-byte rows (columns past R are zeros, as in hg)
        r8 = -(-R // 8) * 8
        out = torch.zeros(N, r8, dtype=torch.bfloat16, device=B.device)
        out[:, :R] = B
        return out

    Bp = B if B.dtype == torch.bfloat16 and R % 8 == 0 and B.is_contiguous() else derived_cached(_PADDED_B, [B], padded)
    shrink_gate = ec_shrink_gate_splitk if splitk and A.is_contiguous() else ec_shrink_gate
    cfg_self = ec_self_config(M, N, K, group_size) if self_ else None
    if (cfg_self is not None and ra.takes(x2, N, group_size, scales, zeros, bias)
            and self_takes(A, Bp, W1, K) is None):
        return ra.w4a16_gemm_wgmma_ra_ec_self(x2, qweight, scales, zeros, group_size, bias, A, Bp, W1, b1, W2, b2,
                                              alpha, act, config=cfg_self)
    if use_ra:
        pdl = pdl_launch_ok(x2.device)
        if ra.ring_params_wanted(tuple(cfg[1:]), group_size, K, N):  # (made here, before the gate: see x2 above)
            ra.ring_row_params(scales, zeros)
        hg = shrink_gate(x2, A, W1, b1, W2, b2, act, alpha=alpha, dtype=x2.dtype, pdl_trigger=pdl)
        return ra.w4a16_gemm_wgmma_ra(x2, qweight, scales, zeros, group_size, bias, config=tuple(cfg[1:]),
                                      ec=(hg, Bp), ec_wait=pdl)
    hg = shrink_gate(x2, A, W1, b1, W2, b2, act, alpha=alpha, dtype=x2.dtype)  # [M, R_P], alpha g h
    return wg.w4a16_gemm_wgmma(x2, qweight, scales, zeros, group_size, bias, config=wgmma_config(M, N, K, group_size),
                               ec=(hg, Bp))


def register_cuda_kernels() -> None:
    """Route the ops' CUDA dispatch key to the Triton implementations (idempotent)."""
    if getattr(register_cuda_kernels, "_done", False):
        return
    torch.library.register_kernel("spear::w4a16_linear", "cuda", w4a16_linear_cuda)
    torch.library.register_kernel("spear::ec_linear", "cuda", ec_linear_cuda)
    from .ec_cat import ec_linear_cat_cuda, ec_linear_glu_cuda
    from .w4a16_cat import w4a16_linear_cat_cuda, w4a16_linear_glu_cuda

    torch.library.register_kernel("spear::w4a16_linear_cat", "cuda", w4a16_linear_cat_cuda)
    torch.library.register_kernel("spear::ec_linear_cat", "cuda", ec_linear_cat_cuda)
    torch.library.register_kernel("spear::w4a16_linear_glu", "cuda", w4a16_linear_glu_cuda)
    torch.library.register_kernel("spear::ec_linear_glu", "cuda", ec_linear_glu_cuda)
    register_cuda_kernels._done = True  # type: ignore[attr-defined]
