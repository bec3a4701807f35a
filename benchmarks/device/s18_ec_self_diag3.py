"""Session 18 diagnostic 3: does the CUDA-core (Triton) one-launch EC show the TMA form's wrong launches
(calls 5-7)? Fresh tensors and workspace per repetition, launches on x0, x1, x0 (a stale piece accepted from
the previous launch would then be visibly wrong too), the TMA form's test shape (4096x2048, r = 64) and a shipped
one (11008x4096), each config whose programs hold A's pieces; norm-relative error against the reference.
Usage (GPU): python benchmarks/device/s18_ec_self_diag3.py"""
import torch

from spear_compile.lowering.ec_linear import ec_linear_ref
from spear_compile.lowering.w4a16_triton import GEMV1_CONFIGS, self_plan_ok, w4a16_gemv1
from tests.lowering.test_gemv_gluon import _case
from tests.lowering.test_gemv_tma_ec import _ec, _rel

bad = total = 0
for N, K in [(4096, 2048), (11008, 4096)]:
    G, R = 128, 64
    for config in GEMV1_CONFIGS:
        if not self_plan_ok(R, K, -(-N // config[0]), config[2], torch.device("cuda")):
            continue
        for rep in range(6):
            x, _, q, s, z, b = _case(N, K, G, seed=rep)
            ec = [t.cuda() for t in _ec(N, K, R, 8, rep)]
            q, s, z, b = q.cuda(), s.cuda(), z.cuda(), b.cuda()
            xs = [x.cuda() * 3, torch.randn_like(x).cuda() * 3]
            errs = []
            for i in (0, 1, 0):
                y = w4a16_gemv1(xs[i], q, s, z, G, b, ec=ec, config=config)
                errs.append(_rel(y, ec_linear_ref(xs[i], q, s, z, G, b, *ec)))
            total += 3
            bad += sum(e > 5e-3 for e in errs)
            print("BAD" if max(errs) > 5e-3 else "ok ", N, K, config, "rep", rep, [f"{e:.4f}" for e in errs],
                  flush=True)
print(f"launches with relative error > 0.005: {bad} of {total}")
