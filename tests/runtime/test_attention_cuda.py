"""torch's varlen kernel (``runtime.attention.varlen_attention`` on CUDA), alone and with the split-KV decode
kernel, against the per-sequence reference:
causal aligned to the end of each sequence's keys, GQA, the padded query rows of a static-shape step."""
import pytest
import torch

from spear_compile.runtime.attention import kernel_available, varlen_attention, varlen_reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the varlen kernel runs on CUDA")


@pytest.mark.parametrize("split_kv", ["0", "1"], ids=["torch", "split_kv"])
@pytest.mark.parametrize("gqa", [1, 4])
@pytest.mark.parametrize("seqs", [[(1, 300), (1, 17), (1, 0)], [(64, 0)], [(37, 200), (1, 999), (128, 64), (1, 5)],
                                  [(1, 2047), (1, 5)] + [(0, 0)] * 62],
                         ids=["decodes", "prompt", "mixed", "padded_as_transformers_pads"])
def test_kernel_equals_reference(seqs, gqa, split_kv, monkeypatch):
    """Both engine paths: torch's kernel for every sequence, and the decodes on the split-KV kernel
    (``SPEAR_SPLIT_KV=1``)."""
    monkeypatch.setenv("SPEAR_SPLIT_KV", split_kv)
    assert kernel_available("cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    H, D, pad = 32, 128, 7
    cu_q, cu_k = [0], [0]
    for n, p in seqs:
        cu_q.append(cu_q[-1] + n)
        cu_k.append(cu_k[-1] + n + p)
    max_q, max_k = max(n for n, _ in seqs), max(n + p for n, p in seqs)
    cu_q, cu_k = torch.tensor(cu_q, device="cuda"), torch.tensor(cu_k, device="cuda")
    q = torch.randn(int(cu_q[-1]) + pad, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(int(cu_k[-1]), H // gqa, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    got = varlen_attention(q, k, v, cu_q, cu_k, max_q + pad, max_k, D ** -0.5)
    want = varlen_reference(q.float(), k.float(), v.float(), cu_q, cu_k, D ** -0.5)
    n = int(cu_q[-1])
    torch.testing.assert_close(got[:n].float(), want[:n], atol=2e-2, rtol=2e-2)
