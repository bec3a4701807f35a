"""W4A16 / W4A16+EC kernels on the GPU against cuBLAS and torch's int4 tinygemm, one run.

For each weight shape (N x K) and M: correctness of our kernels against the PyTorch
references (fresh random inputs, relative error), a config search for our kernels
(saved per GPU for the library to use), then timing of every provider under CUDA
graphs with input copies rotating through more than 3x the L2:

  cublas_bf16      F.linear with a bf16 weight
  tinygemm_int4    aten._weight_int4pack_mm (group 128, the torchao / gpt-fast path)
  naive_ec         tinygemm + the EC as eager PyTorch ops (r = 64, gated)
  ours_w4          our W4 as the op runs it (``spear::w4a16_linear``: the route's kernel for M, on the table this run
                   writes), group 128; ``ours_w4_gemv`` (M = 2..4): the M > 1 Triton GEMV, which the route no longer takes
  ours_w4_ec_r64   our W4 + EC (r = 64, gated) as the op runs it (``spear::ec_linear``: fused or overlapped by the
                   shape's crossover)
  ours_w4_ec_r{16,32,64}_{fused,overlapped}  our W4 + EC in each lowering: the fused decode EC for M <= 4, the
                   overlapped one in the structure measured fastest for the shape (``dispatch/cuda.py:ec_overlapped``
                   "auto")
  ours_w4_ec_r64_{side,side_hi,c_operand,c_operand_hi,in_gemm,in_gemm_sk}  (M >= 256) each prefill EC structure; the
                   fastest is saved in the tuned table (``ecstruct|M|N|K|G``) before "auto" is timed

Writes JSON (all numbers, GPU, versions, date), the tuned-config table and the measured
fused/overlapped crossover per shape, and prints a ratio table last.

    python benchmarks/kernels.py --out $OUT [--quick]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

import spear_compile  # noqa: F401  (registers ops)
from spear_compile import QuantConfig
from spear_compile.dispatch import keys as TK
from spear_compile.lowering import w4a16_gemv_tma as GT
from spear_compile.dispatch import cuda as D
from spear_compile.dispatch import route as RT
from spear_compile.lowering import w4a16_triton as T
from spear_compile.dispatch.cuda import OVERLAP_STRUCTURES, ec_overlapped
from spear_compile.ops.ec_ref import ec_linear_ref
from spear_compile.dispatch.tuning import bench_graph, copies_for, gpu_key, refine, save_table, search
from spear_compile.ops.w4a16_ref import w4a16_linear_ref
from spear_compile.quant import quantize_rtn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "experimental"))
import gemv_mma_sync as GG  # noqa: E402  (the register-fed mma.sync GEMV study, --gluon)

SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008), (8192, 8192), (28672, 8192)]
MS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096]
RANKS = [16, 32, 64]
G = 128
DT = torch.bfloat16


STRUCTURES = tuple(st for st in OVERLAP_STRUCTURES if st != "auto")


def rel_err(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()


def make_weights(N, K, copies):
    """`copies` independent quantized weights (ours and tinygemm's layout from the same ints)."""
    ws = []
    for c in range(copies):
        w = torch.randn(N, K, device="cuda", dtype=torch.float32) * 0.02
        qw = quantize_rtn(w, QuantConfig(group_size=G), out_dtype=DT)
        from spear_compile.quant import unpack_int4

        q = unpack_int4(qw.qweight).to(torch.int32)
        # tinygemm's CUDA converter takes uint8 [N, K/2] with the even column in the HIGH nibble
        packed = torch.ops.aten._convert_weight_to_int4pack(((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8), 8)
        # tinygemm: w = (q - 8) * s + zf  ==  (q - z) * s  with zf = (8 - z) * s
        s = qw.scales.float()
        zf = (8 - qw.zeros.float()) * s
        sz = torch.stack([s.t(), zf.t()], dim=-1).contiguous().to(DT)
        ws.append(dict(qw=qw, packed=packed, sz=sz, bf16=qw.dequantize(DT) if c < 2 or N * K <= 64e6 else None))
    return ws


def make_ec(N, K, r, d=16):
    g = torch.Generator(device="cuda").manual_seed(r)
    A = (torch.randn(r, K, device="cuda", generator=g) / K ** 0.5).to(DT)
    B = (torch.randn(N, r, device="cuda", generator=g) * 0.02).to(DT)
    W1 = (torch.randn(d, r, device="cuda", generator=g) / r ** 0.5).to(DT)
    b1 = torch.zeros(d, device="cuda", dtype=DT)
    W2 = (torch.randn(r, d, device="cuda", generator=g) * 0.1).to(DT)
    b2 = torch.full((r,), 2.0, device="cuda", dtype=DT)
    alpha = torch.tensor(1.1, device="cuda")
    return (A, B, W1, b1, W2, b2, alpha)


def naive_ec(x, y, ec):
    A, B, W1, b1, W2, b2, alpha = ec
    h = x @ A.t()
    g = torch.sigmoid(F.silu(h @ W1.t() + b1) @ W2.t() + b2)
    return y + alpha * ((g * h) @ B.t())


def _dump(res, out) -> None:
    """Write results and tables after every row, so a run cut short still leaves its numbers."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"kernels_{gpu_key()}.json"), "w") as f:
        json.dump(res, f, indent=1)
    save_table("configs", TK.tuned_table())


def bandwidth() -> dict:
    """Copy (read + write, an SM kernel, not a DMA memcpy node) and read-only (a sum) bandwidth
    of this GPU in GB/s over 1 GiB fp32 buffers."""
    src = torch.randn(1 << 28, device="cuda")
    dst = torch.empty_like(src)
    t_copy = bench_graph(lambda i: torch.mul(src, 1.0, out=dst), 1, calls=5, replays=10)
    t_read = bench_graph(lambda i: src.sum(), 1, calls=5, replays=10)
    del src, dst
    return {"copy_rw_GBps": 2 * (1 << 30) / t_copy / 1e3, "read_sum_GBps": (1 << 30) / t_read / 1e3}


MAX_LAB_ERR = 1e-2  # relative L2 error against the reference: bf16 output rounding is ~2e-3, bf16x2 ~8e-3


def lab_gemv(args) -> None:
    """M = 1 variants side by side (correctness first): tinygemm, the previous GEMV, the M = 1
    kernel in each config and nibble mode, and the fused EC with stages left out."""
    shapes = [tuple(int(v) for v in sh.split("x")) for sh in args.shapes] if args.shapes else SHAPES
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": __import__("triton").__version__,
           "date": datetime.date.today().isoformat(), "bandwidth": bandwidth(), "rows": []}
    print(json.dumps(res["bandwidth"]), flush=True)
    configs = T.GEMV1_CONFIGS
    for N, K in shapes:
        wbytes = N * K // 2 + N * (K // G) * 4  # packed weight + bf16 scales and zeros
        copies = min(copies_for(wbytes), 12)
        ws = make_weights(N, K, copies)
        args_w = lambda i: (ws[i]["qw"].qweight, ws[i]["qw"].scales, ws[i]["qw"].zeros)  # noqa: E731
        xs = [torch.randn(1, K, device="cuda", dtype=DT) for _ in range(copies)]
        for i in range(copies):  # make the GEMV layout outside the timed region
            T.gemv_words(ws[i]["qw"].qweight)
        qw = ws[0]["qw"]
        x = torch.randn(1, K, device="cuda", dtype=DT)
        ref = w4a16_linear_ref(x, qw.qweight, qw.scales, qw.zeros, G, None)
        row = {"N": N, "K": K, "weight_bytes": wbytes, "err": {}, "us": {}}

        def check(name, fn):
            out = torch.full((1, N), float("nan"), device="cuda", dtype=DT)
            try:
                fn(x, out)
                row["err"][name] = rel_err(out, ref)
            except Exception as e:  # noqa: BLE001  (a variant that fails to build is reported, not fatal)
                row["err"][name] = None
                print(f"  {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)

        def fastest(prefix):
            """The timed variant named ``prefix...`` with the lowest time among those whose output
            matched the reference (relative error < MAX_LAB_ERR; None if none did): a wrong but fast
            kernel must never reach the tuned table."""
            done = [k for k in row["us"] if k.startswith(prefix) and row["us"][k]
                    and row["err"].get(k) is not None and row["err"][k] < MAX_LAB_ERR]
            return min(done, key=lambda k: row["us"][k]) if done else None

        def timeit(name, fn):
            try:
                row["us"][name] = bench_graph(fn, copies)
            except Exception as e:  # noqa: BLE001
                row["us"][name] = None
                print(f"  {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)

        timeit("tinygemm", lambda i: torch.ops.aten._weight_int4pack_mm(xs[i], ws[i]["packed"], G, ws[i]["sz"]))
        old = tuple(TK.tuned_table().get(TK.gemv_key(N, K, G, False), T.GEMV_CONFIGS[0]))
        check("old", lambda xx, o: D.w4a16_gemv(xx, qw.qweight, qw.scales, qw.zeros, G, None, config=old, out=o))
        timeit("old", lambda i: D.w4a16_gemv(xs[i], *args_w(i), G, None, config=old))
        for nib in args.nibs:
            for cfg in configs:  # (BLOCK_N, BLOCK_W, num_warps, prefetch)
                name = f"v4_{nib}_{'_'.join(map(str, cfg))}"
                check(name, lambda xx, o: T.w4a16_gemv1(xx, qw.qweight, qw.scales, qw.zeros, G, None, config=cfg,
                                                        nib=nib, out=o))
                timeit(name, lambda i: T.w4a16_gemv1(xs[i], *args_w(i), G, None, config=cfg, nib=nib))
        if args.gluon:  # the register-fed mma.sync GEMV study (experimental/gemv_mma_sync.py) in each config
            for cfg in GG.GLUON_CONFIGS:
                name = f"gluon_{'_'.join(map(str, cfg))}"
                check(name, lambda xx, o: GG.w4a16_gemv_gluon(xx, qw.qweight, qw.scales, qw.zeros, G, None,
                                                              config=cfg, out=o))
                for i in range(copies):
                    GG.gluon_words(ws[i]["qw"].qweight)
                timeit(name, lambda i: GG.w4a16_gemv_gluon(xs[i], *args_w(i), G, None, config=cfg))
            if fastest("gluon_"):
                row["best_gluon"] = fastest("gluon_")
                print(f"   gluon best {row['best_gluon']} {row['us'][row['best_gluon']]:.1f} us", flush=True)
        if args.tma:  # the TMA-ring GEMV (w4a16_gemv_tma.py) in each config
            for cfg in args.tma_configs or GT.TMA_CONFIGS:
                name = f"tma_{'_'.join(map(str, cfg))}"
                check(name, lambda xx, o: GT.w4a16_gemv_tma(xx, qw.qweight, qw.scales, qw.zeros, G, None,
                                                            config=cfg, out=o))
                for i in range(copies):  # re-tiled weights (and scales) made outside the timed region
                    GT.tma_tiles(ws[i]["qw"].qweight, cfg)
                    if cfg[4] == GT.OPS_SMEM:
                        GT.tma_scale_tiles(ws[i]["qw"].scales, ws[i]["qw"].zeros, G, K, cfg)
                timeit(name, lambda i: GT.w4a16_gemv_tma(xs[i], *args_w(i), G, None, config=cfg))
            if fastest("tma_"):
                row["best_tma"] = fastest("tma_")
                print(f"   tma best {row['best_tma']} {row['us'][row['best_tma']]:.1f} us", flush=True)
        best = row["best_v4"] = fastest("v4_")
        cfg = tuple(int(v) for v in best.split("_")[2:])
        if ((N, K) in ((4096, 4096), (8192, 8192), (11008, 4096))  # the one-launch EC's parts (r = 64), best tile
                and RT.self_plan_fits(64, K, -(-N // cfg[0]), cfg[2], x.device)):
            ec = make_ec(N, K, 64)
            nib = best.split("_")[1]
            row["ec_config"] = list(cfg)
            ref_ec = ec_linear_ref(x, qw.qweight, qw.scales, qw.zeros, G, None, *ec, "silu")
            out = T.w4a16_gemv1(x, qw.qweight, qw.scales, qw.zeros, G, None, ec=ec, config=cfg, nib=nib)
            row["err"]["v4_ec_full"] = rel_err(out, ref_ec)
            timeit("ec_full", lambda i: T.w4a16_gemv1(xs[i], *args_w(i), G, None, ec=ec, config=cfg, nib=nib))
            out = T.w4a16_gemv1(x, qw.qweight, qw.scales, qw.zeros, G, None, ec=ec, config=cfg, nib=nib)
            row["err"]["v4_ec_full_after"] = rel_err(out, ref_ec)
            old_ec = tuple(TK.tuned_table().get(TK.gemv_key(N, K, G, True), T.GEMV_CONFIGS[0]))
            timeit("old_ec_full", lambda i: D.w4a16_gemv(xs[i], *args_w(i), G, None, ec=ec, config=old_ec))
        if args.ec_pdl:  # the decode EC's PDL pair (producer launch + GEMV) in each GEMV tile
            from spear_compile.lowering.ec_decode_triton import w4a16_gemv1_ec_pdl

            ec = make_ec(N, K, args.ec_pdl)
            ref_pdl = ec_linear_ref(x, qw.qweight, qw.scales, qw.zeros, G, None, *ec, "silu")
            for cfg in configs:
                name = f"pdl_{'_'.join(map(str, cfg))}"
                try:
                    row["err"][name] = rel_err(w4a16_gemv1_ec_pdl(x, qw.qweight, qw.scales, qw.zeros, G, None, ec,
                                                                  config=cfg), ref_pdl)
                except Exception as e:  # noqa: BLE001
                    row["err"][name] = None
                    print(f"  {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                timeit(name, lambda i: w4a16_gemv1_ec_pdl(xs[i], *args_w(i), G, None, ec, config=cfg))
            bp = fastest("pdl_")
            if bp:
                TK.tuned_table()[TK.gemv1pdl_key(N, K, G)] = [int(v) for v in bp.split("_")[1:]]
                print(f"   pdl best {bp} {row['us'][bp]:.1f} us (r = {args.ec_pdl})", flush=True)
            bt = row.get("best_tma")
            cfg_t = tuple(int(v) for v in bt.split("_")[1:]) if bt else None
            if cfg_t and GT.ec_ok(cfg_t):  # the TMA GEMV with the EC epilogue, PDL behind the producer grid
                from spear_compile.dispatch.cuda import tma_ec_gemv

                def tma_ec(xx, i):
                    return tma_ec_gemv(xx, *args_w(i), G, None, ec, "silu", cfg_t, ec[1], None)

                row["err"]["tma_ec"] = rel_err(tma_ec(x, 0), ref_pdl)
                timeit("tma_ec", lambda i: tma_ec(xs[i], i))
                t_ec = row["us"].get("tma_ec")
                if bp and t_ec and row["err"]["tma_ec"] < MAX_LAB_ERR:  # which pair a single EC takes here
                    TK.tuned_table()[TK.gemv1tmaec_key(N, K, G)] = int(t_ec < row["us"][bp])
                    print(f"   tma ec pair {t_ec:.1f} us vs pdl {row['us'][bp]:.1f} us", flush=True)
            lab_ec_self(row, N, K, G, ec, ref_pdl, configs, args.tma_configs or GT.TMA_CONFIGS, x, xs, args_w, timeit)
        # the fastest M = 1 config measured here goes into the tuned table (the fused EC uses the
        # same tile; kernels.py's full run searches the EC configs separately)
        TK.tuned_table()[TK.gemv1_key(N, K, G, False)] = [int(v) for v in best.split("_")[2:]]
        # the TMA kernel serves this shape (M = 1, no EC) only where it measured faster than the best v4
        bt = row.get("best_tma")
        stored = TK.tuned_table().get(TK.tma_key(N, K, G))
        if args.tma_configs and stored is not None and tuple(stored) not in args.tma_configs:
            # a restricted run did not time the stored config: it cannot tell whether to replace it
            print(f"   table entry {stored} kept (not among --tma-configs)", flush=True)
        elif bt and row["us"][bt] < row["us"][best]:
            TK.tuned_table()[TK.tma_key(N, K, G)] = [int(v) for v in bt.split("_")[1:]]
        elif args.tma:
            TK.tuned_table().pop(TK.tma_key(N, K, G), None)
        TK.tuned_table().setdefault(TK.gemv1_key(N, K, G, True), [int(v) for v in best.split("_")[2:]])
        res["rows"].append(row)
        tg = row["us"]["tinygemm"]
        print(f"{N}x{K}: tinygemm {tg:.1f} us  old {row['us']['old']:.1f}  best {best} {row['us'][best]:.1f} us "
              f"= {row['us'][best] / tg:.2f}x tg, {wbytes / row['us'][best] / 1e3:.0f} GB/s; "
              f"max err {max(v for v in row['err'].values() if v is not None):.1e}", flush=True)
        print("   " + " ".join(f"{k}={v:.1f}" for k, v in row["us"].items() if v), flush=True)
        with open(os.path.join(args.out, f"lab_gemv_{gpu_key()}.json"), "w") as f:
            json.dump(res, f, indent=1)
        path = save_table("configs", TK.tuned_table())
        import shutil

        shutil.copy(path, args.out)
        del ws
        torch.cuda.empty_cache()


def lab_ec_self(row, N, K, G, ec, ref, configs, tma_configs, x, xs, args_w, timeit) -> None:
    """--lab gemv --ec-pdl R: the one-launch decode EC (``ec_self.py``) on the CUDA-core kernel in each
    GEMV tile and on the TMA kernel in each of ``tma_configs`` it takes (``self_*`` / ``tmaself_*``); its fastest
    goes into the table (``gemv1self``) where it beats both two-launch pairs (``pdl_*``, ``tma_ec``), and the same
    decision for this rank's bucket (``gemv1selfr``); other ranks' entries for the shape are dropped when the rank-free
    entry changes (they were measured against the previous one: ``benchmarks/decode_ec_ranks.py`` remakes them)."""
    from spear_compile.lowering.ec_self import self_plan, sm_count
    from spear_compile.dispatch.cuda import tma_self_gemv

    R, sms = ec[0].shape[0], sm_count(x.device)
    variants = []
    for cfg in configs:
        if self_plan(R, K, -(-N // cfg[0]), 32 * cfg[2], sms) is None:
            continue
        name = f"self_{'_'.join(map(str, cfg))}"
        variants.append((name, lambda xx, i, cfg=cfg: T.w4a16_gemv1(xx, *args_w(i), G, None, ec=ec, config=cfg)))
    if GT.HAS_TMA:
        for cfg in tma_configs:
            bn = GT.tile_geometry(cfg)[0]
            if not GT.ec_ok(cfg) or self_plan(R, K, -(-N // bn), 32 * cfg[0], sms) is None:
                continue
            name = f"tmaself_{'_'.join(map(str, cfg))}"
            variants.append((name, lambda xx, i, cfg=cfg: tma_self_gemv(xx, *args_w(i), G, None, ec, "silu", cfg)))
    for name, fn in variants:
        try:
            row["err"][name] = rel_err(fn(x, 0), ref)
        except Exception as e:  # noqa: BLE001  (reported, not fatal)
            row["err"][name] = None
            print(f"  {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        timeit(name, lambda i, fn=fn: fn(xs[i], i))
    ok = {k: v for k, v in row["us"].items() if v and (k.startswith("self_") or k.startswith("tmaself_"))
          and row["err"].get(k) is not None and row["err"][k] < MAX_LAB_ERR}
    pairs = [v for k, v in row["us"].items() if v and (k.startswith("pdl_") or k == "tma_ec")]
    key, table = TK.gemv1self_key(N, K, G), TK.tuned_table()
    old = table.get(key)
    won = bool(ok and pairs and min(ok.values()) < min(pairs))
    if won:
        best = min(ok, key=ok.get)
        kind, cfg = best.split("_")[0], [int(v) for v in best.split("_")[1:]]
        table[key] = ["cc" if kind == "self" else "tma"] + cfg
    else:
        table.pop(key, None)
    if table.get(key) != old:  # other ranks' choices were made against the previous entry
        TK.drop_gemv1self_ranks(N, K, G)
    if ok and pairs:  # this rank's bucket: what was just measured at it
        table[TK.gemv1self_rank_key(N, K, G, R)] = table.get(key, ["pair"])
    if won:
        print(f"   one-launch EC {best} {ok[best]:.1f} us vs the pairs' best {min(pairs):.1f} us", flush=True)
    else:
        if ok:
            print(f"   one-launch EC best {min(ok.values()):.1f} us, not faster than the pairs "
                  f"({min(pairs) if pairs else float('nan'):.1f} us)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true", help="two shapes, fewer M (smoke run)")
    ap.add_argument("--shapes", nargs="+", default=None, help="N x K shapes, e.g. 8192x8192")
    ap.add_argument("--ms", nargs="+", type=int, default=None, help="M values (default: all, or the quick set)")
    ap.add_argument("--lab", choices=["gemv"], default=None, help="variant study instead of the provider table")
    ap.add_argument("--gluon", action="store_true", help="--lab gemv: also time the register-fed mma.sync GEMV study "
                    "(experimental/gemv_mma_sync.py)")
    ap.add_argument("--tma", action="store_true", help="--lab gemv: also time the TMA-ring GEMV")
    ap.add_argument("--tma-configs", nargs="+", default=None, metavar="W,RB,CH,ST,OPS",
                    help="--lab gemv --tma: only these TMA configs (default: all of w4a16_gemv_tma.TMA_CONFIGS)")
    ap.add_argument("--ec-pdl", type=int, default=0, metavar="R",
                    help="--lab gemv: also time the decode EC's PDL pair (rank R) in each GEMV tile -> gemv1pdl keys; "
                         "with --tma also the TMA GEMV's EC pair -> gemv1tmaec keys (which pair a single EC takes)")
    ap.add_argument("--nibs", nargs="+", default=["biased", "bf16x2"], choices=sorted(T.GEMV1_NIBS),
                    help="--lab gemv: the M = 1 kernel's nibble modes to time")
    args = ap.parse_args()
    if args.tma_configs:  # validated before any GPU work, with unpack_config's message
        if not (args.lab == "gemv" and args.tma):
            ap.error("--tma-configs needs --lab gemv --tma")
        try:
            args.tma_configs = [tuple(int(v) for v in c.split(",")) for c in args.tma_configs]
            for c in args.tma_configs:
                GT.unpack_config(c)
        except ValueError as e:
            ap.error(f"--tma-configs: {e}")
    os.makedirs(args.out, exist_ok=True)
    if args.lab == "gemv":
        return lab_gemv(args)
    shapes = SHAPES[:1] + SHAPES[3:4] if args.quick else SHAPES
    if args.shapes:
        shapes = [tuple(int(v) for v in sh.split("x")) for sh in args.shapes]
    ms = args.ms or ([1, 8, 16, 256, 1024] if args.quick else MS)
    torch.manual_seed(0)
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": __import__("triton").__version__,
           "date": datetime.date.today().isoformat(), "group_size": G, "dtype": "bf16", "rows": [], "checks": [],
           "crossover": {}}
    t0 = time.time()
    for N, K in shapes:
        wbytes = N * K // 2
        copies = min(copies_for(wbytes), 12)
        ws = make_weights(N, K, copies)
        ecs = {r: make_ec(N, K, r) for r in RANKS}
        for M in ms:
            xs = [torch.randn(M, K, device="cuda", dtype=DT) for _ in range(copies)]
            qw = ws[0]["qw"]
            args_w = lambda i: (ws[i]["qw"].qweight, ws[i]["qw"].scales, ws[i]["qw"].zeros)  # noqa: E731
            # ---- correctness (fresh inputs, poisoned outputs) before any timing
            x = torch.randn(M, K, device="cuda", dtype=DT)
            ref = w4a16_linear_ref(x, qw.qweight, qw.scales, qw.zeros, G, None)
            fused_ok = M <= T.GEMV_MAX_M
            out = torch.full((M, N), float("nan"), device="cuda", dtype=DT)
            (D.w4a16_gemv if fused_ok else D.w4a16_gemm)(x, qw.qweight, qw.scales, qw.zeros, G, None, out=out)
            chk = {"N": N, "K": K, "M": M, "w4_rel_err": rel_err(out, ref)}
            ec = ecs[64]
            ref_ec = ec_linear_ref(x, qw.qweight, qw.scales, qw.zeros, G, None, *ec, "silu")
            if fused_ok:
                chk["w4_ec_fused_rel_err"] = rel_err(D.w4a16_gemv(x, qw.qweight, qw.scales, qw.zeros, G, None, ec=ec), ref_ec)
            chk["w4_ec_overlapped_rel_err"] = rel_err(ec_overlapped(x, qw.qweight, qw.scales, qw.zeros, G, None, *ec, "silu"), ref_ec)
            tg = torch.ops.aten._weight_int4pack_mm(x, ws[0]["packed"], G, ws[0]["sz"])
            chk["tinygemm_vs_ref_rel_err"] = rel_err(tg, ref)
            res["checks"].append(chk)
            # ---- config search for our kernels (saved for the library)
            if fused_ok and T.gemv1_ok(M, K, G, qw.qweight):  # the M = 1 kernel
                for i in range(copies):  # its weight layout is made once, outside the timed region
                    T.gemv_words(ws[i]["qw"].qweight)
                cfg, _ = search(lambda c: (lambda i: T.w4a16_gemv1(xs[i], *args_w(i), G, None, config=c)),
                                T.GEMV1_CONFIGS, copies)
                TK.tuned_table()[TK.gemv1_key(N, K, G, False)] = list(cfg)
                # (the one-launch EC's tile off Hopper: configs whose programs cannot hold A's pieces are
                # skipped; if none can, gemv1_ec runs the pair there and the key is not needed)
                ok_ec = [c for c in T.GEMV1_CONFIGS
                         if RT.self_plan_fits(ec[0].shape[0], K, -(-N // c[0]), c[2], x.device)]
                if ok_ec:
                    cfg_ec, _ = search(lambda c: (lambda i: T.w4a16_gemv1(xs[i], *args_w(i), G, None, ec=ec,
                                                                          config=c)), ok_ec, copies)
                    TK.tuned_table()[TK.gemv1_key(N, K, G, True)] = list(cfg_ec)
            elif fused_ok:
                cfg, _ = search(lambda c: (lambda i: D.w4a16_gemv(xs[i], *args_w(i), G, None, config=c)), T.GEMV_CONFIGS, copies)
                TK.tuned_table()[TK.gemv_key(N, K, G, False)] = list(cfg)
                cfg_ec, _ = search(lambda c: (lambda i: D.w4a16_gemv(xs[i], *args_w(i), G, None, ec=ec, config=c)),
                                   T.GEMV_CONFIGS, copies)
                TK.tuned_table()[TK.gemv_key(N, K, G, True)] = list(cfg_ec)
            gemm_run = lambda c: (lambda i: D.w4a16_gemm(xs[i], *args_w(i), G, None, config=c))  # noqa: E731
            cfg, t_gemm = search(gemm_run, RT.gemm_choices(M, N, K, G), copies)
            finalists = [(tuple(cfg), t_gemm)]  # the best of each kernel family, re-timed together below
            # the wgmma GEMMs (not below M = 64, where they never won): the plain kernel's fastest config is also
            # the "in_gemm" structure's GEMM where the table does not run the shape on the register-operand one
            if RT.wgmma_choices() and M >= 64:
                cfg_wg, t_wg = search(gemm_run, RT.wgmma_choices(), copies)
                if M >= 256:
                    TK.tuned_table()[TK.wgmma_key(M, N, K, G)] = list(cfg_wg[1:])
                finalists.append((tuple(cfg_wg), t_wg))
                from spear_compile.lowering import w4a16_gemm_wgmma_ra as RA

                # (else the search would time the fallback GEMM under the register-operand kernel's name)
                assert RA.takes(x, N, G, qw.scales, qw.zeros, None), "register-operand GEMM cannot take these weights"
                cfg_ra, t_ra = search(gemm_run, RT.wgmma_ra_choices(), copies)
                if M >= 256:  # the "in_gemm_self" structure's GEMM whatever wins the W4 table
                    TK.tuned_table()[TK.wgmma_ra_key(M, N, K, G)] = list(cfg_ra[1:])
                finalists.append((tuple(cfg_ra), t_ra))
            t_min = min(t for _, t in finalists)
            close = [c for c, t in finalists if t <= 1.08 * t_min]
            refined = len(close) > 1
            if refined:  # a near tie between families: decided by full, interleaved timings
                cfg, t_gemm = refine(gemm_run, close, copies)
                chk["gemm_finalists"] = {",".join(map(str, c)): t for c, t in finalists}
            else:
                cfg, t_gemm = min(finalists, key=lambda ft: ft[1])
            TK.tuned_table()[TK.gemm_key(M, N, K, G)] = list(cfg)
            if M >= 256 and RT.wgmma_ra_choices():  # the in-launch EC's own launch config (``RT.ec_self_config``)
                from spear_compile.lowering import w4a16_gemm_wgmma_ra as RA

                e64 = ecs[64]
                cfg_self, _ = search(lambda c: (lambda i: RA.w4a16_gemm_wgmma_ra_ec_self(
                    xs[i], *args_w(i), G, None, *e64, "silu", config=c[1:])), RT.wgmma_ra_choices(), copies)
                TK.tuned_table()[TK.ec_self_key(M, N, K, G)] = list(cfg_self[1:])
            chk["w4_op_rel_err"] = rel_err(D.w4a16_linear_cuda(x, qw.qweight, qw.scales, qw.zeros, G, None), ref)
            chk["w4_ec_op_rel_err"] = rel_err(D.ec_linear_cuda(x, qw.qweight, qw.scales, qw.zeros, G, None, *ec), ref_ec)
            chk["w4_gemm_chosen_rel_err"] = rel_err(D.w4a16_gemm(x, qw.qweight, qw.scales, qw.zeros, G, None, config=cfg), ref)
            if M >= 256:  # every prefill EC structure, checked on the GEMMs the table now gives this shape
                for st in STRUCTURES:
                    chk[f"w4_ec_{st}_rel_err"] = rel_err(ec_overlapped(x, qw.qweight, qw.scales, qw.zeros, G, None, *ec,
                                                                       "silu", structure=st), ref_ec)
            # ---- timing, all providers in this same run
            row = {"N": N, "K": K, "M": M}
            bf = [w["bf16"] for w in ws if w["bf16"] is not None]
            row["cublas_bf16"] = bench_graph(lambda i: F.linear(xs[i], bf[i % len(bf)]), copies)
            row["tinygemm_int4"] = bench_graph(lambda i: torch.ops.aten._weight_int4pack_mm(xs[i], ws[i]["packed"], G, ws[i]["sz"]), copies)
            row["naive_ec_r64"] = bench_graph(lambda i: naive_ec(xs[i], torch.ops.aten._weight_int4pack_mm(xs[i], ws[i]["packed"], G, ws[i]["sz"]), ec), copies)
            row["ours_w4"] = bench_graph(lambda i: D.w4a16_linear_cuda(xs[i], *args_w(i), G, None), copies)
            row["ours_w4_route"] = RT.route(RT.problem_of("w4a16", xs[0], *args_w(0), G)).describe()
            if fused_ok and M > 1:
                row["ours_w4_gemv"] = bench_graph(lambda i: D.w4a16_gemv(xs[i], *args_w(i), G, None), copies)
            row["ours_w4_ec_r64"] = bench_graph(lambda i: D.ec_linear_cuda(xs[i], *args_w(i), G, None, *ecs[64]), copies)
            if M >= 256:  # each prefill EC structure, the fastest saved for "auto"
                for st in STRUCTURES:
                    row[f"ours_w4_ec_r64_{st}"] = bench_graph(
                        lambda i: ec_overlapped(xs[i], *args_w(i), G, None, *ecs[64], "silu", structure=st), copies)
                # the C-operand structures are built on dequantize + cuBLAS; elsewhere "auto" ignores them
                ok = [st for st in STRUCTURES if T.is_dequant_cublas(tuple(cfg)) or not st.startswith("c_operand")]
                best = min(ok, key=lambda st: row[f"ours_w4_ec_r64_{st}"])
                TK.tuned_table()[TK.ec_structure_key(M, N, K, G)] = best
                row["ec_structure"] = best
            for r in RANKS:
                e = ecs[r]
                row[f"ours_w4_ec_r{r}_overlapped"] = bench_graph(lambda i: ec_overlapped(xs[i], *args_w(i), G, None, *e, "silu"), copies)
                if fused_ok:
                    row[f"ours_w4_ec_r{r}_fused"] = bench_graph(lambda i: D.w4a16_gemv(xs[i], *args_w(i), G, None, ec=e), copies)
            row["gemm_choice"] = list(cfg)
            row["ours_gemm_any_m"] = t_gemm  # the search's short timing, or refine's median where it decided
            row["gemm_refined"] = refined
            if M >= 256:
                row["ours_dequant_cublas"] = bench_graph(
                    lambda i: D.w4a16_gemm(xs[i], *args_w(i), G, None, config=T.DEQUANT_CUBLAS), copies)
                row["ours_dequant_cublas_pipe"] = bench_graph(
                    lambda i: D.w4a16_gemm(xs[i], *args_w(i), G, None, config=T.DEQUANT_CUBLAS_PIPE), copies)
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
            _dump(res, args.out)
        # measured crossover: smallest M where overlapped (r=64) beats fused
        fused = {r["M"]: r.get("ours_w4_ec_r64_fused") for r in res["rows"] if (r["N"], r["K"]) == (N, K)}
        over = {r["M"]: r["ours_w4_ec_r64_overlapped"] for r in res["rows"] if (r["N"], r["K"]) == (N, K)}
        cross = next((m for m in sorted(over) if fused.get(m) is None or over[m] < fused[m]), max(over) + 1)
        res["crossover"][f"{N}x{K}"] = cross
        del ws
        torch.cuda.empty_cache()
    res["seconds"] = time.time() - t0
    save_table("configs", TK.tuned_table())
    if not args.quick and not args.ms:  # the crossover needs every M the fused path takes (quick mode skips 2 and 4)
        from spear_compile.dispatch.tuning import load_table

        save_table("crossover", {**(load_table("crossover") or {}), **res["crossover"]})
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"kernels_{gpu_key()}.json"), "w") as f:
        json.dump(res, f, indent=1)
    import shutil

    from spear_compile.dispatch import table as tuned

    for name in ("configs", "crossover"):  # the tables this run wrote (the user cache), beside its results
        if os.path.exists(tuned.user_path(name, gpu_key())):
            shutil.copy(tuned.user_path(name, gpu_key()), args.out)
    # ---- table
    print(f"\n{res['gpu']}  torch {res['torch']}  triton {res['triton']}  (us per call, CUDA graphs)")
    hdr = f"{'N x K':>12} {'M':>5} {'cuBLAS':>8} {'tinygemm':>9} {'naiveEC':>8} {'ours W4':>8} {'W4/tg':>6} {'W4/cuB':>7} {'EC64/W4':>8}"
    print(hdr)
    for r in res["rows"]:
        ec64 = r["ours_w4_ec_r64"]
        print(f"{r['N']:>6}x{r['K']:<5} {r['M']:>5} {r['cublas_bf16']:8.1f} {r['tinygemm_int4']:9.1f} {r['naive_ec_r64']:8.1f} "
              f"{r['ours_w4']:8.1f} {r['ours_w4'] / r['tinygemm_int4']:6.2f} {r['ours_w4'] / r['cublas_bf16']:7.2f} {ec64 / r['ours_w4']:8.2f}")
    worst = max(max(c.get(k, 0) for k in c if k.endswith("rel_err")) for c in res["checks"])
    print(f"max relative error of any check: {worst:.2e}; crossover: {res['crossover']}")
    sys.exit(0 if worst < 2e-2 else 1)


if __name__ == "__main__":
    main()
