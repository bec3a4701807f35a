"""Large-M W4A16 GEMM lab: the warpgroup-MMA kernels with in-loop dequantization
(``lowering/w4a16_gemm_wgmma.py``; with ``--ra``, its register-operand form ``w4a16_gemm_wgmma_ra.py``)
against dequantize + cuBLAS (one pass and pipelined in 4 slices) and cuBLAS bf16 itself, all in one run,
per shape and M. (The kernels' diagnostic variants, parts of the K step removed and timed only, were removed
from the product; their findings are in docs/kernels.md, their code in git history.)

Every wgmma config is first checked against the reference (``dequantize_ref`` + an fp32 matmul; bf16
output rounding ~2e-3 relative) and only timed if it passes. Timing: CUDA graphs with input copies
rotating through more than 3x the L2 (``tuning.bench_graph``), so each call reads its weight from DRAM.
Writes ``lab_gemm_<GPU>.json`` (every number, GPU, versions, date) and prints ratio lines.

    python benchmarks/lab_gemm.py --out $OUT [--shapes 8192x8192 ...] [--ms 256 1024 4096] [--configs 128,128,5,8 ...]
        [--ra 128,256,3,8 ...]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernels import DT, G, SHAPES, make_weights, rel_err  # noqa: E402

from spear_compile.lowering import w4a16_gemm_wgmma as WG  # noqa: E402
from spear_compile.dispatch import cuda as D
from spear_compile.lowering import w4a16_triton as T  # noqa: E402
from spear_compile.dispatch.tuning import bench_graph, copies_for, gpu_key  # noqa: E402
from spear_compile.ops.w4a16_ref import dequantize_ref  # noqa: E402

MAX_ERR = 1e-2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--shapes", nargs="+", default=None, help="N x K shapes, e.g. 8192x8192")
    ap.add_argument("--ms", nargs="+", type=int, default=[256, 1024, 4096])
    ap.add_argument("--configs", nargs="*", default=None, metavar="BM,BN,STAGES,WARPS",
                    help="plain wgmma configs (default: its searched list; none given: none)")
    ap.add_argument("--ra", nargs="*", default=None, metavar="BNW,BMX,STAGES,WARPS",
                    help="also the register-operand kernel (w4a16_gemm_wgmma_ra) in these configs (none given: its list)")
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes] if args.shapes else SHAPES
    configs = [tuple(int(v) for v in c.split(",")) for c in args.configs] if args.configs is not None else WG.WGMMA_CONFIGS
    for c in configs:
        WG.check_config(c)
    from spear_compile.lowering import w4a16_gemm_wgmma_ra as RA

    ra = [] if args.ra is None else [tuple(int(v) for v in c.split(",")) for c in args.ra] or RA.RA_CONFIGS
    for c in ra:
        RA.check_ra_config(c)
    kernels = [("wgmma_" + "_".join(map(str, c)), c, WG.w4a16_gemm_wgmma) for c in configs]
    kernels += [("ra_" + "_".join(map(str, c)), c, RA.w4a16_gemm_wgmma_ra) for c in ra]
    for i, (name, c, fn) in enumerate(kernels):  # a config given twice is timed twice (run-to-run spread)
        if any(name == k[0] for k in kernels[:i]):
            kernels[i] = (f"{name}_rep{i}", c, fn)
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": datetime.date.today().isoformat(),
           "configs": [list(c) for c in configs], "ra_configs": [list(c) for c in ra], "rows": []}
    import triton

    res["triton"] = triton.__version__
    os.makedirs(args.out, exist_ok=True)
    for N, K in shapes:
        copies = copies_for(N * K // 2)
        ws = make_weights(N, K, copies)
        for M in args.ms:
            xs = [torch.randn(M, K, device="cuda", dtype=DT) for _ in range(copies)]
            qw0 = ws[0]["qw"]
            ref = (xs[0].float() @ dequantize_ref(qw0.qweight, qw0.scales, qw0.zeros, G, "spear", DT).float().t())
            row = {"N": N, "K": K, "M": M, "errors": {}}
            ok = []
            for name, c, fn in kernels:
                try:
                    out = fn(xs[0], qw0.qweight, qw0.scales, qw0.zeros, G, None, config=c)
                    torch.cuda.synchronize()
                    err = rel_err(out, ref)
                except Exception as e:  # a config that does not launch is reported, not fatal
                    row["errors"][name] = f"{type(e).__name__}: {str(e)[:200]}"
                    continue
                row["errors"][name] = err
                if err <= MAX_ERR:
                    ok.append((name, c, fn))
            args_w = lambda i, ws=ws: (ws[i]["qw"].qweight, ws[i]["qw"].scales, ws[i]["qw"].zeros)  # noqa: E731
            bf = [w["bf16"] for w in ws if w["bf16"] is not None]
            row["cublas_bf16"] = bench_graph(lambda i: F.linear(xs[i], bf[i % len(bf)]), copies)
            row["dequant_cublas"] = bench_graph(
                lambda i: D.w4a16_gemm(xs[i], *args_w(i), G, None, config=T.DEQUANT_CUBLAS), copies)
            row["dequant_cublas_pipe"] = bench_graph(
                lambda i: D.w4a16_gemm(xs[i], *args_w(i), G, None, config=T.DEQUANT_CUBLAS_PIPE), copies)
            for name, c, fn in ok:
                row[name] = bench_graph(lambda i: fn(xs[i], *args_w(i), G, None, config=c), copies)
            best = min((n for n, _, _ in ok), key=lambda n: row[n], default=None)
            row["best_wgmma"] = best
            cb = row["cublas_bf16"]
            shipped = min(row["dequant_cublas"], row["dequant_cublas_pipe"])
            line = (f"{N}x{K} M={M}: cuBLAS {cb:.1f} us  dequant+cuBLAS {shipped:.1f} ({shipped / cb:.2f}x)")
            for n, _, fn in ok:
                if fn is not WG.w4a16_gemm_wgmma:
                    line += f"  {n} {row[n]:.1f} ({row[n] / cb:.2f}x cuBLAS)"
            if best:
                line += f"  {best} {row[best]:.1f} ({row[best] / cb:.2f}x cuBLAS, {row[best] / shipped:.2f}x shipped)"
            bad = {n: e for n, e in row["errors"].items() if not isinstance(e, float) or e > MAX_ERR}
            if bad:
                line += f"  FAILED: {bad}"
            print(line, flush=True)
            res["rows"].append(row)
            with open(os.path.join(args.out, f"lab_gemm_{gpu_key()}.json"), "w") as f:
                json.dump(res, f, indent=1)
        del ws
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
