"""The engine's varlen attention with and without the split-KV decode kernel, on steps a server runs.

For each step (decodes at given contexts, optionally a prefill piece after them; Llama-2-7B's 32 heads of 128,
and a GQA case of 32 query / 8 KV heads), as the engine hands it to the attention under CUDA graphs (padded:
``make_step``) and unpadded, one run:

* checks ``runtime.attention.decodes_split`` (the engine's path on CUDA under ``SPEAR_SPLIT_KV=1``) and
  torch's varlen kernel alone against ``varlen_reference`` (max abs error over the sequences' rows);
* times, as CUDA-graph replays of one layer's attention (``dispatch.tuning.bench_graph``): ``torch_varlen``
  (torch's kernel for every sequence: the path without the split), ``split`` (the engine's path: ``route_rows``
  decides on the device, a step of decodes only to the split-KV kernel, a step with a prefill piece to torch's
  kernel whole; the launches one after the other), ``split_overlap`` (the split's first launch on a side
  stream beside torch's kernel: ``decodes_split(overlap=True)``) and ``floor_us``, the byte floor: K and V of
  every sequence read once at ``--bandwidth`` TB/s (default 4.8, the H200's HBM3e); on a torch whose kernel
  takes no ``enable_gqa`` (2.11), the GQA rows also time ``torch_grouped`` (``_torch_varlen(gqa="grouped")``:
  one call per position in the head group on K and V as they are, instead of repeating them). Expected of it: decode-heavy GQA steps
  near the 32 / 32 rows' time (64 decodes at 1k: about 500 us against 1553 with the repeat), prefill pieces
  about unchanged.

Measured (H100, ``benchmarks/results/decode_attention/2026-12-07_h100_overlap``), when the split took every step's
decodes and torch's kernel the rest: decode-only steps 0.16-0.53x torch's time at 1-2 sequences, but steps with a
prefill piece 1.02-1.69x, overlapped or not (the piece's kernel fills the SMs; torch's one launch runs the
decodes in its idle tail). Routed by step (``2026-12-07_h100_routed``): steps with a prefill piece 1.04-1.19x
serial (the split's launches over empty sequences and ``route_rows``), up to 1.69x overlapped; decode-only
steps as before.

    python benchmarks/decode_attention.py --out OUT
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import time

import torch

try:
    from _syspath import unshadow
except ImportError:  # run as a module from the repository root
    from benchmarks._syspath import unshadow
unshadow()

from spear_compile.dispatch.tuning import bench_graph  # noqa: E402
from spear_compile.runtime import attention as A  # noqa: E402

from benchmarks._meta import run_meta  # noqa: E402

# (label, decode contexts, prefill piece (tokens, prefilled) or None)
STEPS = [
    ("1 decode @512", [512], None),
    ("1 decode @2k", [2048], None),
    ("1 decode @4k", [4096], None),
    ("2 decodes @3k", [3000, 3000], None),
    ("5 decodes @1.4k", [1400] * 5, None),
    ("16 decodes @1k", [1024] * 16, None),
    ("64 decodes @1k", [1024] * 64, None),
    ("4 decodes @1k + 512 piece @1k", [1024] * 4, (512, 1024)),
    ("1 decode @2k + 2048 piece @0", [2048], (2048, 0)),
    ("1 decode @4k + 32 piece @0", [4096], (32, 0)),
]


def make_step(decodes, piece, H, Hkv, D, device, dtype, padded: bool, seed=0):
    """The step's packed inputs. ``padded``: as transformers 5.17 hands them to the attention under CUDA graphs
    (tokens padded to a multiple of 64, as many sequences as padded tokens up to 64 with the extra ones empty,
    ``max_q`` the padded token count, ``max_k`` a power of two of at least 1024)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    q_lens = [1] * len(decodes) + ([piece[0]] if piece else [])
    k_lens = list(decodes) + ([piece[0] + piece[1]] if piece else [])
    Tq, Tk = sum(q_lens), sum(k_lens)
    max_q, max_k = max(q_lens), max(k_lens)
    if padded:
        Tq = -(-Tq // 64) * 64
        n = max(len(q_lens), min(Tq, 64))
        q_lens, k_lens = q_lens + [0] * (n - len(q_lens)), k_lens + [0] * (n - len(k_lens))
        max_q, max_k = Tq, max(1024, 1 << (max_k - 1).bit_length())
    q = torch.randn(Tq, H, D, generator=g).to(device, dtype)
    k = torch.randn(Tk, Hkv, D, generator=g).to(device, dtype)
    v = torch.randn(Tk, Hkv, D, generator=g).to(device, dtype)
    cu = lambda ls: torch.tensor([0] + torch.tensor(ls).cumsum(0).tolist(), dtype=torch.int32, device=device)
    return q, k, v, cu(q_lens), cu(k_lens), max_q, max_k


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--bandwidth", type=float, default=4.8, help="TB/s for the byte floor")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("decode_attention.py needs a CUDA GPU")
    got = A._kernel()
    if got is None:
        raise SystemExit("this torch has no torch.nn.attention.varlen.varlen_attn")
    dev, dtype, D = torch.device("cuda"), torch.bfloat16, 128
    rows, t0 = [], time.time()
    for (H, Hkv), padded in ((h, p) for h in ((32, 32), (32, 8)) for p in (True, False)):
        for label, decodes, piece in STEPS:
            q, k, v, cu_q, cu_k, mq, mk = make_step(decodes, piece, H, Hkv, D, dev, dtype, padded)
            scale = D ** -0.5
            torch_only = functools.partial(A._torch_varlen, got)
            old = torch_only(q, k, v, cu_q, cu_k, mq, mk, scale)
            new = A.decodes_split(torch_only, q, k, v, cu_q, cu_k, mq, mk, scale)  # SPEAR_SPLIT_KV=1's path
            ovl = A.decodes_split(torch_only, q, k, v, cu_q, cu_k, mq, mk, scale, overlap=True)
            ref = A.varlen_reference(q.float(), k.float(), v.float(), cu_q, cu_k, scale)
            n = int(cu_q[-1])
            err = lambda out: (out[:n].float() - ref[:n]).abs().max().item()  # noqa: E731 (over the sequences' rows)
            err_new, err_old, err_ovl = err(new), err(old), err(ovl)
            t_old = bench_graph(lambda i: torch_only(q, k, v, cu_q, cu_k, mq, mk, scale), calls=20)
            t_new = bench_graph(lambda i: A.decodes_split(torch_only, q, k, v, cu_q, cu_k, mq, mk, scale), calls=20)
            t_ovl = bench_graph(lambda i: A.decodes_split(torch_only, q, k, v, cu_q, cu_k, mq, mk, scale,
                                                          overlap=True), calls=20)
            if Hkv != H and "enable_gqa" not in got[1]:  # torch 2.11: K / V repeated, or one call per group position
                grouped = functools.partial(A._torch_varlen, got, gqa="grouped")
                out_g = grouped(q, k, v, cu_q, cu_k, mq, mk, scale)
                t_g = bench_graph(lambda i: grouped(q, k, v, cu_q, cu_k, mq, mk, scale), calls=20)
                row_g = {"torch_grouped_us": t_g, "torch_grouped_over_torch": t_g / t_old,
                         "max_abs_err_torch_grouped": err(out_g)}
            else:
                row_g = {}
            kv_bytes = 2 * cu_k[-1].item() * Hkv * D * 2
            row = {"step": label, "H": H, "Hkv": Hkv, "D": D, "engine_padding": padded, "torch_varlen_us": t_old,
                   "split_us": t_new, "split_over_torch": t_new / t_old,
                   "split_overlap_us": t_ovl, "split_overlap_over_torch": t_ovl / t_old,
                   "floor_us": kv_bytes / (args.bandwidth * 1e12) * 1e6,
                   "max_abs_err_split": err_new, "max_abs_err_split_overlap": err_ovl, "max_abs_err_torch": err_old,
                   **row_g}
            rows.append(row)
            print({k_: (round(v_, 4) if isinstance(v_, float) else v_) for k_, v_ in row.items()}, flush=True)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "decode_attention.json")
    args.device = "cuda"
    meta = run_meta(args, {}, tail={"seconds": time.time() - t0, "varlen_params": sorted(got[1])})
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
