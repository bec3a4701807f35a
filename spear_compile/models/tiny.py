"""A tiny random-weight Llama (the SmolLM2 architecture at toy size) for tests and demos
of the compiler, where only shapes and graph structure matter. Never for quality claims."""
from __future__ import annotations

import torch


def tiny_llama(hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2, intermediate: int = 128,
               vocab: int = 256, seed: int = 0, dtype: torch.dtype = torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, intermediate_size=intermediate, vocab_size=vocab,
                      max_position_embeddings=512, tie_word_embeddings=True)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
    return model.to(dtype).eval()
