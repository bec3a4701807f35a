"""Where a KL-calibration step's time goes: torch.profiler over a few ``calibrate_`` steps.

    python benchmarks/calib_profile.py [--steps 6] [--out profile.txt]

SmolLM2-135M, per-channel RTN W4, the default SPEAR plan's ECs (damage on one short sequence, so
the plan is quick), 4 x 256 self-sampled tokens per step. Prints the wall time per step and the top
operators by self device time (CUDA) or self CPU time, so an optimisation of the training loop
starts from a measurement.
"""
from __future__ import annotations

try:
    from _syspath import unshadow  # run as a script: benchmarks/ is first on sys.path
except ImportError:  # loaded from elsewhere (a test, benchmarks.<name>)
    from benchmarks._syspath import unshadow
unshadow()  # before transformers is imported (benchmarks/kernels.py would shadow its ``kernels`` probe)

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--budget", type=float, default=0.01)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import copy

    import torch

    from spear_compile.config import default_device
    from torch.profiler import ProfilerActivity, profile

    from spear_compile.compensators.calibrate import CalibConfig, calibrate_, sample_sequences
    from spear_compile.compensators.spear import SpearConfig, fit_spear_
    from spear_compile.evaluate import fp16_bytes
    from spear_compile.models import load
    from spear_compile import QuantConfig, quantize_

    dev = default_device()
    ref, _ = load("smollm2-135m")
    ref.to(dev)
    seqs = sample_sequences(ref, 8, 256, ref.config.bos_token_id, progress=False)
    q = quantize_(copy.deepcopy(ref), QuantConfig(group_size=None), progress=False)
    cfg = SpearConfig(damage_seqs=1, calib=CalibConfig(steps=1))
    ecs, _ = fit_spear_(ref, q, seqs, int(args.budget * fp16_bytes(ref)), cfg, progress=False)
    run = CalibConfig(n_seqs=8, steps=args.steps)
    calibrate_(q, ref, seqs, CalibConfig(steps=2), progress=False)  # warm-up
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    t0 = time.time()
    with profile(activities=acts) as prof:
        log = calibrate_(q, ref, seqs, run, progress=False)
    wall = time.time() - t0
    key = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    lines = [f"device {dev} ({torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}), torch {torch.__version__}",
             f"{len(ecs)} ECs; {log['steps']} steps in {log['seconds']:.2f}s = {log['seconds'] / log['steps']:.3f} s/step "
             f"(profiled wall {wall:.2f}s)",
             prof.key_averages().table(sort_by=key, row_limit=30)]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
