"""W4 GEMMs in the serving regime (M = 2..128): the register-operand wgmma GEMM's small tiles against what the
route ran before and cuBLAS.

For each shape (the five benchmark shapes, and Qwen2.5-7B's, which the shipped table does not hold) and each M,
one run checks the small tiles (``lowering/w4a16_gemm_wgmma_ra.SMALL_CONFIGS``: x blocks of 16 / 32 / 64 rows,
deep rings, an optional K split) against the dequantized reference and for bitwise reproducibility, then times,
as CUDA-graph replays over weight copies that do not fit in L2:

* ``cublas_bf16``: ``F.linear`` on the dequantized bf16 weight (the ratios' denominator);
* ``route_before``: our W4 as the op runs it with the table before this run (the table's GEMM);
* ``triton_best``: the Triton GEMM's fastest config (``GEMM_CONFIGS``);
* ``ra_small_best``: the whole-K small tiles' fastest config (``route.ra_small_choices`` without a K split);
* ``ra_large_best`` (M >= 64): the register-operand GEMM's large tiles (``RA_CONFIGS``);
* ``ra_ks_best``: the small tiles with K split (``KSPLIT_CONFIGS``, also in ``route.ra_small_choices``);
* ``tma_rows_best`` (M <= 16, with ``--tma-rows``: the kernel is opt-in until its GPU tests have passed): the TMA
  GEMV with x's rows in the MMA's columns (``lowering/w4a16_gemv_tma_rows``, ``route.tma_rows_choices``), beside
  ``tma_m1``: the route's M = 1 kernel on the first row alone (prediction: within ~1.2x of it at M <= 8);
* ``ec_r64_fused`` / ``ec_r64_overlapped`` (M <= 4, where the fused EC can run): W4 + EC under each lowering,
  the evidence for the fused / overlapped crossover (``ec_crossover``: the one the backend compiles with);
* ``route_after`` / ``ec_r64_after``: our W4 and W4 + EC (rank 64, gated) as the op runs them once the
  table holds the row's fastest (``fastest``: the previous choice, ``triton_best`` and every register-operand
  family's best that matched the reference) (``ec_r64_before``: the EC before).

Writes ``OUT/small_m_gemm_<GPU>.json`` (rows, meta) and ``OUT/configs_<GPU>.json``: the table with those
choices (``dispatch.table.dumps``), for the shipped table when the numbers say so. Targets (the serving-regime
kernel targets, W4 / cuBLAS): M <= 16 0.40, 32 0.45, 64 0.60, 128 0.85; W4 + EC <= 1.10x W4.

    python benchmarks/small_m_gemm.py --out OUT [--ms 2 4 8 16 32 64 128] [--shapes 4096x4096 ...]
    python benchmarks/small_m_gemm.py --out OUT --table-from RECORD.json   # the table a record measured
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F

try:
    from _syspath import unshadow
except ImportError:  # run as a module from the repository root
    from benchmarks._syspath import unshadow
unshadow()

from spear_compile.config import DEFAULT_CROSSOVER_M  # noqa: E402
from spear_compile.dispatch import autotune as AT  # noqa: E402
from spear_compile.dispatch import cuda as D  # noqa: E402
from spear_compile.dispatch import keys as TK  # noqa: E402
from spear_compile.dispatch import route as RT  # noqa: E402
from spear_compile.dispatch import table as TT  # noqa: E402
from spear_compile.dispatch.tuning import bench_graph, copies_for, gpu_key, search  # noqa: E402
from spear_compile.lowering import w4a16_triton as T  # noqa: E402
from spear_compile.ops.w4a16_ref import dequantize_ref  # noqa: E402

BENCH = ["4096x4096", "11008x4096", "4096x11008", "8192x8192", "28672x8192"]
QWEN = ["4608x3584", "3584x3584", "37888x3584", "3584x18944"]  # Qwen2.5-7B: q/k/v, o, gate/up, down


def rel_err(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()


def _config_of(kernel: str):
    """A route description's table value (``gemm[...]``, ``gemm_wgmma_ra[...]``, ``gemv_tma_rows[...]``,
    ``dequant_cublas[chunks]``), or None for other kernels."""
    name, _, vals = kernel.partition("[")
    if name not in ("gemm", "gemm_wgmma_ra", "gemv_tma_rows", "dequant_cublas") or not vals.endswith("]"):
        return None
    cfg = [int(v) for v in vals[:-1].split(",")]
    if name == "dequant_cublas":
        return list(T.DEQUANT_CUBLAS) if cfg == [1] else [T.DEQUANT_CUBLAS_PIPE[0], cfg[0]]
    return [T.WGMMA_RA] + cfg if name == "gemm_wgmma_ra" else [name] + cfg if name == "gemv_tma_rows" else cfg


def fastest(row: dict):
    """The table value a row measured fastest: the route's choice before the run, the Triton GEMM's best config,
    and each register-operand family's best that matched the reference (rel. error < 1e-2) and reproduced its
    bits. None when no candidate has a table value."""
    cands = [(row["route_before"], _config_of(row["route_before_kernel"])),
             (row["triton_best"], row["triton_best_config"])]
    for stem in ("ra_small", "ra_large", "ra_ks", "tma_rows"):
        if f"{stem}_best" in row and row[f"{stem}_rel_err"] < 1e-2 and row[f"{stem}_reproducible"]:
            cands.append((row[f"{stem}_best"], row[f"{stem}_best_config"]))
    cands = [(t, list(c)) for t, c in cands if c is not None]
    return min(cands, key=lambda tc: tc[0])[1] if cands else None


def table_from(record: str):
    """The configs table a recorded run measured (``fastest`` per row with M > 1), without a GPU."""
    rows = json.load(open(record))["rows"]
    table = TT.TunedTable("configs")
    for r in rows:
        choice = fastest(r)
        if r["M"] > 1 and choice is not None:
            table[TK.gemm_key(r["M"], r["N"], r["K"], r["G"])] = choice
    return table


def one(N: int, K: int, G: int, M: int, ksplit: bool = True) -> dict:
    copies = min(copies_for(N * K // 2), 12)
    ws = AT.random_weights(N, K, G, copies, "cuda")
    xs = [torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    bf = [dequantize_ref(*ws[i], G, "spear", torch.bfloat16) for i in range(2)]
    ec = AT.random_ec(N, K, 64, "cuda")
    row = {"N": N, "K": K, "G": G, "M": M}
    ref = F.linear(xs[0], bf[0])
    w4 = lambda i: D.w4a16_linear_cuda(xs[i], *ws[i], G, None)  # noqa: E731
    measured = TT.crossover(N, K)  # the crossover the backend compiles with: measured, else the default
    row["ec_crossover"] = cross = measured if measured is not None else DEFAULT_CROSSOVER_M
    ecl = lambda i: D.ec_linear_cuda(xs[i], *ws[i], G, None, *ec, crossover=cross)  # noqa: E731
    row["cublas_bf16"] = bench_graph(lambda i: F.linear(xs[i], bf[i % 2]), copies)
    row["route_before"] = bench_graph(w4, copies)
    row["route_before_kernel"] = RT.route(RT.problem_of("w4a16", xs[0], *ws[0], G)).describe()
    row["ec_r64_before"] = bench_graph(ecl, copies)
    run = lambda c: (lambda i: D.w4a16_gemm(xs[i], *ws[i], G, None, config=c))  # noqa: E731
    cfg_t, row["triton_best"] = search(run, list(T.GEMM_CONFIGS), copies)
    row["triton_best_config"] = list(cfg_t)

    def checked(stem, choices):
        """The fastest of ``choices``, recorded as ``<stem>_best`` with its config, its error against the
        reference (``<stem>_rel_err``) and whether a second call gives the same bits (``<stem>_reproducible``)."""
        cfg, row[f"{stem}_best"] = search(run, choices, copies)
        row[f"{stem}_best_config"] = list(cfg)
        y = D.w4a16_gemm(xs[0], *ws[0], G, None, config=cfg)
        row[f"{stem}_rel_err"] = rel_err(y, ref)
        row[f"{stem}_reproducible"] = bool(torch.equal(y, D.w4a16_gemm(xs[0], *ws[0], G, None, config=cfg)))
        return cfg, row[f"{stem}_best"]

    choices = RT.ra_small_choices(M, N, K, G)
    small = [c for c in choices if len(c) == 6]  # whole K
    ks = [c for c in choices if len(c) == 7] if ksplit else []  # K split
    if small:  # (empty where the kernel does not take the shape)
        row["ra_small_over_cublas"] = checked("ra_small", small)[1] / row["cublas_bf16"]
        for c in small:  # every tile's own time, for the record
            row[f"ra_{'_'.join(map(str, c[1:]))}"] = bench_graph(run(c), copies)
    if M >= 64 and small:  # from M = 64 the register-operand GEMM's large tiles too (the M = 128 entries predate them)
        checked("ra_large", RT.wgmma_ra_choices())
    if ks:
        checked("ra_ks", ks)
    rows = RT.tma_rows_choices(M, N, K, G)
    if rows:
        row["tma_rows_over_cublas"] = checked("tma_rows", rows)[1] / row["cublas_bf16"]
        row["tma_m1"] = bench_graph(lambda i: D.w4a16_linear_cuda(xs[i][:1], *ws[i], G, None), copies)
        row["tma_m1_kernel"] = RT.route(RT.problem_of("w4a16", xs[0][:1], *ws[0], G)).describe()
    key = TK.gemm_key(M, N, K, G)
    table = TT.configs()
    choice = fastest(row)
    if M > RT.W4_GEMV_MAX_M and choice is not None:
        table[key] = choice
    row["table_choice"] = table.get(key)
    row["route_after"] = bench_graph(w4, copies)
    row["route_after_kernel"] = RT.route(RT.problem_of("w4a16", xs[0], *ws[0], G)).describe()
    row["ec_r64_after"] = bench_graph(ecl, copies)
    if M <= T.GEMV_MAX_M:  # both EC lowerings where the fused one can run: the crossover's evidence
        for lw in ("fused", "overlapped"):
            row[f"ec_r64_{lw}"] = bench_graph(
                lambda i, lw=lw: D.ec_linear_cuda(xs[i], *ws[i], G, None, *ec, lowering=lw), copies)
    for k in ("route_before", "triton_best", "route_after"):
        row[f"{k}_over_cublas"] = row[k] / row["cublas_bf16"]
    row["ec_after_over_w4_after"] = row["ec_r64_after"] / row["route_after"]
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", nargs="+", type=int, default=[2, 4, 8, 16, 32, 64, 128])
    ap.add_argument("--shapes", nargs="+", default=BENCH + QWEN)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--no-ksplit", action="store_true",
                    help="leave the K-split tiles out (where their GPU tests have not passed on this machine)")
    ap.add_argument("--table-from", metavar="RECORD",
                    help="no GPU run: write OUT/configs_<GPU>.json from a recorded run's rows (its GPU's table)")
    ap.add_argument("--tma-rows", action="store_true",
                    help="also time the multi-row TMA GEMV (SPEAR_TMA_ROWS=1 for the run: where fastest and right it "
                         "is written into the table, which then needs SPEAR_TMA_ROWS=1 to be read as measured)")
    args = ap.parse_args(argv)
    if args.tma_rows:
        os.environ["SPEAR_TMA_ROWS"] = "1"
    os.makedirs(args.out, exist_ok=True)
    if args.table_from:
        gpu = json.load(open(args.table_from))["gpu"].replace(" ", "_")
        path = os.path.join(args.out, f"configs_{gpu}.json")
        with open(path, "w") as f:
            f.write(TT.dumps(table_from(args.table_from), gpu))
        print(f"wrote {path}")
        return
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
           "group_size": args.group_size, "ms": args.ms, "ksplit": not args.no_ksplit, "rows": []}
    import triton

    res["triton"] = triton.__version__
    t0 = time.time()
    for shape in args.shapes:
        N, K = map(int, shape.split("x"))
        for M in args.ms:
            row = one(N, K, args.group_size, M, ksplit=not args.no_ksplit)
            res["rows"].append(row)
            print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
            torch.cuda.empty_cache()
        res["seconds"] = time.time() - t0
        with open(os.path.join(args.out, f"small_m_gemm_{gpu_key()}.json"), "w") as f:
            json.dump(res, f, indent=1)
        with open(os.path.join(args.out, f"configs_{gpu_key()}.json"), "w") as f:
            f.write(TT.dumps(TT.configs(), gpu_key()))
    print(f"{'shape':>12} {'M':>4} {'cuB':>7} {'before':>7} {'trit':>7} {'ra':>7} {'rows':>7} {'after/cuB':>9} "
          f"{'EC/W4':>6}")
    for r in res["rows"]:
        print(f"{r['N']:>6}x{r['K']:<5} {r['M']:>4} {r['cublas_bf16']:7.1f} {r['route_before']:7.1f} {r['triton_best']:7.1f} "
              f"{r.get('ra_small_best', float('nan')):7.1f} {r.get('tma_rows_best', float('nan')):7.1f} "
              f"{r['route_after_over_cublas']:9.2f} "
              f"{r['ec_after_over_w4_after']:6.2f}")


if __name__ == "__main__":
    main()
