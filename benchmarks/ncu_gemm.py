"""Hardware counters for the large-M W4A16 GEMMs under Nsight Compute, one launch each: cuBLAS bf16, the
dequantize pass + cuBLAS, and the warpgroup-MMA kernel in the given configs.

Why: timing says the wgmma kernel takes ~2.2x the MMA-bound time per K step (docs/kernels.md); the
counters (tensor-pipe utilisation, shared-memory wavefronts, warp stall reasons) say what a step waits on.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section WarpStateStats \\
        --section SchedulerStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \\
        python benchmarks/ncu_gemm.py --shape 8192x8192 --m 1024 --configs 128,256,4,8
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernels import DT, G, make_weights  # noqa: E402

from spear_compile.lowering import w4a16_gemm_wgmma as WG  # noqa: E402
from spear_compile.dispatch import cuda as D
from spear_compile.lowering import w4a16_triton as T  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="8192x8192")
    ap.add_argument("--m", type=int, default=1024)
    ap.add_argument("--configs", nargs="*", default=["128,256,4,8", "128,128,3,8"])
    ap.add_argument("--ra", nargs="*", default=[], metavar="BNW,BMX,STAGES,WARPS",
                    help="also the register-operand kernel (w4a16_gemm_wgmma_ra) in these configs")
    args = ap.parse_args()
    N, K = (int(v) for v in args.shape.split("x"))
    qw = make_weights(N, K, 1)[0]
    x = torch.randn(args.m, K, device="cuda", dtype=DT)
    w = qw["bf16"]
    q = qw["qw"]
    configs = [tuple(int(v) for v in c.split(",")) for c in args.configs]
    runs = [("cublas_bf16", lambda: F.linear(x, w)),
            ("dequant_cublas", lambda: D.w4a16_gemm(x, q.qweight, q.scales, q.zeros, G, None, config=T.DEQUANT_CUBLAS))]
    runs += [(f"wgmma_{c}", (lambda c=c: WG.w4a16_gemm_wgmma(x, q.qweight, q.scales, q.zeros, G, None, config=c)))
             for c in configs]
    from spear_compile.lowering import w4a16_gemm_wgmma_ra as RA

    runs += [(f"ra_{c}", (lambda c=c: RA.w4a16_gemm_wgmma_ra(x, q.qweight, q.scales, q.zeros, G, None, config=c)))
             for c in (tuple(int(v) for v in r.split(",")) for r in args.ra)]
    for _, fn in runs:  # compile and warm up outside the profiled range
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for name, fn in runs:
        torch.cuda.nvtx.range_push(name)
        fn()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
    torch.cuda.cudart().cudaProfilerStop()
    print("profiled:", [n for n, _ in runs])


if __name__ == "__main__":
    main()
