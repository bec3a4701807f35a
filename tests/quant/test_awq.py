"""AWQ: scale folding keeps the fp function exactly, the searched scales and clipping lower the
layer output error, and ``quantize_(method="awq")`` produces ordinary packed QuantLinears."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import spear_compile as spear
from spear_compile import QuantConfig, QuantLinear
from spear_compile.models.tiny import tiny_llama
from spear_compile.quant import pack_int4, quantize_rtn, unpack_int4
from spear_compile.quant.awq import (AWQModelError, apply_awq_, awq_quantize, fake_quantize, fold_awq_,
                                     llama_scale_groups, output_error, search_clip, search_scale)


def _salient_layer(seed=0, N=64, K=128, n=2048, salient=4, mag=30.0):
    """Gaussian weights; inputs with a few channels 30x larger than the rest (AWQ's setting)."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(N, K, generator=g) * 0.05
    X = torch.randn(n, K, generator=g)
    X[:, torch.randperm(K, generator=g)[:salient]] *= mag
    return W, X.abs().mean(0), X.double().t() @ X.double() / n


def _calib(n=2, vocab=256):
    return [torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(i)) for i in range(n)]


def _err(W, approx, R):
    return output_error(W, approx, R).sum().item()


# --------------------------------------------------------------------------- folding


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_folding_random_scales_leaves_fp_model_unchanged(dtype, tol):
    m = tiny_llama(heads=4, kv_heads=2, dtype=dtype)  # GQA: each v channel feeds two query heads of o_proj
    ref = copy.deepcopy(m)
    x = _calib(1)[0]
    gen = torch.Generator().manual_seed(1)
    groups = llama_scale_groups(m)
    assert [g.name.split(".")[-1] for g in groups[0]] == ["qkv", "o_proj", "gate_up", "down_proj"]
    assert groups[0][1].n_rep == 2
    for layer in groups:
        for g in layer:
            g.fold_(torch.exp(torch.randn(g.prev.weight.shape[0], generator=gen, dtype=torch.float64)))
    for (n, p), (_, p0) in zip(m.named_parameters(), ref.named_parameters()):
        if "layers" in n and "rotary" not in n:
            assert not torch.equal(p, p0), n  # every norm and linear inside the layers was rescaled
    with torch.no_grad():
        out, want = m(x).logits, ref(x).logits
    assert (out - want).abs().max() <= tol * want.abs().max()


def test_apply_awq_keeps_fp_function_and_reports_scales_and_clips():
    m = tiny_llama()
    ref = copy.deepcopy(m)
    cfg = QuantConfig(method="awq", group_size=32)
    res = apply_awq_(m, _calib(), cfg, progress=False)
    assert len(res.alphas) == 8 and all(0.0 <= a <= 1.0 for a in res.alphas.values())
    assert any(a > 0 for a in res.alphas.values())
    assert len(res.clips) == 14
    c = res.clips["model.layers.1.mlp.down_proj"]
    assert c.shape == (64, 128 // 32) and ((c >= 0.5) & (c <= 1.0)).all()
    x = _calib(1)[0]
    with torch.no_grad():
        out, want = m(x).logits, ref(x).logits
    assert (out - want).abs().max() <= 1e-5 * want.abs().max()  # fp32; exact in fp64, see the test above
    assert not torch.equal(m.model.layers[0].input_layernorm.weight, ref.model.layers[0].input_layernorm.weight)


def test_awq_only_touches_groups_with_a_target():
    m = tiny_llama()
    ref = copy.deepcopy(m)
    attn_only = lambda mod, n: isinstance(mod, nn.Linear) and "self_attn" in n  # noqa: E731
    spear.quantize_(m, QuantConfig(method="awq"), filter_fn=attn_only, progress=False, calib=_calib())
    for i, (L, L0) in enumerate(zip(m.model.layers, ref.model.layers)):
        assert isinstance(L.self_attn.q_proj, QuantLinear) and type(L.mlp.up_proj) is nn.Linear
        assert torch.equal(L.post_attention_layernorm.weight, L0.post_attention_layernorm.weight)
        assert torch.equal(L.mlp.down_proj.weight, L0.mlp.down_proj.weight)  # MLP groups had no target
        assert not torch.equal(L.input_layernorm.weight, L0.input_layernorm.weight)


# --------------------------------------------------------------------------- search quality


@pytest.mark.parametrize("group_size", [None, 32])
@pytest.mark.parametrize("seed", [0, 1])
def test_awq_beats_rtn_on_salient_channels(group_size, seed):
    W, act_abs, R = _salient_layer(seed)
    cfg = QuantConfig(method="awq", group_size=group_size)
    rtn = _err(W, quantize_rtn(W, cfg).dequantize(torch.float64), R)
    qw, s = awq_quantize(W, act_abs, R, cfg)
    assert qw.qweight.shape == (64, 64) and qw.scales.shape == (64, 128 // (group_size or 128))
    assert _err(W, qw.dequantize(torch.float64) / s, R) < 0.5 * rtn  # measured 0.20-0.33
    # the scale search alone: alpha = 0 (plain RTN) is in the grid, so it can only win
    s2, alpha, errs = search_scale([W], act_abs, R, cfg)
    assert alpha > 0 and min(errs) == pytest.approx(errs[int(round(alpha * cfg.awq_grid))])
    assert errs[0] == pytest.approx(rtn, rel=1e-4)
    assert _err(W, fake_quantize(W * s2.float(), cfg, torch.float32).double() / s2, R) < 0.8 * rtn


@pytest.mark.parametrize("group_size", [None, 32, 64])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("heavy_tail", [False, True])
def test_clip_search_never_increases_output_error(group_size, symmetric, heavy_tail):
    W, _, R = _salient_layer(3, N=48, K=128)
    if heavy_tail:
        W = W * torch.distributions.StudentT(3.0).sample(W.shape) / 3
    cfg = QuantConfig(method="awq", group_size=group_size, symmetric=symmetric)
    clip = search_clip(W, R, cfg)
    assert clip.shape == (48, 128 // (group_size or 128)) and ((clip >= 0.5) & (clip <= 1.0)).all()
    e_clip = output_error(W, fake_quantize(W, cfg, torch.float32, clip), R)
    e_none = output_error(W, fake_quantize(W, cfg, torch.float32), R)
    assert (e_clip <= e_none * (1 + 1e-9) + 1e-15).all()  # per output channel, not just in total
    assert (clip < 1).any() and e_clip.sum() < e_none.sum()
    # what quantize_rtn stores with that clip is what the search evaluated
    stored = quantize_rtn(W, cfg, clip=clip).dequantize(torch.float32)
    assert torch.equal(stored, fake_quantize(W, cfg, torch.float32, clip))
    assert torch.equal(search_clip(W, R, QuantConfig(group_size=group_size, awq_clip_grid=0)), torch.ones_like(clip))


# --------------------------------------------------------------------------- quantize_ integration


def test_quantize_awq_needs_calib_and_a_llama_model():
    with pytest.raises(ValueError, match=r"method='awq' needs calib="):
        spear.quantize_(tiny_llama(), QuantConfig(method="awq"), progress=False)
    from tests.helpers import LlamaLike

    with pytest.raises(AWQModelError, match=r"layers\.0\.input_layernorm is missing"):
        spear.quantize_(LlamaLike(), QuantConfig(method="awq"), progress=False, calib=[torch.randn(2, 8, 64)])
    m = tiny_llama()
    m.model.layers[1].mlp = nn.Identity()
    with pytest.raises(AWQModelError, match=r"model\.layers\.1\.mlp\.gate_proj is missing"):
        spear.quantize_(m, QuantConfig(method="awq"), progress=False, calib=_calib(1))

    class OnePlusNorm(nn.Module):  # Gemma-style: out = norm(x) * (1 + w); 1/s cannot be folded into w
        def __init__(self, d):
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(d))

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + self.weight)

    m = tiny_llama()
    m.model.layers[0].post_attention_layernorm = OnePlusNorm(64)
    before = copy.deepcopy(m.state_dict())
    with pytest.raises(AWQModelError, match=r"model\.layers\.0\.post_attention_layernorm \(OnePlusNorm\) does not"):
        spear.quantize_(m, QuantConfig(method="awq"), progress=False, calib=_calib(1))
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())  # nothing was touched
    with pytest.raises(ValueError, match="awq_grid=0"):
        QuantConfig(method="awq", awq_grid=0)
    with pytest.raises(ValueError, match="awq_max_shrink=1.0"):
        QuantConfig(method="awq", awq_max_shrink=1.0)


def test_quantize_awq_packed_format_roundtrip_and_quality(tmp_path):
    fp = tiny_llama()
    calib = _calib()
    q = spear.quantize_(copy.deepcopy(fp), QuantConfig(method="awq", group_size=32), progress=False, calib=calib)
    r = spear.quantize_(copy.deepcopy(fp), QuantConfig(group_size=32), progress=False)
    qls = spear.quantized_linears(q)
    assert len(qls) == 14 and type(q.lm_head) is nn.Linear
    for name, ql in qls.items():
        assert torch.equal(pack_int4(unpack_int4(ql.qweight)), ql.qweight)
        xi = torch.randn(5, ql.in_features)
        again = QuantLinear.from_quantized(ql.quantized_weight(), ql.bias, name=name)
        torch.testing.assert_close(again(xi), ql(xi))
        torch.testing.assert_close(ql(xi), F.linear(xi, ql.dequantize(torch.float32)), rtol=1e-5, atol=1e-5)
    ids = calib[0]
    with torch.no_grad():
        want = fp(ids).logits
        err_awq = ((q(ids).logits - want) ** 2).mean()
        err_rtn = ((r(ids).logits - want) ** 2).mean()
    assert torch.isfinite(err_awq) and err_awq < err_rtn
    # the fp reference in the quantized model's coordinates: same weights AWQ quantized, same function
    folded = fold_awq_(copy.deepcopy(fp), q._spear_awq.scales)
    cfg = QuantConfig(method="awq", group_size=32)
    for name, ql in qls.items():
        w = folded.get_submodule(name).weight
        assert torch.equal(quantize_rtn(w, cfg, clip=q._spear_awq.clips[name]).qweight, ql.qweight), name
    assert torch.equal(folded.model.layers[1].input_layernorm.weight, q.model.layers[1].input_layernorm.weight)
    with torch.no_grad():
        torch.testing.assert_close(folded(ids).logits, want, rtol=1e-5, atol=1e-5)
    # the folded norms travel with the artifact: reloading gives the same logits
    spear.save(q, str(tmp_path / "awq"))
    back = spear.load(str(tmp_path / "awq"), model=fp)
    with torch.no_grad():
        assert torch.equal(back(ids).logits, q(ids).logits)
