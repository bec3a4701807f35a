"""Hardware counters for the M = 1 GEMV against tinygemm, one launch each, under Nsight Compute.

Why: the M = 1 kernel sits at ~0.8x tinygemm while the target is 0.6x (2.5 TB/s); halving its
multiplies moved it 5 % (docs/kernels.md), so it is not issue-bound. The counters say what it
waits on (DRAM throughput reached, warp stall reasons, occupancy), which timing cannot.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \\
        --section LaunchStats python benchmarks/ncu_gemv1.py [--shapes 8192x8192 28672x8192]

Only the launches between cudaProfilerStart/Stop are profiled: tinygemm, then our GEMV in each
nibble mode, for each shape (weights made and kernels compiled before the start).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "experimental"))
from kernels import DT, G, make_weights  # noqa: E402
import gemv_mma_sync as GG  # noqa: E402  (the register-fed mma.sync GEMV study)

from spear_compile.lowering import w4a16_gemv_tma as GT  # noqa: E402
from spear_compile.lowering import w4a16_triton as T  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["8192x8192", "28672x8192"])
    ap.add_argument("--nibs", nargs="+", default=["biased", "bf16x2"])
    ap.add_argument("--gluon", nargs="*", default=[], help="also the mma.sync GEMV study "
                    "(experimental/gemv_mma_sync.py) in these configs (WARPS,RB,CH,PREFETCH, e.g. 8,2,1,1)")
    ap.add_argument("--tma", nargs="*", default=[], help="also the TMA-ring GEMV in these configs "
                    "(WARPS,RB,CH,STAGES,OPS, e.g. 8,2,1,2,2)")
    args = ap.parse_args()
    runs = []
    for sh in args.shapes:
        N, K = (int(v) for v in sh.split("x"))
        w = make_weights(N, K, 1)[0]
        qw = w["qw"]
        x = torch.randn(1, K, device="cuda", dtype=DT)
        runs.append((f"{sh} tinygemm", lambda x=x, w=w: torch.ops.aten._weight_int4pack_mm(x, w["packed"], G, w["sz"])))
        for nib in args.nibs:
            runs.append((f"{sh} ours_{nib}", lambda x=x, qw=qw, nib=nib: T.w4a16_gemv1(
                x, qw.qweight, qw.scales, qw.zeros, G, None, nib=nib)))
        for cfg in args.gluon:
            c = tuple(int(v) for v in cfg.split(","))
            runs.append((f"{sh} gluon_{cfg}", lambda x=x, qw=qw, c=c: GG.w4a16_gemv_gluon(
                x, qw.qweight, qw.scales, qw.zeros, G, None, config=c)))
        for cfg in args.tma:
            c = tuple(int(v) for v in cfg.split(","))
            runs.append((f"{sh} tma_{cfg}", lambda x=x, qw=qw, c=c: GT.w4a16_gemv_tma(
                x, qw.qweight, qw.scales, qw.zeros, G, None, config=c)))
    for _, fn in runs:  # compile, tune-table lookups, GEMV layout: all before profiling
        fn()
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for name, fn in runs:
        print(f"profiling: {name}", flush=True)
        fn()
        torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
