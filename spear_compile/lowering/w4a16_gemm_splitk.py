"""Small-M W4 GEMM on tensor cores with the group scales applied to the product, and a deterministic K split.

Reference: ``ops/w4a16_ref.py:w4a16_linear_ref``. Serving decodes 8-128 requests per step, where the plain Triton
GEMM (``w4a16_triton._w4a16_gemm_kernel``) ran at 0.92-1.36x cuBLAS bf16 on the H200 (M = 16, 2026-12-01): it
dequantizes every weight element in the activation dtype (convert, subtract the zero, multiply by the scale:
four or five instructions per element) and its grid, one program per output tile over all of K, is under one
wave on 132 SMs for N <= 8192 at the small tiles small M needs.

This kernel changes both:

* **Scales on the product.** A K tile never straddles a quantization group, so for the tile's group g
  ``sum_k x_k (q_nk - z_ng) s_ng = s_ng (sum_k x_k q_nk - z_ng sum_k x_k)``: the MMA runs on the raw nibbles and
  the scale and zero apply once per (row, column, tile) to the [BLOCK_M, BLOCK_N] product, not to every element.
  A nibble becomes an MMA operand without a conversion: OR-ed into the low mantissa bits of 2^E (bf16 128.0 =
  0x4300, fp16 1024.0 = 0x6400) it *is* 2^E + q exactly, so the tile's product is
  ``sum_k x_k (2^E + q_nk)`` and ``2^E + z`` is subtracted with the zero. Per element that is a shift or mask
  and an OR (one LOP3), against four or five instructions.
* **K split.** ``SPLIT`` programs share an output tile, each over a contiguous run of K tiles, so short grids
  fill the GPU. Each writes its fp32 partial tile into its own slot of a workspace; the last to arrive (an
  acq_rel counter per tile) sums the slots in slot order, adds the bias, stores Y and resets the counter.
  The sum's order does not depend on arrival, so results are bitwise reproducible, and nothing but the
  counter needs resetting (graph replays need no memset).

Numbers: the product of a bf16 activation and 2^E + q is exact in fp32 and the MMA accumulates in fp32;
subtracting ``(2^E + z) sum x`` cancels about E bits of the partial, leaving ~2^-17 relative error for bf16
(E = 7) - below bf16's own rounding of the output. It differs from the reference, which rounds each
dequantized weight to the activation dtype, by a few units in the output's last place (the tests' tolerance).

Contract: fp16 / bf16 activations [M, K] with unit column stride; the "spear" packed weight [N, K/2] uint8;
group size G with G % BLOCK_K == 0 after clipping (``tile_k``), or per-channel (G >= K). Workspace state is
kept per device and shared by launches that serialize on one stream; two K-split launches must not run
concurrently on different streams. The first launch at a larger size grows the workspace and must happen
outside CUDA-graph capture (the usual warm-up does).

Prediction (to be measured by ``benchmarks/kernels.py``, H200, 8192 x 8192, M = 16): the weight's bytes
(33.6 MB + 1 MB of scales and zeros) at the ~3.3 TB/s the M = 1 GEMV reaches put the floor near 10.5 us;
the per-element work (LOP3 + the operand's trip through shared memory) is within that at 132 x 4 warps, so
~12-16 us (0.35-0.47x cuBLAS's 34 us) against 37.7 us for the plain Triton GEMM.
"""
from __future__ import annotations

from typing import Optional

import torch

from ._triton import HAS_TRITON, INTERPRET, next_pow2
from . import device as _device
from .layout_cache import derived_cached, grown_workspace

SPLITK = "splitk"  # table value ("splitk", BLOCK_M, BLOCK_N, BLOCK_K, SPLIT, num_warps, num_stages)
_MAGIC = {torch.bfloat16: (0x4300, 128.0), torch.float16: (0x6400, 1024.0)}

# (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT, num_warps, num_stages): the search space of the tuner and benchmarks/kernels.py.
SPLITK_CONFIGS = [(16, 32, 64, 2, 4, 1)] if INTERPRET else [
    (16, 64, 128, 1, 4, 4), (16, 64, 128, 2, 4, 4), (16, 64, 128, 4, 4, 4), (16, 32, 128, 4, 4, 4),
    (16, 128, 128, 2, 4, 4), (16, 128, 128, 4, 4, 3), (16, 64, 64, 4, 4, 6), (16, 32, 128, 8, 4, 4),
    (32, 64, 128, 2, 4, 4), (32, 128, 128, 1, 4, 4), (32, 128, 128, 2, 8, 3), (64, 64, 128, 1, 4, 4),
    (64, 128, 128, 1, 8, 3), (64, 128, 64, 2, 4, 4), (128, 128, 64, 1, 8, 3), (128, 64, 128, 1, 8, 3),
]

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _w4a16_gemm_splitk_kernel(
        X, QW, S, Z, BIAS, Y, WS, CNT, M, N, K, G, stride_xm, stride_ym,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
        MAGIC: tl.constexpr, MAGIC_F: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        pid = tl.program_id(0)  # output tile, N-major within an M block
        sk = tl.program_id(1)  # which run of K tiles
        num_n = tl.cdiv(N, BLOCK_N)
        pid_m = pid // num_n
        pid_n = pid % num_n
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m = offs_m < M
        mask_n = offs_n < N
        HALF: tl.constexpr = BLOCK_K // 2
        KB = K // 2
        kt = tl.cdiv(K, BLOCK_K)
        per = tl.cdiv(kt, SPLIT)
        t0 = sk * per
        t1 = tl.minimum(t0 + per, kt)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for t in range(t0, t1):
            k0 = t * BLOCK_K
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :],
                        mask=mask_m[:, None] & (offs_k[None, :] < K), other=0.0)
            kb = k0 // 2 + tl.arange(0, HALF)
            p = tl.load(QW + offs_n[:, None] * KB + kb[None, :], mask=mask_n[:, None] & (kb[None, :] < KB), other=0)
            if UPCAST:  # Triton's interpreter mishandles bf16 bit casts: the same 2^E + q in fp32 (fp16 runs the GPU path)
                q = tl.join(p & 0xF, p >> 4).reshape(BLOCK_N, BLOCK_K).to(tl.float32) + MAGIC_F
                d = tl.dot(x.to(tl.float32), tl.trans(q))
            else:
                p16 = p.to(tl.int16)
                q = tl.join((p16 & 0xF) | MAGIC, (p16 >> 4) | MAGIC).reshape(BLOCK_N, BLOCK_K)
                d = tl.dot(x, tl.trans(q.to(x.dtype, bitcast=True)))
            xs = tl.sum(x.to(tl.float32), axis=1)
            g = k0 // G
            s = tl.load(S + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)  # [NG, N]: coalesced
            zz = tl.full([BLOCK_N], MAGIC_F, tl.float32)
            if HAS_Z:
                zz += tl.load(Z + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            acc += (d - xs[:, None] * zz[None, :]) * s[None, :]
        mask = mask_m[:, None] & mask_n[None, :]
        out = Y + offs_m[:, None] * stride_ym + offs_n[None, :]
        if SPLIT == 1:
            if HAS_BIAS:
                acc += tl.load(BIAS + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            tl.store(out, acc.to(Y.dtype.element_ty), mask=mask)
        else:
            slot = offs_m[:, None] * N + offs_n[None, :]
            tl.store(WS + sk * M * N + slot, acc, mask=mask)
            tl.debug_barrier()  # every thread's partial is written before the program's arrival is published
            old = tl.atomic_add(CNT + pid, 1, sem="acq_rel")
            if old == SPLIT - 1:
                tot = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for j in tl.static_range(SPLIT):  # slot order, not arrival order: reproducible sums
                    tot += tl.load(WS + j * M * N + slot, mask=mask, other=0.0, cache_modifier=".cg")
                if HAS_BIAS:
                    tot += tl.load(BIAS + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
                tl.store(out, tot.to(Y.dtype.element_ty), mask=mask)
                tl.atomic_xchg(CNT + pid, 0)


_WS: dict = {}
_PARAMS_T: dict = {}


def params_t(scales: torch.Tensor, zeros: Optional[torch.Tensor]) -> tuple:
    """Scales and zero points as [NG, N] (made once per weight, ``layout_cache``): a tile's loads of one group's
    row parameters are then contiguous; from [N, NG] each column's 2 bytes sit NG * 2 bytes apart, one sector
    per column (what made the register-operand wgmma GEMM stall on them, docs/kernels.md)."""
    return derived_cached(_PARAMS_T, [scales, zeros],
                          lambda: (scales.t().contiguous(), None if zeros is None else zeros.t().contiguous()))


def tile_k(bk: int, G: int, K: int) -> int:
    """BLOCK_K for group size G: at most one group (G >= K: any), at least 16 (the MMA's K), a power of two."""
    bk = max(16, min(bk, next_pow2(K)))
    return bk if G >= K else min(bk, G)


def can_implement(x_dtype: torch.dtype, K: int, G: int, config: tuple) -> tuple:
    """(ok, reason): fp16 / bf16 activations, and K tiles that never straddle a group."""
    if x_dtype not in _MAGIC:
        return False, f"activations {x_dtype}: the nibble-as-operand trick needs fp16 or bf16"
    bk = tile_k(config[2], G, K)
    if G < K and G % bk:
        return False, f"group size {G} is not a multiple of the K tile {bk}"
    return True, f"K tiles of {bk} inside groups of {G}"


def default_config(M: int, N: int, K: int, G: int, sms: int = 132) -> tuple:
    """The untuned choice: the smallest M tile that holds M (16 / 32 / 64, else 128), 64 columns per tile up to
    M = 32, then 128; the K split that brings the grid to about two programs per SM, at most 8 ways and at
    least two K tiles per split."""
    bm = 16 if M <= 16 else 32 if M <= 32 else 64 if M <= 64 else 128
    bn = 64 if M <= 32 else 128
    bk = tile_k(128 if bm <= 64 else 64, G, K)
    tiles = -(-M // bm) * -(-N // bn)
    kt = -(-K // bk)
    split = 1
    while split < 8 and tiles * split * 2 <= 2 * sms and kt // (split * 2) >= 2:
        split *= 2
    warps = 8 if bm * bn >= 128 * 128 else 4
    return (bm, bn, bk, split, warps, 3 if bm >= 64 else 4)


def workspace(device: torch.device, floats: int, counters: int) -> tuple:
    """The K split's fp32 partial slots and int32 counters (``layout_cache.grown_workspace``)."""
    return grown_workspace(_WS, device, floats, counters, "the K-split W4 GEMM")


def w4a16_gemm_splitk(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
                      G: int, bias: Optional[torch.Tensor], config: Optional[tuple] = None,
                      out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Y[M, N] = x2 dequant(W)^T + bias through the K-split tensor-core kernel. ``config`` = (BLOCK_M, BLOCK_N,
    BLOCK_K, SPLIT, num_warps, num_stages), else ``default_config`` (the route passes the tuned one)."""
    from .w4a16_triton import check_x

    M, K = x2.shape
    N = qweight.shape[0]
    check_x("w4a16_gemm_splitk", x2, qweight)
    sms = _device.sm_count(x2.device) if x2.device.type == "cuda" else 132
    bm, bn, bk, split, warps, stages = tuple(config) if config is not None else default_config(M, N, K, G, sms)
    ok, why = can_implement(x2.dtype, K, G, (bm, bn, bk))
    if not ok:
        raise ValueError(f"w4a16_gemm_splitk: {why}")
    bk = tile_k(bk, G, K)
    split = max(1, min(split, -(-K // bk)))
    y = out if out is not None else torch.empty(M, N, dtype=x2.dtype, device=x2.device)
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    ws, cnt = workspace(x2.device, split * M * N, tiles) if split > 1 else (scales, scales)
    magic, magic_f = _MAGIC[x2.dtype]
    st, zt = params_t(scales.reshape(N, -1), None if zeros is None else zeros.reshape(N, -1))
    _w4a16_gemm_splitk_kernel[(tiles, split)](
        x2, qweight, st, zt if zt is not None else st, bias if bias is not None else st, y, ws, cnt,
        M, N, K, min(G, K), x2.stride(0), y.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT=split, MAGIC=magic, MAGIC_F=magic_f, HAS_Z=zeros is not None,
        HAS_BIAS=bias is not None, UPCAST=INTERPRET and x2.dtype == torch.bfloat16, num_warps=warps, num_stages=stages,
    )
    return y
