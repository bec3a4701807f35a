"""Split-KV decode attention for the engine's packed variable-length steps (flash decoding).

Reference: ``ops/attention_ref.py:decode_attention_ref`` (each one-query sequence against all its keys,
softmax in fp32).

Why: the engine's attention (``runtime/attention.py``, ``attention="varlen"``) runs torch's variable-length
Flash Attention kernel, which on torch 2.11 takes no key split (its ``varlen_attn`` has no ``num_splits``,
and FlashAttention-2's varlen forward splits only with a paged KV): a decode (one query) then gets one
program per head, which walks every key of its sequence alone (inferred from the residuals below, not yet
profiled). On an H200 (Llama-2-7B-shaped
W4, 32 heads, 2026-12-06, ``benchmarks/results/serving/2026-12-06_h200_plan_all_layers``) decode-only steps
ran above the latency model by a margin that followed the *longest* sequence, not the keys read: one
decode at 2k context +2.5 ms a step (32 layers), five decodes at 5.3k keys in all +0.1 ms. 32 programs on
132 SMs leave the memory system idle. Here the keys of each one-query sequence are cut into ``splits``
slices, one program per (sequence, head, slice), each keeping a running max, sum and weighted value sum
in fp32 (``_partial``); a second launch merges the slices per (sequence, head) (``_combine``).

Status: checked against its reference under Triton's interpreter (``tests/lowering/test_split_kv_decode.py``)
and on an H100 (``tests/runtime/test_attention_cuda.py``, ``benchmarks/results/gpu_tests/2026-12-07_h100_split_kv``).
Timed there (``benchmarks/decode_attention.py``, ``benchmarks/results/decode_attention/2026-12-07_h100_overlap``),
decode-only steps against torch's kernel: one decode at 0.5-4k keys 0.30-0.70x (32 KV heads) and 0.16-0.44x
(8 KV heads, where torch 2.11 repeats the keys per query head), 16-64 decodes at 1k 0.88-1.03x (32 KV heads).
Routed per step (below), steps with a prefill piece cost 4-19 % over torch's kernel alone, 7-25 us a layer
for ``route_rows`` and the split's two launches over empty sequences
(``benchmarks/results/decode_attention/2026-12-07_h100_routed``). The engine takes it only when
``SPEAR_SPLIT_KV=1`` (``envs``): served, it lost on p99 ITL
(``benchmarks/results/serving/2026-12-07_h100_online_correction_ab``).

Contract of ``split_kv_decode_``: ``q`` (Tq, H, D), ``k`` / ``v`` (Tk, Hkv, D) with H a multiple of Hkv,
``cu_q`` / ``cu_k`` (N + 1,) int32 on the device, as the varlen kernel takes them (sequence i: query rows
``cu_q[i]:cu_q[i+1]``, keys ``cu_k[i]:cu_k[i+1]``, its queries the last of its keys). For every sequence
with exactly one query, row ``cu_q[i]`` of ``out`` (Tq, H, D) is overwritten with its attention over all its
keys; every other row is left as it was. ``max_k`` sizes the slices only: the last slice takes the keys
the others leave, so a sequence longer than ``max_k`` is still attended whole. Everything the launch reads about the step is on the device and
the grid depends only on N, H and ``max_k`` (host ints), so a CUDA graph captures and replays it.

``route_rows(cu_q)``: which kernel takes which sequences, decided on the device (under CUDA graphs the host
only knows padded sizes: transformers passes the padded token count as ``max_q``). A step of decodes only:
every decode to the split-KV kernel, the varlen kernel given a ``cu_q`` of empty sequences (its programs
return when their block starts past the sequence's length). A step with a prefill piece: every sequence to
the varlen kernel, none to the split. Measured before this rule (H100, ``benchmarks/results/decode_attention/
2026-12-07_h100_overlap``): with the decodes split off and run beside torch's kernel, steps with a prefill
piece were 1.02-1.69x torch's kernel alone, overlapped or not: the piece's kernel fills every SM, and torch
runs the decodes in its own launch's idle tail, where the split's reads (about twice their byte floor at 4-16
decodes) had to wait.
"""
from __future__ import annotations

import contextlib
from typing import NamedTuple, Optional

import torch

from ._triton import HAS_TRITON, INTERPRET, next_pow2
from .device import sm_count

BLOCK_N = 16 if INTERPRET else 64  # keys per inner step
MIN_KEYS_PER_SPLIT = 32 if INTERPRET else 256  # below this a slice's fixed cost outweighs its keys
WAVES = 2  # programs per SM the split aims at (a decode program holds little: q, one K / V tile, acc)
MAX_SPLITS = 64
INTERPRET_SMS = 4  # (the interpreter: SMs to size the split for, so that tests exercise several slices)

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _partial(Q, K, V, CU_Q, CU_K, M_OUT, L_OUT, ACC, scale, keys_per_split,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                 H: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr,
                 BLOCK_N: tl.constexpr):
        """Program (sequence, head, slice): running max / sum / weighted values over one slice of keys."""
        s = tl.program_id(0)
        h = tl.program_id(1)
        j = tl.program_id(2)
        S = tl.num_programs(2)
        q0 = tl.load(CU_Q + s)
        q1 = tl.load(CU_Q + s + 1)
        k0 = tl.load(CU_K + s)
        k1 = tl.load(CU_K + s + 1)
        n = tl.where(q1 - q0 == 1, k1 - k0, 0)  # other sequences: no keys, nothing stored
        lo = j * keys_per_split
        # the last slice takes every key left: correct whatever max_k the grid was sized with (a CUDA graph
        # replays the grid of its capture; transformers pads max_seqlen_k, but caps it)
        hi = tl.where(j == S - 1, n, tl.minimum(lo + keys_per_split, n))
        offs_d = tl.arange(0, D_P)
        mask_d = offs_d < D
        q = tl.load(Q + q0 * stride_qt + h * stride_qh + offs_d, mask=mask_d & (n > 0), other=0.0).to(tl.float32)
        q = q * scale
        kv_h = h // GROUP
        m_i = tl.full([], -float("inf"), tl.float32)
        l_i = tl.full([], 0.0, tl.float32)
        acc = tl.zeros([D_P], dtype=tl.float32)
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            mask_n = offs_n < hi
            rows = (k0 + offs_n).to(tl.int64)
            mask = mask_n[:, None] & mask_d[None, :]
            kb = tl.load(K + rows[:, None] * stride_kt + kv_h * stride_kh + offs_d[None, :], mask=mask, other=0.0)
            sc = tl.sum(kb.to(tl.float32) * q[None, :], axis=1)
            sc = tl.where(mask_n, sc, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(sc, axis=0))
            p = tl.exp(sc - m_new)
            alpha = tl.exp(m_i - m_new)
            vb = tl.load(V + rows[:, None] * stride_vt + kv_h * stride_vh + offs_d[None, :], mask=mask, other=0.0)
            acc = acc * alpha + tl.sum(p[:, None] * vb.to(tl.float32), axis=0)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            m_i = m_new
        slot = (s * H + h) * S + j
        dec = q1 - q0 == 1  # other sequences (prefill pieces, transformers' padding) store nothing
        tl.store(M_OUT + slot, m_i, mask=dec)
        tl.store(L_OUT + slot, l_i, mask=dec)
        tl.store(ACC + slot * D_P + offs_d, acc, mask=dec)

    @triton.jit
    def _combine(OUT, CU_Q, M_OUT, L_OUT, ACC, stride_ot, stride_oh,
                 H: tl.constexpr, S: tl.constexpr, S_P: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr):
        """Program (sequence, head): merge the slices (weights exp(m_j - max m)) into the output row."""
        s = tl.program_id(0)
        h = tl.program_id(1)
        q0 = tl.load(CU_Q + s)
        q1 = tl.load(CU_Q + s + 1)
        offs_j = tl.arange(0, S_P)
        offs_d = tl.arange(0, D_P)
        base = (s * H + h) * S
        mask_j = (offs_j < S) & (q1 - q0 == 1)  # (nothing was stored for other sequences)
        m = tl.load(M_OUT + base + offs_j, mask=mask_j, other=-float("inf"))
        l_ = tl.load(L_OUT + base + offs_j, mask=mask_j, other=0.0)
        mx = tl.max(m, axis=0)
        mx = tl.where(mx == -float("inf"), 0.0, mx)  # (a sequence without one query: nothing is stored)
        w = tl.where(m == -float("inf"), 0.0, tl.exp(m - mx))
        acc = tl.load(ACC + (base + offs_j)[:, None] * D_P + offs_d[None, :], mask=mask_j[:, None], other=0.0)
        den = tl.sum(w * l_, axis=0)
        o = tl.sum(w[:, None] * acc, axis=0) / tl.where(den > 0.0, den, 1.0)
        tl.store(OUT + q0 * stride_ot + h * stride_oh + offs_d, o.to(OUT.dtype.element_ty),
                 mask=(offs_d < D) & (q1 - q0 == 1))

    @triton.jit
    def _route(CU_Q, OUT, N, BLOCK: tl.constexpr):
        """OUT (2, N + 1): a step with a sequence of several queries: row 0 CU_Q (the varlen kernel attends
        every sequence), row 1 zeros (the split-KV kernel none); a step of decodes only: row 0 CU_Q[N] (every
        sequence empty), row 1 CU_Q."""
        i = tl.arange(0, BLOCK)
        c = tl.load(CU_Q + i, mask=i <= N, other=0)
        nxt = tl.load(CU_Q + i + 1, mask=i < N, other=0)
        mixed = tl.max(tl.where((i < N) & (nxt - c > 1), 1, 0), axis=0) > 0
        end = tl.load(CU_Q + N)
        tl.store(OUT + i, tl.where(mixed, c, end), mask=i <= N)
        tl.store(OUT + N + 1 + i, tl.where(mixed, 0, c), mask=i <= N)


def splits_for(heads: int, max_k: int, device) -> int:
    """Key slices per sequence: enough for one decode's programs (``heads`` per slice) to give every SM
    ``WAVES`` of them, no slice under ``MIN_KEYS_PER_SPLIT`` keys, at most ``MAX_SPLITS``. Not sized by the
    step's sequence count: under CUDA graphs transformers pads it (to 64 sequences for a step of 64 padded
    tokens), so a count-based split would leave the one long decode it is for unsplit; the padding's
    programs and those of prefill pieces exit after two loads and store nothing."""
    if max_k <= MIN_KEYS_PER_SPLIT:
        return 1
    sms = sm_count(device) if torch.device(device).type == "cuda" else INTERPRET_SMS
    want = -(-WAVES * sms // max(1, heads))
    return max(1, min(want, -(-max_k // MIN_KEYS_PER_SPLIT), MAX_SPLITS))


def _check(q, k, v, cu_q, cu_k) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"split_kv_decode: q {tuple(q.shape)} must be (Tq, H, D) and k / v {tuple(k.shape)} / "
                         f"{tuple(v.shape)} (Tk, Hkv, D)")
    if q.shape[2] != k.shape[2] or q.shape[1] % k.shape[1]:
        raise ValueError(f"split_kv_decode: q {tuple(q.shape)} and k {tuple(k.shape)}: head dims differ or "
                         f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} KV heads")
    if cu_q.shape != cu_k.shape or cu_q.dim() != 1 or cu_q.dtype != torch.int32 or cu_k.dtype != torch.int32:
        raise ValueError(f"split_kv_decode: cu_q {tuple(cu_q.shape)} {cu_q.dtype} and cu_k {tuple(cu_k.shape)} "
                         f"{cu_k.dtype} must be one (N + 1,) int32 vector each")
    for name, t in (("cu_q", cu_q), ("cu_k", cu_k), ("k", k), ("v", v)):
        if t.device != q.device:
            raise ValueError(f"split_kv_decode: {name} is on {t.device}, q on {q.device}")
    if not (cu_q.is_contiguous() and cu_k.is_contiguous()):
        raise ValueError("split_kv_decode: cu_q and cu_k must be contiguous")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(2) != 1:
            raise ValueError(f"split_kv_decode: {name} must be contiguous in its last dimension")


class Partials(NamedTuple):
    """What ``split_kv_partials`` leaves for ``combine_``: each (sequence, head, slice)'s running max ``m``,
    sum ``l`` and weighted value sum ``acc`` (fp32), and the launch sizes."""
    m: torch.Tensor
    l: torch.Tensor
    acc: torch.Tensor
    n: int
    S: int


def split_kv_decode_(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
                     cu_k: torch.Tensor, max_k: int, scale=None) -> torch.Tensor:
    """Overwrite the rows of ``out`` of the one-query sequences with their attention (module docstring);
    returns ``out``. ``split_kv_partials`` then ``combine_``."""
    if out.shape != q.shape:
        raise ValueError(f"split_kv_decode: out {tuple(out.shape)} must have q's shape {tuple(q.shape)}")
    return combine_(out, cu_q, split_kv_partials(q, k, v, cu_q, cu_k, max_k, scale))


def split_kv_partials(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                      max_k: int, scale=None, stream=None) -> Optional[Partials]:
    """The first launch alone: every one-query sequence's slices, nothing written to any output (None when
    the step has no sequence or no key). With ``stream`` the buffers are allocated on the current stream and
    the launch goes to ``stream``, so it can run beside another kernel of the current stream (the caller
    joins the streams before ``combine_``)."""
    if not HAS_TRITON:
        raise RuntimeError("split_kv_decode needs Triton")
    _check(q, k, v, cu_q, cu_k)
    n, H, D = cu_q.numel() - 1, q.shape[1], q.shape[2]
    if n <= 0 or max_k <= 0:
        return None
    scale = float(scale) if scale is not None else D ** -0.5
    S = splits_for(H, max_k, q.device)
    kps = -(-max_k // (S * BLOCK_N)) * BLOCK_N  # keys per slice: ceil(max_k / S), rounded up to whole blocks
    D_P = next_pow2(D)
    m = torch.empty(n * H * S, device=q.device, dtype=torch.float32)
    l_ = torch.empty_like(m)
    acc = torch.empty(n * H * S * D_P, device=q.device, dtype=torch.float32)
    with (torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()):
        _partial[(n, H, S)](q, k, v, cu_q, cu_k, m, l_, acc, scale, kps,
                            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                            H=H, GROUP=H // k.shape[1], D=D, D_P=D_P, BLOCK_N=BLOCK_N)
    return Partials(m, l_, acc, n, S)


def combine_(out: torch.Tensor, cu_q: torch.Tensor, parts: Optional[Partials]) -> torch.Tensor:
    """The second launch: merge each one-query sequence's slices into its row of ``out`` (Tq, H, D); the
    other rows are left as they were. Returns ``out``."""
    if out.dim() != 3 or out.stride(2) != 1:
        raise ValueError(f"split_kv_decode: out {tuple(out.shape)} must be (Tq, H, D), contiguous in its last "
                         f"dimension")
    if parts is None:
        return out
    if out.device != parts.m.device:
        raise ValueError(f"split_kv_decode: out is on {out.device}, the partials on {parts.m.device}")
    H, D = out.shape[1], out.shape[2]
    if cu_q.numel() - 1 != parts.n or parts.m.numel() != parts.n * H * parts.S:
        raise ValueError(f"split_kv_decode: combine_ got partials of {parts.n} sequences x {parts.S} slices "
                         f"for cu_q {tuple(cu_q.shape)} and out {tuple(out.shape)}")
    _combine[(parts.n, H)](out, cu_q, parts.m, parts.l, parts.acc, out.stride(0), out.stride(1),
                           H=H, S=parts.S, S_P=next_pow2(parts.S), D=D, D_P=next_pow2(D))
    return out


def route_rows(cu_q: torch.Tensor) -> torch.Tensor:
    """Which kernel attends which sequences of the step (module docstring), decided on the device in one
    launch: a (2, N + 1) int32 tensor, row 0 the ``cu_q`` to give the varlen kernel, row 1 the one to give
    the split-KV kernel (each row contiguous)."""
    if not HAS_TRITON:
        raise RuntimeError("route_rows needs Triton")
    if cu_q.dim() != 1 or cu_q.dtype != torch.int32 or cu_q.numel() < 1 or not cu_q.is_contiguous():
        raise ValueError(f"route_rows: cu_q {tuple(cu_q.shape)} {cu_q.dtype} must be a contiguous (N + 1,) int32 "
                         f"vector")
    n = cu_q.numel() - 1
    out = torch.empty((2, n + 1), device=cu_q.device, dtype=torch.int32)
    _route[(1,)](cu_q, out, n, BLOCK=next_pow2(n + 1))
    return out


__all__ = ["Partials", "combine_", "route_rows", "split_kv_decode_", "split_kv_partials", "splits_for"]
