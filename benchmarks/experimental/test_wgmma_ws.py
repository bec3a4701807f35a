"""Checks of the warp-specialised wgmma GEMM study (``wgmma_ws.py``; not shipped, not in CI):
``python -m pytest benchmarks/experimental/test_wgmma_ws.py`` on a GPU machine (the compile check runs
anywhere Triton can compile for sm_90)."""
import os
import re
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import wgmma_ws  # noqa: E402

from spear_compile.lowering import w4a16_gemm_wgmma as wg  # noqa: E402
from spear_compile.ops.w4a16_ref import dequantize_ref  # noqa: E402
from spear_compile.quant import quantize_rtn  # noqa: E402
from spear_compile.config import QuantConfig  # noqa: E402

CUDA = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="a real sm_90 compile")
def test_compiles_with_the_expanders_register_split():
    asm = wgmma_ws.compile_ws_sm90(wgmma_ws.WS_CONFIGS[0], zint=True)
    config = wgmma_ws.WS_CONFIGS[0]
    assert asm["ptx"].count("wgmma.mma_async") == wg.BK // 16 * config[0] // (16 * config[3])
    assert asm["ptx"].count("prmt.b32") == 4 * (config[1] * wg.BK // 8) // (32 * config[4])  # the expanders' share
    assert re.search(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+%d;" % wgmma_ws.WS_EXP_REGS, asm["ptx"])


def test_config_check():
    with pytest.raises(ValueError, match="4 expander warps"):
        wgmma_ws.check_ws_config((256, 128, 4, 8, 2))


@pytest.mark.skipif(not CUDA, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("M,N,K,G", [(200, 264, 640, 128), (1024, 1024, 1024, 1024)])
def test_matches_the_reference_on_gpu(M, N, K, G):
    gen = torch.Generator().manual_seed(0)
    qw = quantize_rtn(torch.randn(N, K, generator=gen) * 0.05, QuantConfig(group_size=None if G >= K else G))
    x = torch.randn(M, K, generator=gen).to("cuda", torch.bfloat16)
    q, s, z = qw.qweight.cuda(), qw.scales.cuda().bfloat16(), qw.zeros.cuda().bfloat16()
    ref = x.double() @ dequantize_ref(q, s, z, min(G, K), "spear", torch.bfloat16).double().t()
    y = wgmma_ws.w4a16_gemm_wgmma_ws(x, q, s, z, G, None)
    assert ((y.double() - ref).abs() <= ref.abs() * 2 ** -7 + 1e-2 * ref.abs().mean()).all()
