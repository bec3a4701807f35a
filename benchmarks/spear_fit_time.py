"""Wall time of SPEAR's selection + calibration at the device's preset (the issue's 10-minute CPU /
3-minute H200 budget), phase by phase.

    python benchmarks/spear_fit_time.py [--budget 0.01] [--preset auto|gpu|cpu] [--out FILE.json]

Loads SmolLM2-135M, quantizes it (RTN per-channel), then times exactly what ``spear demo`` (CPU)
or ``spear eval`` (GPU) runs after quantization with ``spear.preset(device)``: sampling the
calibration text from the fp model, CKA damage, input statistics and error spectra, QERA init,
the KL steps. Run it with nothing else on the machine.
"""
from __future__ import annotations

try:
    from _syspath import unshadow  # run as a script: benchmarks/ is first on sys.path
except ImportError:  # loaded from elsewhere (a test, benchmarks.<name>)
    from benchmarks._syspath import unshadow
unshadow()  # before transformers is imported (benchmarks/kernels.py would shadow its ``kernels`` probe)

import argparse
import copy
import dataclasses
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    from spear_compile import QuantConfig, quantize_
    from spear_compile.config import default_device
    from spear_compile.compensators.calibrate import sample_calibration
    from spear_compile.compensators.spear import fit_spear_, preset
    from spear_compile.evaluate import fp16_bytes
    from spear_compile.models import load

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=float, default=0.01)
    ap.add_argument("--preset", default="auto", choices=["auto", "gpu", "cpu"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = str(default_device())
    name = torch.cuda.get_device_name() if dev == "cuda" else f"cpu_{os.cpu_count()}cores"
    torch.manual_seed(0)
    ref, _ = load("smollm2-135m")
    ref.to(dev)
    q = quantize_(copy.deepcopy(ref), QuantConfig(), progress=False)
    cfg = preset(dev, args.preset)
    calib = cfg.calib
    t0 = time.time()
    seqs = sample_calibration(ref, calib)
    sampling = time.time() - t0
    ecs, log = fit_spear_(ref, q, seqs, int(args.budget * fp16_bytes(ref)), cfg)
    seconds = {"sampling": sampling, **log["seconds"]}
    seconds["total"] = sampling + log["seconds"]["total"]
    res = {"device": name, "torch": torch.__version__, "threads": torch.get_num_threads(),
           "machine": platform.processor() or platform.machine(), "budget": args.budget, "ec_modules": len(ecs),
           "spear": dataclasses.asdict(cfg), "seconds": seconds, "kl_first": log["losses"][0], "kl_last": log["losses"][-1],
           "date": time.strftime("%Y-%m-%d")}
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "calibration",
                                   f"{res['date']}_spear_fit_time_{name.replace(' ', '_')}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(seconds, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
