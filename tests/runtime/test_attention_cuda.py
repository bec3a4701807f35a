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


def test_overlapped_split_replays_in_a_cuda_graph_and_routes_each_replay_on_the_device():
    """``decodes_split(overlap=True)`` forks the split's first launch onto a side stream and joins it: a CUDA
    graph captures both streams. Replayed with the lengths of a step with a prefill piece and then, in the
    same tensors, of a step of decodes only (``route_rows`` decides on the device which kernel attends), it
    equals the serial path (the same kernels, bit for bit) and the reference."""
    import functools

    from spear_compile.lowering.split_kv_decode import route_rows
    from spear_compile.runtime import attention as A

    g = torch.Generator(device="cuda").manual_seed(1)
    H, Hkv, D = 32, 8, 128
    cu = lambda ls: torch.tensor([0] + torch.tensor(ls).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    steps = [([1, 1, 1, 200, 0], [1500, 40, 3000, 700, 0]),  # decodes, a piece, a padding sequence
             ([1, 1, 1, 0, 0], [1500, 40, 3700, 0, 0])]      # decodes only, in the same buffers
    cu_q, cu_k = cu(steps[0][0]), cu(steps[0][1])
    q = torch.randn(256, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(5240, Hkv, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    varlen = functools.partial(A._torch_varlen, A._kernel())
    run = lambda overlap: A.decodes_split(varlen, q, k, v, cu_q, cu_k, 256, 4096, D ** -0.5,
                                          routes=route_rows(cu_q), overlap=overlap)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (Triton compiles) off the capture
        run(True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(True)
    for q_lens, k_lens in steps + steps:
        cu_q.copy_(cu(q_lens))
        cu_k.copy_(cu(k_lens))
        q.copy_(torch.randn(q.shape, device="cuda", dtype=q.dtype, generator=g))
        k.copy_(torch.randn(k.shape, device="cuda", dtype=k.dtype, generator=g))
        graph.replay()
        serial = run(False)
        torch.cuda.synchronize()
        n = sum(q_lens)
        assert torch.equal(out[:n], serial[:n]), q_lens
        want = varlen_reference(q.float(), k.float(), v.float(), cu_q, cu_k, D ** -0.5)
        torch.testing.assert_close(out[:n].float(), want[:n], atol=2e-2, rtol=2e-2)
