"""passes/fold_gqa_attention.py: grouped-query attention against the KV heads themselves.

Before/after on Dynamo's graph (what is matched, what is left), the rewrite against the repeated form
over random shapes and masks (Hypothesis), the forms it must leave alone, and an HF Llama with GQA and
a ``StaticCache`` compiled by the spear backend against eager, prefill and decode.
"""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from spear_compile.passes import backend
from spear_compile.passes.fold_gqa_attention import FoldGQAAttention


def repeat_kv(t, r):
    b, kv, L, d = t.shape
    return t[:, :, None, :, :].expand(b, kv, r, L, d).reshape(b, kv * r, L, d)


class RepeatedAttention(torch.nn.Module):
    def __init__(self, r, causal=False, scale=None):
        super().__init__()
        self.r, self.causal, self.scale = r, causal, scale

    def forward(self, q, k, v, m=None):
        return F.scaled_dot_product_attention(q, repeat_kv(k, self.r), repeat_kv(v, self.r), attn_mask=m,
                                              is_causal=self.causal, scale=self.scale)


def folded(module, *args):
    """Run ``module`` through Dynamo with the pass alone on its graph: (output, folds, graph after)."""
    seen = {}

    def be(gm, example_inputs):
        p = FoldGQAAttention()
        seen["count"] = p(gm)
        seen["graph"] = gm.graph
        return gm
    torch._dynamo.reset()
    out = torch.compile(module, backend=be, dynamic=False)(*args)
    torch._dynamo.reset()
    return out, seen["count"], seen["graph"]


def test_before_after_the_repeat_is_gone_and_attention_reads_the_kv_heads():
    q, k, v = torch.randn(2, 4, 1, 16), torch.randn(2, 2, 32, 16), torch.randn(2, 2, 32, 16)
    m = torch.rand(2, 1, 1, 32) > 0.3
    mod = RepeatedAttention(2, scale=0.25)
    ref = mod(q, k, v, m)
    out, count, g = folded(mod, q, k, v, m)
    assert count == 1
    methods = [n.target for n in g.nodes if n.op == "call_method"]
    assert "expand" not in methods and "unflatten" in methods and "reshape_as" in methods
    (attn,) = [n for n in g.nodes if n.op == "call_function" and "scaled_dot_product" in str(n.target)]
    assert [a.op for a in attn.args[1:3]] == ["placeholder", "placeholder"]  # k and v themselves
    assert attn.kwargs["scale"] == 0.25
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


@settings(max_examples=12, deadline=None)
@given(b=st.integers(1, 3), kv=st.integers(1, 3), r=st.integers(2, 4), S=st.sampled_from([1, 3, 5]),
       L=st.integers(5, 24), d=st.sampled_from([8, 16]), mask=st.sampled_from(["none", "bool_rows", "bool_one",
                                                                               "float_rows", "batch1"]),
       seed=st.integers(0, 2 ** 16))
def test_folded_attention_equals_the_repeated_form(b, kv, r, S, L, d, mask, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, S, kv * r, d, generator=g).transpose(1, 2)  # the layout HF hands SDPA
    k, v = torch.randn(b, kv, L, d, generator=g), torch.randn(b, kv, L, d, generator=g)
    m = {"none": None,
         "bool_rows": torch.rand(b, 1, S, L, generator=g) > 0.3,
         "bool_one": torch.rand(b, 1, 1, L, generator=g) > 0.3,
         "float_rows": torch.randn(b, 1, S, L, generator=g),
         "batch1": torch.rand(1, 1, S, L, generator=g) > 0.3}[mask]
    if m is not None and m.dtype == torch.bool:
        m[..., 0] = True  # every row attends somewhere
    mod = RepeatedAttention(r)
    out, count, _ = folded(mod, q, k, v, m)
    assert count == (0 if b == 1 and S == 1 else 1)  # batch-1 decode stays unfolded (the module docstring)
    torch.testing.assert_close(out, mod(q, k, v, m), rtol=1e-5, atol=1e-5)


def test_batch_one_decode_is_left_unfolded_and_two_rows_are_folded():
    k, v = torch.randn(1, 2, 32, 16), torch.randn(1, 2, 32, 16)
    mod = RepeatedAttention(2)
    for q, want in ((torch.randn(1, 4, 1, 16), 0), (torch.randn(1, 4, 2, 16), 1)):
        out, count, g = folded(mod, q, k, v)
        assert count == want
        assert ("expand" in [n.target for n in g.nodes if n.op == "call_method"]) == (want == 0)
        torch.testing.assert_close(out, mod(q, k, v), rtol=1e-5, atol=1e-6)
    q2, k2, v2 = torch.randn(2, 4, 1, 16), torch.randn(2, 2, 32, 16), torch.randn(2, 2, 32, 16)
    assert folded(mod, q2, k2, v2)[1] == 1  # a decode batch of two is folded


@pytest.mark.parametrize("case", ["causal", "no_repeat", "per_head_mask"])
def test_forms_it_must_leave_alone(case):
    q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    m = None
    if case == "causal":
        mod = RepeatedAttention(2, causal=True)
    elif case == "no_repeat":
        mod, k, v = RepeatedAttention(1), torch.randn(1, 4, 3, 8), torch.randn(1, 4, 3, 8)
    else:
        mod, m = RepeatedAttention(2), torch.randn(1, 4, 3, 3)
    ref = mod(q, k, v, m)
    out, count, _ = folded(mod, q, k, v, m)
    assert count == 0
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def _hf_gqa_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval(), cfg


def test_hf_llama_with_gqa_and_a_static_cache_compiles_folded_and_equals_eager():
    """The public path on an HF model with grouped-query attention: W4 (RTN g32) + spear backend with
    HF's StaticCache, a batch of two, a prefill of 5 tokens then 3 decode steps; the fold matches once per
    layer and every step's logits equal eager's."""
    import spear_compile as spear
    from transformers import StaticCache

    model, cfg = _hf_gqa_llama()
    spear.quantize_(model, spear.QuantConfig(group_size=32), progress=False)
    counts = []

    def observe(phase, name, graph, p):
        if phase == "after" and name == "fold_gqa_attention":
            counts.append(p.matched_count)

    def run(step_fn):
        cache = StaticCache(config=cfg, max_cache_len=16)
        outs, ids = [], torch.tensor([[5, 17, 3, 99, 42], [7, 1, 64, 2, 30]])
        pos = torch.arange(5)
        with torch.no_grad():
            for _ in range(4):
                logits = step_fn(ids, cache, pos)
                outs.append(logits)
                ids, pos = logits[:, -1:].argmax(-1), pos[-1:] + 1
        return outs

    def eager(ids, cache, pos):
        return model(ids, past_key_values=cache, use_cache=True, cache_position=pos).logits

    ref = run(eager)
    torch._dynamo.reset()
    backend._OBSERVERS.append(observe)
    try:
        compiled = torch.compile(eager, backend="spear")
        got = run(compiled)
    finally:
        backend._OBSERVERS.remove(observe)
        torch._dynamo.reset()
    assert counts and all(c == cfg.num_hidden_layers for c in counts), counts
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_the_config_switch_turns_it_off():
    q, k, v = torch.randn(2, 4, 1, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    seen = {}

    def be(gm, example_inputs):
        seen["would"] = FoldGQAAttention().matches(gm)
        seen["n"] = FoldGQAAttention(enabled=False)(gm)
        return gm
    torch._dynamo.reset()
    torch.compile(RepeatedAttention(2), backend=be)(q, k, v)
    torch._dynamo.reset()
    assert seen["would"] == 1 and seen["n"] == 0
