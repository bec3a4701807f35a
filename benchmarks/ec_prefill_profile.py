"""Where the prefill EC's time goes (H200): each part of the W4 + EC structures timed alone.

Why: at 4096^2 the best prefill EC structure costs 1.23-1.28x W4 (H200, 2026-11-30), while its extra
memory traffic (shrink reads X, the expand writes E, the GEMM's epilogue reads E) predicts ~1.10-1.15x.
This times, in CUDA graphs and on the same inputs, every piece on its own:

    cublas        F.linear(x, W)                 the bf16 GEMM the W4 path runs after dequantizing
    cublas_beta1  E.addmm_(x, W^T)               the same GEMM reading C (the C-operand structure)
    cublas_kcat   F.linear([x | hg], [W | B])    one GEMM over K + r: the EC as extra K columns
    dequant       w4_dequantize                  the W4 path's first pass
    shrink_gate   ec_shrink_gate                 hg = alpha g(x A^T) * x A^T (cuBLAS shrink, then the gate)
    shrink_gate_sk  ec_shrink_gate_splitk        the same in one split-K kernel ("in_gemm_sk")
    expand        hg B^T                         E for the C-operand structure
    w4            dequant + cuBLAS               our W4 at this M
    w4_table      w4a16_gemm                     our W4 as the tuned table runs it (maybe a wgmma GEMM)
    ra, ra_ec     w4a16_gemm_wgmma_ra            the register-operand GEMM (Hopper), alone and with the EC
                                                 step on a ready alpha g h (no PDL wait): with shrink_gate,
                                                 the parts of the "in_gemm" structure
    ra_self       w4a16_gemm_wgmma_ra_ec_self    the same GEMM with the shrink roles in its launch
    <structure>   ec_overlapped(structure=...)   every prefill EC structure end to end

so that the sum of the parts can be set against the measured structures, and the K-concatenated
design (``cublas_kcat`` after ``max(dequant, shrink_gate)``) priced before it is built.
(The profile at commit 8918269 (git history) also timed a split-K Triton
shrink - slower than cuBLAS everywhere, removed: there ``shrink_gate`` is the split-K one and
``*_cublas`` the shrink kept here.)

``--ra-sweep`` times only the register-operand parts, for every config of ``RA_CONFIGS`` and every number of
shrink roles per x block (``ra[cfg]``, ``ra_ec[cfg]``, ``ra_self[cfg]`` with the default split,
``ra_self[cfg]/sS`` for S in ``ec_gemm_self.SPLITS``, the roles' ring S times deeper where it fits, as it
ships), plus "in_gemm_self" as the dispatch runs it.

Usage (GPU): python benchmarks/ec_prefill_profile.py --out DIR [--shapes 4096x4096 ...] [--ms 1024 4096]
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
from kernels import DT, G, STRUCTURES, make_ec, make_weights  # noqa: E402

from spear_compile.dispatch import cuda as D
from spear_compile.dispatch import route as RT
from spear_compile.lowering import w4a16_triton as T  # noqa: E402
from spear_compile.lowering.dequant_cublas import dequant_cublas  # noqa: E402
from spear_compile.dispatch.cuda import ec_overlapped  # noqa: E402
from spear_compile.lowering.ec_shrink_splitk import ec_shrink_gate_splitk  # noqa: E402
from spear_compile.lowering.ec_triton import ec_shrink_gate  # noqa: E402
from spear_compile.dispatch.tuning import bench_graph, copies_for, gpu_key  # noqa: E402


def profile(N: int, K: int, M: int, r: int = 64) -> dict:
    copies = copies_for(N * K // 2 + M * K * 2)
    ws = make_weights(N, K, copies)
    ec = make_ec(N, K, r)
    A, B, W1, b1, W2, b2, alpha = ec
    xs = [torch.randn(M, K, device="cuda", dtype=DT) for _ in range(copies)]
    wb = [w["qw"].dequantize(DT) for w in ws]  # bf16 weights for the cuBLAS-only parts
    xc = [torch.cat([x, torch.randn(M, r, device="cuda", dtype=DT)], 1) for x in xs]
    wc = [torch.cat([w, B], 1) for w in wb]
    e = [torch.randn(M, N, device="cuda", dtype=DT) for _ in range(copies)]
    hg = ec_shrink_gate(xs[0], A, W1, b1, W2, b2, "silu", alpha=alpha, dtype=DT)[:, :r].contiguous()

    def q(i):
        w = ws[i]["qw"]
        return w.qweight, w.scales, w.zeros

    parts = {
        "cublas": lambda i: F.linear(xs[i], wb[i]),
        "cublas_beta1": lambda i: e[i].addmm_(xs[i], wb[i].t()),
        "cublas_kcat": lambda i: F.linear(xc[i], wc[i]),
        "dequant": lambda i: T.w4_dequantize(*q(i), G, DT),
        "shrink_gate": lambda i: ec_shrink_gate(xs[i], A, W1, b1, W2, b2, "silu", alpha=alpha, dtype=DT),
        "shrink_gate_sk": lambda i: ec_shrink_gate_splitk(xs[i], A, W1, b1, W2, b2, "silu", alpha=alpha, dtype=DT),
        "expand": lambda i: torch.mm(hg, B.t()),
        "w4": lambda i: dequant_cublas(xs[i], *q(i), G, None),
        "w4_table": lambda i: D.w4a16_gemm(xs[i], *q(i), G, None),
    }
    from spear_compile.lowering import w4a16_gemm_wgmma_ra as RA

    if RA.takes(xs[0], N, G, *q(0)[1:], None):  # (sm_90, integer zero points)
        hgp = ec_shrink_gate(xs[0], A, W1, b1, W2, b2, "silu", alpha=alpha, dtype=DT)  # [M, R_P], as in_gemm
        parts["ra"] = lambda i: RA.w4a16_gemm_wgmma_ra(xs[i], *q(i), G, None)
        parts["ra_ec"] = lambda i: RA.w4a16_gemm_wgmma_ra(xs[i], *q(i), G, None, ec=(hgp, B.contiguous()))
        # the in-launch shrink roles on the config "in_gemm_self" runs (the register-operand GEMM's tuned one),
        # or the first where none was measured
        cfg_ra = RT.wgmma_ra_config(M, N, K, G) or RA.RA_CONFIGS[0]
        parts["ra_self"] = lambda i: RA.w4a16_gemm_wgmma_ra_ec_self(xs[i], *q(i), G, None, A, B.contiguous(), W1, b1,
                                                                     W2, b2, alpha, "silu", config=cfg_ra)
    for st in STRUCTURES:
        parts[st] = (lambda st: lambda i: ec_overlapped(xs[i], *q(i), G, None, *ec, "silu", structure=st))(st)
    from spear_compile.lowering import ec_shrink_splitk as SK

    row = {"N": N, "K": K, "M": M, "r": r}
    for name, fn in parts.items():
        torch.cuda.synchronize()
        row[name] = bench_graph(fn, copies=copies)
        print(f"{N}x{K} M={M} {name:15s} {row[name]:8.1f} us", flush=True)
    # the split-K shrink with 1 program per SM (each beside a GEMM CTA, the first setting measured)
    default, SK.PROGRAMS_PER_SM = SK.PROGRAMS_PER_SM, 1
    for name in ("shrink_gate_sk", "in_gemm_sk"):
        row[name + "_x1"] = bench_graph(parts[name], copies=copies)
        print(f"{N}x{K} M={M} {name + '_x1':15s} {row[name + '_x1']:8.1f} us", flush=True)
    SK.PROGRAMS_PER_SM = default
    row["kcat_estimate"] = max(row["dequant"], row["shrink_gate"]) + row["cublas_kcat"]
    row["kcat_over_w4"] = row["kcat_estimate"] / row["w4"]
    for st in STRUCTURES:
        row[f"{st}_over_w4"] = row[st] / row["w4"]
    return row


def ra_case(N: int, K: int, M: int, r: int = 64) -> tuple:
    """Inputs of the register-operand timings: (copies, xs, q(i) -> (qweight, scales, zeros) of copy i, the EC
    (A, B, W1, b1, W2, b2, alpha), a ready alpha g h [M, R_P], B contiguous)."""
    copies = copies_for(N * K // 2 + M * K * 2)
    ws = make_weights(N, K, copies)
    ec = make_ec(N, K, r)
    A, B, W1, b1, W2, b2, alpha = ec
    xs = [torch.randn(M, K, device="cuda", dtype=DT) for _ in range(copies)]
    hgp = ec_shrink_gate(xs[0], A, W1, b1, W2, b2, "silu", alpha=alpha, dtype=DT)

    def q(i):
        w = ws[i]["qw"]
        return w.qweight, w.scales, w.zeros

    return copies, xs, q, ec, hgp, B.contiguous()


def ra_sweep(N: int, K: int, M: int, r: int = 64) -> dict:
    """The register-operand GEMM alone, with the EC step on a ready alpha g h, and with the shrink roles in its
    launch (default and every split), for each config; and "in_gemm_self" through the dispatch."""
    from spear_compile.lowering import w4a16_gemm_wgmma_ra as RA
    from spear_compile.lowering.ec_gemm_self import SPLITS, split_ok

    copies, xs, q, ec, hgp, Bc = ra_case(N, K, M, r)
    A, B, W1, b1, W2, b2, alpha = ec
    parts = {"w4_table": lambda i: D.w4a16_gemm(xs[i], *q(i), G, None)}
    for cfg in RA.RA_CONFIGS:
        c = ",".join(map(str, cfg))
        parts[f"ra[{c}]"] = (lambda cfg: lambda i: RA.w4a16_gemm_wgmma_ra(xs[i], *q(i), G, None, config=cfg))(cfg)
        parts[f"ra_ec[{c}]"] = (lambda cfg: lambda i: RA.w4a16_gemm_wgmma_ra(xs[i], *q(i), G, None, config=cfg,
                                                                             ec=(hgp, Bc)))(cfg)
        for sp in (None,) + SPLITS:
            if sp is not None and not split_ok(sp, cfg[1]):
                continue
            name = f"ra_self[{c}]" + ("" if sp is None else f"/s{sp}")
            parts[name] = (lambda cfg, sp: lambda i: (
                RA.w4a16_gemm_wgmma_ra_ec_self(xs[i], *q(i), G, None, A, Bc, W1, b1, W2, b2, alpha, "silu",
                                               config=cfg, split=sp)))(cfg, sp)
    parts["in_gemm_self"] = lambda i: ec_overlapped(xs[i], *q(i), G, None, *ec, "silu", structure="in_gemm_self")
    row = {"N": N, "K": K, "M": M, "r": r, "gemm_choice": list(RT.gemm_config(M, N, K, G)),
           "ra_config": RT.wgmma_ra_config(M, N, K, G)}
    for name, fn in parts.items():
        torch.cuda.synchronize()
        row[name] = bench_graph(fn, copies=copies)
        print(f"{N}x{K} M={M} {name:28s} {row[name]:8.1f} us", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", nargs="+", default=["4096x4096", "11008x4096", "4096x11008"])
    ap.add_argument("--ms", nargs="+", type=int, default=[256, 1024, 4096])
    ap.add_argument("--ra-sweep", action="store_true", help="only the register-operand parts, every config and split")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("ec_prefill_profile.py needs a CUDA GPU")
    os.makedirs(args.out, exist_ok=True)
    import triton

    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "date": datetime.date.today().isoformat(), "group_size": G, "dtype": str(DT), "rows": []}
    for shape in args.shapes:
        N, K = map(int, shape.split("x"))
        for M in args.ms:
            res["rows"].append(ra_sweep(N, K, M) if args.ra_sweep else profile(N, K, M))
            name = "ec_prefill_ra_sweep" if args.ra_sweep else "ec_prefill_profile"
            with open(os.path.join(args.out, f"{name}_{gpu_key()}.json"), "w") as f:
                json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
