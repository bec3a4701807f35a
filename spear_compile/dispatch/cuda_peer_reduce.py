"""The CUDA implementation of ``spear::ec_linear_peer_reduce``: the peer-write pair where it can run (unless
``SPEAR_NO_PEER_WRITE=1``, ``envs.py``), else the host path (the reference partial, an all-reduce over the
group - NCCL on CUDA - and the gated apply).

The pair (``lowering/ec_peer_reduce.py``) runs at decode (M <= its staging rows) on a group of any size,
one included (``group_name=""``: one GPU, the same kernels with one slot). Its staging is allocated on
the first call for each layer shape (a collective: run one eager step before capturing a CUDA graph).
"""
from __future__ import annotations

import torch

from .. import envs
from ..lowering import ec_peer_reduce as PR
from ..lowering.problem import Problem
from ..ops.collective import all_reduce_sum
from ..ops.peer_reduce_ref import ec_partial_ref, ec_reduced_apply_ref
from ..ops.tp_schemas import check_peer_reduce_args

_WHERE = "spear::ec_linear_peer_reduce"


def peer_reduce_problem(x, qweight, scales, zeros, group_size, A, W1, layout) -> Problem:
    M = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return Problem(op="ec", M=M, N=qweight.shape[0], K=x.shape[-1], G=group_size, dtype=x.dtype,
                   device=x.device, layout=layout, has_zeros=zeros is not None, rank=A.shape[0],
                   gate_width=W1.shape[0], weight_contiguous=qweight.is_contiguous(),
                   params_contiguous=scales.is_contiguous() and (zeros is None or zeros.is_contiguous()),
                   a_contiguous=A.is_contiguous())


def ec_linear_peer_reduce_cuda(x, qweight, scales, zeros, group_size, bias, A, B, W1, b1, W2, b2, alpha, act="silu",
                               layout="spear", group_name="", timeout_s=300.0):

    check_peer_reduce_args(x, qweight, scales, zeros, group_size, bias, A, B, W1, b1, W2, b2, alpha, act, layout,
                           group_name, timeout_s)
    ok = not envs.no_peer_write() and PR.can_implement(peer_reduce_problem(x, qweight, scales, zeros, group_size, A, W1,
                                                                      layout))[0]
    if ok:
        st = PR.staging_for(group_name, qweight.shape[0], A.shape[0], x.device)
        return PR.ec_linear_peer_reduce_gpu(x, qweight, scales, zeros, group_size, bias, A, B, W1, b1, W2, b2, alpha,
                                            act, st)
    yh = all_reduce_sum(ec_partial_ref(x, qweight, scales, zeros, group_size, A, layout).contiguous(), group_name,
                        timeout_s, _WHERE)
    return ec_reduced_apply_ref(yh, bias, B, W1, b1, W2, b2, alpha, act, x.dtype)


def register_peer_reduce_cuda() -> None:
    """Route the op's CUDA dispatch key here (idempotent)."""
    if getattr(register_peer_reduce_cuda, "_done", False):
        return
    torch.library.register_kernel("spear::ec_linear_peer_reduce", "cuda", ec_linear_peer_reduce_cuda)
    register_peer_reduce_cuda._done = True  # type: ignore[attr-defined]
