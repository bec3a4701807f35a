"""Test helpers: a generator of small Llama-like models, foreign quantized modules in the
three source forms the compiler adopts, and graph capture for pass tests."""
from __future__ import annotations

import collections

import torch
import torch.nn as nn
import torch.nn.functional as F

import spear_compile as spear
from spear_compile import QuantConfig
from spear_compile.inspect import capture
from spear_compile.quant import pack_int4, quantize_rtn


class RMSNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w


class Block(nn.Module):
    """Pre-norm attention (causal, no rotary) + SwiGLU MLP: the linears a Llama layer has."""

    def __init__(self, d: int, heads: int, ff: int) -> None:
        super().__init__()
        self.h = heads
        self.n1, self.n2 = RMSNorm(d), RMSNorm(d)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.gate_proj, self.up_proj = nn.Linear(d, ff, bias=False), nn.Linear(d, ff, bias=False)
        self.down_proj = nn.Linear(ff, d, bias=False)

    def forward(self, x):
        B, T, D = x.shape
        h = self.n1(x)
        q, k, v = (p(h).view(B, T, self.h, D // self.h).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, D)
        x = x + self.o_proj(a)
        h = self.n2(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class LlamaLike(nn.Module):
    def __init__(self, d: int = 64, layers: int = 1, heads: int = 2, ff: int = 128, seed: int = 0) -> None:
        super().__init__()
        g = torch.random.fork_rng()
        with g:
            torch.manual_seed(seed)
            self.layers = nn.ModuleList(Block(d, heads, ff) for _ in range(layers))
            self.norm = RMSNorm(d)
            self.lm_head = nn.Linear(d, 32, bias=False)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


class DequantLinear(nn.Module):
    """HF-style foreign module: integer weight, ``(q - z) * s`` then ``F.linear``."""

    def __init__(self, N: int, K: int, group_size=None, bias: bool = True, zero: str = "tensor",
                 qdtype=torch.uint8, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        G = group_size or K
        self.G = group_size
        self.zero_kind = zero
        self.register_buffer("q", torch.randint(0, 16, (N, K), generator=gen).to(qdtype))
        shape = (N, K // G, 1) if group_size else (N, 1)
        self.register_buffer("s", torch.rand(shape, generator=gen) * 0.02 + 0.005)
        self.register_buffer("z", torch.randint(5, 11, shape, generator=gen).float())
        self.register_buffer("bias", torch.randn(N, generator=gen) if bias else None)

    def forward(self, x):
        q = self.q.view(self.q.shape[0], -1, self.G) if self.G else self.q
        w = q.to(x.dtype)
        if self.zero_kind == "tensor":
            w = w - self.z.to(x.dtype)
        elif self.zero_kind == "scalar":
            w = w - 8
        w = (w * self.s.to(x.dtype)).reshape(self.q.shape[0], -1)
        return F.linear(x, w, self.bias)


class Int4PackLinear(nn.Module):
    """torchao / gpt-fast style int4: ``aten._weight_int4pack_mm_for_cpu``."""

    def __init__(self, N: int, K: int, group_size: int = 32, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        w = torch.randint(0, 16, (N, K), generator=gen, dtype=torch.int32)
        self.G = group_size
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(w, 2))
        sz = torch.empty(K // group_size, N, 2)
        sz[..., 0] = torch.rand(K // group_size, N, generator=gen) * 0.02 + 0.005
        sz[..., 1] = torch.randn(K // group_size, N, generator=gen) * 0.01
        self.register_buffer("sz", sz)

    def forward(self, x):
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.G, self.sz)


def spear_ops_after(report) -> collections.Counter:
    """Counts of spear ops in the final graphs of a capture report."""
    c = collections.Counter()
    for g in report.graphs:
        for k, v in g.snapshots[-1].ops_after.items():
            if k.startswith("spear."):
                c[k] += v
    return c


def ops_before_first_pass(report) -> collections.Counter:
    c = collections.Counter()
    for g in report.graphs:
        c.update(g.snapshots[0].ops_before)
    return c


def snapshot(report, pass_name: str, graph: int = 0):
    """The before/after snapshot of one pass in one captured graph."""
    return next(s for s in report.graphs[graph].snapshots if s.pass_name == pass_name)


def round_trip_reaches_pass(snap) -> bool:
    """Whether the graph a pass saw (``snapshot``) still holds a dtype round trip (two conversions, e.g.
    fp32 -> bf16 -> fp32). torch 2.13 hands it to the post-grad passes; torch 2.11 (the GPU machine's) has
    removed it before them, and then there is no rounding left for a fused op to skip."""
    return sum(v for k, v in snap.ops_before.items() if "convert_element_type" in k) >= 2


def assert_compiled_matches_eager(model, x, tol: float = 1e-5, config=None) -> None:
    """``torch.compile(model, backend="spear")(x)`` against ``model(x)``, fresh Dynamo state each side."""
    with torch.no_grad():
        ref = model(x)
        torch._dynamo.reset()
        if config is None:
            out = torch.compile(model, backend="spear")(x)
        else:
            with spear.compile_config(config):
                out = torch.compile(model, backend="spear")(x)
    torch._dynamo.reset()
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)


def quantized_llama(d=64, layers=1, heads=2, ff=128, group_size=None, dtype=torch.float32, seed=0):
    m = LlamaLike(d, layers, heads, ff, seed).to(dtype)
    spear.quantize_(m, spear.QuantConfig(group_size=group_size), progress=False)
    return m


__all__ = ["DequantLinear", "Int4PackLinear", "LlamaLike", "assert_compiled_matches_eager", "capture",
           "ops_before_first_pass", "quantized_llama", "snapshot", "spear_ops_after"]


def use_tuned_table(monkeypatch, entries: dict):
    """Make ``entries`` (typed keys or wire strings -> values) the process's tuned configs table for one test;
    returns the ``TunedTable``."""
    from spear_compile.dispatch import table as TT

    t = TT.TunedTable("configs", entries)
    monkeypatch.setattr(TT, "_CONFIGS", t)
    return t


# ---- kernel-test operands (the lowering tests' shared cases)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}  # relative to max |ref|


def close_to(out, ref, dtype):
    err = (out.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item() + 1e-6
    assert err / scale < TOL[dtype], f"max err {err:.3g} vs scale {scale:.3g}"


def ec_operands(N, K, R, D, dtype, seed=1):
    gen = torch.Generator().manual_seed(seed)
    A = torch.randn(R, K, generator=gen) / K ** 0.5
    B = torch.randn(N, R, generator=gen) * 0.1
    W1, b1 = torch.randn(D, R, generator=gen) / R ** 0.5, torch.randn(D, generator=gen) * 0.1
    W2, b2 = torch.randn(R, D, generator=gen) / D ** 0.5, torch.randn(R, generator=gen)
    alpha = torch.tensor(1.25)
    return tuple(t.to(DEV, dtype) for t in (A, B, W1, b1, W2, b2)) + (alpha.to(DEV),)


def packed_weight(N, K, G, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    qw = quantize_rtn(torch.randn(N, K, generator=gen) * 0.05, QuantConfig(group_size=G), out_dtype=dtype)
    bias = torch.randn(N, generator=gen).to(dtype)
    return [t.to(DEV) for t in (qw.qweight, qw.scales, qw.zeros, bias)] + [qw.group_size]


def gemv_case(N, K, G, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (N, K), generator=gen)
    s = (torch.rand(N, K // G, generator=gen) * 0.02 + 0.005).to(torch.bfloat16)
    z = (torch.rand(N, K // G, generator=gen) * 15).to(torch.bfloat16)
    b = torch.randn(N, generator=gen).to(torch.bfloat16)
    x = torch.randn(1, K, generator=gen).to(torch.bfloat16)
    return x, q, pack_int4(q), s, z, b


def exact_gemv(x, q, s, z, G, b):
    zz = z.double().repeat_interleave(G, 1) if z is not None else 0.0
    W = (q.double() - zz) * s.double().repeat_interleave(G, 1)
    return x.double() @ W.T + (b.double() if b is not None else 0.0)


def run_compiled(code: str) -> None:
    """Run ``code`` (which prints "ok") in a separate process without Triton's interpreter (on for
    these tests), which cannot compile for a GPU."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


def bf16_ec(N, K, R, D, seed):
    gen = torch.Generator().manual_seed(seed)
    A = torch.randn(R, K, generator=gen) / K ** 0.5
    B = torch.randn(N, R, generator=gen) * 0.3
    W1, b1 = torch.randn(D, R, generator=gen) / R ** 0.5, torch.randn(D, generator=gen) * 0.1
    W2, b2 = torch.randn(R, D, generator=gen) / D ** 0.5, torch.randn(R, generator=gen)
    return [t.to(torch.bfloat16) for t in (A, B, W1, b1, W2, b2)] + [torch.tensor(1.25 + 0.25 * seed)]


def rel_err(y, ref):
    return ((y.float() - ref.float()).norm() / ref.float().norm()).item()


def random_ec(d_in, d_out, rank, seed):
    torch.manual_seed(seed)
    ec = spear.ErrorCompensator(d_in, d_out, spear.ECConfig(rank=rank, gate_hidden=4))
    with torch.no_grad():  # a non-trivial EC: B is zero at init, alpha and the gate bias away from their defaults
        for p in ec.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return ec


def llama_with_ecs():
    m = quantized_llama(d=64, layers=1, heads=2, ff=128)
    names = {"q_proj": 64, "k_proj": 64, "v_proj": 64, "gate_proj": 128, "up_proj": 128, "o_proj": 64}
    spear.attach_(m, {f"layers.0.{n}": random_ec(64, d, 4 + i, i) for i, (n, d) in enumerate(names.items())})
    return m
