"""Shapes outside the shipped table: the route's default for them against the same shapes tuned.

For each model's W4 linear shapes (``spear_compile.tuner.shapes_from_config``: Qwen2.5-7B-, Llama-3-8B- and
Mistral-7B-shaped by default, none of them in the shipped H200 table) and each M, one run times:

* ``cublas_bf16``: ``F.linear`` on the dequantized bf16 weight;
* ``first_config``: our W4 with an empty table (each kernel's first config, the CUDA-core GEMV at M = 1:
  what an untuned shape ran before the nearest-geometry default);
* ``nearest``: our W4 with the shipped table (``route.tuned_key``: the nearest tuned geometry's entries);
* ``tuned``: our W4 after ``dispatch.autotune`` measured the shape at that M (what ``spear tune`` writes).

Targets (the serving-regime kernel targets): ``nearest / tuned <= 1.15``; ``spear tune`` of a 7-8B model within
5 minutes (``tune_seconds`` per model: every job of the model, M in ``--ms``, measured once).

    python benchmarks/untuned_shapes.py --out OUT [--models qwen2.5-7b llama3-8b] [--ms 1 16 64 256]
    python benchmarks/untuned_shapes.py --out OUT --dry-run     # the shapes and jobs, no GPU

Writes ``OUT/untuned_shapes_<GPU>.json``. Nothing is written to the user's tuned table (the tuned
entries live in this process only).
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

from spear_compile.dispatch import autotune as AT  # noqa: E402
from spear_compile.dispatch import cuda as D  # noqa: E402
from spear_compile.dispatch import table as TT  # noqa: E402
from spear_compile.dispatch.tuning import bench_graph, copies_for, gpu_key  # noqa: E402
from spear_compile.ops.w4a16_ref import dequantize_ref  # noqa: E402
from spear_compile.tuner import shapes_from_config  # noqa: E402

MODELS = {
    "qwen2.5-7b": {"model_type": "qwen2", "hidden_size": 3584, "num_attention_heads": 28, "num_key_value_heads": 4,
                   "intermediate_size": 18944},
    "llama3-8b": {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
                  "intermediate_size": 14336},
    "mistral-7b": {"model_type": "mistral", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
                   "intermediate_size": 14336},
}


def w4(x, w, G):
    """Our W4 linear as the compiled model runs it: the route for x's M (GEMV at M = 1, else a GEMM)."""
    return D.w4a16_linear_cuda(x, *w, G, None)


def time_shape(N: int, K: int, G: int, M: int) -> dict:
    """The four timings of one shape at one M (module docstring), in us, the process's table restored after."""
    copies = min(copies_for(N * K // 2), 12)
    ws = AT.random_weights(N, K, G, copies, "cuda")
    xs = [torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    bf = [dequantize_ref(*ws[i], G, "spear", torch.bfloat16) for i in range(min(2, copies))]
    row = {"N": N, "K": K, "G": G, "M": M}
    row["cublas_bf16"] = bench_graph(lambda i: F.linear(xs[i], bf[i % len(bf)]), copies)
    shipped = TT.configs()
    try:
        TT.set_configs(TT.TunedTable("configs", {}))
        row["first_config"] = bench_graph(lambda i: w4(xs[i], ws[i], G), copies)
        TT.set_configs(shipped)
        row["nearest"] = bench_graph(lambda i: w4(xs[i], ws[i], G), copies)
        job = AT.Job("gemv1", N, K, G) if M == 1 else AT.Job("gemm", N, K, G, M)
        tuned = TT.TunedTable("configs", dict(shipped.items()))
        TT.set_configs(tuned)
        t0 = time.perf_counter()
        got = AT.measure(job)
        row["tune_job_s"] = time.perf_counter() - t0
        for k, v in got.items():
            tuned[k] = v
        row["tuned_entries"] = {str(k): v for k, v in got.items()}
        row["tuned"] = bench_graph(lambda i: w4(xs[i], ws[i], G), copies)
    finally:
        TT.set_configs(shipped)
    row["nearest_over_tuned"] = row["nearest"] / row["tuned"]
    row["tuned_over_cublas"] = row["tuned"] / row["cublas_bf16"]
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", nargs="+", default=["qwen2.5-7b", "llama3-8b"], choices=sorted(MODELS))
    ap.add_argument("--ms", nargs="+", type=int, default=[1, 16, 64, 256])
    ap.add_argument("--tune-ms", nargs="+", type=int, default=list(AT.DEFAULT_MS),
                    help="M values of the whole-model spear tune run that is timed (tune_seconds)")
    ap.add_argument("--no-tune-time", action="store_true", help="skip the whole-model spear tune timing")
    ap.add_argument("--dry-run", action="store_true", help="print the shapes and the jobs, then exit")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    plan = {m: [s for s in shapes_from_config(MODELS[m])] for m in args.models}
    if args.dry_run:
        for m, shapes in plan.items():
            jobs = AT.jobs_for(shapes, args.tune_ms)
            print(f"{m}: {len(shapes)} shapes, {len(jobs)} spear tune jobs")
            for s in shapes:
                print(f"  {s.N}x{s.K} g{s.G} decode={s.decode} prefill={s.prefill}")
        return
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
           "ms": args.ms, "models": {}, "rows": []}
    for m, shapes in plan.items():
        seen = set()
        for s in shapes:
            for M in args.ms:
                if (M == 1 and not s.decode) or (M > 1 and not s.prefill) or (s.N, s.K, s.G, M) in seen:
                    continue
                seen.add((s.N, s.K, s.G, M))
                row = {"model": m, **time_shape(s.N, s.K, s.G, M)}
                res["rows"].append(row)
                print(json.dumps(row), flush=True)
        if not args.no_tune_time:
            shipped = TT.configs()
            try:
                TT.set_configs(TT.TunedTable("configs", dict(shipped.items())))
                rep = AT.run(AT.jobs_for(shapes, args.tune_ms), budget_s=3600, progress=False, save=False)
            finally:
                TT.set_configs(shipped)
            res["models"][m] = {"tune_seconds": rep.seconds, "jobs": len(rep.done) + len(rep.failed),
                                "failed": [(j.describe(), why) for j, why in rep.failed]}
            print(m, json.dumps(res["models"][m]), flush=True)
        with open(os.path.join(args.out, f"untuned_shapes_{gpu_key()}.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
