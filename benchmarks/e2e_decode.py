"""End-to-end decode latency of a Llama-2-7B-shaped model (random weights), one run.

32 layers, hidden 4096, MLP 11008, 32 heads, vocab 32000, KV cache of 1024 positions
(decoding at position 512; no rotary embedding: identical work in every variant).
Each variant's decoder layer is compiled with torch.compile (layers share one compiled
graph per structure), the whole decode step (embedding, 32 layers, head) is captured in
one CUDA graph, and we time graph replays (median ms/token, ``dispatch.tuning.bench_graph``):

  bf16              nn.Linear, Inductor
  int4_tinygemm     aten._weight_int4pack_mm (group 128), Inductor   (torchao / gpt-fast way)
  ours_w4           QuantLinear (group 128) through backend="spear"
  spear_ec{10,25,100}  + ECs (r=64, d=16, gated) on 10 / 25 / 100 % of linears, backend="spear"
  unfused_ec{25}    tinygemm + the same ECs as plain PyTorch ops, Inductor
  ours_w4_fused, spear_ec25_fused   ours_w4 / spear_ec25 with CompileConfig(fuse_shared_input=True):
                    at M = 1, q/k/v and gate/up (those without an EC) as one GEMV each
  ours_w4_nocat, spear_ec25_nocat   the same with fuse_shared_input=False
  ours_w4_nocatgemm  ours_w4 with fuse_shared_input_gemm=False: at batch > 1 q/k/v and gate/up as separate
                    GEMMs, not one over their concatenation
  spear_ec25_ecfused  spear_ec25 with CompileConfig(fuse_shared_input_ec=True): q/k/v and gate/up
                    *with* ECs as one GEMV + one block-diagonal EC each (the default since 2026-11-30)
  spear_ec25_ecsep  spear_ec25 with fuse_shared_input_ec=False: EC linears keep one GEMV + EC each
  *_noglu, *_nofold, *_nonorm, *_nofusions   without fuse_glu (silu(gate) * up in the gate / up GEMV's
                    epilogue), fold_residual_add (the residual add as the GEMV's bias), fuse_rmsnorm (the
                    RMSNorm in the GEMV's x staging), or all three
                    (plain ours_w4 / spear_ec* take the library default, which is True since
                    2026-11-30; the 2026-11-29 and earlier JSONs' plain rows are unfused)

    python benchmarks/e2e_decode.py --out $OUT [--batch 1 16] [--variants ...]

HF-model mode (``--hf llama2-7b qwen2.5-7b``): HF ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` from a config
through the public path, each row with its byte floor (``benchmarks/e2e_hf.py``).
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import spear_compile as spear
from spear_compile import ECConfig, QuantConfig
from spear_compile.compensators.init import random_ecs
from spear_compile.dispatch.tuning import bench_graph
from spear_compile.quant import QuantLinear, unpack_int4

D, H, FF, L, V, CTX, POS, G = 4096, 32, 11008, 32, 32000, 1024, 512, 128
DT = torch.bfloat16
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class RMSNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(D, dtype=DT))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype) * self.weight


class Layer(nn.Module):
    def __init__(self, batch):
        super().__init__()
        self.n1, self.n2 = RMSNorm(), RMSNorm()
        for name in LINEARS[:4]:
            setattr(self, name, nn.Linear(D, D, bias=False, dtype=DT))
        self.gate_proj, self.up_proj = nn.Linear(D, FF, bias=False, dtype=DT), nn.Linear(D, FF, bias=False, dtype=DT)
        self.down_proj = nn.Linear(FF, D, bias=False, dtype=DT)
        self.register_buffer("k_cache", torch.randn(batch, H, CTX, D // H, dtype=DT) * 0.1)
        self.register_buffer("v_cache", torch.randn(batch, H, CTX, D // H, dtype=DT) * 0.1)

    def forward(self, x, pos, mask):
        B = x.shape[0]
        h = self.n1(x)
        q = self.q_proj(h).view(B, 1, H, D // H).transpose(1, 2)
        k = self.k_proj(h).view(B, 1, H, D // H).transpose(1, 2)
        v = self.v_proj(h).view(B, 1, H, D // H).transpose(1, 2)
        self.k_cache.index_copy_(2, pos, k)
        self.v_cache.index_copy_(2, pos, v)
        a = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask)
        x = x + self.o_proj(a.transpose(1, 2).reshape(B, 1, D))
        h = self.n2(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Model(nn.Module):
    def __init__(self, batch):
        super().__init__()
        self.embed = nn.Embedding(V, D, dtype=DT)
        self.layers = nn.ModuleList(Layer(batch) for _ in range(L))
        self.norm = RMSNorm()
        self.lm_head = nn.Linear(D, V, bias=False, dtype=DT)

    def forward(self, ids, pos):
        mask = (torch.arange(CTX, device=ids.device) <= pos)[None, None, None, :]
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, pos, mask)
        return self.lm_head(self.norm(x))


class TinyGemmLinear(nn.Module):
    """torchao / gpt-fast int4 linear; optional eager EC (the 'unfused' baseline)."""

    def __init__(self, q: QuantLinear, ec=None):
        super().__init__()
        qi = unpack_int4(q.qweight).to(torch.int32)
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack(
            ((qi[:, ::2] << 4) | qi[:, 1::2]).to(torch.uint8), 8))
        s = q.scales.float()
        self.register_buffer("sz", torch.stack([s.t(), ((8 - q.zeros.float()) * s).t()], -1).contiguous().to(DT))
        self.out_features = q.out_features
        self.ec = ec

    def forward(self, x):
        x2 = x.reshape(-1, x.shape[-1])
        y = torch.ops.aten._weight_int4pack_mm(x2, self.packed, G, self.sz)
        if self.ec is not None:
            e = self.ec
            h = x2 @ e.A.t()
            g = torch.sigmoid(F.silu(h @ e.W1.t() + e.b1) @ e.W2.t() + e.b2)
            y = y + e.alpha * ((g * h) @ e.B.t())
        return y.reshape(*x.shape[:-1], self.out_features)


# variant name suffix -> CompileConfig options of that A/B variant (the plain name takes the defaults)
OPTION_SUFFIXES = {
    "fused": {"fuse_shared_input": True}, "nocat": {"fuse_shared_input": False},
    "ecfused": {"fuse_shared_input_ec": True}, "ecsep": {"fuse_shared_input_ec": False},
    "nocatgemm": {"fuse_shared_input_gemm": False},  # batch > 1: q/k/v and gate/up as separate GEMMs
    "noglu": {"fuse_glu": False}, "nofold": {"fold_residual_add": False}, "nonorm": {"fuse_rmsnorm": False},
    "nofusions": {"fuse_glu": False, "fold_residual_add": False, "fuse_rmsnorm": False},  # none of the three
}


def ec_fraction(variant: str) -> float:
    """Fraction of layers with ECs: spear_ec25_* / unfused_ec25 -> 0.25; ours_w4*, bf16, tinygemm -> 0."""
    head = variant.split("_")
    if head[0] in ("spear", "unfused") and len(head) > 1 and head[1].startswith("ec"):
        return int(head[1][2:]) / 100
    return 0.0


def ec_names(model, frac):
    n_layers = round(L * frac)
    return [f"layers.{i}.{n}" for i in range(n_layers) for n in LINEARS]


def build(variant, batch, base_state):
    torch.manual_seed(0)
    with torch.device("cuda"):
        m = Model(batch)
    m.load_state_dict(base_state, strict=False)
    m.eval()
    if variant == "bf16":
        return m, "inductor"
    spear.quantize_(m, QuantConfig(group_size=G), progress=False)
    frac = ec_fraction(variant)
    ecs = {}
    if frac:
        all_ecs = random_ecs(m, ECConfig(rank=64, gate_hidden=16), seed=1)
        ecs = {k: all_ecs[k].to("cuda", DT) for k in ec_names(m, frac)}
    if variant.startswith("spear") or variant.startswith("ours_w4"):
        spear.attach_(m, ecs)
        return m, "spear"
    for fqn, q in list(spear.quantized_linears(m).items()):  # tinygemm variants
        parent, _, child = fqn.rpartition(".")
        setattr(m.get_submodule(parent), child, TinyGemmLinear(q, ecs.get(fqn)))
    return m, "inductor"


FIRST_OUT: dict = {}  # (backend, EC fraction, batch) -> (variant, logits) of the first variant of that model


def digest(t: torch.Tensor) -> str:
    """A hash of a tensor's bytes (bitwise comparisons of outputs; numpy has no bf16, so as uint8)."""
    return hashlib.sha1(t.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def distinct_reruns(model, ids, pos, n: int) -> int:
    """How many bitwise-distinct logits ``n`` eager calls of the compiled step give on the same inputs (1: the
    step is run-to-run deterministic)."""
    return len({digest(model(ids, pos)) for _ in range(n)})


def time_variant(variant, batch, base_state, reps=50, reruns=0):
    model, backend = build(variant, batch, base_state)
    n_ec = sum(1 for mod in model.modules() if getattr(mod, "ec", None) is not None)
    opts = {"options": OPTION_SUFFIXES[variant.rsplit("_", 1)[-1]]} if variant.rsplit("_", 1)[-1] in OPTION_SUFFIXES else {}
    for layer in model.layers:  # one compiled graph per layer structure, shared by the 32 layers
        layer.forward = torch.compile(layer.forward, backend=backend, dynamic=False, **opts)
    ids = torch.randint(0, V, (batch, 1), device="cuda")
    pos = torch.tensor([POS], device="cuda")
    with torch.no_grad():
        t = time.time()
        model(ids, pos)  # compiles (and makes the GEMV weight layout, outside the graph)
        torch.cuda.synchronize()
        compile_s = time.time() - t
        # the whole decode step captured in one CUDA graph, median replay time (tuning.bench_graph)
        ms = bench_graph(lambda i: model(ids, pos), copies=1, calls=1, replays=reps) / 1e3
        out = model(ids, pos)
        rerun_equal = bool(torch.equal(out, model(ids, pos)))  # run-to-run determinism of one compilation
        n_distinct = distinct_reruns(model, ids, pos, reruns) if reruns else None
    ok = bool(torch.isfinite(out.float()).all())
    # the same weights (and ECs) under other compile options must give the same logits: A/B variants
    # are compared with the first variant of their model (e.g. ours_w4_nofusions with ours_w4)
    same = (backend, ec_fraction(variant), batch)
    first = FIRST_OUT.setdefault(same, (variant, out.float().cpu()))
    rel = ((out.float().cpu() - first[1]).norm() / first[1].norm()).item()
    del model
    torch.cuda.empty_cache()
    torch._dynamo.reset()
    return {"variant": variant, "batch": batch, "ms_per_token": ms, "ec_linears": n_ec,
            "logits_rel_diff": {"vs": first[0], "value": rel}, "rerun_bitwise_equal": rerun_equal,
            **({"distinct_logits_of_reruns": [n_distinct, reruns]} if reruns else {}),
            "compile_and_warmup_s": compile_s, "finite": ok}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--variants", nargs="+", default=None,
                    help="default: bf16 int4_tinygemm ours_w4 spear_ec10 spear_ec25 spear_ec100 unfused_ec25 "
                         "ours_w4_nocat spear_ec25_nocat; with --hf: those of benchmarks/e2e_hf.py")
    ap.add_argument("--hf", nargs="+", default=None, metavar="MODEL",
                    help="HF-model mode (benchmarks/e2e_hf.py): llama2-7b and / or qwen2.5-7b through the public path")
    ap.add_argument("--ctx", type=int, default=1024, help="--hf: StaticCache length")
    ap.add_argument("--pos", type=int, default=512, help="--hf: the decode position (context attended)")
    ap.add_argument("--tbps", type=float, default=4.17, help="--hf: the byte floor's bandwidth, TB/s")
    ap.add_argument("--reruns", type=int, default=0,
                    help="also count the distinct logits of this many eager reruns of each compiled step")
    args = ap.parse_args()
    if args.reruns < 0:
        ap.error(f"--reruns {args.reruns}: must be >= 0")
    if args.hf:
        from e2e_hf import main_hf

        args.variants = args.variants or []
        return main_hf(args)
    args.variants = args.variants or ["bf16", "int4_tinygemm", "ours_w4", "spear_ec10", "spear_ec25", "spear_ec100",
                                      "unfused_ec25", "ours_w4_nocat", "spear_ec25_nocat"]
    torch.manual_seed(0)
    with torch.device("cuda"):
        ref = Model(1)
    base_state = {k: v for k, v in ref.state_dict().items() if "cache" not in k}
    del ref
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": __import__("triton").__version__,
           "date": datetime.date.today().isoformat(), "model": "Llama-2-7B-shaped, random weights, ctx 1024 @ pos 512",
           "ec": "r=64, d=16, gated, bf16", "rows": []}
    path = os.path.join(args.out, "e2e_decode.json")
    for batch in args.batch:
        for v in args.variants:
            try:
                row = time_variant(v, batch, base_state, reruns=args.reruns)
            except Exception as e:  # keep the other variants' numbers
                row = {"variant": v, "batch": batch, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
            with open(path, "w") as f:
                json.dump(res, f, indent=1)
    print(f"\n{res['gpu']}  ms/token (CUDA graph replay)")
    for batch in args.batch:
        rows = {r["variant"]: r for r in res["rows"] if r["batch"] == batch and "ms_per_token" in r}
        base = rows.get("bf16", {}).get("ms_per_token")
        w4 = rows.get("ours_w4", {}).get("ms_per_token")
        for v, r in rows.items():
            extra = f"  /bf16 {r['ms_per_token'] / base:.2f}" if base else ""
            extra += f"  /ours_w4 {r['ms_per_token'] / w4:.2f}" if w4 else ""
            d = r.get("logits_rel_diff", {})
            extra += f"  logits vs {d['vs']}: {d['value']:.1e}" if d.get("vs") not in (None, v) else ""
            print(f"  batch {batch:2d} {v:14s} {r['ms_per_token']:7.3f} ms{extra}")


if __name__ == "__main__":
    main()
