"""Tensor-parallel decode latency of Llama-shaped linears: bf16 + NCCL, W4 + NCCL, SPEAR with EC + NCCL
all-reduce + gate, and SPEAR peer-write (``spear::ec_linear_peer_reduce``, no collective on the path).

What it needs: 2 or 4 GPUs of one host with P2P access between them (NVLink or PCIe P2P;
``torch.distributed._symmetric_memory`` must rendezvous), NCCL, Triton; about 16 GB per GPU for the
13B-shaped bf16 rows at world size 2. NVLink multicast stays off: the script sets ``NCCL_NVLS_ENABLE=0`` and
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` before it initialises anything (and refuses other values).

Launch (one process per GPU):

    torchrun --standalone --nproc-per-node 2 benchmarks/tp_decode.py --out benchmarks/results/tp_decode
    torchrun --standalone --nproc-per-node 4 benchmarks/tp_decode.py --out benchmarks/results/tp_decode
    torchrun --standalone --nproc-per-node 2 benchmarks/tp_decode.py --device cpu --models tiny   # CPU smoke (gloo)

A step is every decoder layer's linears at M = 1 (``--batch`` rows): q/k/v and gate/up column-parallel
(``N / W`` rows each), o and down row-parallel (``K / W`` columns) each followed by its reduction, and
``silu(gate) * up`` between; attention and the LM head are left out (the same work for every provider; the
comparison is of the linears and their communication). Weights are random with the real shapes
(``--models 7b 13b``: Llama-2-7B, hidden 4096, MLP 11008, 32 layers; Llama-2-13B, 5120, 13824, 40 layers),
int4 with group ``--group-size`` (64 divides every shard at W = 2 and 4). Providers:

  bf16_nccl       F.linear (bf16), torch.distributed.all_reduce (NCCL) after o and down
  w4_nccl         spear::w4a16_linear, NCCL all-reduce of y
  spear_ec_nccl   the row-parallel linears with an EC (rank ``--rank``, gate ``--gate``): W4 GEMV for y_i,
                  A_i x_i, NCCL all-reduce of the stacked [y | A x], then the gate and B (g * h) - the plain fix
  spear_peer      the same layers as spear::ec_linear_peer_reduce: GEMV epilogue stores to the peers'
                  staging buffers, post kernel sums, gates and adds B (g * h); no NCCL call

Each provider's whole step is captured in one CUDA graph (on CUDA) and replayed; the result is the median
over ``--reps`` replays of rank 0's time, after a barrier. Rank 0 writes ``tp_decode_<date>_w<W>.json``
under ``--out`` (rows with ``world_size``, the model, the provider, ms per step and the ratio to w4_nccl;
the GPU, versions, date and commit) and prints a table. Targets: spear_peer <= 1.05 x w4_nccl and faster
than spear_ec_nccl.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _meta import run_meta  # noqa: E402

MODELS = {"7b": dict(hidden=4096, inter=11008, layers=32), "13b": dict(hidden=5120, inter=13824, layers=40),
          "tiny": dict(hidden=256, inter=512, layers=2)}
PROVIDERS = ("bf16_nccl", "w4_nccl", "spear_ec_nccl", "spear_peer")


def _w4(N, K, G, dtype, dev, gen):
    q = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=gen).to(dev)
    s = (torch.rand(N, K // G, generator=gen) * 0.01 + 0.001).to(dev, dtype)
    return q, s, torch.full((N, K // G), 8.0, dtype=dtype, device=dev)


def _ec(N, K, r, d, dtype, dev, gen):
    t = lambda *shape, scale=0.05: (torch.randn(*shape, generator=gen) * scale).to(dev, dtype)  # noqa: E731
    return (t(r, K), t(N, r), t(d, r), t(d), t(r, d), t(r), torch.tensor(1.0, device=dev))


class Layer:
    """One decoder layer's sharded linears (this rank's shards) for every provider."""

    def __init__(self, hidden, inter, W, G, r, d, dtype, dev, seed):
        gen = torch.Generator().manual_seed(seed)
        self.shapes = {"qkv": (3 * hidden // W, hidden), "o": (hidden, hidden // W),
                       "gate_up": (2 * inter // W, hidden), "down": (hidden, inter // W)}
        self.G, self.dtype = G, dtype
        self.w4 = {k: _w4(N, K, G, dtype, dev, gen) for k, (N, K) in self.shapes.items()}
        self.ec = {k: _ec(*self.shapes[k], r, d, dtype, dev, gen) for k in ("o", "down")}
        self.bf16 = {k: (torch.randn(N, K, generator=gen) * 0.02).to(dev, dtype) for k, (N, K) in self.shapes.items()}


def _reduce(t, group):
    dist.all_reduce(t, group=group)
    return t


def step_fn(provider: str, layers: list, x: torch.Tensor, group, group_name: str):
    """The decode step of ``provider`` on ``x [M, hidden]``: a closure returning the last layer's output."""
    ops = torch.ops.spear

    def lin(L, k, h):
        q, s, z = L.w4[k]
        return ops.w4a16_linear(h, q, s, z, L.G, None)

    def row(L, k, h):
        if provider == "bf16_nccl":
            return _reduce(F.linear(h, L.bf16[k]), group)
        if provider == "w4_nccl":
            return _reduce(lin(L, k, h), group)
        q, s, z = L.w4[k]
        A, B, W1, b1, W2, b2, alpha = L.ec[k]
        if provider == "spear_ec_nccl":
            yh = torch.cat([lin(L, k, h).float(), h.float() @ A.float().t()], dim=-1)
            yh = _reduce(yh, group)
            N = B.shape[0]
            y, hh = yh[:, :N], yh[:, N:]
            g = torch.sigmoid(F.silu(hh @ W1.float().t() + b1.float()) @ W2.float().t() + b2.float())
            return (y + alpha * ((g * hh) @ B.float().t())).to(h.dtype)
        return ops.ec_linear_peer_reduce(h, q, s, z, L.G, None, A, B, W1, b1, W2, b2, alpha, "silu", "spear",
                                         group_name)

    def col(L, k, h):
        return F.linear(h, L.bf16[k]) if provider == "bf16_nccl" else lin(L, k, h)

    def run():
        h = x
        for L in layers:
            qkv = col(L, "qkv", h)
            a = qkv[:, :L.shapes["o"][1]].contiguous()  # attention left out: its q slice stands in for its output
            h = h + row(L, "o", a)
            gu = col(L, "gate_up", h)
            g, u = gu.chunk(2, dim=-1)
            h = h + row(L, "down", (F.silu(g) * u).contiguous())
        return h

    return run


def bench(fn, reps: int, device: str, group) -> float:
    """Median ms per call of ``fn`` (a CUDA graph of it on CUDA), every rank in step."""
    for _ in range(3):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        g.replay()
        torch.cuda.synchronize()
        fn = g.replay
    times = []
    for _ in range(reps):
        dist.barrier(group=group)
        if device == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def meta(args, W: int) -> dict:
    """The record's meta block (``benchmarks/_meta.py``), with the world size, Triton's version and the
    NVLink multicast / peer-write environment."""
    import triton

    env = {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "SPEAR_NO_PEER_WRITE")}
    return run_meta(args, {"triton": triton.__version__, "spear_compile": args.version}, head={"world_size": W},
                    tail={"env": env})


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--models", nargs="+", default=["7b", "13b"], choices=sorted(MODELS))
    ap.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=PROVIDERS)
    ap.add_argument("--batch", type=int, default=1, help="rows M of the decode step (<= 16 for spear_peer's kernels)")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--rank", type=int, default=64, help="EC rank of the row-parallel linears")
    ap.add_argument("--gate", type=int, default=16, help="EC gate width")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    for var, want in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")):
        if os.environ[var] != want:
            raise SystemExit(f"tp_decode: {var}={os.environ[var]!r}; NVLink multicast must stay off ({var}={want})")
    import spear_compile as spear  # the spear ops and their CUDA implementations


    args.version = spear.__version__
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", timeout=datetime.timedelta(seconds=300))
    group, rank, W = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local) if args.device == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16
    rows = []
    for name in args.models:
        shape = MODELS[name]
        for k in (shape["hidden"], shape["inter"]):
            if k % W or (k // W) % args.group_size:
                raise SystemExit(f"tp_decode: {name}: {k} / {W} is not a multiple of group {args.group_size}")
        layers = [Layer(shape["hidden"], shape["inter"], W, args.group_size, args.rank, args.gate, dtype, dev, i)
                  for i in range(shape["layers"])]
        x = torch.randn(args.batch, shape["hidden"], generator=torch.Generator().manual_seed(0)).to(dev, dtype)
        res, check = {}, {}
        if {"spear_ec_nccl", "spear_peer"} <= set(args.providers):  # the two EC paths compute one function
            outs = [step_fn(p, layers, x, group, group.group_name)().float() for p in ("spear_ec_nccl", "spear_peer")]
            check = {"peer_vs_nccl_max_abs": (outs[0] - outs[1]).abs().max().item(),
                     "scale": outs[0].abs().max().item()}
            if rank == 0:
                print(json.dumps({"model": name, **check}), flush=True)
        for p in args.providers:
            res[p] = bench(step_fn(p, layers, x, group, group.group_name), args.reps, args.device, group)
            if rank == 0:
                print(json.dumps({"model": name, "provider": p, "world_size": W, "ms": round(res[p], 4)}), flush=True)
        base = res.get("w4_nccl")
        rows += [{"model": name, "provider": p, "world_size": W, "batch": args.batch, "ms_per_step": round(t, 4),
                  "vs_w4_nccl": round(t / base, 3) if base else None, **(check if p == "spear_peer" else {})}
                 for p, t in res.items()]
        del layers
    if rank == 0:
        print(f"\n{'model':6} {'provider':14} {'W':>2} {'ms/step':>9} {'x w4_nccl':>9}")
        for r in rows:
            print(f"{r['model']:6} {r['provider']:14} {r['world_size']:>2} {r['ms_per_step']:>9.3f} "
                  f"{r['vs_w4_nccl'] if r['vs_w4_nccl'] is not None else '':>9}")
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            path = os.path.join(args.out, f"tp_decode_{datetime.date.today().isoformat()}_w{W}.json")
            with open(path, "w") as f:
                json.dump({"meta": meta(args, W), "rows": rows}, f, indent=1)
            print(f"wrote {path}")
    dist.barrier(group=group)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
