"""KL calibration step, eager against one CUDA graph per step (``CalibConfig.cuda_graph``).

SmolLM2-135M's shapes with random weights (a timing, never a quality claim): per-channel RTN W4,
the SPEAR plan at 1 % (damage on one sequence, every damaged module offered), then the same
calibration twice from the same starting ECs - eager, and graphed - with GPU_PRESET's step
settings (4 x 512 tokens per step, A/B lr 1e-3, cosine). Reports seconds per step (after the
teacher cache and the warm-up/capture), the largest loss difference and parameter difference.

    python benchmarks/calib_graph_check.py --steps 40 --out $OUT
"""
from __future__ import annotations

try:
    from _syspath import unshadow  # run as a script: benchmarks/ is first on sys.path
except ImportError:  # loaded from elsewhere (a test, benchmarks.<name>)
    from benchmarks._syspath import unshadow
unshadow()  # before transformers is imported (benchmarks/kernels.py would shadow its ``kernels`` probe)

import argparse
import copy
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    import torch

    from spear_compile.config import default_device

    from spear_compile import QuantConfig, quantize_
    from spear_compile.compensators.calibrate import CalibConfig, calibrate_
    from spear_compile.compensators.spear import SpearConfig, fit_spear_
    from spear_compile.evaluate import fp16_bytes
    from spear_compile.models import tiny_llama

    dev = default_device()
    ref = tiny_llama(hidden=576, layers=30, heads=9, kv_heads=3, intermediate=1536, vocab=49152).to(dev)
    seqs = torch.randint(0, 49152, (args.seqs, args.seq_len), generator=torch.Generator().manual_seed(0)).to(dev)
    q = quantize_(copy.deepcopy(ref), QuantConfig(group_size=None), progress=False)
    fit_spear_(ref, q, seqs, int(0.01 * fp16_bytes(ref)),
               SpearConfig(damage_seqs=1, select="all", calib=CalibConfig(steps=1)), progress=False)
    start = copy.deepcopy(q.state_dict())
    res = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__,
           "steps": args.steps, "tokens_per_step": 4 * args.seq_len}
    out = {}
    for graph in (False, True):
        q.load_state_dict(start)
        cfg = CalibConfig(n_seqs=args.seqs, seq_len=args.seq_len, steps=args.steps, lr_ab=1e-3, schedule="cosine",
                          cuda_graph=graph, teacher_cache_bytes=8 << 30)
        short = calibrate_(q, ref, seqs, dataclasses_replace(cfg, steps=1), progress=False)  # teacher cache only
        q.load_state_dict(start)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.time()
        log = calibrate_(q, ref, seqs, cfg, progress=False)
        total = time.time() - t0
        per_step = (total - short["seconds"]) / max(1, args.steps - 1)
        params = torch.cat([p.detach().flatten().float().cpu() for m in q.modules()
                            if getattr(m, "ec", None) is not None for p in m.ec.parameters()])
        out[graph] = (log["losses"], params)
        res["graph" if graph else "eager"] = {"seconds": total, "seconds_one_step_run": short["seconds"],
                                              "approx_seconds_per_step": per_step, "first_loss": log["losses"][0],
                                              "last_loss": log["losses"][-1]}
        print(json.dumps(res["graph" if graph else "eager"]), flush=True)
    (le, pe), (lg, pg) = out[False], out[True]
    res["max_loss_rel_diff"] = max(abs(a - b) / abs(a) for a, b in zip(le, lg))
    res["max_param_abs_diff"] = float((pe - pg).abs().max())
    res["speedup"] = res["eager"]["approx_seconds_per_step"] / res["graph"]["approx_seconds_per_step"]
    print(json.dumps(res, indent=1))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "calib_graph_check.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0


def dataclasses_replace(cfg, **kw):
    import dataclasses

    return dataclasses.replace(cfg, **kw)


if __name__ == "__main__":
    sys.exit(main())
