"""Optional Triton import and small shared device helpers.

Triton is optional: without it (a CPU-only install) the ops run their PyTorch
references. On CPU, ``TRITON_INTERPRET=1`` (set before import) runs the kernels in
Triton's interpreter, which is how CI checks them against the references.
"""
from __future__ import annotations

import os

import torch

try:  # pragma: no cover - exercised by whichever environment runs
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    HAS_TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Gate activations as constexpr codes (Triton kernels cannot take strings).
ACT_CODES = {"silu": 0, "relu": 1, "gelu": 2}


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


if HAS_TRITON:
    try:  # grid dependency control (programmatic dependent launch), Triton >= 3.4
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    except ImportError:  # pragma: no cover - older Triton: the PDL paths are never taken
        gdc_launch_dependents = gdc_wait = None
else:  # pragma: no cover - no Triton: pdl_ok() is False
    gdc_launch_dependents = gdc_wait = None


if HAS_TRITON:

    @triton.jit
    def gate_act(z, ACT: tl.constexpr):
        if ACT == 0:
            return z * tl.sigmoid(z)
        elif ACT == 1:
            return tl.maximum(z, 0.0)
        else:  # exact (erf) GELU, as torch's default
            return 0.5 * z * (1.0 + tl.math.erf(z * 0.7071067811865476))


TRITON_DTYPES = (torch.float16, torch.bfloat16)


def can_implement(p) -> tuple:
    """(ok, reason) of whether the Triton kernels can run problem ``p`` (a ``lowering.problem.Problem``) at all:
    Triton installed, activations on CUDA, the spear packing, fp16 / bf16 activations."""
    if not HAS_TRITON:
        return False, "Triton is not installed"
    if p.device.type != "cuda":
        return False, f"activations on {p.device.type}"
    if p.layout != "spear":
        return False, f"layout {p.layout!r} (the Triton kernels read the spear packing)"
    if p.dtype not in TRITON_DTYPES:
        return False, f"activations {p.dtype} (the Triton kernels take fp16 / bf16)"
    return True, "CUDA, spear layout, fp16 / bf16"
