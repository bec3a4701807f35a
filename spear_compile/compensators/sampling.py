"""Self-sampling with a static KV cache: ``generate``'s draws from the same model, less overhead.

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
and falls back to the eager step.

Attention (``attention="gqa"``, the default): a static cache makes every step attend over all
``seq_len`` slots, and on the H200 the model's own SDPA path spent 17 of the graphed step's
21.5 ms there (fp32, batch 64, 1024 slots; ``benchmarks/results/calibration/2026-11-30_h200_sampler_profile_model_attention.json``):
transformers 5.17 materialises the grouped K/V heads (``repeat_kv``, 2 x 151 MB per layer) and
the fp32 memory-efficient kernel then reads them at ~0.8 TB/s. ``_gqa_decode_attention``
instead groups the query heads that share a K/V head into one batched matmul, reading the cache
once: 6.8 ms per step (``calibration/2026-11-30_h200_sampler_profile.json``). Same math as SDPA, different summation
order: logits agree to fp32 rounding (tested) but, as the sequence goes on, a draw can land on
the other side of a rounding difference, so the tokens are samples from the same model, not
bitwise ``generate``'s. ``attention="model"`` keeps the model's own attention (then the tokens
equal ``generate``'s, tested on the CPU).
"""
from __future__ import annotations

import contextlib
import inspect
import warnings

import torch
from torch import nn


def _cache_kwarg(model: nn.Module) -> str:
    """transformers 5.24 renamed ``past_key_values`` to ``cache`` (the old name warns); 5.17 has
    only the old one."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def eos_ids(model: nn.Module) -> list[int]:
    """The ids ``generate`` suppresses under ``min_new_tokens``: the generation config's EOS."""
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    eos = eos if eos is not None else getattr(model.config, "eos_token_id", None)
    if eos is None:
        return []
    return list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]


_ATTN = "spear_gqa_decode"
ATTENTIONS = ("gqa", "model")


def _gqa_decode_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask, scaling=None, dropout: float = 0.0, **kwargs):
    """Hugging Face attention-interface function with SDPA's semantics (``attention_mask`` bool =
    keep, float = additive, None = causal when there is more than one query), computed as batched
    matmuls over groups of query heads so grouped K/V heads are read once, never repeated.

    query [b, h, q, d]; key, value [b, kvh, L, d]; returns ([b, q, h, d], None)."""
    if dropout and module.training:
        raise ValueError("_gqa_decode_attention: dropout is not supported (sampling runs in eval mode)")
    b, h, q, d = query.shape
    kvh, L = key.shape[1], key.shape[2]
    if h % kvh:
        raise ValueError(f"_gqa_decode_attention: {h} query heads do not group over {kvh} K/V heads")
    g = h // kvh
    scaling = d ** -0.5 if scaling is None else scaling
    # Query head j*g + r uses K/V head j (repeat_kv's layout), so [b, kvh, g*q, d] groups them.
    s = torch.matmul(query.reshape(b, kvh, g * q, d), key.transpose(-1, -2)).view(b, kvh, g, q, L) * scaling
    if attention_mask is None:
        if q > 1:  # SDPA's is_causal: top-left aligned
            keep = torch.ones(q, L, dtype=torch.bool, device=s.device).tril()
            s = s.masked_fill(~keep, float("-inf"))
    elif attention_mask.dtype == torch.bool:
        s = s.masked_fill(~attention_mask[:, :, None], float("-inf"))  # [b|1, 1, q, L] -> per K/V group
    else:
        s = s + attention_mask[:, :, None]
    p = torch.softmax(s.float(), -1).to(value.dtype).view(b, kvh, g * q, L)
    out = torch.matmul(p, value).view(b, h, q, d)
    return out.transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def _attention(model: nn.Module, attention: str):
    """Run ``model`` with ``_gqa_decode_attention`` (``attention="gqa"``) or unchanged ("model");
    the model's attention setting is restored on exit, whatever happens."""
    if attention not in ATTENTIONS:
        raise ValueError(f"sample_static: attention={attention!r}; expected one of {ATTENTIONS}")
    if attention == "model":
        yield
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(_ATTN, _gqa_decode_attention)
    AttentionMaskInterface.register(_ATTN, sdpa_mask)  # the masks SDPA gets: bool, True = attend
    old = model.config._attn_implementation
    model.config._attn_implementation = _ATTN
    try:
        yield
    finally:
        model.config._attn_implementation = old


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
                  graph: bool = True, attention: str = "gqa", first: torch.Tensor | None = None) -> torch.Tensor:
    """[b, seq_len] tokens sampled from BOS with the current random state (the caller seeds it);
    ``attention``: "gqa" (``_gqa_decode_attention``) or "model" (the model's own).
    ``first`` ([b] long, optional): where >= 0, the token after BOS is forced to it instead of
    sampled (the draw is still made, so the random stream is the same either way)."""
    if temperature <= 0:
        raise ValueError(f"sample_static: temperature={temperature} must be > 0")
    if first is not None and (tuple(first.shape) != (b,) or first.dtype != torch.long):
        raise ValueError(f"sample_static: first is {first.dtype} {tuple(first.shape)}; expected torch.int64 ({b},)")
    with _attention(model, attention):
        return _sample(model, b, seq_len, bos_token_id, temperature, graph, first)


def force_first(logits: torch.Tensor, first: torch.Tensor | None) -> torch.Tensor:
    """``logits`` [b, V] with rows where ``first`` >= 0 set to -inf everywhere but that token, so
    the draw that follows picks it with probability one and consumes the same random numbers."""
    if first is None:
        return logits
    forced = first >= 0
    only = torch.full_like(logits, float("-inf")).scatter_(1, first.clamp(min=0)[:, None].to(logits.device), 0.0)
    return torch.where(forced.to(logits.device)[:, None], only, logits)


def _sample(model: nn.Module, b: int, seq_len: int, bos_token_id: int, temperature: float,
            graph: bool, first: torch.Tensor | None = None) -> torch.Tensor:
    step = _Step(model, b, seq_len, bos_token_id, graph)
    ids = torch.full((b, seq_len), bos_token_id, dtype=torch.long, device=step.tok.device)
    eos = torch.tensor(eos_ids(model), dtype=torch.long, device=ids.device)
    for t in range(seq_len - 1):
        step.pos.fill_(t)
        logits = step().index_fill(1, eos, float("-inf"))  # out of place: a graph's output stays intact
        if temperature != 1.0:
            logits = logits / temperature
        if t == 0:
            logits = force_first(logits, first)
        nxt = torch.multinomial(torch.softmax(logits, -1), 1)
        ids[:, t + 1] = nxt[:, 0]
        step.tok.copy_(nxt)
    return ids
