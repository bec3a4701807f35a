"""M = 1 W4A16 GEMV as one streaming pass: every program loads one tile once, partials meet in order.

Reference: ``lowering/w4a16.py:w4a16_linear_ref``.

Why: the looping M = 1 kernel (``w4a16_triton._w4a16_gemv1_kernel``, 1024 programs at 8192^2,
2 tiles each, 128 registers, 25 % occupancy) reads 8192^2's 35.7 MB in 17.2 us on the H200, and a
tensor-core rewrite with 30-45 % fewer instructions per weight ran no faster (benchmarks/NOTES.md,
session 7): the kernel is not issue-bound. A plain streaming read of the same bytes, one 4 KB load
per program and thousands of programs, takes 9.8 us (``benchmarks/read_floor.py``): what the GPU
needs is many small, register-light programs whose loads are all issued up front. So here the grid
is (row blocks, K splits), each program reads exactly one [BLOCK_N, BLOCK_W] tile of the GEMV
words (``gemv_words`` layout, the same nibble arithmetic: ``w4a16_triton._gemv1_tile``), writes its
BLOCK_N partial sums to its own slot of an fp32 workspace [splits, N], and bumps its row block's
counter; the last program of a row block (acq_rel counter) adds the splits' partials *in split
order* - deterministic, unlike fp32 atomics - plus the bias, stores the output and resets the
counter, so consecutive launches and CUDA-graph replays need no memset.
NOTE (ordering): each program's partial stores are ordered before its counter increment by a CTA
barrier and the increment's release; the last program's acquire makes them visible to its loads.
The workspace is per device and stream (launches on one stream serialise).
"""
from __future__ import annotations

from typing import Optional

import torch

from ._triton import HAS_TRITON, INTERPRET

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .w4a16_triton import _gemv1_scales, _gemv1_tile

    @triton.jit
    def _w4a16_gemv1_splitk_kernel(X, QW, S, Z, BIAS, Y, WS, CNT, N, K, KW, NG, MAG7, MAG11, MAG15, MAG19, MAG23,
                                   G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
                                   SPLITS: tl.constexpr, SPLITS_P: tl.constexpr, NIB: tl.constexpr,
                                   ASM: tl.constexpr, PER_CHANNEL: tl.constexpr, HAS_Z: tl.constexpr,
                                   HAS_BIAS: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        w0 = pid_k * BLOCK_W
        offs_w = tl.arange(0, BLOCK_W)
        w = tl.load(QW + offs_n[:, None] * KW + (w0 + offs_w)[None, :],
                    mask=mask_n[:, None] & ((w0 + offs_w) < KW)[None, :], other=0, eviction_policy="evict_first")
        sc, z = _gemv1_scales(S, Z, offs_n, mask_n, w0, KW, NG, G, BLOCK_W, PER_CHANNEL, HAS_Z)
        d, sx = _gemv1_tile(w, sc, z, X, w0, KW, MAG7, MAG11, MAG15, MAG19, MAG23, BLOCK_W, NIB, ASM, PER_CHANNEL,
                            HAS_Z)
        part = tl.sum(d, axis=1)  # [BLOCK_N]
        if PER_CHANNEL:  # scale and zero point are per row: each split applies them to its own part
            if HAS_Z:
                part -= tl.load(Z + offs_n, mask=mask_n, other=0.0).to(tl.float32) * tl.sum(sx, axis=0)
            part *= tl.load(S + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        tl.store(WS + pid_k * N + offs_n, part, mask=mask_n)
        tl.debug_barrier()
        done = tl.atomic_add(CNT + pid_n, 1, sem="acq_rel")
        if done == SPLITS - 1:  # the last split of this row block: sum the parts in split order
            offs_s = tl.arange(0, SPLITS_P)
            parts = tl.load(WS + offs_s[:, None] * N + offs_n[None, :],
                            mask=(offs_s < SPLITS)[:, None] & mask_n[None, :], other=0.0, cache_modifier=".cg")
            out = tl.sum(parts, axis=0)
            if HAS_BIAS:
                out += tl.load(BIAS + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            tl.store(Y + offs_n, out.to(Y.dtype.element_ty), mask=mask_n)
            tl.atomic_xchg(CNT + pid_n, 0)


# (BLOCK_N, BLOCK_W int32 words per row and program, num_warps)
# (register counts for sm_90, bf16, G = 128, read offline from the cubin: 48, 48, 64, 64, 88, 128, 128, 128)
SPLITK_CONFIGS = [(8, 32, 1)] if INTERPRET else [
    (8, 128, 4), (4, 128, 2), (16, 128, 4), (8, 256, 4), (8, 128, 1), (16, 64, 1), (32, 128, 4), (16, 128, 2),
]
_WS: dict = {}


def splitk_workspace(device: torch.device, splits: int, N: int, row_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 [splits * N] partials, int32 [row_blocks] counters) for launches on the current stream,
    grown as needed; counters start at zero and every launch leaves them at zero."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    ws, cnt = _WS.get(key, (None, None))
    if ws is None or ws.numel() < splits * N:
        ws = torch.empty(splits * N, dtype=torch.float32, device=device)
    if cnt is None or cnt.numel() < row_blocks:
        cnt = torch.zeros(row_blocks, dtype=torch.int32, device=device)
    _WS[key] = (ws, cnt)
    return ws, cnt


def w4a16_gemv1_splitk(x2: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
                       G: int, bias: Optional[torch.Tensor], config: Optional[tuple] = None,
                       out: Optional[torch.Tensor] = None, nib: str = "exact") -> torch.Tensor:
    """Y[1, N] from the GEMV words (``w4a16_triton.gemv_words``). config = (BLOCK_N, BLOCK_W, warps);
    a tile holds whole 32-column chunks of one quantization group or whole groups (BLOCK_W clipped)."""
    from .w4a16_triton import _MAGICS, GEMV1_NIBS

    M, K = x2.shape
    N, KW = words.shape
    if M != 1 or KW * 8 != K:
        raise ValueError(f"w4a16_gemv1_splitk: x2 {tuple(x2.shape)} and words {tuple(words.shape)}; "
                         f"needs M = 1 and K = 8 * words.shape[1]")
    bn, bw, warps = config or SPLITK_CONFIGS[0]
    bw = min(bw, triton.next_power_of_2(KW))
    splits = triton.cdiv(KW, bw)
    row_blocks = triton.cdiv(N, bn)
    ws, cnt = splitk_workspace(x2.device, splits, N, row_blocks)
    y = out if out is not None else torch.empty(M, N, dtype=x2.dtype, device=x2.device)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    _w4a16_gemv1_splitk_kernel[(row_blocks, splits)](
        x2, words, scales, zeros if zeros is not None else scales, bias if bias is not None else scales, y, ws, cnt,
        N, K, KW, K // G, *_MAGICS,
        G=G, BLOCK_N=bn, BLOCK_W=bw, SPLITS=splits, SPLITS_P=triton.next_power_of_2(splits), NIB=GEMV1_NIBS[nib],
        ASM=not INTERPRET, PER_CHANNEL=G >= K, HAS_Z=zeros is not None, HAS_BIAS=bias is not None,
        num_warps=warps, num_stages=1,
    )
    return y
