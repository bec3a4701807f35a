"""Registered operators of row-parallel EC linears (tensor parallelism).

``spear::ec_linear_partial(x, qweight, scales, zeros, group_size, A, layout) -> [..., N + r] fp32``
    one rank's stacked partial ``[Q(W_i) x_i | A_i x_i]`` (``ops/peer_reduce_ref.py``).
``spear::ec_reduced_apply(yh, bias, B, W1, b1, W2, b2, alpha, act, dtype) -> [..., N]``
    the layer's output from the reduced stack: ``y + bias + alpha * B (g(h) * h)``.
``spear::ec_linear_peer_reduce(x, ..., act, layout, group_name, timeout_s) -> [..., N]``
    the whole row-parallel layer: partial, sum over the group ``group_name``, gate on the reduced ``h``.

An eager row-parallel layer (``parallel/layers.py:RowParallelLinear``) runs the first, a functional
all-reduce, and the second, so that the compiled graph shows the collective; the ``fuse_peer_reduce`` pass
rewrites the three into the third, which a GPU runs as a peer-write GEMV epilogue and a post kernel
(``lowering/ec_peer_reduce.py``) and a CPU as the partial, a gloo all-reduce that times out naming the rank
(``ops/collective.py``), and the gated apply. With ``group_name=""`` (no process group) it is the plain
single-process math. None of these is differentiable: tensor parallelism serves, calibration runs on one
process.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .collective import all_reduce_sum
from .peer_reduce_ref import ec_partial_ref, ec_reduced_apply_ref
from .schemas import _static, check_ec_shapes, check_same_device, check_w4a16_args, out_features
from .format import QuantFormatError

DEFAULT_TIMEOUT_S = 300.0  # a reduction's wait before PeerTimeoutError (the group's own timeout may be longer)


def _check_partial(x, qweight, scales, zeros, group_size, A, layout, where):
    check_w4a16_args(x, qweight, scales, zeros, group_size, None, layout, "auto", where)
    check_same_device(x, {"A": A}, where)
    K = _static(x.shape[-1])
    if A.dim() != 2 or (K is not None and _static(A.shape[1]) not in (None, K)):
        raise QuantFormatError(f"{where}: EC tensor A has shape {tuple(A.shape)}, expected (rank, {K}) for this "
                               f"rank's K slice")


def _check_apply(yh, bias, B, W1, b1, W2, b2, alpha, act, where):
    if yh.dtype != torch.float32:
        raise QuantFormatError(f"{where}: the reduced stack yh must be fp32, got {yh.dtype}")
    if B.dim() != 2:
        raise QuantFormatError(f"{where}: EC tensor B must be [N, rank], got shape {tuple(B.shape)}")
    N, r = _static(B.shape[0]), _static(B.shape[1])
    C = _static(yh.shape[-1])
    if None not in (N, r, C) and C != N + r:
        raise QuantFormatError(f"{where}: yh has last dim {C}, expected N + rank = {N} + {r} (B is {tuple(B.shape)})")
    check_same_device(yh, {"B": B, "W1": W1, "b1": b1, "W2": W2, "b2": b2, "alpha": alpha, "bias": bias}, where)
    if bias is not None and N is not None and tuple(bias.shape) != (N,):
        raise QuantFormatError(f"{where}: bias has shape {tuple(bias.shape)}, expected ({N},)")


@torch.library.custom_op("spear::ec_linear_partial", mutates_args=())
def ec_linear_partial(x: Tensor, qweight: Tensor, scales: Tensor, zeros: Optional[Tensor], group_size: int,
                      A: Tensor, layout: str = "spear") -> Tensor:
    """One rank's stacked partial ``[Q(W_i) x_i | A_i x_i]``, fp32 ``[..., N + r]``."""
    _check_partial(x, qweight, scales, zeros, group_size, A, layout, "spear::ec_linear_partial")
    return ec_partial_ref(x, qweight, scales, zeros, group_size, A, layout)


@ec_linear_partial.register_fake
def _(x, qweight, scales, zeros, group_size, A, layout="spear"):
    _check_partial(x, qweight, scales, zeros, group_size, A, layout, "spear::ec_linear_partial")
    N = out_features(qweight, scales, layout)
    return x.new_empty((*x.shape[:-1], N + A.shape[0]), dtype=torch.float32)


@torch.library.custom_op("spear::ec_reduced_apply", mutates_args=())
def ec_reduced_apply(yh: Tensor, bias: Optional[Tensor], B: Tensor, W1: Tensor, b1: Tensor, W2: Tensor, b2: Tensor,
                     alpha: Tensor, act: str, dtype: torch.dtype) -> Tensor:
    """``y + bias + alpha * B (g(h) * h)`` of the reduced stack ``yh = [y | h]``, in ``dtype``."""
    _check_apply(yh, bias, B, W1, b1, W2, b2, alpha, act, "spear::ec_reduced_apply")
    return ec_reduced_apply_ref(yh, bias, B, W1, b1, W2, b2, alpha, act, dtype)


@ec_reduced_apply.register_fake
def _(yh, bias, B, W1, b1, W2, b2, alpha, act, dtype):
    _check_apply(yh, bias, B, W1, b1, W2, b2, alpha, act, "spear::ec_reduced_apply")
    return yh.new_empty((*yh.shape[:-1], B.shape[0]), dtype=dtype)


def check_peer_reduce_args(x, qweight, scales, zeros, group_size, bias, A, B, W1, b1, W2, b2, alpha, act, layout,
                           group_name, timeout_s, where="spear::ec_linear_peer_reduce") -> None:
    _check_partial(x, qweight, scales, zeros, group_size, A, layout, where)
    check_w4a16_args(x, qweight, scales, zeros, group_size, bias, layout, "auto", where)
    check_same_device(x, {"B": B, "W1": W1, "b1": b1, "W2": W2, "b2": b2, "alpha": alpha}, where)
    K, N = _static(x.shape[-1]), _static(out_features(qweight, scales, layout))
    if K is not None and N is not None:
        check_ec_shapes(K, N, A, B, W1, b1, W2, b2, alpha, act, where)
    if not isinstance(group_name, str):
        raise QuantFormatError(f"{where}: group_name must be a process group's name (str), got {type(group_name)}")
    if not timeout_s > 0:
        raise QuantFormatError(f"{where}: timeout_s={timeout_s} must be > 0")


@torch.library.custom_op("spear::ec_linear_peer_reduce", mutates_args=())
def ec_linear_peer_reduce(x: Tensor, qweight: Tensor, scales: Tensor, zeros: Optional[Tensor], group_size: int,
                          bias: Optional[Tensor], A: Tensor, B: Tensor, W1: Tensor, b1: Tensor, W2: Tensor,
                          b2: Tensor, alpha: Tensor, act: str = "silu", layout: str = "spear", group_name: str = "",
                          timeout_s: float = DEFAULT_TIMEOUT_S) -> Tensor:
    """The row-parallel EC layer: this rank's partial, summed over ``group_name`` (none for ``""``), gated
    on the reduced ``A x``. CPU: a host all-reduce (``ops/collective.py``)."""
    check_peer_reduce_args(x, qweight, scales, zeros, group_size, bias, A, B, W1, b1, W2, b2, alpha, act, layout,
                           group_name, timeout_s)
    yh = ec_partial_ref(x, qweight, scales, zeros, group_size, A, layout)
    yh = all_reduce_sum(yh.contiguous(), group_name, timeout_s, "spear::ec_linear_peer_reduce")
    return ec_reduced_apply_ref(yh, bias, B, W1, b1, W2, b2, alpha, act, x.dtype)


@ec_linear_peer_reduce.register_fake
def _(x, qweight, scales, zeros, group_size, bias, A, B, W1, b1, W2, b2, alpha, act="silu", layout="spear",
      group_name="", timeout_s=DEFAULT_TIMEOUT_S):
    check_peer_reduce_args(x, qweight, scales, zeros, group_size, bias, A, B, W1, b1, W2, b2, alpha, act, layout,
                           group_name, timeout_s)
    return x.new_empty((*x.shape[:-1], out_features(qweight, scales, layout)))
