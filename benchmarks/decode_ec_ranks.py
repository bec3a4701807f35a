"""The M = 1 decode EC at several ranks, every route side by side (GPU; one shape per row).

Why: the tuned table's one-launch entry (``gemv1self|N|K|G``) is measured at r = 64 only and is taken for every
rank, and a kernels.py run (H200, 2026-12-02) found the fused EC at 11008x4096 slower at r = 16 / 32 (15.1 / 15.4 us)
than at r = 64 (12.8). This times, for each shape and rank, what the dispatch does (``w4a16_gemv`` with ``ec``) against
each route it chooses between: the one launch on the TMA kernel (the table's config), the TMA pair (producer grid
+ PDL-launched TMA GEMV with the EC epilogue), the CUDA-core PDL pair, and the plain W4 GEMV. Every route is
checked against ``ec_linear_ref`` first (relative L2 error). Microseconds under CUDA graphs; x and the weights
rotate through up to 12 copies (at least 3x the L2 from 8192x8192 up, ~1.7x at 4096x4096), the EC's A and B are
one copy per rank, so every EC route is timed with them warm in L2 (as in ``kernels.py``; end to end they are not).

``--write-table``: for each shape measured, its old per-rank entries are dropped, then for each rank the
dispatch's choice for that rank's bucket (``gemv1self_rank_key``) is written where the one launch and the pair
the dispatch would take (``tma_ec_measured_ok``: the TMA pair, else the CUDA-core PDL pair) differ by more than
``--margin`` us: the rank-free one-launch value where it is faster, ``["pair"]`` where the pair is. Within the
margin nothing is written (the rank-free entry decides). The table (the user cache, ``dispatch/table.py``) is copied to ``--out``.

    python benchmarks/decode_ec_ranks.py --out DIR [--shapes 11008x4096 ...] [--ranks 4 8 ...] [--write-table]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os

import torch

import spear_compile  # noqa: F401  (registers ops)
from spear_compile.dispatch import keys as TK
from spear_compile.dispatch import cuda as D
from spear_compile.dispatch import route as RT
from spear_compile.lowering import w4a16_triton as T
from spear_compile.ops.ec_ref import ec_linear_ref
from spear_compile.dispatch.tuning import bench_graph, copies_for, gpu_key, save_table

from kernels import DT, G, MAX_LAB_ERR, make_ec, make_weights, rel_err

def rank_choice(row: dict, generic: list, tma_pair_ok: bool, margin: float) -> list | None:
    """The per-rank table value from one measured row: ``generic`` (the rank-free one-launch entry) where the
    one launch is more than ``margin`` us faster than the pair the dispatch would take (the TMA pair where
    ``tma_pair_ok`` and it ran, else the CUDA-core PDL pair), ``["pair"]`` where that pair is more than
    ``margin`` faster, None otherwise (a near tie, or a route not timed correctly)."""
    def t(name):
        err = row["err"].get(name)
        return row["us"].get(name) if isinstance(err, float) and err < MAX_LAB_ERR else None

    one = t("one_launch_tma") or t("one_launch_cc")
    pair = (t("tma_pair") if tma_pair_ok and "tma_pair" in row["us"] else None) or t("pdl_pair")
    if one is None or pair is None or abs(one - pair) <= margin:
        return None
    return list(generic) if one < pair else ["pair"]


def routes(N: int, K: int, ec: tuple, params: tuple):
    """(name, fn(x, qweight, scales, zeros)) for every decode-EC route that can run this shape here."""
    from spear_compile.dispatch.route import ec_tma_config
    from spear_compile.lowering.ec_decode_triton import w4a16_gemv1_ec_pdl
    from spear_compile.dispatch.cuda import tma_ec_gemv, tma_self_gemv

    out = [("dispatch", lambda x, q, s, z: D.w4a16_gemv(x, q, s, z, G, None, ec=ec)),
           ("w4_plain", lambda x, q, s, z: D.w4a16_gemv(x, q, s, z, G, None))]
    choice = TK.tuned_table().get(TK.gemv1self_key(N, K, G))
    if choice and choice[0] == "tma":
        cfg = tuple(int(v) for v in choice[1:])
        out.append(("one_launch_tma", lambda x, q, s, z: tma_self_gemv(x, q, s, z, G, None, ec, "silu", cfg)))
    elif choice and choice[0] == "cc":
        cfg = tuple(int(v) for v in choice[1:])
        out.append(("one_launch_cc", lambda x, q, s, z: T.w4a16_gemv1(x, q, s, z, G, None, ec=ec, config=cfg)))
    probe = torch.empty(1, K, device="cuda", dtype=DT)
    cfg_t = ec_tma_config(probe, N, G, params, None, ec[0].shape[0])
    if cfg_t is not None:
        out.append(("tma_pair", lambda x, q, s, z: tma_ec_gemv(x, q, s, z, G, None, ec, "silu", cfg_t, ec[1], None)))
    cfg_p = RT.ec_pdl_config(N, K, G)
    out.append(("pdl_pair", lambda x, q, s, z: w4a16_gemv1_ec_pdl(x, q, s, z, G, None, ec, config=cfg_p)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--shapes", nargs="+", default=["11008x4096", "8192x8192", "4096x11008", "4096x4096"])
    ap.add_argument("--ranks", nargs="+", type=int, default=[4, 8, 16, 32, 64, 128])
    ap.add_argument("--write-table", action="store_true", help="store the per-rank route choice in the tuned table")
    ap.add_argument("--margin", type=float, default=0.3, help="us a route must win by to be written (--write-table)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_ec_ranks.py needs a CUDA GPU")
    res = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, date=datetime.date.today().isoformat(),
               rows=[])
    import triton

    res["triton"] = triton.__version__
    for shape in args.shapes:
        N, K = (int(v) for v in shape.split("x"))
        copies = min(copies_for(N * K // 2), 12)
        ws = make_weights(N, K, copies)
        xs = [torch.randn(1, K, device="cuda", dtype=DT) for _ in range(copies)]
        w = lambda i: (ws[i]["qw"].qweight, ws[i]["qw"].scales, ws[i]["qw"].zeros)  # noqa: E731
        if args.write_table:  # this run remakes the shape's per-rank choices
            TK.drop_gemv1self_ranks(N, K, G)
        for r in args.ranks:
            ec = make_ec(N, K, r)
            ref = ec_linear_ref(xs[0], *w(0), G, None, *ec, "silu")
            row = dict(N=N, K=K, r=r, us={}, err={})
            for name, fn in routes(N, K, ec, (ws[0]["qw"].scales, ws[0]["qw"].zeros)):
                try:
                    got = fn(xs[0], *w(0))
                    row["err"][name] = None if name == "w4_plain" else rel_err(got, ref)
                    row["us"][name] = bench_graph(lambda i, fn=fn: fn(xs[i], *w(i)), copies)
                except Exception as e:  # noqa: BLE001  (reported, not fatal)
                    row["err"][name] = f"{type(e).__name__}: {str(e)[:200]}"
            res["rows"].append(row)
            generic = TK.tuned_table().get(TK.gemv1self_key(N, K, G))
            if args.write_table and generic:
                choice = rank_choice(row, generic, RT.tma_ec_measured_ok(N, K, G), args.margin)
                if choice is not None:
                    TK.tuned_table()[TK.gemv1self_rank_key(N, K, G, r)] = choice
                    row["table"] = choice
            print(f"{N}x{K} r={r}: " + "  ".join(f"{k} {v:.1f}" for k, v in row["us"].items())
                  + "  max err " + f"{max((v for v in row['err'].values() if isinstance(v, float)), default=0):.1e}",
                  flush=True)
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, f"decode_ec_ranks_{gpu_key()}.json"), "w") as f:
                json.dump(res, f, indent=1)
        del ws
        torch.cuda.empty_cache()
    if args.write_table:
        import shutil

        shutil.copy(save_table("configs", TK.tuned_table()), args.out)


if __name__ == "__main__":
    main()
