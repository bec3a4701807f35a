"""Large-M W4A16 through cuBLAS: dequantize to a scratch bf16/fp16 weight, then one GEMM.

At M >= 256 the tensor-core GEMM is compute bound and cuBLAS runs it at ~800 TFLOP/s on
an H200, which the in-loop-dequant Triton GEMM does not reach (2.3-2.8x slower,
docs/kernels.md). One vectorised dequantize pass (``w4a16_triton.w4_dequantize``:
N*K/2 bytes read, N*K*2 written; 48 us for 8192^2 on the H200) plus cuBLAS is 1.05-1.25x
cuBLAS bf16 from M = 1024 on.

``chunks > 1`` pipelines the two: the weight's rows are dequantized in ``chunks`` slices
on a side stream while the main stream multiplies the slices already done, writing each
into its columns of Y (cuBLAS takes the column slice with ldc = N, no copy). The fork and
join are stream waits, so the sequence is capturable in a CUDA graph. Results are
identical to ``chunks = 1`` (every output column comes from one GEMM over all of K).

``ec_dequant_cublas`` is the prefill EC on this path. The side-stream EC of
``dispatch/cuda.py:ec_overlapped`` added ``alpha * hg B^T`` after the GEMM, reading and writing Y
once more (4 M N bytes) and taking SMs from cuBLAS while it ran: 1.07-1.29x the W4 time at
M >= 256. Here the EC goes first and into the GEMM's C operand instead:
``E = alpha * hg B^T (+ bias)`` (cuBLAS shrink, Triton gate, cuBLAS expand) runs on the main
stream while the weight is dequantized on a side stream, then ``E += x2 W^T`` in place
(cuBLAS with beta = 1 reads E in its epilogue): no pass over Y after the GEMM. Measured on the
H200 (``docs/kernels.md``): it wins at M = 4096, and at M = 256-1024 on the larger
shapes only with the EC's stream at high priority - otherwise its small kernels queue behind the
dequantize's grid. ``dispatch/cuda.py:ec_overlapped`` picks the structure per shape from measurements.
"""
from __future__ import annotations

from typing import Optional

import torch

from .device import HIGH_PRIORITY, side_stream
from .w4a16_triton import w4_dequantize
from .ec_triton import ec_shrink_gate


def _mm(x2, w, bias, out):
    if out is None:
        return torch.nn.functional.linear(x2, w, bias)
    if bias is not None:
        return torch.addmm(bias, x2, w.t(), out=out)
    return torch.mm(x2, w.t(), out=out)


def dequant_cublas(x2: torch.Tensor, qweight, scales, zeros, G: int, bias, out: Optional[torch.Tensor] = None,
                   chunks: int = 1, side: Optional["torch.cuda.Stream"] = None) -> torch.Tensor:
    """Y[M, N] = x2 @ dequant(W)^T (+ bias), dequantizing in ``chunks`` row slices (see module docstring)."""
    N = qweight.shape[0]
    if chunks <= 1:
        return _mm(x2, w4_dequantize(qweight, scales, zeros, G, x2.dtype), bias, out)
    y = out if out is not None else torch.empty(x2.shape[0], N, dtype=x2.dtype, device=x2.device)
    step = -(-N // chunks)
    step = -(-step // 64) * 64  # slices on 64-row boundaries keep cuBLAS on its aligned kernels
    bounds = [(a, min(N, a + step)) for a in range(0, N, step)]

    def rows(a: int, b: int) -> torch.Tensor:  # rows a:b of the weight, dequantized
        return w4_dequantize(qweight[a:b], scales[a:b], zeros[a:b] if zeros is not None else None, G, x2.dtype)

    def gemm(w: torch.Tensor, a: int, b: int) -> None:  # Y[:, a:b] = x2 @ w^T (+ bias[a:b])
        _mm(x2, w, bias[a:b] if bias is not None else None, y[:, a:b])

    if not x2.is_cuda:  # (CPU: Triton's interpreter in tests) the same slices, one after another
        for a, b in bounds:
            gemm(rows(a, b), a, b)
        return y

    main = torch.cuda.current_stream(x2.device)
    side = side or side_stream(x2.device)
    side.wait_stream(main)  # the weight and x2 are ready on main
    for a, b in bounds:
        with torch.cuda.stream(side):
            w = rows(a, b)
            ready = torch.cuda.Event()
            ready.record(side)
        main.wait_event(ready)
        gemm(w, a, b)
        w.record_stream(main)  # the slice's memory is not reused before main's GEMM has read it
    return y


def ec_dequant_cublas(x2: torch.Tensor, qweight, scales, zeros, G: int, bias, A, B, W1, b1, W2, b2, alpha,
                      act: str = "silu", side: Optional["torch.cuda.Stream"] = None,
                      high_priority_ec: bool = False) -> torch.Tensor:
    """Y = x2 dequant(W)^T (+ bias) + alpha * (g * x2 A^T) B^T, the EC in the GEMM's C operand
    (module docstring). Capturable: the fork and join are stream waits.

    ``high_priority_ec``: the EC chain on a high-priority stream and the dequantize on the
    current one, instead of the dequantize on a side stream. The block scheduler dispatches a
    later kernel's CTAs only once an earlier kernel's are all dispatched, unless the later one's
    stream has higher priority: the EC's small, latency-bound kernels otherwise wait for the
    dequantize's full grid."""

    R = A.shape[0]

    def ec_chain(out: Optional[torch.Tensor] = None) -> torch.Tensor:  # E = alpha (g * x2 A^T) B^T (+ bias)
        hg = ec_shrink_gate(x2, A, W1, b1, W2, b2, act, alpha=alpha, dtype=x2.dtype)[:, :R]
        return _mm(hg, B if B.dtype == x2.dtype else B.to(x2.dtype), bias, out)

    if not x2.is_cuda:  # (CPU: Triton's interpreter in tests) the same steps, one after another
        return ec_chain().addmm_(x2, w4_dequantize(qweight, scales, zeros, G, x2.dtype).t())

    main = torch.cuda.current_stream(x2.device)
    other = side or side_stream(x2.device, HIGH_PRIORITY if high_priority_ec else 0)
    other.wait_stream(main)  # the weight and x2 are ready on main
    if high_priority_ec:
        # E belongs to main's pool (it is the layer's output), the EC's stream only writes it
        e = torch.empty(x2.shape[0], qweight.shape[0], dtype=x2.dtype, device=x2.device)
        with torch.cuda.stream(other):
            ec_chain(out=e)
        w = w4_dequantize(qweight, scales, zeros, G, x2.dtype)
        main.wait_stream(other)
        x2.record_stream(other)
    else:
        with torch.cuda.stream(other):
            w = w4_dequantize(qweight, scales, zeros, G, x2.dtype)
        e = ec_chain()
        main.wait_stream(other)
        w.record_stream(main)  # allocated on the side stream, read by main's GEMM
    return e.addmm_(x2, w.t())
