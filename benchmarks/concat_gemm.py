"""Linears sharing an input at M = 2..256: one W4 GEMM over their concatenated weights against one GEMM each.

The decode fusion ``fuse_shared_input`` concatenated q/k/v and gate/up only at M = 1 (one GEMV) before this
measurement (it now does at a static M of 2..256 too). In the serving
regime the W4 GEMMs are latency-bound and a 4096-wide output leaves SMs idle (H200, 4096x4096 at M = 16: 1.10x
cuBLAS, where 11008x4096 is 0.99x; README "Serving's batch sizes"), so one GEMM over the three q/k/v weights
(12288 rows) should fill the grid where three 4096-row GEMMs do not. Prediction: at M = 16-64, the q/k/v
concatenation at most 0.6x the three parts' time (three launches of ~15-20 us against one ~25 us GEMM),
gate/up (already 11008 rows each) 0.85-1.0x; above M = 256 no gain (the GEMMs fill the GPU alone).

For each group (Llama-2-7B's q/k/v and gate/up, Qwen2.5-7B's) and M, as CUDA-graph replays over weight copies
past L2 (``dispatch.tuning.bench_graph``), microseconds per call:

* ``parts``: what ``spear::w4a16_linear_cat`` runs at M > 1 today: each part through the route, then ``torch.cat``;
* ``parts_no_cat``: the parts' GEMMs alone (the copy's share);
* ``cat_route``: one ``w4a16_linear`` over the concatenated weight as the route runs it (an untuned shape: the
  table's nearest geometry);
* ``cat_best``: the fastest of the register-operand small tiles (with and without K split) and the Triton GEMM
  configs on the concatenated shape (what ``spear tune`` would store), checked against the parts first;
* ``cublas_cat``: ``F.linear`` on the dequantized concatenation (bf16), for scale.

Writes ``OUT/concat_gemm_<GPU>.json``.

    python benchmarks/concat_gemm.py --out OUT [--ms 2 8 16 32 64 128 256] [--groups llama2-qkv ...]
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F

try:
    from _syspath import unshadow
except ImportError:  # run as a module from the repository root
    from benchmarks._syspath import unshadow
unshadow()

from spear_compile.dispatch import autotune as AT  # noqa: E402
from spear_compile.dispatch import cuda as D  # noqa: E402
from spear_compile.dispatch import route as RT  # noqa: E402
from spear_compile.dispatch.tuning import bench_graph, copies_for, gpu_key, search  # noqa: E402
from spear_compile.lowering import w4a16_triton as T  # noqa: E402
from spear_compile.ops.w4a16_ref import dequantize_ref  # noqa: E402

GROUPS = {  # name -> (rows of each part, K)
    "llama2-qkv": ((4096, 4096, 4096), 4096),
    "llama2-gate-up": ((11008, 11008), 4096),
    "qwen2.5-qkv": ((3584, 512, 512), 3584),
    "qwen2.5-gate-up": ((18944, 18944), 3584),
}


def one(parts, K: int, G: int, M: int) -> dict:
    N = sum(parts)
    copies = min(copies_for(N * K // 2), 8)
    ws = [[AT.random_weights(n, K, G, 1, "cuda")[0] for n in parts] for _ in range(copies)]
    cat = [tuple(torch.cat([w[j] for w in part_ws]) for j in range(3)) for part_ws in ws]
    xs = [torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    row = {"parts": list(parts), "K": K, "G": G, "M": M}
    ref = torch.cat([D.w4a16_linear_cuda(xs[0], *w, G, None) for w in ws[0]], dim=-1)
    y = D.w4a16_linear_cuda(xs[0], *cat[0], G, None)
    row["cat_route_rel_err"] = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
    row["parts"] = bench_graph(lambda i: torch.cat([D.w4a16_linear_cuda(xs[i], *w, G, None) for w in ws[i]], -1), copies)
    row["parts_no_cat"] = bench_graph(lambda i: [D.w4a16_linear_cuda(xs[i], *w, G, None) for w in ws[i]], copies)
    row["cat_route"] = bench_graph(lambda i: D.w4a16_linear_cuda(xs[i], *cat[i], G, None), copies)
    row["cat_route_kernel"] = RT.route(RT.problem_of("w4a16", xs[0], *cat[0], G)).describe()
    choices = list(RT.ra_small_choices(M, N, K, G)) + list(T.GEMM_CONFIGS)
    good = []
    for c in choices:  # only configs whose output matches the parts'
        try:
            out = D.w4a16_gemm(xs[0], *cat[0], G, None, config=c)
        except Exception:  # a config this GPU or shape does not take
            continue
        if ((out.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2:
            good.append(c)
    if good:
        cfg, row["cat_best"] = search(lambda c: (lambda i: D.w4a16_gemm(xs[i], *cat[i], G, None, config=c)), good, copies)
        row["cat_best_config"] = list(cfg)
    bf = [dequantize_ref(*cat[i], G, "spear", torch.bfloat16) for i in range(min(2, copies))]
    row["cublas_cat"] = bench_graph(lambda i: F.linear(xs[i], bf[i % len(bf)]), copies)
    for k in ("cat_route", "cat_best"):
        if k in row:
            row[f"{k}_over_parts"] = row[k] / row["parts"]
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", type=int, nargs="+", default=[2, 8, 16, 32, 64, 128, 256])
    ap.add_argument("--groups", nargs="+", default=list(GROUPS), choices=list(GROUPS))
    ap.add_argument("--group-size", type=int, default=128)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("concat_gemm.py: needs a CUDA GPU (it times the CUDA kernels)")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"concat_gemm_{gpu_key()}.json")
    rows = []
    for g in args.groups:
        parts, K = GROUPS[g]
        for M in args.ms:
            r = {"group": g, **one(parts, K, args.group_size, M)}
            rows.append(r)
            print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)
            with open(path, "w") as f:
                json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
