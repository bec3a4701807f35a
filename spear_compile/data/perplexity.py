"""Token-level perplexity over non-overlapping windows (tail dropped), DESIGN section 7.

Every window is scored from its first token: the loss covers tokens 2..L of each
window, pooled over all windows before the exp, so the number does not depend on
how the windows are batched.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm


def windows(ids: torch.Tensor, seq_len: int, max_tokens: Optional[int] = None) -> torch.Tensor:
    """Split a 1-D token tensor into ``[n, seq_len]`` non-overlapping windows, tail dropped."""
    ids = ids.reshape(-1)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    n = ids.numel() // seq_len
    if n == 0:
        raise ValueError(f"text has {ids.numel()} tokens, fewer than one window of seq_len={seq_len}")
    return ids[: n * seq_len].reshape(n, seq_len)


@torch.no_grad()
def perplexity(model: Callable, wins: torch.Tensor, batch_size: int = 1, progress: bool = True,
               desc: str = "perplexity") -> float:
    """``exp(mean NLL)`` of ``model`` (returns logits or an object with ``.logits``) over windows."""
    total, count = 0.0, 0
    for i in tqdm(range(0, wins.shape[0], batch_size), desc=desc, disable=not progress, leave=False):
        batch = wins[i:i + batch_size]
        out = model(batch)
        logits = getattr(out, "logits", out)
        nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1),
                              reduction="sum")
        total += float(nll)
        count += batch[:, 1:].numel()
    return math.exp(total / count)
