"""Registered operators ``spear::w4a16_linear`` and ``spear::ec_linear``.

Why custom ops: Dynamo and AOTAutograd keep them as single opaque nodes (with fake
implementations for symbolic shapes), so the compiler passes can find and rewrite
them, and Inductor can later lower them to Triton kernels. Eagerly they run the
PyTorch references in ``ops/refs.py`` and are differentiable in ``x`` and the EC
parameters (calibration trains ECs through quantized layers), via a backward that
re-runs the reference under autograd.

Extra arguments that do not change the numbers:
  layout     weight layout, one of ``format.LAYOUTS``
  lowering   "auto" (not decided), "fused", "overlapped" or "dispatch" (branch on M at
             run time against ``crossover``); set by the phase-dispatch pass.
"""
from __future__ import annotations

import functools
import inspect
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from .refs import _ACTS, GLU_ACTS, cat_part_ref, ec_linear_ref, ec_parts, glu_of, has_ec, rms_norm_ref, w4a16_linear_ref
from .format import ACT_DTYPES, LAYOUTS, QuantFormatError, check_group_params, check_spear_weight
from ..config import DEFAULT_CROSSOVER_M

LOWERINGS = ("auto", "fused", "overlapped", "dispatch")


def _static(v) -> Optional[int]:
    return v if isinstance(v, int) else None


def out_features(qweight: Tensor, scales: Tensor, layout: str) -> int:
    """N of a weight in any layout (tinygemm CUDA packs N into a 4-D tensor)."""
    return scales.shape[1] if layout == "tinygemm_cuda" else qweight.shape[0]


def check_w4a16_args(x, qweight, scales, zeros, group_size, bias, layout, lowering, where, crossover=DEFAULT_CROSSOVER_M) -> None:
    if isinstance(crossover, bool) or not isinstance(crossover, int) or crossover < 1:
        raise QuantFormatError(f"{where}: crossover={crossover!r} must be an int >= 1 (rows M below it take the "
                               "fused decode path)")
    if layout not in LAYOUTS:
        raise QuantFormatError(f"{where}: unknown layout {layout!r}; expected one of {LAYOUTS}")
    if lowering not in LOWERINGS:
        raise QuantFormatError(f"{where}: unknown lowering {lowering!r}; expected one of {LOWERINGS}")
    if x.dtype not in ACT_DTYPES:
        raise QuantFormatError(f"{where}: activation dtype {x.dtype} is not supported; expected one of {ACT_DTYPES}")
    if x.dim() == 0:
        raise QuantFormatError(f"{where}: x must be [..., K], got a 0-d tensor")
    check_same_device(x, {"qweight": qweight, "scales": scales, "zeros": zeros, "bias": bias}, where)
    K = _static(x.shape[-1])
    if layout == "spear" and K is not None:
        packed = _static(qweight.shape[1]) if qweight.dim() == 2 else None
        if packed is not None and packed * 2 != K:
            raise QuantFormatError(f"{where}: x has last dim {K} but qweight {tuple(qweight.shape)} packs "
                                   f"in_features {packed * 2}")
        check_spear_weight(qweight, scales, zeros, group_size, K, where)
    elif layout == "unpacked":
        if qweight.is_floating_point() or qweight.dim() != 2:
            raise QuantFormatError(f"{where}: unpacked qweight must be an integer [N, K], got {qweight.dtype} {tuple(qweight.shape)}")
        if K is not None and _static(qweight.shape[1]) not in (None, K):
            raise QuantFormatError(f"{where}: x has K={K} but qweight has shape {tuple(qweight.shape)}")
        if K is not None and (group_size < 1 or K % group_size):
            raise QuantFormatError(f"{where}: in_features K={K} is not divisible by group_size={group_size}")
        n = _static(qweight.shape[0])
        if K is not None and n is not None:
            check_group_params(scales, zeros, n, K, group_size, where)
    N = _static(out_features(qweight, scales, layout))
    if bias is not None and N is not None and tuple(bias.shape) != (N,):
        raise QuantFormatError(f"{where}: bias has shape {tuple(bias.shape)}, expected ({N},)")
    if bias is not None and bias.dtype != x.dtype:
        raise QuantFormatError(f"{where}: bias dtype {bias.dtype} differs from the activation dtype {x.dtype}")


def check_same_device(x: Tensor, tensors: dict, where: str) -> None:
    """Every tensor on x's device: a CPU EC on a CUDA layer (or a meta tensor, whose matmul with a
    CPU tensor returns uninitialised memory) would otherwise fail deep inside, or not at all."""
    for name, t in tensors.items():
        if t is not None and t.device != x.device:
            raise QuantFormatError(f"{where}: {name} is on {t.device} but x is on {x.device}")


def check_ec_shapes(K: int, N: int, A, B, W1, b1, W2, b2, alpha, act: str, where: str) -> None:
    """Raise a clear error when an EC does not fit a [N, K] layer."""
    if act not in _ACTS:
        raise QuantFormatError(f"{where}: unknown gate activation {act!r}; expected one of {tuple(_ACTS)}")
    r = A.shape[0] if A.dim() == 2 else -1
    d = W1.shape[0] if W1.dim() == 2 else -1
    expected = {"A": (r, K), "B": (N, r), "W1": (d, r), "b1": (d,), "W2": (r, d), "b2": (r,)}
    got = {"A": A, "B": B, "W1": W1, "b1": b1, "W2": W2, "b2": b2}
    for name, shape in expected.items():
        if tuple(got[name].shape) != shape:
            raise QuantFormatError(
                f"{where}: EC tensor {name} has shape {tuple(got[name].shape)}, expected {shape} "
                f"for a layer with in_features={K}, out_features={N}, rank={r}, gate_hidden={d}"
            )
    if alpha.numel() != 1:
        raise QuantFormatError(f"{where}: EC alpha must hold one value, got shape {tuple(alpha.shape)}")


# ---------------------------------------------------------------------------- autograd
# Differentiable inputs by position; qweight/scales/zeros are frozen quantized state.
_W4A16_DIFF = (0, 5)  # x, bias
_EC_DIFF = (0, 5, 6, 7, 8, 9, 10, 11, 12)  # x, bias, A, B, W1, b1, W2, b2, alpha


def _make_backward(ref, diff_positions: Sequence[int], n_inputs: int, n_ref_args: int):
    """Backward = VJP of the reference, recomputed from the saved inputs."""
    def setup_context(ctx, inputs, output):
        ctx.inputs = inputs  # small python values and tensors, kept for the recompute
        ctx.save_for_backward(*[inputs[i] if isinstance(inputs[i], Tensor) else None for i in diff_positions])

    def backward(ctx, grad):
        saved = ctx.saved_tensors
        args = list(ctx.inputs)
        wanted = []
        for slot, pos in enumerate(diff_positions):
            t = saved[slot]
            if t is not None and ctx.needs_input_grad[pos]:
                args[pos] = t.detach().requires_grad_(True)
                wanted.append(pos)
        grads: list[Optional[Tensor]] = [None] * n_inputs
        if wanted:
            with torch.enable_grad():
                out = ref(*args[:n_ref_args])
                gs = torch.autograd.grad(out, [args[p] for p in wanted], grad, allow_unused=True)
            for p, g in zip(wanted, gs):
                grads[p] = g
        return tuple(grads)

    return setup_context, backward


# ---------------------------------------------------------------------------- registration
# Every op is its reference-running body (whose signature is the op's schema), registered by ``_op``: the eager
# implementation checks the arguments, then runs the body; the fake checks them and returns [..., N] (``out_n``);
# ops with ``diff`` positions get a backward that re-runs the reference under autograd (``_make_backward``).


def _n_one(a: dict) -> int:
    return out_features(a["qweight"], a["scales"], a["layout"])


def _n_sum(a: dict) -> int:
    return sum(out_features(q, s, a["layout"]) for q, s in zip(a["qweights"], a["scales"]))


def _n_half(a: dict) -> int:
    return out_features(a["qweights"][0], a["scales"][0], a["layout"])


def _op(name: str, check: Callable, out_n: Callable, norm: bool = False, diff: Sequence[int] = (),
        ref: Optional[Callable] = None, n_ref_args: int = 0):
    """Register the decorated body as the custom op ``name``. ``check`` takes the op's arguments in order (with
    ``norm``, all but the last two, ``norm_weight`` and ``norm_eps``, which ``check_norm`` takes); ``out_n`` the
    bound arguments by name; ``diff``: the differentiable positions (the VJP of ``ref`` on the first
    ``n_ref_args`` arguments)."""
    def deco(fn):
        sig = inspect.signature(fn)

        def checked(args, kwargs) -> dict:
            b = sig.bind(*args, **kwargs)
            b.apply_defaults()
            a = b.args
            check(*(a[:-2] if norm else a))
            if norm:
                check_norm(a[0], a[-2], a[-1], name)
            return b.arguments

        @functools.wraps(fn)
        def eager(*args, **kwargs):
            checked(args, kwargs)
            return fn(*args, **kwargs)

        op = torch.library.custom_op(name, mutates_args=())(eager)

        @op.register_fake
        def _(*args, **kwargs):
            a = checked(args, kwargs)
            return a["x"].new_empty((*a["x"].shape[:-1], out_n(a)))

        if diff:
            sc, bw = _make_backward(ref, diff, len(sig.parameters), n_ref_args)
            torch.library.register_autograd(name, bw, setup_context=sc)
        return op

    return deco


@_op("spear::w4a16_linear", lambda *a: check_w4a16_args(*a[:8], "spear::w4a16_linear", a[8]), _n_one,
     diff=_W4A16_DIFF, ref=w4a16_linear_ref, n_ref_args=7)
def w4a16_linear(
    x: Tensor,
    qweight: Tensor,
    scales: Tensor,
    zeros: Optional[Tensor],
    group_size: int,
    bias: Optional[Tensor],
    layout: str = "spear",
    lowering: str = "auto",
    crossover: int = DEFAULT_CROSSOVER_M,
) -> Tensor:
    """4-bit-weight linear, ``x [..., K] -> [..., N]``; see module docstring."""
    return w4a16_linear_ref(x, qweight, scales, zeros, group_size, bias, layout)


@_op("spear::ec_linear", lambda *a: _check_ec_op(*a), _n_one, diff=_EC_DIFF, ref=ec_linear_ref, n_ref_args=15)
def ec_linear(
    x: Tensor,
    qweight: Tensor,
    scales: Tensor,
    zeros: Optional[Tensor],
    group_size: int,
    bias: Optional[Tensor],
    A: Tensor,
    B: Tensor,
    W1: Tensor,
    b1: Tensor,
    W2: Tensor,
    b2: Tensor,
    alpha: Tensor,
    act: str = "silu",
    layout: str = "spear",
    lowering: str = "auto",
    crossover: int = DEFAULT_CROSSOVER_M,
) -> Tensor:
    """W4A16 linear plus a gated low-rank error compensator; see module docstring."""
    return ec_linear_ref(x, qweight, scales, zeros, group_size, bias, A, B, W1, b1, W2, b2, alpha, act, layout)


def _check_ec_op(x, qweight, scales, zeros, group_size, bias, A, B, W1, b1, W2, b2, alpha, act, layout, lowering,
                 crossover=DEFAULT_CROSSOVER_M, where="spear::ec_linear"):
    check_w4a16_args(x, qweight, scales, zeros, group_size, bias, layout, lowering, where, crossover)
    check_same_device(x, {"A": A, "B": B, "W1": W1, "b1": b1, "W2": W2, "b2": b2, "alpha": alpha}, where)
    K, N = _static(x.shape[-1]), _static(out_features(qweight, scales, layout))
    if K is not None and N is not None:
        check_ec_shapes(K, N, A, B, W1, b1, W2, b2, alpha, act, where)


@_op("spear::w4a16_linear_cat", lambda *a: _check_cat(*a), _n_sum, norm=True)
def w4a16_linear_cat(
    x: Tensor,
    qweights: list[Tensor],
    scales: list[Tensor],
    zeros: list[Optional[Tensor]],
    group_size: int,
    biases: list[Optional[Tensor]],
    layout: str = "spear",
    norm_weight: Optional[Tensor] = None,
    norm_eps: float = 1e-6,
) -> Tensor:
    """Several 4-bit linears that read the same ``x``, outputs concatenated along the last dim:
    ``cat([w4a16_linear(x, qweights[i], ...) for i], -1)``. Made by the ``fuse_shared_input``
    pass (q/k/v, gate/up at decode) so that a GPU runs one GEMV over all of them. With
    ``norm_weight`` the linears read ``rms_norm(x, norm_weight, norm_eps)`` (``rms_norm_ref``; set
    by the ``fuse_rmsnorm`` pass, so that the GEMV normalises x as it stages it)."""
    x = rms_norm_ref(x, norm_weight, norm_eps) if norm_weight is not None else x
    return torch.cat([w4a16_linear_ref(x, q, s, z, group_size, b, layout)
                      for q, s, z, b in zip(qweights, scales, zeros, biases)], dim=-1)


def check_norm(x, norm_weight, norm_eps, where: str) -> None:
    """An RMSNorm prologue's weight must be one value per input feature, in x's dtype; eps > 0."""
    if norm_weight is None:
        return
    K = _static(x.shape[-1])
    if norm_weight.dim() != 1 or (K is not None and _static(norm_weight.shape[0]) not in (None, K)):
        raise QuantFormatError(f"{where}: norm_weight has shape {tuple(norm_weight.shape)}, expected ({K},)")
    if norm_weight.dtype != x.dtype:
        raise QuantFormatError(f"{where}: norm_weight dtype {norm_weight.dtype} differs from x's {x.dtype}")
    if not norm_eps > 0:
        raise QuantFormatError(f"{where}: norm_eps={norm_eps} must be > 0")
    check_same_device(x, {"norm_weight": norm_weight}, where)


def _check_cat(x, qweights, scales, zeros, group_size, biases, layout) -> None:
    n = len(qweights)
    if n == 0 or not (len(scales) == len(zeros) == len(biases) == n):
        raise QuantFormatError(f"spear::w4a16_linear_cat: qweights, scales, zeros and biases must be non-empty lists "
                               f"of one length, got {n}, {len(scales)}, {len(zeros)}, {len(biases)}")
    for i, (q, s, z, b) in enumerate(zip(qweights, scales, zeros, biases)):
        check_w4a16_args(x, q, s, z, group_size, b, layout, "auto", f"spear::w4a16_linear_cat (part {i})")


@_op("spear::w4a16_linear_glu", lambda *a: _check_glu(*a), _n_half, norm=True)
def w4a16_linear_glu(
    x: Tensor,
    qweights: list[Tensor],
    scales: list[Tensor],
    zeros: list[Optional[Tensor]],
    group_size: int,
    act: str = "silu",
    layout: str = "spear",
    norm_weight: Optional[Tensor] = None,
    norm_eps: float = 1e-6,
) -> Tensor:
    """A gated MLP's input side, ``act(x Wg^T) * (x Wu^T)`` for ``qweights = [gate, up]`` (4-bit, no
    bias), rounded as the unfused graph rounds (``ops/refs.py:glu_of``). Made by the ``fuse_glu``
    pass at decode so that a GPU runs one GEMV over both weights whose epilogue applies the gate and
    stores only the product (``lowering/w4a16_cat.py``). ``norm_weight``: as in ``w4a16_linear_cat``."""
    x = rms_norm_ref(x, norm_weight, norm_eps) if norm_weight is not None else x
    return glu_of(torch.cat([w4a16_linear_ref(x, q, s, z, group_size, None, layout)
                             for q, s, z in zip(qweights, scales, zeros)], dim=-1), act)


def _check_glu(x, qweights, scales, zeros, group_size, act, layout) -> None:
    if len(qweights) != 2:
        raise QuantFormatError(f"spear::w4a16_linear_glu: expected [gate, up] weights, got {len(qweights)}")
    if act not in GLU_ACTS:
        raise QuantFormatError(f"spear::w4a16_linear_glu: unknown gate activation {act!r}; expected one of {GLU_ACTS}")
    _check_cat(x, qweights, scales, zeros, group_size, [None, None], layout)
    n = [_static(out_features(q, s, layout)) for q, s in zip(qweights, scales)]
    if None not in n and n[0] != n[1]:
        raise QuantFormatError(f"spear::w4a16_linear_glu: gate has {n[0]} outputs but up has {n[1]}")


@_op("spear::ec_linear_cat", lambda *a: _check_ec_cat(*a), _n_sum, norm=True)
def ec_linear_cat(
    x: Tensor,
    qweights: list[Tensor],
    scales: list[Tensor],
    zeros: list[Optional[Tensor]],
    group_size: int,
    biases: list[Optional[Tensor]],
    As: list[Optional[Tensor]],
    Bs: list[Optional[Tensor]],
    W1s: list[Optional[Tensor]],
    b1s: list[Optional[Tensor]],
    W2s: list[Optional[Tensor]],
    b2s: list[Optional[Tensor]],
    alphas: list[Optional[Tensor]],
    act: str = "silu",
    layout: str = "spear",
    norm_weight: Optional[Tensor] = None,
    norm_eps: float = 1e-6,
) -> Tensor:
    """Several EC-compensated 4-bit linears that read the same ``x``, outputs concatenated along the
    last dim: ``cat([ec_linear(x, qweights[i], ..., As[i], ...) for i], -1)``. Made by the
    ``fuse_shared_input`` pass when ``CompileConfig.fuse_shared_input_ec`` is on, so that a GPU runs
    one GEMV with one (block-diagonal) EC over all of them (``lowering/w4a16_cat.py``). A part whose seven
    EC arguments are all None is a plain linear fused beside the EC ones (``w4a16_linear`` of its part: q and k
    beside a v with an EC, as SPEAR's placements leave them). ``norm_weight``: as in ``w4a16_linear_cat`` (the
    EC's producer and the GEMV each normalise x)."""
    x = rms_norm_ref(x, norm_weight, norm_eps) if norm_weight is not None else x
    return torch.cat([cat_part_ref(x, part, act, layout) for part in
                      ec_parts(qweights, scales, zeros, group_size, biases, As, Bs, W1s, b1s, W2s, b2s, alphas)],
                     dim=-1)


def _check_ec_cat(x, qweights, scales, zeros, group_size, biases, As, Bs, W1s, b1s, W2s, b2s, alphas, act,
                  layout, op: str = "ec_linear_cat") -> None:
    lists = (qweights, scales, zeros, biases, As, Bs, W1s, b1s, W2s, b2s, alphas)
    if len(qweights) == 0 or len({len(v) for v in lists}) != 1:
        raise QuantFormatError(f"spear::{op}: the weight and EC lists must be non-empty and of one length, "
                               f"got {[len(v) for v in lists]}")
    parts = ec_parts(qweights, scales, zeros, group_size, biases, As, Bs, W1s, b1s, W2s, b2s, alphas)
    for i, part in enumerate(parts):
        where = f"spear::{op} (part {i})"
        missing = [k for k, v in zip(("A", "B", "W1", "b1", "W2", "b2", "alpha"), part[5:]) if v is None]
        if not missing:
            _check_ec_op(x, *part, act, layout, "auto", where=where)
        elif len(missing) == 7:  # a plain linear beside the EC ones
            check_w4a16_args(x, *part[:5], layout, "auto", where)
        else:
            raise QuantFormatError(f"{where}: an EC needs all of A, B, W1, b1, W2, b2, alpha (a part without one has "
                                   f"None for all seven); {missing} are None")
    if not any(has_ec(p) for p in parts):
        plain = "w4a16_linear_glu" if op == "ec_linear_glu" else "w4a16_linear_cat"
        raise QuantFormatError(f"spear::{op}: no part has an EC; linears without ECs take spear::{plain}")


@_op("spear::ec_linear_glu", lambda *a: _check_ec_glu(*a), _n_half, norm=True)
def ec_linear_glu(
    x: Tensor,
    qweights: list[Tensor],
    scales: list[Tensor],
    zeros: list[Optional[Tensor]],
    group_size: int,
    As: list[Optional[Tensor]],
    Bs: list[Optional[Tensor]],
    W1s: list[Optional[Tensor]],
    b1s: list[Optional[Tensor]],
    W2s: list[Optional[Tensor]],
    b2s: list[Optional[Tensor]],
    alphas: list[Optional[Tensor]],
    act: str = "silu",
    layout: str = "spear",
    norm_weight: Optional[Tensor] = None,
    norm_eps: float = 1e-6,
) -> Tensor:
    """``silu(gate) * up`` of a gate / up pair of EC-compensated 4-bit linears (no biases): the
    ``w4a16_linear_glu`` of ``ec_linear_cat``, rounded as the unfused graph rounds (``glu_of``). ``act`` is
    the ECs' gate activation (the GLU's is silu). Made by the ``fuse_glu`` pass at decode so that a GPU
    runs one GEMV whose epilogue adds each row's EC and stores only the product
    (``lowering/w4a16_cat.py``). ``norm_weight``: as in ``w4a16_linear_cat``."""
    x = rms_norm_ref(x, norm_weight, norm_eps) if norm_weight is not None else x
    return glu_of(torch.cat([cat_part_ref(x, part, act, layout) for part in
                             ec_parts(qweights, scales, zeros, group_size, [None, None], As, Bs, W1s, b1s, W2s, b2s,
                                      alphas)], dim=-1))


def _check_ec_glu(x, qweights, scales, zeros, group_size, As, Bs, W1s, b1s, W2s, b2s, alphas, act, layout) -> None:
    if len(qweights) != 2:
        raise QuantFormatError(f"spear::ec_linear_glu: expected [gate, up] weights, got {len(qweights)}")
    _check_ec_cat(x, qweights, scales, zeros, group_size, [None, None], As, Bs, W1s, b1s, W2s, b2s, alphas, act, layout,
                  "ec_linear_glu")
    n = [_static(out_features(q, s, layout)) for q, s in zip(qweights, scales)]
    if None not in n and n[0] != n[1]:
        raise QuantFormatError(f"spear::ec_linear_glu: gate has {n[0]} outputs but up has {n[1]}")
