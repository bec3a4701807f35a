"""Triton W4A16 kernels (CUDA; on CPU under ``TRITON_INTERPRET=1`` for tests).

Reference: ``lowering/w4a16.py:w4a16_linear_ref`` (and ``ec_linear_ref`` for the fused EC).

``_w4a16_gemv_kernel`` - small M (decode). One program per BLOCK_N output rows loops
over all of K. The int4 weight is never dequantized element-wise: per K-tile (which
never straddles a quantization group) it accumulates ``sum_k q[n,k] x[k]`` and
``sum_k x[k]`` and applies ``s * (qx - z * sx)`` once, so the inner loop is
convert + FMA on the bytes it streams. With ``HAS_EC`` the same launch also computes
the error compensator: the first ``P_H`` programs compute split-K partials of
``h = A x`` into a tiny fp32 workspace and publish them with a release-counter; the
GEMV programs, after their weight loop, acquire that counter, run the gate MLP on the
r-vector and add ``alpha * B[rows] (g * h)`` to the accumulator before the single
store. The last GEMV program resets the workspace, so consecutive launches (and CUDA
graph replays) need no memset.
NOTE (forward progress): GEMV programs spin on the counter only after their main loop;
the producers are the lowest program ids, which the hardware dispatches first, the
same assumption CUB's decoupled look-back scan makes.

``_w4a16_gemm_kernel`` - large M (prefill). Tiled GEMM; each K-tile of packed weights
is unpacked (``join`` of low/high nibbles), dequantized in the activation dtype in the
same order as the reference, ``(q - z) * s``, and fed to ``tl.dot``.
"""
from __future__ import annotations

from typing import Optional

import torch

from ._triton import ACT_CODES, HAS_TRITON, INTERPRET, next_pow2

GEMV_MAX_M = 4  # rows handled by the GEMV kernel; above this the tiled GEMM (tensor cores) is faster

if HAS_TRITON:
    import triton
    import triton.language as tl

    from ._triton import gate_act

    @triton.jit
    def _w4a16_gemv_kernel(
        X, QW, S, Z, BIAS, Y,
        A, B, W1, B1, W2, B2, ALPHA, HBUF, CNT,
        M, N, K, G, NG, stride_xm, stride_ym, R, D,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TG: tl.constexpr,
        PER_CHANNEL: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr,
        HAS_EC: tl.constexpr, P_H: tl.constexpr, BLOCK_KH: tl.constexpr, R_P: tl.constexpr, D_P: tl.constexpr,
        ACT: tl.constexpr,
    ):
        pid = tl.program_id(0)
        offs_m = tl.arange(0, BLOCK_M)
        mask_m = offs_m < M
        if HAS_EC and pid < P_H:
            # ---- producer (the first P_H programs, before their own GEMV work): split-K partial
            # of h = A x, published to HBUF. No extra programs: the GEMV keeps its wave count.
            offs_r = tl.arange(0, R_P)
            mask_r = offs_r < R
            chunk = tl.cdiv(tl.cdiv(K, P_H), BLOCK_KH) * BLOCK_KH
            k_lo = pid * chunk
            h = tl.zeros([BLOCK_M, R_P], dtype=tl.float32)
            for k0 in range(k_lo, tl.minimum(k_lo + chunk, K), BLOCK_KH):
                offs_k = k0 + tl.arange(0, BLOCK_KH)
                mask_k = offs_k < K
                a = tl.load(A + offs_r[:, None] * K + offs_k[None, :], mask=mask_r[:, None] & mask_k[None, :],
                            other=0.0).to(tl.float32)
                x = tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                            other=0.0).to(tl.float32)
                h += tl.sum(x[:, None, :] * a[None, :, :], axis=2)
            tl.atomic_add(HBUF + offs_m[:, None] * R_P + offs_r[None, :], h,
                          mask=mask_m[:, None] & mask_r[None, :], sem="release")
            tl.debug_barrier()
            tl.atomic_add(CNT, 1, sem="release")
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        if HAS_EC:  # EC operands do not depend on h: load them before the weight stream
            offs_r = tl.arange(0, R_P)
            mask_r = offs_r < R
            offs_d = tl.arange(0, D_P)
            mask_d = offs_d < D
            w1 = tl.load(W1 + offs_d[:, None] * R + offs_r[None, :], mask=mask_d[:, None] & mask_r[None, :],
                         other=0.0).to(tl.float32)
            b1 = tl.load(B1 + offs_d, mask=mask_d, other=0.0).to(tl.float32)
            w2 = tl.load(W2 + offs_r[:, None] * D + offs_d[None, :], mask=mask_r[:, None] & mask_d[None, :],
                         other=0.0).to(tl.float32)
            b2 = tl.load(B2 + offs_r, mask=mask_r, other=0.0).to(tl.float32)
            bt = tl.load(B + offs_n[:, None] * R + offs_r[None, :], mask=mask_n[:, None] & mask_r[None, :],
                         other=0.0).to(tl.float32)
            alpha = tl.load(ALPHA).to(tl.float32)
        HALF: tl.constexpr = BLOCK_K // 2
        offs_h = tl.arange(0, HALF)
        NT: tl.constexpr = BLOCK_K // TG  # scale groups per K tile
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        sx_all = tl.zeros([BLOCK_M], dtype=tl.float32)  # per-channel: sum_k x, for the zero point
        KB = K // 2
        for k0 in range(0, K, BLOCK_K):
            kb = k0 // 2 + offs_h
            mask_kb = kb < KB
            p = tl.load(QW + offs_n[:, None] * KB + kb[None, :], mask=mask_n[:, None] & mask_kb[None, :], other=0)
            lo = (p & 0xF).to(tl.float32)
            hi = (p >> 4).to(tl.float32)
            offs_k = k0 + tl.arange(0, BLOCK_K)
            if not PER_CHANNEL:
                g = k0 // TG * TG // G + tl.arange(0, NT)  # group index of each TG sub-tile
                mask_g = mask_n[:, None] & (g[None, :] < NG)
                s = tl.load(S + offs_n[:, None] * NG + g[None, :], mask=mask_g, other=0.0).to(tl.float32)
                if HAS_Z:
                    z = tl.load(Z + offs_n[:, None] * NG + g[None, :], mask=mask_g, other=0.0).to(tl.float32)
            for m in tl.static_range(BLOCK_M):
                x = tl.load(X + m * stride_xm + offs_k, mask=(offs_k < K) & (m < M), other=0.0).to(tl.float32)
                xe, xo = tl.split(tl.reshape(x, [HALF, 2]))
                prod = lo * xe[None, :] + hi * xo[None, :]  # [BLOCK_N, BLOCK_K / 2]
                if PER_CHANNEL:
                    part = tl.sum(prod, axis=1)
                    sx_all += tl.where(offs_m == m, tl.sum(xe + xo, axis=0), 0.0)
                else:
                    qx = tl.sum(tl.reshape(prod, [BLOCK_N, NT, TG // 2]), axis=2)  # [BLOCK_N, NT]
                    if HAS_Z:
                        sx = tl.sum(tl.reshape(xe + xo, [NT, TG // 2]), axis=1)  # [NT]
                        qx = qx - z * sx[None, :]
                    part = tl.sum(s * qx, axis=1)
                acc += tl.where(offs_m[:, None] == m, part[None, :], 0.0)
        if PER_CHANNEL:  # y = s * (sum q x - z * sum x), applied once
            s1 = tl.load(S + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            if HAS_Z:
                z1 = tl.load(Z + offs_n, mask=mask_n, other=0.0).to(tl.float32)
                acc = acc - z1[None, :] * sx_all[:, None]
            acc = acc * s1[None, :]
        if HAS_BIAS:
            acc += tl.load(BIAS + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        if HAS_EC:
            # ---- consumer: wait for h, gate it, add alpha * B (g * h)
            c = tl.load(CNT, volatile=True)  # poll with plain loads, then one acquire
            while c < P_H:
                c = tl.load(CNT, volatile=True)
            tl.atomic_add(CNT, 0, sem="acquire")
            h = tl.load(HBUF + offs_m[:, None] * R_P + offs_r[None, :], volatile=True)
            zz = gate_act(tl.sum(h[:, None, :] * w1[None, :, :], axis=2) + b1[None, :], ACT)
            gg = tl.sigmoid(tl.sum(zz[:, None, :] * w2[None, :, :], axis=2) + b2[None, :])
            acc += alpha * tl.sum((gg * h)[:, None, :] * bt[None, :, :], axis=2)
            tl.debug_barrier()
            done = tl.atomic_add(CNT + 1, 1, sem="acq_rel")
            if done == tl.num_programs(0) - 1:  # last reader resets the workspace
                tl.store(HBUF + offs_m[:, None] * R_P + offs_r[None, :], tl.zeros([BLOCK_M, R_P], tl.float32))
                tl.atomic_xchg(CNT + 1, 0)
                tl.atomic_xchg(CNT, 0)
        tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty),
                 mask=mask_m[:, None] & mask_n[None, :])

    @triton.jit
    def _w4a16_gemm_kernel(
        X, QW, S, Z, BIAS, Y, M, N, K, G, NG, stride_xm, stride_ym,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TG: tl.constexpr, GROUP_M: tl.constexpr,
        HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr,
    ):
        pid = tl.program_id(0)
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        group = pid // (GROUP_M * num_n)  # grouped ordering: tiles sharing weights run together
        first_m = group * GROUP_M
        size_m = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % size_m)
        pid_n = (pid % (GROUP_M * num_n)) // size_m
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m = offs_m < M
        mask_n = offs_n < N
        HALF: tl.constexpr = BLOCK_K // 2
        KB = K // 2
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask_m[:, None] & (offs_k[None, :] < K),
                        other=0.0)
            kb = k0 // 2 + tl.arange(0, HALF)
            p = tl.load(QW + offs_n[:, None] * KB + kb[None, :], mask=mask_n[:, None] & (kb[None, :] < KB), other=0)
            q = tl.join(p & 0xF, p >> 4).reshape(BLOCK_N, BLOCK_K)
            NT: tl.constexpr = BLOCK_K // TG
            g = k0 // TG * TG // G + tl.arange(0, NT)
            if UPCAST:  # Triton's interpreter mishandles bf16 arithmetic: CPU tests use fp32 there
                x = x.to(tl.float32)
            mask_g = mask_n[:, None] & (g[None, :] < NG)
            s = tl.load(S + offs_n[:, None] * NG + g[None, :], mask=mask_g, other=0.0).to(x.dtype)
            w = tl.reshape(q.to(x.dtype), [BLOCK_N, NT, TG])
            if HAS_Z:
                z = tl.load(Z + offs_n[:, None] * NG + g[None, :], mask=mask_g, other=0.0).to(x.dtype)
                w = w - z[:, :, None]
            w = tl.reshape(w * s[:, :, None], [BLOCK_N, BLOCK_K])
            acc = tl.dot(x, tl.trans(w), acc)
        if HAS_BIAS:
            acc += tl.load(BIAS + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty),
                 mask=mask_m[:, None] & mask_n[None, :])


    @triton.jit
    def _w4_dequant_kernel(QW, S, Z, W, N, K, G, NG, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           HAS_Z: tl.constexpr):
        """W[N, K] = (q - z) * s in W's dtype: the prologue of the dequantize + cuBLAS path."""
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
        p = tl.load(QW + offs_n[:, None] * (K // 2) + offs_k[None, :] // 2, mask=mask, other=0)
        q = tl.where(offs_k[None, :] % 2 == 0, p & 0xF, p >> 4).to(W.dtype.element_ty)
        g = offs_k[None, :] // G
        if HAS_Z:
            q = q - tl.load(Z + offs_n[:, None] * NG + g, mask=mask, other=0.0).to(W.dtype.element_ty)
        w = q * tl.load(S + offs_n[:, None] * NG + g, mask=mask, other=0.0).to(W.dtype.element_ty)
        tl.store(W + offs_n[:, None] * K + offs_k[None, :], w, mask=mask)


# ------------------------------------------------------------------------ host side
# (BLOCK_N, BLOCK_K, num_warps, num_stages); BLOCK_K is clipped to the group size.
GEMV_CONFIGS = [(16, 128, 4, 1)] if INTERPRET else [
    (32, 1024, 8, 2), (16, 1024, 4, 3), (32, 512, 4, 3), (16, 2048, 8, 2), (64, 512, 8, 3), (8, 2048, 4, 2),
    (32, 2048, 8, 1), (16, 512, 4, 4), (64, 1024, 8, 2), (8, 1024, 4, 3),
]
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
GEMM_CONFIGS = [(16, 32, 64, 4, 1)] if INTERPRET else [
    (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (64, 128, 64, 4, 4), (128, 128, 128, 8, 3), (64, 64, 64, 4, 4),
    (16, 64, 128, 4, 4), (32, 64, 128, 4, 4), (64, 256, 64, 8, 3), (16, 32, 256, 4, 4), (16, 32, 512, 4, 3),
    (16, 64, 256, 4, 3), (32, 32, 256, 4, 4),
]

_TABLE: Optional[dict] = None  # tuned configs for this GPU (tuning.load_table("configs")), loaded lazily


def tuned_table() -> dict:
    global _TABLE
    if _TABLE is None:
        from .tuning import load_table

        _TABLE = (load_table("configs") or {}) if torch.cuda.is_available() and not INTERPRET else {}
    return _TABLE


def gemv_key(N: int, K: int, G: int, has_ec: bool) -> str:
    return f"gemv|{N}|{K}|{G}|{int(has_ec)}"


def gemm_key(M: int, N: int, K: int, G: int) -> str:
    return f"gemm|{_m_bucket(M)}|{N}|{K}|{G}"


def _default_gemm(M: int) -> tuple:
    if INTERPRET:
        return GEMM_CONFIGS[0]
    return (16, 64, 128, 4, 4) if M <= 16 else (64, 128, 64, 4, 4) if M <= 128 else (128, 128, 64, 8, 3)


_WORKSPACE: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _tiles(bk: int, G: int, K: int) -> tuple[int, int]:
    """(BLOCK_K, TG): TG is the sub-tile sharing one scale; a K tile holds whole groups or
    lies inside one (powers of two), and never runs past what masking covers."""
    bk = max(16, min(bk, next_pow2(K)))
    if G >= K:  # per-channel: one group, any tile
        return bk, bk
    return bk, min(bk, G)


def ec_workspace(device: torch.device, r_p: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused kernel's h buffer [GEMV_MAX_M, r_p] fp32 and its two counters, zeroed once.

    Shared by every fused launch on the device: launches on one stream serialize, and each
    launch leaves it zeroed (see the kernel docstring).
    """
    key = (str(device), r_p)
    ws = _WORKSPACE.get(key)
    if ws is None:
        ws = (torch.zeros(GEMV_MAX_M, r_p, dtype=torch.float32, device=device),
              torch.zeros(2, dtype=torch.int32, device=device))
        _WORKSPACE[key] = ws
    return ws


def w4a16_gemv(x2, qweight, scales, zeros, G: int, bias, ec: Optional[tuple] = None, act: str = "silu",
               config: Optional[tuple] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Y[M, N] for M <= GEMV_MAX_M, optionally with the EC fused (ec = (A, B, W1, b1, W2, b2, alpha))."""
    M, K = x2.shape
    N = qweight.shape[0]
    if M > GEMV_MAX_M:
        raise ValueError(f"w4a16_gemv: M={M} > {GEMV_MAX_M}; use the GEMM kernel")
    y = out if out is not None else torch.empty(M, N, dtype=x2.dtype, device=x2.device)
    bn, bk, warps, stages = config or tuple(tuned_table().get(gemv_key(N, K, G, ec is not None), GEMV_CONFIGS[0]))
    bk, tg = _tiles(bk, G, K)
    BM = next_pow2(M)
    dummy = scales
    if ec is not None:
        A, B, W1, b1, W2, b2, alpha = ec
        R, D = A.shape[0], W1.shape[0]
        r_p, d_p = next_pow2(R), next_pow2(D)
        hbuf, cnt = ec_workspace(x2.device, r_p)
        # Programs run one after another in Triton's interpreter: a single producer (program 0)
        # keeps the spin-wait satisfiable there; GPUs split A x over up to 64 producers.
        p_h = 1 if INTERPRET else max(1, min(64, triton.cdiv(K, 256), triton.cdiv(N, bn)))
    else:
        A = B = W1 = b1 = W2 = b2 = alpha = hbuf = cnt = dummy
        R = D = r_p = d_p = 1
        p_h = 0
    grid = (triton.cdiv(N, bn),)
    _w4a16_gemv_kernel[grid](
        x2, qweight, scales, zeros if zeros is not None else dummy,
        bias if bias is not None else dummy, y, A, B, W1, b1, W2, b2, alpha, hbuf, cnt,
        M, N, K, G, K // G, x2.stride(0), y.stride(0), R, D,
        BLOCK_M=BM, BLOCK_N=bn, BLOCK_K=bk, TG=tg, PER_CHANNEL=G >= K, HAS_Z=zeros is not None,
        HAS_BIAS=bias is not None, HAS_EC=ec is not None, P_H=p_h, BLOCK_KH=32 if INTERPRET else 64,
        R_P=r_p, D_P=d_p, ACT=ACT_CODES[act],
        num_warps=warps, num_stages=stages,
    )
    return y


def w4_dequantize(qweight, scales, zeros, G: int, dtype: torch.dtype) -> torch.Tensor:
    """The whole weight as [N, K] in ``dtype`` (one pass: reads N*K/2 bytes, writes N*K*2)."""
    N, K = qweight.shape[0], qweight.shape[1] * 2
    w = torch.empty(N, K, dtype=dtype, device=qweight.device)
    bn, bk = (16, 32) if INTERPRET else (32, 256)
    _w4_dequant_kernel[(triton.cdiv(N, bn), triton.cdiv(K, bk))](
        qweight, scales, zeros if zeros is not None else scales, w, N, K, G, K // G,
        BLOCK_N=bn, BLOCK_K=bk, HAS_Z=zeros is not None)
    return w


DEQUANT_CUBLAS = ("dequant_cublas",)  # table value: dequantize to a scratch weight, then cuBLAS


def w4a16_gemm(x2, qweight, scales, zeros, G: int, bias, config: Optional[tuple] = None,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Y[M, N] for any M: the tiled in-loop-dequant Triton GEMM, or (when the tuned table says
    it is faster for this M, as for large M where cuBLAS's tensor-core pipeline wins)
    one dequantize pass plus cuBLAS."""
    M, K = x2.shape
    N = qweight.shape[0]
    config = config or tuple(tuned_table().get(gemm_key(M, N, K, G), _default_gemm(M)))
    if tuple(config) == DEQUANT_CUBLAS:
        w = w4_dequantize(qweight, scales, zeros, G, x2.dtype)
        return torch.nn.functional.linear(x2, w, bias) if out is None else torch.addmm(
            bias, x2, w.t(), out=out) if bias is not None else torch.mm(x2, w.t(), out=out)
    y = out if out is not None else torch.empty(M, N, dtype=x2.dtype, device=x2.device)
    bm, bn, bk, warps, stages = config
    bk, tg = _tiles(bk, G, K)
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    _w4a16_gemm_kernel[grid](
        x2, qweight, scales, zeros if zeros is not None else scales, bias if bias is not None else scales, y,
        M, N, K, G, K // G, x2.stride(0), y.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, TG=tg, GROUP_M=8, HAS_Z=zeros is not None, HAS_BIAS=bias is not None,
        UPCAST=INTERPRET and x2.dtype == torch.bfloat16, num_warps=warps, num_stages=stages,
    )
    return y


def _m_bucket(M: int) -> int:
    return min(next_pow2(M), 4096)
