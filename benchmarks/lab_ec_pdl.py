"""Variant studies of the M = 1 decode EC and the large-M dequantize pass (docs/kernels.md), each against
what ships, same run.

``--what tma`` measured TMA-fed kernels (H200, 2026-11-29) that lost everywhere and were removed; they are
at commit 99d8f2d (``spear_compile/lowering/w4a16_tma_triton.py``) with their results in
``results/kernels/2026-11-29_h200_lab_tma.json``.

``--what ec_pdl``: at M = 1, the W4 GEMV, the single-launch fused EC and the two-launch PDL EC
(``lowering/ec_decode_triton.py``) in several producer counts and GEMV tiles, plus the
producer launch alone and the pair without PDL (attribution).
``--what dequant``: at M >= 256, cuBLAS against dequantize (vectorised pass) + cuBLAS and the
dequantize pass alone.
Every variant is checked against the reference before it is timed (CUDA graphs, inputs
rotating through > 3x L2, as in kernels.py). Writes ``lab_<what>_<gpu>.json``.

    python benchmarks/lab_ec_pdl.py --what ec_pdl --out $OUT [--shapes 8192x8192 ...] [--ms 1]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os

import torch
import torch.nn.functional as F

from spear_compile.dispatch import keys as TK
from spear_compile.lowering import ec_decode_triton as ED
from spear_compile.dispatch import cuda as D
from spear_compile.lowering import w4a16_triton as T
from spear_compile.dispatch.tuning import bench_graph, copies_for, gpu_key
from spear_compile.ops.ec_ref import ec_linear_ref
from spear_compile.ops.w4a16_ref import w4a16_linear_ref

from kernels import DT, G, SHAPES, bandwidth, make_ec, make_weights, rel_err  # noqa: E402  (benchmarks/ on sys.path)

MS = [1, 256, 1024, 4096]


def _producer_only(x2, ec):
    """The PDL path's producer launch alone (timing attribution)."""
    from spear_compile.lowering._triton import ACT_CODES, next_pow2

    A, B, W1, b1, W2, b2, alpha = ec
    K = x2.shape[1]
    r_p = next_pow2(A.shape[0])
    ws, cnt = T.ec_workspace(x2.device, r_p)
    p_h = min(T.MAX_PRODUCERS, -(-K // ED.PRODUCER_BLOCK_K))
    ED._ec_decode_producer_kernel[(p_h,)](
        x2, A, W1, b1, W2, b2, ws[T.GEMV_MAX_M + T.GH_COPIES:], ws[T.GEMV_MAX_M:T.GEMV_MAX_M + T.GH_COPIES], cnt,
        K, A.shape[0], W1.shape[0], P_H=p_h, P_HP=p_h, BLOCK_KH=ED.PRODUCER_BLOCK_K, R_P=r_p,
        D_P=next_pow2(W1.shape[0]), ACT=ACT_CODES["silu"], GH_COPIES=T.GH_COPIES, PDL=True, num_warps=4)
    return None


def _pair(x2, wargs, ec, cfg):
    """Producer launch then the GEMV epilogue, both without the PDL attribute (attribution)."""
    _producer_only(x2, ec)
    return T.w4a16_gemv1(x2, *wargs, G, None, ec=ec, config=cfg, pair=True)


def run_shape(N: int, K: int, ms: list[int], res: dict, out_dir: str, what: str) -> None:
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
        row = {"N": N, "K": K, "M": M, "what": what, "err": {}, "us": {}}
        expect = ref

        def variant(name, fn, quick=False, check=True):
            """fn(x, wi) -> y; checked on (x, weight 0) against ``expect``, then timed over the rotating copies."""
            try:
                if check:
                    row["err"][name] = rel_err(fn(x, 0), expect)
                kw = dict(calls=10, replays=5) if quick else {}
                row["us"][name] = bench_graph(lambda i: fn(xs[i], i), copies, **kw)
            except Exception as e:  # noqa: BLE001  (a config too large for this GPU)
                torch.cuda.synchronize()
                row["us"][name] = None
                print(f"  {name}: {type(e).__name__}: {str(e)[:160]}", flush=True)

        if what == "ec_pdl":
            if M != 1:
                continue
            ec = make_ec(N, K, 64)
            w4cfg = tuple(TK.tuned_table().get(TK.gemv1_key(N, K, G, False), T.GEMV1_CONFIGS[0]))
            variant("w4", lambda xx, i: D.w4a16_gemv(xx, *wargs(i), G, None))
            expect = ec_linear_ref(x, qw.qweight, qw.scales, qw.zeros, G, None, *ec, "silu")
            variant("fused", lambda xx, i: D.w4a16_gemv(xx, *wargs(i), G, None, ec=ec))
            variant("producer_only", lambda xx, i: _producer_only(xx, ec), check=False)
            variant("pair_no_pdl", lambda xx, i: _pair(xx, wargs(i), ec, w4cfg))
            for p in (16, 32, 64):
                variant(f"pdl_p{p}", lambda xx, i, p=p: ED.w4a16_gemv1_ec_pdl(xx, *wargs(i), G, None, ec, config=w4cfg,
                                                                             producers=p))
            for cfg in T.GEMV1_CONFIGS:
                if tuple(cfg) != w4cfg:
                    variant("pdl_p64_" + "_".join(map(str, cfg)),
                            lambda xx, i, c=cfg: ED.w4a16_gemv1_ec_pdl(xx, *wargs(i), G, None, ec, config=c), quick=True)
            base = "w4"
        elif what == "dequant":
            if M < 256:
                continue
            variant("cublas", lambda xx, i: F.linear(xx, bf[i % len(bf)]))
            variant("shipped", lambda xx, i: D.w4a16_gemm(xx, *wargs(i), G, None))
            variant("dequant_cublas", lambda xx, i: D.w4a16_gemm(xx, *wargs(i), G, None, config=T.DEQUANT_CUBLAS))
            variant("dequant_only", lambda xx, i: T.w4_dequantize(*wargs(i), G, DT), check=False)
            base = "cublas"
        new = {k: v for k, v in row["us"].items()
               if v and k.split("_")[0] in ("pdl", "dequant") and k != "dequant_only"}
        if new:
            best = min(new, key=new.get)
            row["best"] = best
            row["best_over_" + base] = new[best] / row["us"][base] if row["us"].get(base) else None
            ship = "fused" if what == "ec_pdl" else "shipped"
            row["shipped_over_" + base] = (row["us"][ship] / row["us"][base]
                                           if row["us"].get(ship) and row["us"].get(base) else None)
            row["best_over_shipped"] = new[best] / row["us"][ship] if row["us"].get(ship) else None
        res["rows"].append(row)
        us = row["us"]
        print(f"{N}x{K} M={M}: " + " ".join(f"{k}={v:.1f}" for k, v in us.items() if v)
              + f"  best {row.get('best')}  max err {max(row['err'].values()):.1e}", flush=True)
        with open(os.path.join(out_dir, f"lab_{what}_{gpu_key()}.json"), "w") as f:
            json.dump(res, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--shapes", nargs="+", default=None, help="N x K shapes, e.g. 8192x8192")
    ap.add_argument("--ms", nargs="+", type=int, default=MS)
    ap.add_argument("--what", choices=["ec_pdl", "dequant"], default="ec_pdl")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes] if args.shapes else SHAPES
    torch.manual_seed(0)
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": __import__("triton").__version__,
           "date": datetime.date.today().isoformat(), "group_size": G, "dtype": "bf16", "bandwidth": bandwidth(),
           "rows": []}
    print(json.dumps(res["bandwidth"]), flush=True)
    for N, K in shapes:
        run_shape(N, K, args.ms, res, args.out, args.what)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
