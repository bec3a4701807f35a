"""Self-sampling with a static KV cache: the same tokens as Hugging Face ``generate``, less overhead.

Why: on an H200 the SPEAR fit's self-sampling (``GPU_PRESET``: 96 x 1024 tokens) took 55 of its
~155 s, at 27 ms per decode step for a 135M model whose step is well under a millisecond of GPU
work: ``generate`` is host-bound (logits processors, stopping criteria, a dynamic cache that grows
by concatenation). This loop keeps only what pure ancestral sampling needs:

    for t in 0 .. T-2:  logits = model(tok, cache_position=[t]) -> EOS masked -> / temperature
                        -> softmax -> multinomial -> tok

with a ``transformers.StaticCache`` preallocated for ``seq_len`` tokens. The random draws are the
same ops in the same order as ``generate``'s (``MinNewTokensLengthLogitsProcessor`` masks EOS,
the temperature warper divides, ``torch.multinomial`` on the softmax), so under one seed the tokens
match ``generate``'s (tested on CPU) as long as the logits match bitwise.

On CUDA (``graph=True``) the model's forward for one token is captured once per batch as a CUDA
graph and replayed each step (token and position are static buffers; the sampling itself stays
outside the graph, on the default generator, so the draws are unchanged). A failed capture warns
and falls back to the eager step. Status: the eager loop is tested on the CPU; the graphed step
has not run on a GPU yet, so ``CalibConfig.sampler`` defaults to "hf".
"""
from __future__ import annotations

import inspect
import warnings

import torch
from torch import nn


def _cache_kwarg(model: nn.Module) -> str:
    """transformers 5.24 renamed ``past_key_values`` to ``cache`` (the old name warns); 5.17 has
    only the old one."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _eos_ids(model: nn.Module) -> list[int]:
    """The ids ``generate`` suppresses under ``min_new_tokens``: the generation config's EOS."""
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    eos = eos if eos is not None else getattr(model.config, "eos_token_id", None)
    if eos is None:
        return []
    return list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]


class _Step:
    """One decode step of ``model`` for a batch of ``b`` rows: ``tok`` [b, 1] and ``pos`` [1] are
    the inputs, ``__call__`` returns fp32 logits [b, V] (a graph's static output when graphed)."""

    def __init__(self, model: nn.Module, b: int, seq_len: int, bos: int, graph: bool):
        from transformers import StaticCache

        dev = next(model.parameters()).device
        self.tok = torch.full((b, 1), bos, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        try:  # transformers 5.x: layers allocate lazily at the first update
            cache = StaticCache(config=model.config, max_cache_len=seq_len)
        except TypeError:  # releases that want the batch, device and dtype up front
            cache = StaticCache(config=model.config, max_batch_size=b, max_cache_len=seq_len, device=dev,
                                dtype=next(model.parameters()).dtype)
        kw = {_cache_kwarg(model): cache, "use_cache": True}
        self._eager = lambda: model(input_ids=self.tok, cache_position=self.pos, **kw).logits[:, -1].float()
        self._graph = None
        if graph and dev.type == "cuda":
            self._capture(dev)
            # Some transformers releases (5.17) write a static layer at its own step counter, not at
            # cache_position: the warm-up and check forwards above advanced it. reset() zeroes the
            # buffers and counters in place (the graph keeps its addresses), so step t writes slot t.
            cache.reset()

    def _capture(self, dev: torch.device) -> None:
        try:
            s = torch.cuda.Stream(dev)
            s.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(s):  # warm-up (allocates the cache); writes position 0, rewritten at t = 0
                for _ in range(2):
                    self._eager()
            torch.cuda.current_stream(dev).wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = self._eager()
            # A forward that turned the position into a Python value would replay a stale one
            # silently: check graph against eager at another position (1; the loop rewrites it).
            self.pos.fill_(1)
            want = self._eager().clone()
            g.replay()
            self.pos.fill_(0)
            if not torch.allclose(out, want, rtol=1e-3, atol=1e-3):
                raise RuntimeError(f"graphed step differs from eager at position 1 "
                                   f"(max |diff| {(out - want).abs().max().item():.3g})")
            self._graph, self._out = g, out
        except Exception as e:  # noqa: BLE001 - any capture failure: fall back, say why
            warnings.warn(f"sample_sequences(sampler='static'): CUDA graph of the decode step unusable "
                          f"({type(e).__name__}: {str(e)[:200]}); sampling with the eager step instead")
            self._graph = None

    def __call__(self) -> torch.Tensor:
        if self._graph is None:
            return self._eager()
        self._graph.replay()
        return self._out


@torch.no_grad()
def sample_static(model: nn.Module, b: int, seq_len: int, bos_token_id: int, temperature: float = 1.0,
                  graph: bool = True) -> torch.Tensor:
    """[b, seq_len] tokens sampled from BOS with the current random state (the caller seeds it)."""
    if temperature <= 0:
        raise ValueError(f"sample_static: temperature={temperature} must be > 0")
    step = _Step(model, b, seq_len, bos_token_id, graph)
    ids = torch.full((b, seq_len), bos_token_id, dtype=torch.long, device=step.tok.device)
    eos = torch.tensor(_eos_ids(model), dtype=torch.long, device=ids.device)
    for t in range(seq_len - 1):
        step.pos.fill_(t)
        logits = step().index_fill(1, eos, float("-inf"))  # out of place: a graph's output stays intact
        if temperature != 1.0:
            logits = logits / temperature
        nxt = torch.multinomial(torch.softmax(logits, -1), 1)
        ids[:, t + 1] = nxt[:, 0]
        step.tok.copy_(nxt)
    return ids
