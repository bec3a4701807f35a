"""Session 20 diagnostic: where in_gemm_self's time goes on the 4-warp tiles at 4096^2 M = 256 (64 x 128: +6 us over
its GEMM in call 4; 64 x 256: +2.3 in call 2), per split: SELF_DIAG 0 (full), 1 (no shrink K loop), 4 (tiles do not
wait), 5 (neither), against the GEMM alone and with the EC step on a ready alpha g h.
Usage (GPU): python benchmarks/device/s20_self_diag.py [N K M]"""
import json
import sys

import torch

sys.path.insert(0, "benchmarks")
from ec_prefill_profile import ra_case  # noqa: E402
from kernels import G  # noqa: E402

from spear_compile.lowering import w4a16_gemm_wgmma_ra as RA  # noqa: E402
from spear_compile.lowering.ec_gemm_self import split_ok  # noqa: E402
from spear_compile.lowering.tuning import bench_graph  # noqa: E402

N, K, M = (int(v) for v in sys.argv[1:4]) if len(sys.argv) >= 4 else (4096, 4096, 256)
torch.manual_seed(0)
copies, xs, q, (A, B, W1, b1, W2, b2, alpha), hgp, Bc = ra_case(N, K, M)


res = {"N": N, "K": K, "M": M, "us": {}}
for cfg in ((64, 128, 4, 4), (64, 256, 4, 4)):
    runs = {"ra": lambda i: RA.w4a16_gemm_wgmma_ra(xs[i], *q(i), G, None, config=cfg),
            "ra_ec": lambda i: RA.w4a16_gemm_wgmma_ra(xs[i], *q(i), G, None, config=cfg, ec=(hgp, Bc))}
    for sp in (1, 2, 4):
        if not split_ok(sp, cfg[1]):
            continue
        for sd in (0, 1, 4, 5):
            runs[f"self/s{sp}/diag{sd}"] = (lambda sp, sd: lambda i: RA.w4a16_gemm_wgmma_ra_ec_self(
                xs[i], *q(i), G, None, A, Bc, W1, b1, W2, b2, alpha, "silu", config=cfg, split=sp, self_diag=sd))(sp, sd)
    for name, fn in runs.items():
        t = bench_graph(fn, copies=copies)
        res["us"][f"{cfg}/{name}"] = t
        print(f"{N}x{K} M={M} {str(cfg):18s} {name:16s} {t:8.1f} us", flush=True)
print(json.dumps(res))
