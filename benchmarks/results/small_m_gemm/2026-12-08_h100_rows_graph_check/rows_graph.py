import torch
from spear_compile import QuantConfig
from spear_compile.quant import quantize_rtn
from spear_compile.lowering import w4a16_gemv_tma_rows as R
def tg(f, n=50):
    f(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n): f()
    g.replay(); torch.cuda.synchronize()
    s=torch.cuda.Event(True); e=torch.cuda.Event(True); s.record()
    for _ in range(5): g.replay()
    e.record(); torch.cuda.synchronize(); return s.elapsed_time(e)/(5*n)*1e3
for N,K in ((8192,8192),(4096,4096)):
    qw = quantize_rtn(torch.randn(N,K,device="cuda")*0.05, QuantConfig(group_size=128), out_dtype=torch.bfloat16)
    w = torch.randn(N,K,device="cuda",dtype=torch.bfloat16)
    x = torch.randn(8,K,device="cuda",dtype=torch.bfloat16)
    out = torch.empty(8,N,device="cuda",dtype=torch.bfloat16)
    cub = tg(lambda: torch.mm(x, w.t(), out=out))
    r = tg(lambda: R.w4a16_gemv_tma_rows(x, qw.qweight, qw.scales, qw.zeros, 128, None, config=(4,2,2,2), out=out))
    print(f"N={N} K={K} M=8 graph: cublas {cub:.1f} us rows(4,2,2,2) {r:.1f} us ratio {r/cub:.2f}", flush=True)
