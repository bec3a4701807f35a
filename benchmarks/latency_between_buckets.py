"""The compiled model's linears timed between the latency model's M buckets, where the engine runs them.

The latency model times each compiled linear at powers of two (``measure.default_buckets``) and
interpolates between them. The engine runs a compiled step at its token count padded to 64
(``Engine.token_pad``), so most prefill steps run at an M that no bucket measured. On an H100 (Llama-2-7B
shape, ECs on 25 % of the linears, 2026-12-06, ``results/serving/2026-12-06_h100_online_correction``)
served steps padded to 192 tokens measured a median 2.24x their prediction, against 1.08-1.3x at 128,
256 and beyond. This script starts the serving engine on the same model (compiled with
``backend="spear"``, as ``benchmarks/serving.py`` does), takes its plan (``runtime.plan_of``) and times
every planned linear's ops at ``--ms`` rows as the latency tables time them (``op_runner`` over weight
copies past L2, ``part_time_ms``), with the route each op takes there, so a slow M between buckets
shows as a row out of line with its neighbours.

    python benchmarks/latency_between_buckets.py --out OUT [--density 25] [--ms 64 128 192 256 320 384]

Writes ``OUT/latency_between_buckets_<GPU>.json`` (CUDA only).
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from _meta import run_meta
from _syspath import unshadow

unshadow()

from benchmarks.serving import build_model, set_ec_density  # noqa: E402

from spear_compile import runtime  # noqa: E402
from spear_compile.runtime import Engine, StaticChunkPolicy  # noqa: E402
from spear_compile.runtime.measure import part_time_ms, weight_copies  # noqa: E402
from spear_compile.runtime.op_runner import op_runner  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--density", type=int, default=25)
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--ms", type=int, nargs="+", default=[64, 128, 192, 256, 320, 384])
    args = ap.parse_args()
    args.device = "cuda"  # for the record's meta (run_meta)
    if not torch.cuda.is_available():
        raise SystemExit("latency_between_buckets.py: needs a CUDA GPU")
    os.makedirs(args.out, exist_ok=True)
    model = build_model("llama2-7b", "cuda", args.layers)
    set_ec_density(model, args.density, args.rank)
    eng = Engine(model, policy=StaticChunkPolicy(512), compile=True, block_size=256, max_batch_tokens=768,
                 attention="varlen", calibrate=False, log=print).start()
    try:
        plan = runtime.plan_of(model)
        rows = []
        with torch.inference_mode():
            for lin in plan.linears:
                weights = {}
                for m in args.ms:
                    n = weight_copies(lin, m, "cuda")
                    us = 1e3 * part_time_ms(op_runner(lin, m, "cuda", torch.bfloat16, weights, copies=n), "cuda",
                                            reps=10, calls=max(10, n))
                    row = {"linear": lin.name, "count": lin.count, "ec_rank": lin.ec_rank, "M": m, "us": us,
                           "route": lin.route_at(m)}
                    rows.append(row)
                    print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    finally:
        eng.stop(wait=False)
    name = torch.cuda.get_device_name().replace(" ", "_")
    with open(os.path.join(args.out, f"latency_between_buckets_{name}.json"), "w") as f:
        json.dump({"meta": run_meta(args, {"triton": __import__("triton").__version__}), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
