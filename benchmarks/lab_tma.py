"""Variant study: the TMA-fed kernels (``lowering/w4a16_tma_triton.py``) against what ships.

For each weight shape: at M = 1 tinygemm, the shipped M = 1 GEMV (its tuned config) and the
TMA GEMV in each config; at M > 1 cuBLAS bf16, the shipped GEMM path (its tuned config,
which may be dequantize + cuBLAS) and the transposed tensor-core GEMM in each config.
Every variant is checked against the reference before it is timed (CUDA graphs, inputs
rotating through > 3x L2, as in kernels.py). Writes ``lab_tma_<gpu>.json``.

    python benchmarks/lab_tma.py --out $OUT [--shapes 8192x8192 ...] [--ms 1 1024]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os

import torch
import torch.nn.functional as F

from spear_compile.lowering import w4a16_tma_triton as TT
from spear_compile.lowering import w4a16_triton as T
from spear_compile.lowering.tuning import bench_graph, copies_for, gpu_key
from spear_compile.lowering.w4a16 import w4a16_linear_ref

from kernels import DT, G, SHAPES, bandwidth, make_weights, rel_err  # noqa: E402  (benchmarks/ on sys.path)

MS = [1, 16, 64, 256, 1024, 4096]


def run_shape(N: int, K: int, ms: list[int], res: dict, out_dir: str) -> None:
    wbytes = N * K // 2 + N * (K // G) * 4
    copies = min(copies_for(wbytes), 12)
    ws = make_weights(N, K, copies)
    for w in ws:  # the word layout is made once per weight, outside the timed region
        T.gemv_words(w["qw"].qweight)
    wargs = lambda i: (ws[i]["qw"].qweight, ws[i]["qw"].scales, ws[i]["qw"].zeros)  # noqa: E731
    qw = ws[0]["qw"]
    bf = [w["bf16"] for w in ws if w["bf16"] is not None]
    for M in ms:
        xs = [torch.randn(M, K, device="cuda", dtype=DT) for _ in range(copies)]
        x = torch.randn(M, K, device="cuda", dtype=DT)
        ref = w4a16_linear_ref(x, qw.qweight, qw.scales, qw.zeros, G, None)
        row = {"N": N, "K": K, "M": M, "err": {}, "us": {}}

        def variant(name, fn, quick=False):
            """fn(x, wi) -> y; checked on (x, weight 0), then timed over the rotating copies."""
            try:
                row["err"][name] = rel_err(fn(x, 0), ref)
                kw = dict(calls=10, replays=5) if quick else {}
                row["us"][name] = bench_graph(lambda i: fn(xs[i], i), copies, **kw)
            except Exception as e:  # noqa: BLE001  (a config too large for this GPU)
                torch.cuda.synchronize()
                row["us"][name] = None
                print(f"  {name}: {type(e).__name__}: {str(e)[:160]}", flush=True)

        if M == 1:
            variant("tinygemm", lambda xx, i: torch.ops.aten._weight_int4pack_mm(xx, ws[i]["packed"], G, ws[i]["sz"]))
            variant("shipped", lambda xx, i: T.w4a16_gemv(xx, *wargs(i), G, None))
            for cfg in TT.GEMV1_TMA_CONFIGS:
                variant("tma_" + "_".join(map(str, cfg)),
                        lambda xx, i, c=cfg: TT.w4a16_gemv1_tma(xx, *wargs(i), G, None, config=c), quick=True)
            base = "tinygemm"
        else:
            variant("cublas", lambda xx, i: F.linear(xx, bf[i % len(bf)]))
            variant("shipped", lambda xx, i: T.w4a16_gemm(xx, *wargs(i), G, None))
            for cfg in TT.GEMM_T_CONFIGS:
                variant("gemmT_" + "_".join(map(str, cfg)),
                        lambda xx, i, c=cfg: TT.w4a16_gemm_t(xx, *wargs(i), G, None, config=c), quick=True)
            base = "cublas"
        new = {k: v for k, v in row["us"].items() if v and (k.startswith("tma_") or k.startswith("gemmT_"))}
        if new:
            best = min(new, key=new.get)
            row["best"] = best
            row["best_over_" + base] = new[best] / row["us"][base] if row["us"].get(base) else None
            row["shipped_over_" + base] = (row["us"]["shipped"] / row["us"][base]
                                           if row["us"].get("shipped") and row["us"].get(base) else None)
            row["best_over_shipped"] = new[best] / row["us"]["shipped"] if row["us"].get("shipped") else None
        res["rows"].append(row)
        us = row["us"]
        print(f"{N}x{K} M={M}: {base} {us.get(base)}  shipped {us.get('shipped')}  best {row.get('best')} "
              f"{new.get(row.get('best'))}  max err {max(v for v in row['err'].values()):.1e}", flush=True)
        with open(os.path.join(out_dir, f"lab_tma_{gpu_key()}.json"), "w") as f:
            json.dump(res, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--shapes", nargs="+", default=None, help="N x K shapes, e.g. 8192x8192")
    ap.add_argument("--ms", nargs="+", type=int, default=MS)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes] if args.shapes else SHAPES
    torch.manual_seed(0)
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": __import__("triton").__version__,
           "date": datetime.date.today().isoformat(), "group_size": G, "dtype": "bf16", "bandwidth": bandwidth(),
           "rows": []}
    print(json.dumps(res["bandwidth"]), flush=True)
    for N, K in shapes:
        run_shape(N, K, args.ms, res, args.out)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
