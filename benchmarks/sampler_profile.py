"""Where the static sampler's decode step spends its time (random weights, SmolLM2-135M's shapes).

The graphed sampler drew 96 x 1024 tokens in 36.8 s on the H200 (18 ms per step at batch 64) against
a prediction of ~1-2 ms per step. The first run of this script (the model's own attention,
``results/calibration/2026-11-30_h200_sampler_profile_model_attention.json``) found why: the graphed step is 21.5 ms at
every position, 17 ms of it attention over the static cache's 1024 slots (repeated K/V heads and the
fp32 memory-efficient kernel). This times, for the model's attention and sampling.py's grouped one,
the graphed and the eager step (CUDA events), a profiler table of one eager step, the sampling ops
(EOS mask, softmax, multinomial) one by one, and the whole b x T loop. Random weights are fine for time.

    python benchmarks/sampler_profile.py --json $OUT/sampler_profile.json [--batch 64] [--seq-len 1024]
"""
from __future__ import annotations

try:
    from _syspath import unshadow  # run as a script: benchmarks/ is first on sys.path
except ImportError:  # loaded from elsewhere (a test, benchmarks.<name>)
    from benchmarks._syspath import unshadow
unshadow()  # before transformers is imported (benchmarks/kernels.py would shadow its ``kernels`` probe)

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from spear_compile.compensators.sampling import ATTENTIONS, _attention, _Step, sample_static  # noqa: E402
from spear_compile.models.tiny import tiny_llama  # noqa: E402


def _ms(fn, n: int) -> tuple[float, float]:
    """(GPU ms, host wall ms) per call of ``fn`` over ``n`` calls: wall >> GPU means host-bound."""
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t = time.perf_counter()
    s.record()
    for _ in range(n):
        fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / n, (time.perf_counter() - t) * 1e3 / n


@torch.no_grad()  # as in sample_static: with autograd on, the cache's in-place writes chain a graph
def main() -> None:  # across steps that is never freed (OOM after a few hundred steps)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model = tiny_llama(hidden=576, layers=30, heads=9, kv_heads=3, intermediate=1536, vocab=49152).cuda()
    model.config.max_position_embeddings = 8192
    b, T = args.batch, args.seq_len
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "batch": b, "seq_len": T}
    from torch.profiler import ProfilerActivity, profile

    for attention in ATTENTIONS:
        with _attention(model, attention):
            for graph in (True, False):
                step = _Step(model, b, T, 1, graph)
                step.pos.fill_(T // 2)
                res[f"{attention}_forward_{'graph' if graph else 'eager'}_ms"] = _ms(step, 20)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                step()
                torch.cuda.synchronize()
            res[f"profile_{attention}_eager_step"] = prof.key_averages().table(sort_by="cuda_time_total", row_limit=12)
            print(res[f"profile_{attention}_eager_step"])
            del step
    logits = torch.randn(b, 49152, device="cuda")
    eos = torch.tensor([2], device="cuda")
    probs = torch.softmax(logits, -1)
    for name, fn in (("index_fill", lambda: logits.index_fill(1, eos, float("-inf"))),
                     ("softmax", lambda: torch.softmax(logits, -1)),
                     ("multinomial", lambda: torch.multinomial(probs, 1))):
        res[f"sampling_{name}_ms"] = _ms(fn, 50)
    ids = {}
    for attention in ATTENTIONS:  # the whole loop, b x T tokens, same seed
        torch.manual_seed(0)
        torch.cuda.synchronize()
        t = time.perf_counter()
        ids[attention] = sample_static(model, b, T, 1, attention=attention)
        torch.cuda.synchronize()
        res[f"{attention}_sample_static_seconds"] = time.perf_counter() - t
    res["identical_token_share"] = (ids["model"] == ids["gqa"]).float().mean().item()
    print(json.dumps({k: v for k, v in res.items() if not k.startswith("profile")}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
