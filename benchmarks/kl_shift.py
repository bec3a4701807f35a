"""Where SPEAR's remaining error lives: KL to the full-precision model on self-sampled text vs real text.

SPEAR is fitted on text the full-precision model samples itself and judged on Shakespeare. If the
compensators remove most of the KL on fresh self-samples but much less on real text, the gap to the
85 % target is a distribution-shift problem (the next lever is the calibration data), not a
capacity or optimisation one (budget, steps). Diagnostic only: a development play (Lear), never the
evaluation plays.

    python benchmarks/kl_shift.py --json OUT.json [--budget 0.01] [--text lear_gut]

Prints and writes mean per-token KL(p_fp || p_model) for W4 and W4 + SPEAR on (a) 16 x 256 fresh
self-samples (another seed than the calibration's) and (b) 16 x 256 tokens of the play, and the
fraction of the W4 KL that SPEAR removes on each; also W4 + SPEAR's KL on 16 of the calibration
sequences it was trained on (train vs held-out: does it overfit?).
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

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from spear_compile.compensators.calibrate import kl_fp_q, sample_sequences  # noqa: E402
from spear_compile.compensators.spear import fit_spear_, parse_overrides, preset  # noqa: E402
from spear_compile.evaluate import EvalSession  # noqa: E402


@torch.no_grad()
def mean_kl(ref, model, seqs: torch.Tensor, batch: int = 4) -> float:
    """Token-mean KL(p_ref || p_model) over ``seqs`` (calibration's own loss, batch by batch)."""
    tot, n = 0.0, 0
    for i in range(0, len(seqs), batch):
        x = seqs[i:i + batch]
        tot += kl_fp_q(ref(x).logits, model(x).logits).item() * x.numel()
        n += x.numel()
    return tot / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--text", default="lear_gut")
    ap.add_argument("--budget", type=float, default=0.01)
    ap.add_argument("--device", default=None)
    ap.add_argument("--set", default="", help="SPEAR settings key=value,... on top of the device's preset")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    spear = preset(args.device).replace(**parse_overrides(args.set))
    s = EvalSession(texts=[args.text], seq_len=256, max_tokens=16 * 256, spear=spear, device=args.device)
    ref = s.ref
    base, _ = s.base("rtn", 0)
    q = copy.deepcopy(base)
    fit_spear_(ref, q, s.seqs, int(args.budget * s.ref_bytes), spear)
    fresh = sample_sequences(ref, 16, 256, ref.config.bos_token_id, batch_size=16, seed=12345, progress=False)
    play = s.wins[:16]
    res = {"text": args.text, "budget": args.budget, "overrides": parse_overrides(args.set),
           "calib": {"n_seqs": spear.calib.n_seqs, "seq_len": spear.calib.seq_len, "steps": spear.calib.steps},
           # the calibration set itself (seen in training), for the train / held-out gap
           "calib_set": {"kl_spear": mean_kl(ref, q, s.seqs[:16])}}
    for name, seqs in (("self_samples", fresh), ("play", play)):
        kq, ks = mean_kl(ref, base, seqs), mean_kl(ref, q, seqs)
        res[name] = {"kl_w4": kq, "kl_spear": ks, "removed": 1 - ks / kq}
        print(f"{name:13s} KL W4 {kq:.4f}  W4+SPEAR {ks:.4f}  removed {100 * (1 - ks / kq):.1f} %", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
