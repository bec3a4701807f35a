"""End-to-end decode step of HF transformers models through the public path, with each row's byte floor.

What a user runs: an HF ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` built from a config (random bf16
weights: the latency does not depend on their values), ``spear.quantize_`` (RTN, group 128), ECs on a
share of the linears for the SPEAR rows, then ``torch.compile(step, backend=...)`` of one decode step
with HF's ``StaticCache`` (``max_cache_len`` ``--ctx``, decoding at position ``--pos``), the whole step
captured in one CUDA graph and timed by graph replays (median ms per step, ``dispatch.tuning.bench_graph``).

Models (``--hf``): ``llama2-7b`` (32 layers, hidden 4096, MLP 11008, 32 heads, 32 KV heads, vocab 32000)
and ``qwen2.5-7b`` (28 layers, hidden 3584, MLP 18944, 28 heads, 4 KV heads: grouped-query attention,
q/k/v biases, vocab 152064). Variants: ``bf16`` (Inductor), ``ours_w4`` (spear), ``ours_w4_head`` (the
output head in W4 too), ``spear_ec25`` (ECs r=64 gated on 25 % of the linears, every fourth: an EC in most
q/k/v and gate/up groups, as SPEAR's placements leave them), ``spear_ec25_nomixed`` (the same with
``fuse_shared_input_mixed`` off: plain linears do not fuse with EC ones), ``ours_w4_nogqa`` (the
GQA fold off: HF's repeated KV cache), ``ours_w4_nocatgemm`` (at batch > 1 q/k/v and gate/up as separate GEMMs,
not one over their concatenation).

The byte floor of a row: the bytes one step must read at least, over ``--tbps`` TB/s (default 4.17, the
H200's streaming read): every parameter the step reads (packed int4 weights with their scales and
zeros, EC factors, norms, the head; one embedding row per sequence) plus the K and V of the ``--pos``
positions attended, per sequence. ``x_floor`` = ms / floor.

    python benchmarks/e2e_decode.py --hf llama2-7b qwen2.5-7b --batch 1 8 16 64 --out $OUT

Writes ``OUT/e2e_hf.json`` (rows appended as they finish).
"""
from __future__ import annotations

import datetime
import json
import os
import time

import torch
from torch import nn

from _meta import git
from _syspath import unshadow

unshadow()  # before transformers is imported

import spear_compile as spear
from spear_compile import ECConfig, QuantConfig
from spear_compile.dispatch.tuning import bench_graph

MODELS = {
    "llama2-7b": ("LlamaConfig", "LlamaForCausalLM",
                  dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=32, vocab_size=32000)),
    "qwen2.5-7b": ("Qwen2Config", "Qwen2ForCausalLM",
                   dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                        num_key_value_heads=4, vocab_size=152064)),
}
VARIANTS = ("bf16", "ours_w4", "ours_w4_head", "spear_ec25", "spear_ec25_nomixed", "ours_w4_nogqa",
            "ours_w4_nocatgemm")


def build(name: str, variant: str, ctx: int):
    import transformers

    cfg_name, cls_name, shape = MODELS[name]
    cfg = getattr(transformers, cfg_name)(**shape, max_position_embeddings=max(ctx, 4096))
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = getattr(transformers, cls_name)(cfg).to(torch.bfloat16).eval()
    if variant == "bf16":
        return model, cfg, "inductor", {}
    flt = (lambda m, fqn: isinstance(m, nn.Linear)) if variant == "ours_w4_head" else None
    spear.quantize_(model, QuantConfig(group_size=128), filter_fn=flt, progress=False)
    if variant.startswith("spear_ec"):
        set_ec_share(model, int(variant[len("spear_ec"):].split("_")[0]))
    opts = ({"fold_gqa_attention": False} if variant.endswith("_nogqa")
            else {"fuse_shared_input_gemm": False} if variant.endswith("_nocatgemm")
            else {"fuse_shared_input_mixed": False} if variant.endswith("_nomixed") else {})
    return model, cfg, "spear", opts


def set_ec_share(model, percent: int, rank: int = 64) -> int:
    """Random gated ECs (rank ``rank``, gate 16) on ``percent`` % of the quantized linears, evenly spread."""
    lins = [(f, m) for f, m in spear.quantized_linears(model).items() if not f.endswith("lm_head")]
    n = round(len(lins) * percent / 100)
    g = torch.Generator().manual_seed(1)
    ecs = {}
    for fqn, mod in (lins[int(i * len(lins) / n)] for i in range(n)):
        ec = spear.ErrorCompensator(mod.in_features, mod.out_features, ECConfig(rank=rank, gate_hidden=16))
        with torch.no_grad():
            for p in ec.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        ecs[fqn] = ec.to("cuda", torch.bfloat16)
    spear.attach_(model, ecs)
    return n


def floor_bytes(model, cfg, batch: int, pos: int) -> int:
    """Parameter bytes one decode step reads (embedding: one row per sequence) plus the KV of ``pos``
    positions per sequence."""
    total = 0
    emb = model.get_input_embeddings().weight
    seen = {emb.data_ptr()}
    total += batch * emb.shape[1] * emb.element_size()
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() in seen or not t.is_floating_point() and t.dtype not in (torch.int32, torch.uint8, torch.int8):
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    heads_kv = cfg.num_key_value_heads
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    total += batch * 2 * cfg.num_hidden_layers * heads_kv * head_dim * pos * 2
    return total


def time_row(name: str, variant: str, batch: int, ctx: int, pos: int, tbps: float, reps: int = 30) -> dict:
    from transformers import StaticCache

    t0 = time.time()
    model, cfg, backend, opts = build(name, variant, ctx)
    cache = StaticCache(config=cfg, max_cache_len=ctx)
    ids = torch.randint(0, cfg.vocab_size, (batch, 1), device="cuda")
    cpos = torch.tensor([pos], device="cuda")

    def step(i, p):
        return model(input_ids=i, past_key_values=cache, cache_position=p, use_cache=True).logits

    compiled = torch.compile(step, backend=backend, dynamic=False, **({"options": opts} if opts else {}))
    with torch.no_grad():
        compiled(ids, cpos)  # compiles; the cache is allocated for this batch on its first update
        torch.cuda.synchronize()
        compile_s = time.time() - t0
        ms = bench_graph(lambda i: compiled(ids, cpos), copies=1, calls=1, replays=reps) / 1e3
        ok = bool(torch.isfinite(compiled(ids, cpos).float()).all())
    nbytes = floor_bytes(model, cfg, batch, pos)
    floor_ms = nbytes / (tbps * 1e12) * 1e3
    return {"model": name, "variant": variant, "batch": batch, "ms_per_step": ms, "floor_ms": floor_ms,
            "x_floor": ms / floor_ms, "bytes": nbytes, "build_compile_s": compile_s, "finite": ok}


def main_hf(args) -> None:
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": __import__("triton").__version__, "transformers": __import__("transformers").__version__,
           "date": datetime.date.today().isoformat(), "commit": git("rev-parse", "HEAD") or "unknown", "ctx": args.ctx, "pos": args.pos, "tbps": args.tbps,
           "path": "HF model from config, quantize_ g128, torch.compile(step, backend) with StaticCache, "
                   "one CUDA graph per step", "rows": []}
    path = os.path.join(args.out, "e2e_hf.json")
    variants = [v for v in args.variants if v in VARIANTS] or list(VARIANTS)
    for name in args.hf:
        if name not in MODELS:
            raise SystemExit(f"--hf {name!r}: expected one of {sorted(MODELS)}")
        for batch in args.batch:
            for v in variants:
                try:
                    row = time_row(name, v, batch, args.ctx, args.pos, args.tbps)
                except Exception as e:  # keep the other rows
                    row = {"model": name, "variant": v, "batch": batch, "error": f"{type(e).__name__}: {str(e)[:300]}"}
                torch._dynamo.reset()  # the row's model, cache and graphs are gone with time_row's frame
                torch.cuda.empty_cache()
                res["rows"].append(row)
                print(json.dumps(row), flush=True)
                with open(path, "w") as f:
                    json.dump(res, f, indent=1)
    for name in args.hf:
        for batch in args.batch:
            rows = {r["variant"]: r for r in res["rows"] if r["model"] == name and r["batch"] == batch
                    and "ms_per_step" in r}
            base = rows.get("bf16", {}).get("ms_per_step")
            for v, r in rows.items():
                rel = f"  /bf16 {r['ms_per_step'] / base:.2f}" if base else ""
                print(f"  {name} batch {batch:2d} {v:14s} {r['ms_per_step']:7.3f} ms  floor {r['floor_ms']:.3f} ms "
                      f"({r['x_floor']:.2f}x){rel}")
