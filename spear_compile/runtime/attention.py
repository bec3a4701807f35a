"""Paged attention for the engine with variable-length kernels: each sequence against its own keys, no step mask.

Without flash-attn, transformers' continuous batching runs ``paged|sdpa``: each step packs every sequence's
new tokens into one query of T rows and every sequence's keys (cached and new) into one key of K rows, builds
a (T, K) mask that keeps each token to its own sequence and the causal order, and runs one masked SDPA. The
work is T x K scores per head and layer, where the step needs only the sum of q_i x k_i over its sequences:
a step of a 512-token chunk beside 30 decodes at 2k context scores 542 x 62k pairs where 512 x 2k + 30 x 2k
are needed (27x). On an H100 (2026-12-05, Llama-2-7B-shaped W4, ``benchmarks/results/serving/
2026-12-05_h100_llama2_partial``) such steps took 150-300 ms against a 29 ms batch-1 decode step.

``paged_varlen_attention`` (registered with transformers' ``AttentionInterface`` as ``paged|spear_varlen``
by ``register()``) takes the same packed inputs: it updates the paged cache as transformers' own paths do
(``cache.update``, which returns each sequence's keys contiguous in ``cu_seq_lens_k`` order) and then runs
variable-length attention over ``cu_seq_lens_q`` / ``cu_seq_lens_k``, causal with the queries aligned to the
end of their keys (a chunk of a prompt sees all of its sequence's earlier tokens):

* on CUDA, ``torch.nn.attention.varlen.varlen_attn`` (Flash Attention's varlen kernel, in torch since 2.9;
  GQA without repeating the KV heads where the installed torch takes ``enable_gqa``);
* elsewhere, or without it, ``varlen_reference``: SDPA per sequence with an explicit causal mask (it reads
  the sequence lengths on the host, so it does not run inside a CUDA graph; the engine's CPU path has none).

Query rows past ``cu_seq_lens_q[-1]`` (transformers' padding for static CUDA-graph shapes) come out zero from
the reference and unspecified from the kernel; they are never read. No mask is built: transformers builds
one only for ``paged|sdpa`` / ``paged|eager``. Outside continuous batching (no paged cache in the call) the
function is plain SDPA, so a model switched to it still runs ``generate`` and ordinary forwards.
"""
from __future__ import annotations

import functools
import inspect
import threading
from typing import Optional

import torch

from .. import envs

NAME = "paged|spear_varlen"


def _bottom_right_causal(n_q: int, n_k: int, device) -> torch.Tensor:
    """(n_q, n_k) bool: query j (the (n_k - n_q + j)-th token of its sequence) sees keys 0 .. n_k - n_q + j."""
    return torch.ones(n_q, n_k, dtype=torch.bool, device=device).tril(n_k - n_q)


def varlen_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                     scale: Optional[float] = None) -> torch.Tensor:
    """Variable-length causal attention, one SDPA per sequence. ``q``: (Tq, H, D); ``k``, ``v``: (Tk, Hkv, D)
    with H a multiple of Hkv; sequence i is rows ``cu_q[i]:cu_q[i+1]`` of ``q`` against ``cu_k[i]:cu_k[i+1]`` of
    ``k`` / ``v``, its queries the last of its keys. Returns (Tq, H, D); rows of no sequence are zero."""
    H, Hkv = q.shape[1], k.shape[1]
    if H % Hkv:
        raise ValueError(f"varlen_reference: {H} query heads are not a multiple of {Hkv} KV heads")
    out = torch.zeros_like(q)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    if len(cq) != len(ck):
        raise ValueError(f"varlen_reference: cu_q has {len(cq)} entries, cu_k {len(ck)}: one per sequence + 1 each")
    for a, b, c, d in zip(cq, cq[1:], ck, ck[1:]):
        if b <= a:
            continue
        if d - c < b - a:
            raise ValueError(f"varlen_reference: a sequence has {b - a} queries but only {d - c} keys")
        qi, ki, vi = q[a:b].transpose(0, 1), k[c:d].transpose(0, 1), v[c:d].transpose(0, 1)
        if Hkv != H:
            ki, vi = ki.repeat_interleave(H // Hkv, 0), vi.repeat_interleave(H // Hkv, 0)
        mask = _bottom_right_causal(b - a, d - c, q.device)
        out[a:b] = torch.nn.functional.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale).transpose(0, 1)
    return out


@functools.lru_cache(maxsize=None)
def _kernel():
    """``(varlen_attn, its keyword names)`` when torch has it, else None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def kernel_available(device) -> bool:
    """Whether ``paged_varlen_attention`` runs torch's varlen kernel on ``device`` (else the reference)."""
    return torch.device(device).type == "cuda" and _kernel() is not None


def split_kv_available(device) -> bool:
    """Whether ``varlen_attention`` hands the step's decodes to the split-KV kernel on ``device``: CUDA, Triton
    installed, and ``SPEAR_SPLIT_KV=1`` (opt-in until a GPU run has checked and timed it: ``envs``)."""
    from ..lowering._triton import HAS_TRITON

    return torch.device(device).type == "cuda" and HAS_TRITON and envs.split_kv()


def varlen_attention(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: Optional[float] = None,
                     routes: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal variable-length attention (the contract of ``varlen_reference``): torch's kernel on CUDA, the
    reference elsewhere. With ``split_kv_available`` (CUDA, ``SPEAR_SPLIT_KV=1``) a step of decodes only goes
    to the split-KV kernel (``lowering/split_kv_decode``), a step with a prefill piece to torch's kernel whole
    (``decodes_split``; ``routes``: ``route_rows(cu_q)``, made here when not given)."""
    got = _kernel() if q.is_cuda else None
    if got is None:
        return varlen_reference(q, k, v, cu_q, cu_k, scale)
    if not split_kv_available(q.device):
        return _torch_varlen(got, q, k, v, cu_q, cu_k, max_q, max_k, scale)
    return decodes_split(functools.partial(_torch_varlen, got), q, k, v, cu_q, cu_k, max_q, max_k, scale, routes)


def decodes_split(varlen, q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: Optional[float] = None,
                  routes: Optional[torch.Tensor] = None, overlap: bool = False) -> torch.Tensor:
    """``varlen`` (a function of ``varlen_attention``'s arguments less ``routes``) for a step with a sequence
    of several queries, the split-KV kernel for a step of decodes only, chosen on the device by ``routes``
    (``lowering.split_kv_decode.route_rows(cu_q)``, made here when not given): both launch every step, and
    the one not chosen gets a ``cu_q`` of empty sequences. A step whose ``max_q`` is 1 does not call
    ``varlen`` at all; in the engine that is only an eager step (under CUDA graphs transformers passes the
    padded token count as ``max_q``).

    ``overlap`` (CUDA; off by default): the split's first launch runs on a side stream beside ``varlen``,
    joined before its second launch writes the decode rows, so that part of what the idle one costs leaves
    the step's path. Measured with the routing (H100, ``benchmarks/results/decode_attention/
    2026-12-07_h100_routed``): it saves 5 us a layer on one decode at 2k keys under the engine's padding
    (46 against 51 us; torch's kernel over the 64 padded, empty sequences still starts a program per
    sequence and head) and 17 us with 8 KV heads, but costs up to 77 us on steps with a prefill piece (one
    decode at 4k beside a 32-token piece: 222 against 145 us serial, 131 torch alone; not profiled). Those
    steps are the ones planned up to the SLO, hence serial. A CUDA graph captures the fork and the join."""
    from ..lowering.split_kv_decode import combine_, route_rows, split_kv_decode_, split_kv_partials

    cu_q, cu_k = cu_q.to(torch.int32), cu_k.to(torch.int32)
    if int(max_q) <= 1:
        out = torch.zeros_like(q)  # (rows of no sequence: transformers' padding, never read)
        return split_kv_decode_(out, q, k, v, cu_q, cu_k, max_k, scale)
    routes = route_rows(cu_q) if routes is None else routes
    to_varlen, to_split = routes[0], routes[1]
    if not (overlap and q.is_cuda):
        out = varlen(q, k, v, to_varlen, cu_k, max_q, max_k, scale)
        return split_kv_decode_(out, q, k, v, to_split, cu_k, max_k, scale)
    main, side = torch.cuda.current_stream(q.device), _side_stream(q.device)
    side.wait_stream(main)  # the step's q / k / v / cu are written on main
    parts = split_kv_partials(q, k, v, to_split, cu_k, max_k, scale, stream=side)  # buffers on main, launch on side
    out = varlen(q, k, v, to_varlen, cu_k, max_q, max_k, scale)
    main.wait_stream(side)
    return combine_(out, to_split, parts)


_SIDE = threading.local()  # .streams: {device index: the side stream of decodes_split on this thread}


def _side_stream(device) -> "torch.cuda.Stream":
    """One side stream per device and thread (engines on two threads never join each other's work)."""
    streams = getattr(_SIDE, "streams", None)
    if streams is None:
        streams = _SIDE.streams = {}
    idx = torch.device(device).index
    idx = torch.cuda.current_device() if idx is None else idx
    if idx not in streams:
        streams[idx] = torch.cuda.Stream(device=idx)
    return streams[idx]


def _torch_varlen(got, q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: Optional[float],
                  gqa: str = "repeat") -> torch.Tensor:
    """torch's kernel (``got``: ``_kernel()``), causal aligned to the end of each sequence's keys. Grouped
    query heads go to the kernel's ``enable_gqa`` where it has one (torch 2.13); on a kernel without it
    (torch 2.11) ``gqa`` says how: ``"repeat"`` (K and V repeated per query head, the engine's path) or
    ``"grouped"`` (``_per_group_position``, a candidate not yet timed on a GPU:
    ``benchmarks/decode_attention.py`` times both). Measured (H100, torch 2.11,
    ``benchmarks/results/decode_attention/2026-12-07_h100_routed``): with the repeat, 64 decodes at 1k keys
    on 32 / 8 heads took 1553 us against 498 us on 32 / 32."""
    fn, params = got
    kw = {"scale": scale}
    if "window_size" in params:
        kw["window_size"] = (-1, 0)  # causal, aligned to the end of the keys
    elif "is_causal" in params:
        kw["is_causal"] = True
    else:  # a torch whose kernel cannot be made causal
        return varlen_reference(q, k, v, cu_q, cu_k, scale)
    cu_q, cu_k, max_q, max_k = cu_q.to(torch.int32), cu_k.to(torch.int32), int(max_q), int(max_k)
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        elif gqa == "grouped":
            return _per_group_position(fn, q, k, v, cu_q, cu_k, max_q, max_k, kw)
        elif gqa == "repeat":
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        else:
            raise ValueError(f"varlen attention: gqa={gqa!r} must be 'repeat' or 'grouped'")
    return fn(q, k, v, cu_q, cu_k, max_q, max_k, **kw)


def _per_group_position(fn, q, k, v, cu_q, cu_k, max_q: int, max_k: int, kw: dict) -> torch.Tensor:
    """Grouped-query attention on a kernel without ``enable_gqa``, K and V never repeated: query head
    ``j * r + i`` reads KV head ``j`` (``repeat_interleave``'s order), so the ``i``-th heads of every group
    form one multi-head call against K and V as they are, one call per ``i``, and the ``r`` outputs are
    interleaved back. Reads K and V ``r`` times, as the kernel on repeated K and V does, but writes no
    copy of them (``r`` times their size); launches ``r`` kernels of ``Hkv`` heads each."""
    T, H, D = q.shape
    Hkv = k.shape[1]
    qg = q.reshape(T, Hkv, H // Hkv, D)
    outs = [fn(qg[:, :, i].contiguous(), k, v, cu_q, cu_k, max_q, max_k, **kw) for i in range(H // Hkv)]
    return torch.stack(outs, dim=2).view(T, H, D)


def paged_varlen_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                           **kwargs):
    """transformers' attention-function contract (``query``: (1, H, T, D); ``key`` / ``value``: (1, Hkv, T, D);
    returns ``(output (1, T, H, D) or (T, H, D), None)``) for continuous batching's packed steps; plain SDPA
    when the call carries no paged cache."""
    cache = kwargs.get("cache")
    if cache is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if getattr(module, "sliding_window", None):  # transformers' cache reads those layers' keys differently
        raise NotImplementedError(f"{NAME}: sliding-window layers ({type(module).__name__}) are not supported; "
                                  f"use transformers' paged|sdpa for this model")
    return _paged_step(module, query, key, value, scaling, kwargs), None


# eager under torch.compile: the step's lengths stay Python ints (no guard on them, so no recompile per padded
# length); a CUDA graph captures and replays it with the rest of the step
@torch.compiler.disable
def _paged_step(module, query, key, value, scaling, kwargs) -> torch.Tensor:
    cu_k, max_k = kwargs["cu_seq_lens_k"], kwargs["max_seqlen_k"]
    if isinstance(cu_k, dict):
        cu_k, max_k = cu_k["full_attention"], max_k["full_attention"]
    # the paged cache written and read back as transformers' paged paths do: (Tk, Hkv, D) each, sequence by
    # sequence in cu_seq_lens_k order
    k, v = kwargs["cache"].update(key_states=key, value_states=value, layer_idx=module.layer_idx,
                                  read_index=kwargs["read_index"], write_index=kwargs["write_index"])
    q = query.transpose(1, 2).squeeze(0).contiguous()
    cu_q = kwargs["cu_seq_lens_q"]
    routes = _routes(module, cu_q) if split_kv_available(q.device) else None
    return varlen_attention(q, k.contiguous(), v.contiguous(), cu_q, cu_k, kwargs["max_seqlen_q"], max_k, scaling,
                            routes=routes)


_MEMO = threading.local()  # .last: (cu_seq_lens_q of the forward, capturing, its route_rows)


def _routes(module, cu_q: torch.Tensor) -> torch.Tensor:
    """``route_rows(cu_q)``, made by the first layer of each forward and reused by the others
    (one launch per step instead of one per layer). It is remade at layer 0 (every forward, and every
    CUDA-graph capture of one, starts there, so a graph never reads a copy another graph or an eager
    warm-up made), for another ``cu_q`` object, and when CUDA-graph capture started or stopped since it was
    made (a model whose attention has no layer 0, e.g. a pipeline stage, still gets it made inside the
    capture). One memo per thread: engines on two threads never share it."""
    from ..lowering.split_kv_decode import route_rows

    capturing = bool(cu_q.is_cuda and torch.cuda.is_current_stream_capturing())
    last = getattr(_MEMO, "last", None)
    if last is None or getattr(module, "layer_idx", 0) == 0 or last[0] is not cu_q or last[1] != capturing:
        made = route_rows(cu_q.to(torch.int32))
        _MEMO.last = (cu_q, capturing, made)
        return made
    return last[2]


@functools.lru_cache(maxsize=None)
def unsupported() -> Optional[str]:
    """Why the installed transformers cannot run ``paged_varlen_attention`` in continuous batching, or None.

    It needs the paged-attention interface of transformers 5.17 (the GPU image's): continuous batching
    hands the attention function the paged cache and the step's ``cu_seq_lens``, and accepts any
    registered ``paged|`` implementation. Later releases update the cache in the model and accept only
    their own implementations (5.25: "paged|eager", "sdpa" or flash), so there the engine keeps theirs.
    Probed, not read from the version: transformers' own ``paged|sdpa`` function updates the cache."""
    import transformers

    try:
        from transformers.integrations import sdpa_paged

        src = inspect.getsource(sdpa_paged.sdpa_attention_paged_forward)
    except (ImportError, AttributeError, OSError):
        src = ""
    if "cache.update(" in src:
        return None
    return (f"transformers {transformers.__version__} updates the paged cache outside the attention function and "
            f"takes no custom paged attention in continuous batching; {NAME} needs the interface of "
            f"transformers 5.17")


def register() -> str:
    """Register ``paged_varlen_attention`` with transformers under ``NAME`` (idempotent); returns ``NAME``.
    ``RuntimeError`` (saying why) where the installed transformers cannot run it (``unsupported``)."""
    from transformers import AttentionInterface

    why = unsupported()
    if why is not None:
        raise RuntimeError(f"attention='varlen': {why}")
    AttentionInterface.register(NAME, paged_varlen_attention)
    return NAME


__all__ = ["NAME", "decodes_split", "kernel_available", "paged_varlen_attention", "register", "split_kv_available", "unsupported",
           "varlen_attention", "varlen_reference"]
