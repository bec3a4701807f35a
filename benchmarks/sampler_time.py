"""Self-sampling time: Hugging Face ``generate`` against ``sampling.py``'s static-cache loop.

    python benchmarks/sampler_time.py [--n 32] [--seq-len 256] [--batch 32] [--device cpu] [--json OUT]

Both samplers draw from SmolLM2-135M (real weights) with the same seed; the JSON has each one's
seconds, the ratio, and the share of identical tokens (1.0 when the static cache's logits match the
dynamic cache's bitwise; a near-tie between two tokens can flip a draw otherwise, after which the
rows diverge). On CUDA the static loop replays its decode step as a CUDA graph.
"""
from __future__ import annotations

try:
    from _syspath import unshadow  # run as a script: benchmarks/ is first on sys.path
except ImportError:  # loaded from elsewhere (a test, benchmarks.<name>)
    from benchmarks._syspath import unshadow
unshadow()  # before transformers is imported (benchmarks/kernels.py would shadow its ``kernels`` probe)

import argparse
import datetime
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from spear_compile.compensators.calibrate import sample_sequences  # noqa: E402
from spear_compile.config import default_device  # noqa: E402
from spear_compile.models import load_smollm2  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--device", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = default_device(args.device)
    model = load_smollm2()[0].to(dev)
    res = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "device": str(dev),
           "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
           "threads": torch.get_num_threads(), "n": args.n, "seq_len": args.seq_len, "batch": args.batch}
    out = {}
    for sampler in ("hf", "static"):
        sample_sequences(model, min(args.batch, 2), 8, model.config.bos_token_id, batch_size=args.batch,
                         progress=False, sampler=sampler)  # warm-up (allocator, first-call overheads)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t = time.perf_counter()
        out[sampler] = sample_sequences(model, args.n, args.seq_len, model.config.bos_token_id,
                                        batch_size=args.batch, progress=False, sampler=sampler)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        res[f"{sampler}_seconds"] = time.perf_counter() - t
        print(f"{sampler}: {res[f'{sampler}_seconds']:.1f} s", flush=True)
    res["static_over_hf"] = res["static_seconds"] / res["hf_seconds"]
    res["identical_token_share"] = (out["hf"] == out["static"]).float().mean().item()
    res["identical_rows"] = int((out["hf"] == out["static"]).all(1).sum())
    print(json.dumps(res, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
