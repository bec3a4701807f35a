"""Session 21: where the register-operand GEMM's stream-K units lose time (diagnostic, timing only).

Forced unit counts (``sk_units``: every tile streamed) on grids of at most one wave, where no two units share a
weight tile's x blocks (M <= 256: one x block), so L2 locality is the same as the plain kernel's:
units = tiles (one whole tile per unit: the SK machinery - ticket, runs, ring restarts - without partials), 2x
and 3x tiles (each tile split in 2 / 3: partial stores, the owners' waits and adds). Interleaved with the plain
config in 3 rounds; prints us and writes sk_diag.json.

    python benchmarks/device/s21_sk_diag.py --out DIR
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from kernels import DT, G, make_weights  # noqa: E402

from spear_compile.lowering import w4a16_gemm_wgmma_ra as RA  # noqa: E402
from spear_compile.lowering.tuning import bench_graph, copies_for  # noqa: E402

CFG = (128, 256, 3, 8, 0, 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for N, K, M in [(11008, 4096, 256), (8192, 8192, 256), (4096, 4096, 256)]:
        copies = copies_for(N * K // 2)
        ws = make_weights(N, K, copies)
        xs = [torch.randn(M, K, device="cuda", dtype=DT) for _ in range(copies)]
        tiles = -(-M // CFG[1]) * -(-N // CFG[0])
        w = lambda i: (ws[i]["qw"].qweight, ws[i]["qw"].scales, ws[i]["qw"].zeros)  # noqa: E731
        variants = {"plain": dict(config=CFG[:5])}
        for f in (1, 2, 3):
            if f * tiles <= sms:
                variants[f"units={f * tiles}"] = dict(config=CFG, sk_units=f * tiles)
        times = {k: [] for k in variants}
        for _ in range(3):
            for k, kw in variants.items():
                times[k].append(bench_graph(lambda i, kw=kw: RA.w4a16_gemm_wgmma_ra(xs[i], *w(i), G, None, **kw),
                                            copies))
        row = {"N": N, "K": K, "M": M, "tiles": tiles, **{k: statistics.median(v) for k, v in times.items()},
               "all": times}
        rows.append(row)
        print(f"{N}x{K} M={M} ({tiles} tiles): " + "  ".join(f"{k} {row[k]:.1f}" for k in variants) + " us",
              flush=True)
        del ws
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sk_diag.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
