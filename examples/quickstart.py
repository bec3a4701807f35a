"""Quickstart: quantize a small Llama to W4, attach SVD-initialised error compensators,
compile with backend="spear", and compare with eager.

    python examples/quickstart.py
"""
import copy

import torch

import spear_compile as spear
from spear_compile.compensators.init import svd_ecs
from spear_compile.models import tiny_llama

ref = tiny_llama()  # random weights: this shows the mechanics, not quality
model = spear.quantize_(copy.deepcopy(ref), spear.QuantConfig(bits=4, group_size=32))
spear.attach_(model, svd_ecs(model, ref, spear.ECConfig(rank=8)))

ids = torch.randint(0, ref.config.vocab_size, (1, 12))
with torch.no_grad():
    eager = model(ids).logits
    compiled = torch.compile(model, backend="spear")(ids).logits
    full = ref(ids).logits
print(f"compiled vs eager  max |diff| = {(compiled - eager).abs().max():.2e}")
print(f"W4+EC vs reference max |diff| = {(eager - full).abs().max():.2e}")
assert torch.allclose(compiled, eager, atol=1e-4)
