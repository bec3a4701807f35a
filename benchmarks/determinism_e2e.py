"""Where the compiled decode step of ``e2e_decode.py`` first differs between reruns on the same inputs.

``benchmarks/determinism.py`` found every spear kernel bitwise deterministic alone, yet the compiled
SPEAR EC steps gave 2 distinct logit vectors in 8 eager reruns now and then (H200, 2026-11-30;
docs/gpu.md). This probe reruns one variant's compiled step ``--reruns`` times and counts distinct logits
(no hooks: the step's launches queue back to back as in ``e2e_decode.py``), then reruns it with forward
hooks on the 32 layers that keep a device copy of each layer's output (no host synchronisation inside the
step; hashed after it) and reports, per rerun, the first layer whose output differs from the first rerun's,
and which layers carry ECs. Run it once with and once without ``SPEAR_NO_PDL=1`` (the same kernels, the EC
pair's GEMV launched after its producer instead of PDL-overlapped) to see whether the dependent launches
matter.

    python benchmarks/determinism_e2e.py --out DIR [--variants spear_ec25 ours_w4] [--reruns 32] [--batch 1]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e_decode import CTX, OPTION_SUFFIXES, POS, V, Model, build, digest  # noqa: E402


def probe(variant: str, batch: int, reruns: int, base_state: dict) -> dict:
    model, backend = build(variant, batch, base_state)
    ec_layers = sorted({int(n.split(".")[1]) for n, m in model.named_modules()
                        if n.startswith("layers.") and getattr(m, "ec", None) is not None})
    suffix = variant.rsplit("_", 1)[-1]
    opts = {"options": OPTION_SUFFIXES[suffix]} if suffix in OPTION_SUFFIXES else {}
    for layer in model.layers:  # compiled as e2e_decode.time_variant compiles them
        layer.forward = torch.compile(layer.forward, backend=backend, dynamic=False, **opts)
    ids = torch.randint(0, V, (batch, 1), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    pos = torch.tensor([POS], device="cuda")
    with torch.no_grad():
        model(ids, pos)  # compile
        outs = [model(ids, pos).clone() for _ in range(reruns)]  # queued back to back, no hooks
        logits = {digest(o) for o in outs}
        kept: list = []
        handles = [layer.register_forward_hook(lambda mod, args, out, i=i: kept.append((i, out.detach().clone())))
                   for i, layer in enumerate(model.layers)]
        runs = []
        for _ in range(reruns):
            kept.clear()
            model(ids, pos)
            runs.append([digest(o) for _, o in sorted(kept, key=lambda e: e[0])])  # hashed after the step
        for h in handles:
            h.remove()
    first_diff = []
    for r in runs[1:]:
        diff = [i for i, (a, b) in enumerate(zip(runs[0], r)) if a != b]
        first_diff.append(diff[0] if diff else None)
    del model
    torch.cuda.empty_cache()
    torch._dynamo.reset()
    return {"variant": variant, "batch": batch, "reruns": reruns, "distinct_logits": len(logits),
            "ec_layers": ec_layers, "first_differing_layer_per_rerun": first_diff,
            "pdl_off": os.environ.get("SPEAR_NO_PDL", "0") not in ("", "0"), "ctx": CTX}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--variants", nargs="+", default=["spear_ec25", "ours_w4"])
    ap.add_argument("--reruns", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    with torch.device("cuda"):
        ref = Model(1)
    base_state = {k: v for k, v in ref.state_dict().items() if "cache" not in k}
    del ref
    rows = []
    for v in args.variants:
        rows.append(probe(v, args.batch, args.reruns, base_state))
        print(json.dumps(rows[-1]), flush=True)
    tag = "nopdl" if rows and rows[0]["pdl_off"] else "pdl"
    with open(os.path.join(args.out, f"determinism_e2e_{tag}.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
