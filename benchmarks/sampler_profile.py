"""Where the static sampler's decode step spends its time (random weights, SmolLM2-135M's shapes).

The graphed sampler drew 96 x 1024 tokens in 36.8 s on the H200 (18 ms per step at batch 64) against
a prediction of ~1-2 ms per step (the model's forward is ~300 small kernels; a graph replays them
without host overhead). This splits one step: the graphed forward alone, the eager forward, and the
sampling ops around it (EOS mask, softmax, multinomial, copies), each timed with CUDA events over
many steps, plus a torch.profiler table of a few full steps. Random weights are fine for time.

    python benchmarks/sampler_profile.py --json $OUT/sampler_profile.json [--batch 64] [--seq-len 1024]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from spear_compile.compensators.sampling import _Step, sample_static  # noqa: E402
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model = tiny_llama(hidden=576, layers=30, heads=9, kv_heads=3, intermediate=1536, vocab=49152).cuda()
    model.config.max_position_embeddings = 8192
    b, T = args.batch, args.seq_len
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "batch": b, "seq_len": T}
    for graph in (True, False):
        step = _Step(model, b, T, 1, graph)
        step.pos.fill_(T // 2)
        res[f"forward_{'graph' if graph else 'eager'}_ms"] = _ms(step, 20)
    logits = torch.randn(b, 49152, device="cuda")
    eos = torch.tensor([2], device="cuda")
    tok = torch.zeros(b, 1, dtype=torch.long, device="cuda")
    ids = torch.zeros(b, T, dtype=torch.long, device="cuda")

    def around():
        lg = logits.index_fill(1, eos, float("-inf"))
        nxt = torch.multinomial(torch.softmax(lg, -1), 1)
        ids[:, 5] = nxt[:, 0]
        tok.copy_(nxt)

    res["sampling_ops_ms"] = _ms(around, 50)
    n = 64
    torch.cuda.synchronize()
    t = time.perf_counter()
    sample_static(model, b, n, 1)
    torch.cuda.synchronize()
    res[f"sample_static_{n}_tokens_ms_per_step"] = (time.perf_counter() - t) * 1e3 / (n - 1)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        sample_static(model, b, 9, 1)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    print(table)
    res["profile_top"] = table
    print(json.dumps({k: v for k, v in res.items() if k != "profile_top"}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
