"""The static-cache sampler (compensators/sampling.py): its draws, its attention, its CUDA graph."""
import pytest
import torch

from spear_compile.compensators.calibrate import CalibConfig, sample_calibration, sample_sequences
from spear_compile.compensators.sampling import _attention, _gqa_decode_attention, _Step, sample_static
from spear_compile.models import tiny_llama


def _ref():
    ref = tiny_llama(vocab=256)  # 4 query heads over 2 K/V heads: grouped-query attention
    ref.generation_config.eos_token_id = ref.config.eos_token_id = 2
    return ref


def _generate(ref, b, T, seed, temperature):
    torch.manual_seed(seed)
    ids = torch.full((b, 1), 1, dtype=torch.long, device=ref.device)
    return ref.generate(ids, do_sample=True, max_new_tokens=T - 1, min_new_tokens=T - 1, temperature=temperature,
                        top_k=0, top_p=1.0, pad_token_id=1, attention_mask=torch.ones_like(ids))


def test_static_loop_with_the_models_attention_draws_generates_tokens():
    """The loop makes generate's draws (EOS masked, temperature, multinomial) with the same random
    state, so with the model's own attention (same logits bitwise) the tokens are generate's."""
    ref = _ref()
    for temperature in (1.0, 0.7):
        want = _generate(ref, 4, 33, 5, temperature)
        torch.manual_seed(5)
        got = sample_static(ref, 4, 33, 1, temperature=temperature, attention="model")
        assert got.shape == (4, 33) and torch.equal(want, got), temperature


@pytest.mark.parametrize("q,mask", [(1, "bool"), (1, "float"), (1, None), (3, "bool"), (3, None)])
def test_gqa_decode_attention_equals_sdpa_on_repeated_heads(q, mask):
    torch.manual_seed(0)
    b, h, kvh, L, d = 2, 6, 2, 11, 8
    query, key, value = torch.randn(b, h, q, d), torch.randn(b, kvh, L, d), torch.randn(b, kvh, L, d)
    keep = torch.rand(b, 1, q, L) > 0.3
    keep[..., 0] = True  # every row attends somewhere
    m = {"bool": keep, "float": torch.randn(b, 1, q, L), None: None}[mask]
    k, v = key.repeat_interleave(h // kvh, 1), value.repeat_interleave(h // kvh, 1)
    want = torch.nn.functional.scaled_dot_product_attention(query, k, v, attn_mask=m, scale=0.3,
                                                            is_causal=mask is None and q > 1)
    got, w = _gqa_decode_attention(torch.nn.Module().eval(), query, key, value, m, scaling=0.3)
    assert w is None and got.shape == (b, q, h, d)
    torch.testing.assert_close(got, want.transpose(1, 2), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="5 query heads do not group over 2"):
        _gqa_decode_attention(torch.nn.Module(), query[:, :5], key, value, m)


def test_gqa_steps_match_the_models_full_forward():
    """Teacher-forced through the static cache with the grouped attention, every step's logits equal
    the model's own full-sequence forward at that position (so the sampler samples the fp model)."""
    ref = _ref()
    torch.manual_seed(0)
    ids = sample_static(ref, 3, 20, 1)
    assert ids.shape == (3, 20) and not (ids[:, 1:] == 2).any()  # EOS suppressed
    with torch.no_grad():
        full = ref(ids).logits.float()
        with _attention(ref, "gqa"):
            step = _Step(ref, 3, 20, 1, graph=False)
            for t in range(19):
                step.tok.copy_(ids[:, t:t + 1])
                step.pos.fill_(t)
                torch.testing.assert_close(step(), full[:, t], rtol=1e-4, atol=1e-4)
    assert ref.config._attn_implementation == "sdpa"  # restored


def test_static_sampler_is_seeded_and_restores_the_attention_on_error():
    ref = _ref()
    a = sample_sequences(ref, 6, 17, bos_token_id=1, batch_size=4, seed=5, progress=False, sampler="static")
    b = sample_sequences(ref, 6, 17, bos_token_id=1, batch_size=4, seed=5, progress=False, sampler="static")
    assert a.shape == (6, 17) and torch.equal(a, b)
    cfg = CalibConfig(n_seqs=3, seq_len=9, sample_batch=2, sampler="static", seed=4)
    assert torch.equal(sample_calibration(ref, cfg, progress=False),
                       sample_sequences(ref, 3, 9, ref.config.bos_token_id, batch_size=2, seed=4, progress=False,
                                        sampler="static"))
    with pytest.raises(ValueError, match="sampler='beam'"):
        CalibConfig(sampler="beam")
    with pytest.raises(ValueError, match="sampler='beam'"):
        sample_sequences(ref, 1, 4, bos_token_id=1, sampler="beam", progress=False)
    with pytest.raises(ValueError, match="attention='flash'"):
        sample_static(ref, 1, 4, 1, attention="flash")
    with pytest.raises(ValueError, match="temperature=0"):
        sample_static(ref, 1, 4, 1, temperature=0)
    with pytest.raises(RuntimeError, match="boom"):
        with _attention(ref, "gqa"):
            assert ref.config._attn_implementation != "sdpa"
            raise RuntimeError("boom")
    assert ref.config._attn_implementation == "sdpa"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the graphed decode step is CUDA only")
def test_graphed_static_sampler_matches_the_eager_loop_on_cuda():
    """The CUDA-graph path: its warm-up and check forwards must not leave the cache's write position
    advanced (transformers 5.17 writes static layers at a step counter; sampling.py resets it), or the
    sequence runs past the cache (an index_copy_ assert) or attends to the wrong slots."""
    ref = _ref().cuda()
    for attention in ("model", "gqa"):
        torch.manual_seed(3)
        a = sample_static(ref, 4, 24, 1, graph=False, attention=attention)
        torch.manual_seed(3)
        b = sample_static(ref, 4, 24, 1, graph=True, attention=attention)
        assert torch.equal(a, b), attention
    got = sample_sequences(ref, 4, 24, bos_token_id=1, batch_size=4, seed=3, progress=False, sampler="static")
    assert got.shape == (4, 24) and not (got[:, 1:] == 2).any()
    want = _generate(ref, 4, 24, 3, 1.0)
    torch.manual_seed(3)
    assert torch.equal(sample_static(ref, 4, 24, 1, attention="model"), want)  # graphed, generate's draws


def test_random_first_tokens_are_forced_spread_evenly_and_seeded():
    """CalibConfig.random_first: the chosen fraction of rows start BOS, then a uniform non-special
    token; the static loop and ``generate`` make the same draws; other rows keep their tokens."""
    from spear_compile.compensators.calibrate import first_tokens

    ref = _ref()
    ref.config.pad_token_id = 0
    first = first_tokens(ref, range(0, 8), 0.5, seed=3)
    chosen = first >= 0
    assert chosen.tolist() == [False, True] * 4  # every other row, whatever the batching
    assert torch.equal(torch.cat([first_tokens(ref, range(0, 3), 0.5, 3), first_tokens(ref, range(3, 8), 0.5, 3)]),
                       first)
    assert not torch.isin(first[chosen], torch.tensor([0, 1, 2])).any()  # pad, BOS, EOS never drawn
    assert (first_tokens(ref, range(0, 64), 1.0, 0) >= 0).all() and (first_tokens(ref, range(64), 0.0, 0) < 0).all()
    assert len(set(first_tokens(ref, range(0, 64), 1.0, 0).tolist())) > 40  # uniform over 253 ids, not one

    kw = dict(bos_token_id=1, batch_size=8, seed=3, progress=False)
    plain = sample_sequences(ref, 8, 12, **kw, sampler="static")
    mixed = sample_sequences(ref, 8, 12, **kw, sampler="static", random_first=0.5)
    assert torch.equal(mixed[chosen, 1], first[chosen]) and torch.equal(mixed[:, 0], plain[:, 0])
    assert torch.equal(mixed[~chosen], plain[~chosen])  # the sampling stream is untouched
    assert not torch.equal(mixed[chosen], plain[chosen])
    # the generate path forces the same token and, with bitwise-equal logits, draws the same rest
    via_hf = sample_sequences(ref, 8, 12, **kw, sampler="hf", random_first=0.5)
    torch.manual_seed(3 * 100_003)
    want = sample_static(ref, 8, 12, 1, attention="model", first=first)
    assert torch.equal(via_hf, want)
    cfg = CalibConfig(n_seqs=8, seq_len=12, sample_batch=8, sampler="static", seed=3, random_first=0.5)
    assert torch.equal(sample_calibration(ref, cfg, progress=False), mixed)
    with pytest.raises(ValueError, match="random_first=1.5"):
        CalibConfig(random_first=1.5)
    with pytest.raises(ValueError, match=r"first is torch.int64 \(3,\); expected torch.int64 \(2,\)"):
        sample_static(ref, 2, 4, 1, first=torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"first is torch.float32 \(2,\)"):
        sample_static(ref, 2, 4, 1, first=torch.zeros(2))
    # the BOS sampling starts from is never drawn, even when it is not the config's
    assert not (first_tokens(ref, range(0, 4096), 1.0, 0, bos_token_id=7) == 7).any()
    assert (first_tokens(ref, range(0, 4096), 1.0, 0) == 7).any()  # P(never drawn) ~ e^-16
