"""Variable-length paged attention (``runtime.attention``) against the masked whole-step attention of
transformers' ``paged|sdpa``, and in the engine against plain ``generate``."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import spear_compile as spear
from spear_compile.compensators.init import random_ecs
from spear_compile.runtime import Engine
from spear_compile.runtime.attention import (NAME, paged_varlen_attention, register, unsupported, varlen_attention,
                                             varlen_reference)


def packed_masked(q, k, v, cu_q, cu_k, scale=None):
    """What ``paged|sdpa`` computes: one SDPA over the packed step, a (Tq, Tk) mask keeping each query to its
    own sequence's keys up to its position (the queries are the last of their sequence's keys)."""
    Tq, Tk = q.shape[0], k.shape[0]
    mask = torch.zeros(Tq, Tk, dtype=torch.bool)
    for i in range(len(cu_q) - 1):
        a, b, c, d = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        for j in range(b - a):
            mask[a + j, c:d - (b - a) + j + 1] = True
    rep = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), kk.transpose(0, 1), vv.transpose(0, 1),
                                                           attn_mask=mask, scale=scale).transpose(0, 1)
    return out * mask.any(1)[:, None, None]  # rows of no sequence: zero


@settings(max_examples=30, deadline=None)
@given(seqs=st.lists(st.tuples(st.integers(1, 9), st.integers(0, 12)), min_size=1, max_size=5),
       pad=st.integers(0, 3), gqa=st.sampled_from([1, 2, 4]), seed=st.integers(0, 2**16))
def test_reference_equals_the_masked_packed_step(seqs, pad, gqa, seed):
    """Decodes (1 query), chunks of prompts (q queries after p cached tokens), whole prompts (p = 0), the
    padded query rows of a static-shape step, GQA."""
    g = torch.Generator().manual_seed(seed)
    H, D = 4, 8
    cu_q, cu_k = [0], [0]
    for n, p in seqs:
        cu_q.append(cu_q[-1] + n)
        cu_k.append(cu_k[-1] + n + p)
    cu_q, cu_k = torch.tensor(cu_q + [cu_q[-1]] * (pad > 0)), torch.tensor(cu_k + [cu_k[-1]] * (pad > 0))
    q = torch.randn(int(cu_q[-1]) + pad, H, D, generator=g)
    k, v = (torch.randn(int(cu_k[-1]), H // gqa, D, generator=g) for _ in range(2))
    want = packed_masked(q, k, v, cu_q, cu_k, scale=0.3)
    got = varlen_reference(q, k, v, cu_q, cu_k, scale=0.3)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(varlen_attention(q, k, v, cu_q, cu_k, 9, 21, 0.3), want)  # CPU: the reference


@pytest.mark.parametrize("gqa", ["repeat", "grouped"])
def test_a_kernel_without_enable_gqa_gets_grouped_heads_either_way(gqa):
    """torch 2.11's ``varlen_attn`` takes no ``enable_gqa``: ``_torch_varlen`` repeats K and V per query head
    (``"repeat"``) or calls the kernel once per position in the group on K and V as they are (``"grouped"``).
    Here a kernel standing in for torch's (the reference, refusing unequal head counts as a kernel without
    GQA would) must give the reference's attention both ways; ``"grouped"`` never hands it repeated K / V."""
    from spear_compile.runtime.attention import _torch_varlen

    seen = []

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
        assert q.shape[1] == k.shape[1] and window_size == (-1, 0) and cu_q.dtype == torch.int32
        seen.append(k.data_ptr())
        return varlen_reference(q, k, v, cu_q, cu_k, scale)

    g = torch.Generator().manual_seed(0)
    cu_q, cu_k = torch.tensor([0, 1, 6, 7]), torch.tensor([0, 9, 16, 20])  # a decode, a piece, a decode
    q = torch.randn(8, 12, 16, generator=g)
    k, v = (torch.randn(20, 3, 16, generator=g) for _ in range(2))
    got = _torch_varlen((kernel, frozenset({"scale", "window_size"})), q, k, v, cu_q, cu_k, 5, 9, 0.25, gqa=gqa)
    want = varlen_reference(q, k, v, cu_q, cu_k, 0.25)
    torch.testing.assert_close(got[:7], want[:7])
    assert len(seen) == (4 if gqa == "grouped" else 1)
    assert (set(seen) == {k.data_ptr()}) == (gqa == "grouped")
    with pytest.raises(ValueError, match="gqa='tiled'"):
        _torch_varlen((kernel, frozenset({"scale", "window_size"})), q, k, v, cu_q, cu_k, 5, 9, 0.25, gqa="tiled")


def test_reference_names_bad_input():
    q, k = torch.randn(3, 4, 8), torch.randn(2, 3, 8)
    with pytest.raises(ValueError, match="multiple of 3 KV heads"):
        varlen_reference(q, k, k, torch.tensor([0, 3]), torch.tensor([0, 2]))
    k = torch.randn(2, 2, 8)
    with pytest.raises(ValueError, match="3 queries but only 2 keys"):
        varlen_reference(q, k, k, torch.tensor([0, 3]), torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="one per sequence"):
        varlen_reference(q, k, k, torch.tensor([0, 3]), torch.tensor([0, 1, 2]))


def test_without_a_paged_cache_it_is_plain_sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from spear_compile.models.tiny import tiny_llama

    attn = tiny_llama().model.layers[0].self_attn
    q, k, v = torch.randn(1, 4, 5, 16), torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16)
    got, _ = paged_varlen_attention(attn, q, k, v, None, scaling=0.25, is_causal=True)
    want, _ = sdpa_attention_forward(attn, q, k, v, None, scaling=0.25, is_causal=True)
    torch.testing.assert_close(got, want)


def test_engine_argument_is_checked():
    with pytest.raises(ValueError, match="attention='flash'"):
        Engine(object(), attention="flash")


def test_engine_refuses_varlen_where_transformers_cannot_run_it():
    from spear_compile.models.tiny import tiny_llama

    m = tiny_llama()
    before = m.config._attn_implementation
    eng = Engine(m, attention="varlen", block_size=16, num_blocks=8, max_batch_tokens=16)
    if unsupported() is None:  # transformers 5.17: it starts, runs and gives the model back as it was
        with eng:
            assert m.config._attn_implementation == NAME
            assert len(eng.generate([[5, 6, 7]], max_new_tokens=2)[0]) == 2
    else:  # a later transformers: a clear error at start, the model untouched
        with pytest.raises(RuntimeError, match="attention='varlen': transformers .* needs the interface of"):
            eng.start()
        assert not eng.running
    assert m.config._attn_implementation == before


@pytest.mark.slow
def test_engine_with_varlen_attention_equals_generate_and_restores_the_model():
    """SmolLM2-135M W4 + ECs, eager, a small cache so that chunked prefill runs beside decodes (transformers
    5.17, the GPU image's and the lower end of the pinned range; a later one refuses it at start: the test
    above)."""
    from spear_compile.models import load

    if unsupported() is not None:
        with pytest.raises(RuntimeError, match="needs the interface of transformers 5.17"):
            register()
        return

    torch.manual_seed(0)
    model, tok = load("smollm2-135m")
    spear.quantize_(model, spear.QuantConfig(group_size=None), progress=False)
    spear.attach_(model, random_ecs(model, spear.ECConfig(rank=4, gate_hidden=4), seed=0))
    prompts = ["The capital of France is", "To be, or not to be, that is the question: whether 'tis nobler in"]
    ids = [tok(p).input_ids for p in prompts]
    with torch.no_grad():
        refs = [model.generate(torch.tensor([x]), max_new_tokens=5, do_sample=False)[0, len(x):].tolist() for x in ids]
    before = model.config._attn_implementation
    with Engine(model, tok, attention="varlen", block_size=16, num_blocks=8, max_batch_tokens=12) as eng:
        assert model.config._attn_implementation == NAME
        assert eng.generate(ids, max_new_tokens=5) == refs
    assert model.config._attn_implementation == before
