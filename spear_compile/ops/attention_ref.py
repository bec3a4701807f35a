"""Reference of the decode attention of a packed variable-length step (``lowering/split_kv_decode.py``).

``decode_attention_ref(q, k, v, cu_q, cu_k, scale)``: for every sequence i with exactly one query (rows
``cu_q[i]:cu_q[i+1]`` of ``q`` (Tq, H, D), keys ``cu_k[i]:cu_k[i+1]`` of ``k`` / ``v`` (Tk, Hkv, D), H a
multiple of Hkv), the softmax attention of that query over all its keys, computed in fp32; every other row
of the result is zero. The query is the last of its sequence's tokens, so causality keeps every key.
"""
from __future__ import annotations

from typing import Optional

import torch


def decode_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                         scale: Optional[float] = None) -> torch.Tensor:
    H, Hkv, D = q.shape[1], k.shape[1], q.shape[2]
    if H % Hkv:
        raise ValueError(f"decode_attention_ref: {H} query heads are not a multiple of {Hkv} KV heads")
    scale = D ** -0.5 if scale is None else float(scale)
    out = torch.zeros_like(q)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for a, b, c, d in zip(cq, cq[1:], ck, ck[1:]):
        if b - a != 1 or d <= c:
            continue
        ki = k[c:d].float().repeat_interleave(H // Hkv, 1)  # (n, H, D)
        vi = v[c:d].float().repeat_interleave(H // Hkv, 1)
        w = torch.softmax(torch.einsum("hd,nhd->hn", q[a].float() * scale, ki), dim=-1)
        out[a] = torch.einsum("hn,nhd->hd", w, vi).to(q.dtype)
    return out


__all__ = ["decode_attention_ref"]
