"""Session 19 diagnostic: the in-launch prefill EC ("in_gemm_self") - (1) correctness per rank: the shrink roles'
alpha g h buffer against the reference, the output and its EC part, the flags and ticket after the launch;
(2) where its time goes: SELF_DIAG variants (1 no shrink K loop, 4 tiles do not wait; 2, no gate, fails to compile) against ra and
ra with the EC step on a ready alpha g h.
Usage (GPU): python benchmarks/device/s19_self_diag.py"""
import sys

import torch

sys.path.insert(0, "benchmarks")
from kernels import make_ec, make_weights  # noqa: E402

from spear_compile.lowering import w4a16_gemm_wgmma_ra as RA  # noqa: E402
from spear_compile.lowering import w4a16_triton as T  # noqa: E402
from spear_compile.lowering.ec_gemm_self import _WORKSPACES  # noqa: E402
from spear_compile.lowering.ec_linear import ec_delta_ref, ec_linear_ref  # noqa: E402
from spear_compile.lowering.ec_triton import ec_shrink_gate  # noqa: E402
from spear_compile.lowering.tuning import bench_graph  # noqa: E402
from tests.lowering.test_gemm_wgmma import _case, _ec_case  # noqa: E402

torch.manual_seed(0)
for R in ((16, 20, 64) if '--timing-only' not in sys.argv else ()):
    for config in ((128, 256, 3, 8), (64, 256, 4, 4)):
        N, K, M = 264, 640, 300
        x, qw, s, z, b = _case(N, K, 128, M=M, device="cuda")
        z = z.round()
        ec = _ec_case(N, K, R, "cuda")
        A, B, W1, b1, W2, b2, alpha = ec
        r_p = max(16, 1 << (R - 1).bit_length())
        Bp = torch.zeros(N, -(-R // 8) * 8, dtype=torch.bfloat16, device="cuda")
        Bp[:, :R] = B
        hg = torch.full((M, r_p), float("nan"), dtype=torch.bfloat16, device="cuda")
        y = RA.w4a16_gemm_wgmma_ra_ec_self(x, qw, s, z, 128, b, A, Bp, W1, b1, W2, b2, alpha, "silu", config=config,
                                           hg=hg)
        torch.cuda.synchronize()
        hg_ref = ec_shrink_gate(x, A, W1, b1, W2, b2, "silu", alpha=alpha, dtype=torch.float32)
        ref = ec_linear_ref(x, qw, s, z, 128, b, *ec, "silu").double()
        w4 = RA.w4a16_gemm_wgmma_ra(x, qw, s, z, 128, b, config=config).double()
        dref = ec_delta_ref(x, *ec, "silu").double()
        hgerr = (hg.float()[:, :R] - hg_ref[:, :R]).abs()
        print(f"R={R} cfg={config}: hg nan {int(hg.isnan().sum())}, hg max err {hgerr.max().item():.4f} "
              f"(ref max {hg_ref.abs().max().item():.3f}; worst row {int(hgerr.max(1).values.argmax())}), pad cols max "
              f"{hg.float()[:, R:].abs().max().item() if r_p > R else 0:.4f}; y err {(y.double() - ref).abs().max().item():.4f} "
              f"(ref max {ref.abs().max().item():.2f}); EC part err {((y.double() - w4) - dref).abs().max().item():.4f} "
              f"(max {dref.abs().max().item():.3f})", flush=True)
        for key, (_, (tick, flags)) in _WORKSPACES.items():
            if key[3] == -(-M // config[1]) * (-(-N // config[0]) + 1):
                print("   ticket", tick.item(), "flags", flags.tolist())

print("timing", flush=True)
G = 128
for N, K, M in ((4096, 4096, 1024), (11008, 4096, 256), (8192, 8192, 1024)):
    ws = make_weights(N, K, 2)
    ec = make_ec(N, K, 64)
    A, B, W1, b1, W2, b2, alpha = ec
    xs = [torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    cfg = T.gemm_config(M, N, K, G)
    cfg_ra = tuple(cfg[1:]) if cfg[0] == T.WGMMA_RA else RA.RA_CONFIGS[0]
    hgp = ec_shrink_gate(xs[0], A, W1, b1, W2, b2, "silu", alpha=alpha, dtype=torch.bfloat16)

    def q(i):
        w = ws[i]["qw"]
        return w.qweight, w.scales, w.zeros

    row = {"ra": bench_graph(lambda i: RA.w4a16_gemm_wgmma_ra(xs[i], *q(i), G, None, config=cfg_ra), 2),
           "ra_ec": bench_graph(lambda i: RA.w4a16_gemm_wgmma_ra(xs[i], *q(i), G, None, config=cfg_ra,
                                                                 ec=(hgp, B.contiguous())), 2)}
    for sd in (0, 1, 4, 5):  # (a bit 2, no gate layers, failed to compile on Triton 3.6 and was removed)
        row[f"self_{sd}"] = bench_graph(lambda i: RA.w4a16_gemm_wgmma_ra_ec_self(
            xs[i], *q(i), G, None, A, B.contiguous(), W1, b1, W2, b2, alpha, "silu", config=cfg_ra, self_diag=sd), 2)
    print(N, K, M, cfg_ra, {k: round(v, 1) for k, v in row.items()}, flush=True)
