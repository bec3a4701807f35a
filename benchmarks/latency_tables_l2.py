"""How the latency tables time a compiled linear: on one weight set (L2-hot) against weight copies past L2.

The serving engine's step reads every layer's weights from HBM in turn. A table timed by replaying one
linear on one weight set inside a CUDA graph reads them from L2 once they fit there (an H200's L2 is
50 MiB; a 4096x4096 W4 weight is 8.4 MiB). (The W4 Llama-2-7B tables once summed to 0.59 ms for a batch-1
decode on an H200, which looked like 6.6 TB/s of weights; that sum was one layer's: the plan counted a
layer frame's graph once, fixed in ``runtime.compiled.instance_records``.) ``runtime.measure`` therefore
cycles a compiled linear's calls over ``weight_copies`` weight sets. This script times the W4 op of the Llama-2-7B linears both ways at several M, as ``measure`` times them
(``part_time_ms`` over ``op_runner``), and reports microseconds and the weights' TB/s.

    python benchmarks/latency_tables_l2.py --out OUT   (CUDA only; writes OUT/latency_tables_l2.json)

Prediction before the run: at M = 1 the one-set timing above the HBM's 4.8 TB/s on the shapes that fit
L2 (4096x4096, 4096x11008), the copies at or below it; from M = 64 the two within ~15 % (the kernel is
no longer bound by the weight reads).
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from _meta import run_meta
from _syspath import unshadow

unshadow()

import spear_compile  # noqa: E402,F401  (registers torch.ops.spear)
from spear_compile.runtime.measure import part_time_ms, weight_copies  # noqa: E402
from spear_compile.runtime.op_runner import linear_bytes, op_runner  # noqa: E402
from spear_compile.runtime.plan import PlannedLinear, PlannedOp  # noqa: E402

SHAPES = ((4096, 4096), (11008, 4096), (4096, 11008), (12288, 4096))  # (N, K): o, up, down, q/k/v concatenated


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("latency_tables_l2.py: needs a CUDA GPU")
    os.makedirs(args.out, exist_ok=True)
    rows = []
    with torch.inference_mode():
        for n, k in SHAPES:
            lin = PlannedLinear(f"{n}x{k}", k, n, ops=(PlannedOp("w4a16", ((n, 0, 0),), k, 128),))
            for m in args.ms:
                nbytes, copies = linear_bytes(lin, m), weight_copies(lin, m, "cuda")
                row = {"N": n, "K": k, "M": m, "weight_bytes": nbytes, "copies": copies}
                for name, c in (("one_set", 1), ("copies", copies)):
                    ms = part_time_ms(op_runner(lin, m, "cuda", torch.bfloat16, {}, copies=c), "cuda", reps=10,
                                      calls=max(10, c))
                    row[f"{name}_us"] = ms * 1e3
                    row[f"{name}_tbps"] = nbytes / (ms * 1e-3) / 1e12
                row["one_set_over_copies"] = row["one_set_us"] / row["copies_us"]
                rows.append(row)
                print({k2: (round(v, 3) if isinstance(v, float) else v) for k2, v in row.items()}, flush=True)
    rec = {"meta": run_meta(args, {"triton": __import__("triton").__version__}), "rows": rows}
    with open(os.path.join(args.out, "latency_tables_l2.json"), "w") as f:
        json.dump(rec, f, indent=1)


if __name__ == "__main__":
    main()
