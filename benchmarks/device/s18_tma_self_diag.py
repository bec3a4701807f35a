"""Session 18 diagnostic: the one-launch TMA EC's test failure (4096x2048, G 128, r 64, config (4, 2, 4, 2, 2):
relative error 0.0122 > 0.01 in call 1). Repeats the case with fresh and reused workspaces and prints, per launch,
the relative error of the normal launch and of the fallback path (parts = 10: every CTA computes every piece),
and of the reference W4 without EC, to tell a protocol race (sporadic, normal path only) from a numerical
difference (every launch, both paths). Usage (GPU): python benchmarks/device/s18_tma_self_diag.py"""
import torch

from spear_compile.lowering.ec_linear import ec_linear_ref
from spear_compile.lowering.w4a16_gemv_tma_ec import tma_self_gemv
from tests.lowering.test_gemv_gluon import _case
from tests.lowering.test_gemv_tma_ec import _ec, _rel

for config in [(4, 2, 2, 2, 2), (4, 2, 4, 2, 2), (2, 2, 4, 2, 2)]:
    for N, K, G, R in [(4096, 2048, 128, 64), (1024, 1024, 128, 64)]:
        for seed in range(3):
            x, _, q, s, z, b = _case(N, K, G, seed=seed)
            ec = [t.cuda() for t in _ec(N, K, R, 8, seed)]
            x, q, s, z, b = x.cuda() * 3, q.cuda(), s.cuda(), z.cuda(), b.cuda()
            ref = ec_linear_ref(x, q, s, z, G, b, *ec)
            normal = [_rel(tma_self_gemv(x, q, s, z, G, b, ec, "silu", config), ref) for _ in range(4)]
            fallback = _rel(tma_self_gemv(x, q, s, z, G, b, ec, "silu", config, parts=10), ref)
            w4 = _rel(torch.ops.spear.w4a16_linear(x, q, s, z, G, b), ref)
            print(config, N, K, G, R, "seed", seed, "normal", [f"{e:.4f}" for e in normal], "fallback",
                  f"{fallback:.4f}", "no-EC", f"{w4:.4f}", flush=True)
