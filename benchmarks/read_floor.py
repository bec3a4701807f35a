"""How fast can one kernel read N*K/2 bytes on this GPU? The floor for an M = 1 W4 GEMV of that shape.

The issue's M = 1 target (0.6x tinygemm) is stated against the copy bandwidth of 1 GiB buffers
(4.2-4.4 TB/s), where launch, ramp-up and the last wave are amortised. A decode GEMV reads 8-117 MB
in one launch, so its floor is the time of the fastest plain read of the same bytes under the same
harness (``tuning.bench_graph``: CUDA-graph replays, inputs rotated through > 3x the L2). Here,
per benchmark shape: torch's fp32 sum over a buffer of the weight's size (the reduction that reads
1 GiB at 4.36 TB/s), and a Triton streaming read (each program sums BLOCK int32 words with
16-byte loads and stores one value; several BLOCK sizes and warps), the best of which is the floor.

    python benchmarks/read_floor.py --out $OUT
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernels import G, SHAPES  # noqa: E402

from spear_compile.dispatch.tuning import bench_graph, copies_for, gpu_key  # noqa: E402


@triton.jit
def _stream_read(P, OUT, n, BLOCK: tl.constexpr, UNROLL: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.int32)
    for u in range(UNROLL):
        offs = (pid * UNROLL + u) * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(P + offs, mask=offs < n, other=0, eviction_policy="evict_first")
    tl.store(OUT + pid, tl.sum(acc, axis=0))


def stream_read(buf, out, block, unroll, warps):
    n = buf.numel()
    _stream_read[(triton.cdiv(n, block * unroll),)](buf, out, n, BLOCK=block, UNROLL=unroll, num_warps=warps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": datetime.date.today().isoformat(),
           "rows": []}
    for N, K in SHAPES:
        nbytes = N * K // 2 + N * (K // G) * 4  # packed weight + bf16 scales and zeros, as kernels.py counts
        copies = min(copies_for(nbytes), 12)
        bufs = [torch.randn(nbytes // 4, device="cuda") for _ in range(copies)]
        us = bench_graph(lambda i: bufs[i].sum(), copies)
        row = {"N": N, "K": K, "bytes": nbytes, "sum_us": us, "TBps": nbytes / us / 1e6, "stream_us": {}}
        words = [b.view(torch.int32) for b in bufs]
        out = torch.empty(nbytes // 512 + 1, dtype=torch.int32, device="cuda")
        for block, unroll, warps in ((1024, 1, 4), (2048, 1, 8), (4096, 1, 8), (2048, 2, 8), (1024, 4, 4), (4096, 2, 8)):
            t = bench_graph(lambda i: stream_read(words[i], out, block, unroll, warps), copies)
            row["stream_us"][f"{block}_{unroll}_{warps}"] = t
        best = min(row["stream_us"].values())
        row["floor_us"] = min(best, us)
        res["rows"].append(row)
        print(f"{N}x{K}: {nbytes / 1e6:.1f} MB: torch sum {us:.1f} us ({row['TBps']:.2f} TB/s), best stream read "
              f"{best:.1f} us ({nbytes / best / 1e6:.2f} TB/s); all {row['stream_us']}", flush=True)
        del bufs
    with open(os.path.join(args.out, f"read_floor_{gpu_key()}.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
