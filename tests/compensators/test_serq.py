"""SERQ baseline: the single-matrix least-squares correction, flattening folded offline,
W4A8/W4A4 activation fake quantization, the budget, and errors that name the module."""
import copy

import pytest
import torch
from torch import nn

import spear_compile as spear
from spear_compile.compensators.serq import (
    SERQLinear, apply_serq_, collect_serq_stats, fold_smoothing_, lsq_correction, select_salient, serq_bytes,
    serq_correction, serq_k_for_budget, serq_output_error, smooth_plan,
)
from spear_compile.quant.stats import collect_input_stats
from spear_compile.models.tiny import tiny_llama
from spear_compile.quant.actquant import add_act_quant_, fake_quant_activation
from spear_compile.quant.format import QuantFormatError


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These are many tiny float64 ops: on a loaded 2-core machine OpenMP threads make them 10x slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _salient_inputs(n, K, seed, outliers=(3, 10, 17, 30), boost=25.0):
    """Correlated inputs where a few channels carry outliers (what LLM activations look like)."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.eye(K) + 0.3 * torch.randn(K, K, generator=torch.Generator().manual_seed(123)) / K ** 0.5
    x = torch.randn(n, K, generator=g) @ mix
    x[:, list(outliers)] *= boost
    return x


def _problem(N=24, K=32, n=4096, seed=0):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(N, K, generator=g, dtype=torch.float64)
    Q = W + 0.1 * torch.randn(N, K, generator=g, dtype=torch.float64)  # any "dequantized" weight
    x = _salient_inputs(n, K, seed).double()
    return W, Q, x, x.t() @ x / n


def _sampled_J(err, R, idx, x):
    out = x @ err.t() - (x[:, idx] @ R.t() if idx.numel() else 0.0)
    return (out ** 2).sum(1).mean().item()


@pytest.mark.parametrize("saliency", ["greedy", "error", "act"])
def test_single_matrix_correction_is_the_least_squares_optimum(saliency):
    W, Q, x, rxx = _problem()
    R, idx = serq_correction(W, Q, rxx, 6, saliency=saliency, act_mag=x.abs().amax(0), damp=0.0)
    assert R.shape == (24, 6) and idx.shape == (6,)
    err = W - Q
    J = _sampled_J(err, R, idx, x)
    assert serq_output_error(err, R, idx, rxx) == pytest.approx(J, rel=1e-9)
    assert serq_output_error(err, R, idx, rxx, err @ rxx) == pytest.approx(J, rel=1e-9)
    assert J < 0.9 * _sampled_J(err, R[:, :0], idx[:0], x)
    g = torch.Generator().manual_seed(7)
    for _ in range(5):  # no perturbation of R does better on the data it was fitted to
        dR = 1e-2 * torch.randn(R.shape, generator=g, dtype=torch.float64)
        assert _sampled_J(err, R + dR, idx, x) > J
    # the salient columns' own error (no cross-channel regression) is never better
    Rc, idc = serq_correction(W, Q, rxx, 6, saliency=saliency, act_mag=x.abs().amax(0), solve="columns")
    assert torch.equal(idc, idx) and _sampled_J(err, Rc, idc, x) >= J


def test_k_equals_K_removes_the_output_error_exactly():
    W, Q, x, rxx = _problem()
    R, idx = serq_correction(W, Q, rxx, 32, damp=0.0)
    assert sorted(idx.tolist()) == list(range(32))
    full = torch.zeros_like(W)
    full[:, idx] = R
    torch.testing.assert_close(full, W - Q, atol=1e-8, rtol=1e-8)
    assert _sampled_J(W - Q, R, idx, x) < 1e-12 * _sampled_J(W - Q, R[:, :0], idx[:0], x)


def test_greedy_picks_the_best_single_channel_and_never_loses_to_the_diagonal_score():
    W, Q, x, rxx = _problem(seed=3)
    err = W - Q

    def J(idx):
        idx = torch.tensor(idx)
        return serq_output_error(err, lsq_correction(err, rxx, idx, damp=0.0), idx, rxx)

    best = min(range(32), key=lambda j: J([j]))
    assert select_salient(err, rxx, 1, "greedy").tolist() == [best]
    for k in (2, 4, 8):
        assert J(select_salient(err, rxx, k, "greedy").tolist()) <= J(select_salient(err, rxx, k, "error").tolist())


@pytest.fixture(scope="module")
def tiny():
    """A 2-layer HF Llama with GQA (4 heads, 2 kv heads), its linears, inputs and full stats; built once."""
    ref = tiny_llama()
    names = [n for n, m in ref.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"]
    batches = [torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    stats = collect_serq_stats(ref, batches, names)
    q = spear.quantize_(copy.deepcopy(ref), spear.QuantConfig(), progress=False)
    return ref, names, batches, stats, q


def test_flattening_folded_offline_keeps_the_fp_function(tiny):
    ref, names, batches, stats, _ = tiny
    plan = smooth_plan(ref, {n: ref.get_submodule(n).weight for n in names}, stats, alpha=0.5)
    folds = {g.fold[0] for g in plan.groups}
    assert folds == {"norm", "rows"}  # everything folds: norms (q/k/v, gate/up), v rows (o, GQA), up rows (down)
    folded = fold_smoothing_(copy.deepcopy(ref), plan)
    x = batches[0]
    torch.testing.assert_close(folded(x).logits, ref(x).logits, atol=1e-4, rtol=1e-4)
    # and the activations really are flatter: max/median channel magnitude drops everywhere
    after = collect_serq_stats(folded, batches, names)
    for n in names:
        before_m, after_m = stats[n].max_abs, after[n].max_abs
        assert (after_m.max() / after_m.median()) < (before_m.max() / before_m.median())


def test_apply_serq_with_k_equal_K_reproduces_the_fp_model(tiny):
    ref, names, batches, _, q = tiny
    q = copy.deepcopy(q)
    stats = collect_input_stats(ref, batches, names=names, module_type=nn.Linear, full=True)  # no max_abs: RMS
    x = batches[1]
    y_ref, y_q = ref(x).logits, q(x).logits
    K = {n: ref.get_submodule(n).in_features for n in names}
    report = apply_serq_(ref, q, stats, 0, k=K, r_dtype=None)
    assert all(isinstance(q.get_submodule(n), SERQLinear) for n in names)
    assert (y_q - y_ref).abs().max() > 1e-2
    torch.testing.assert_close(q(x).logits, y_ref, atol=1e-4, rtol=1e-4)
    assert all(r["out_err_serq"] < 1e-6 * r["out_err_quant"] for r in report.values())
    assert all(r["extra_bytes"] == 0 and r["smoothing"] != "runtime" for r in report.values())


def _single_layer(K=64, N=48, seed=0):
    ref = nn.Sequential(nn.Linear(K, N, bias=True))
    with torch.no_grad():
        ref[0].weight.copy_(torch.randn(N, K, generator=torch.Generator().manual_seed(seed)) / K ** 0.5)
    return ref


@pytest.mark.parametrize("act_bits", [None, 8, 4])
def test_serq_lowers_output_error_on_data_with_salient_channels(act_bits):
    K, N = 64, 48
    ref = _single_layer(K, N)
    calib, held_out = _salient_inputs(2048, K, 0), _salient_inputs(1024, K, 1)
    stats = collect_serq_stats(ref, [calib])
    q = spear.quantize_(copy.deepcopy(ref), spear.QuantConfig(), progress=False)
    y = ref(held_out)

    def err_of(model):
        with torch.no_grad():
            return ((model(held_out) - y) ** 2).mean().item()

    plain = copy.deepcopy(q)
    apply_serq_(ref, plain, stats, 0, act_bits=act_bits, smooth_alpha=None)  # W4A{bits}, no SERQ
    serq = copy.deepcopy(q)
    budget = serq_bytes(N, 8) + 2 * K  # 8 salient channels + the run-time flattening vector
    rep = apply_serq_(ref, serq, stats, budget, act_bits=act_bits, smooth_alpha=0.5)["0"]
    assert rep["k"] == 8 and rep["bytes"] == 2 * N * 8 and rep["extra_bytes"] == 2 * K
    assert rep["smoothing"] == "runtime"  # a lone linear has no producer to fold into
    assert err_of(serq) < 0.5 * err_of(plain)


def test_w4a8_error_is_small_and_w4a4_larger(tiny):
    ref, names, batches, stats, q = tiny
    x = batches[2]
    y = ref(x).logits
    errs = {}
    for bits in (None, 8, 4):
        m = copy.deepcopy(q)
        apply_serq_(ref, m, stats, 0, act_bits=bits, smooth_alpha=None)
        errs[bits] = ((m(x).logits - y) ** 2).mean().item()
    assert errs[8] < 1.1 * errs[None]  # int8 activations add little on top of the 4-bit weights
    assert errs[4] > 1.5 * errs[8]


def test_budget_helper_is_uniform_maximal_and_fits():
    shapes = {"a": (100, 64), "b": (300, 32), "c": (50, 8)}
    for budget in (0, 999, 4500, 123456, 10 ** 9):
        ks = serq_k_for_budget(shapes, budget)
        total = sum(serq_bytes(N, ks[n]) for n, (N, _) in shapes.items())
        assert total <= budget
        k = max(ks.values())
        assert all(ks[n] == min(k, K) for n, (_, K) in shapes.items())
        if k < 64:  # one more channel everywhere would not fit
            assert sum(serq_bytes(N, min(k + 1, K)) for N, K in shapes.values()) > budget
    assert serq_bytes(100, 7) == 2 * 100 * 7 and serq_bytes(100, 0) == 0


def test_bad_inputs_raise_errors_naming_the_module():
    W, Q, x, rxx = _problem()
    with pytest.raises(ValueError, match=r"layers\.3\.q_proj: k=33 salient channels exceeds in_features K=32"):
        serq_correction(W, Q, rxx, 33, name="layers.3.q_proj")
    with pytest.raises(ValueError, match=r"layers\.3\.q_proj: weight \(24, 32\) and dequantized weight \(24, 31\)"):
        serq_correction(W, Q[:, :31], rxx, 2, name="layers.3.q_proj")
    with pytest.raises(ValueError, match=r"layers\.3\.q_proj: input autocorrelation rxx has shape \(31, 31\)"):
        serq_correction(W, Q, rxx[:31, :31], 2, name="layers.3.q_proj")

    ref = _single_layer()
    stats = collect_serq_stats(ref, [_salient_inputs(256, 64, 0)])
    q = spear.quantize_(copy.deepcopy(ref), spear.QuantConfig(), progress=False)
    with pytest.raises(ValueError, match=r"^0: k=65 salient channels exceeds in_features K=64"):
        apply_serq_(ref, copy.deepcopy(q), stats, 0, k={"0": 65})
    with pytest.raises(KeyError, match="no input statistics for 0"):
        apply_serq_(ref, copy.deepcopy(q), {}, 0)
    half = collect_input_stats(ref, [_salient_inputs(256, 64, 0)], module_type=nn.Linear)  # full=False
    with pytest.raises(ValueError, match="statistics of 0 have no E\\[x x\\^T\\]"):
        apply_serq_(ref, copy.deepcopy(q), half, 0)
    with pytest.raises(ValueError, match=r"apply_serq_: 0: ref weight \(48, 32\) does not match"):
        apply_serq_(nn.Sequential(nn.Linear(32, 48)), copy.deepcopy(q), stats, 0)
    with pytest.raises(ValueError, match="activation bits"):
        apply_serq_(ref, copy.deepcopy(q), stats, 0, act_bits=1)
    m = copy.deepcopy(q)
    apply_serq_(ref, m, stats, 10 ** 6)
    with pytest.raises(QuantFormatError, match=r"^0: input has shape \(2, 63\), last dim must be in_features=64"):
        m(torch.randn(2, 63))
    with pytest.raises(ValueError, match="0 is already a SERQLinear"):
        apply_serq_(ref, m, stats, 0)


def test_gptq_requantization_uses_the_flattened_hessian():
    ref = _single_layer()
    stats = collect_serq_stats(ref, [_salient_inputs(1024, 64, 0)])
    q = spear.quantize_(copy.deepcopy(ref), spear.QuantConfig(), progress=False)
    J = {}
    for method in ("rtn", "gptq"):
        rep = apply_serq_(ref, copy.deepcopy(q), stats, 0, quant_cfg=spear.QuantConfig(method=method))["0"]
        J[method] = rep["out_err_quant"]
    assert J["gptq"] < J["rtn"]


def test_plain_baselines_agree_and_group_quant_runs_in_the_permuted_order():
    ref = _single_layer()
    calib, x = _salient_inputs(1024, 64, 0), _salient_inputs(64, 64, 1)
    stats = collect_serq_stats(ref, [calib])
    q = spear.quantize_(copy.deepcopy(ref), spear.QuantConfig(), progress=False)
    # "no SERQ" through apply_serq_ equals the plain QuantLinear with an activation-quant hook
    hooked = copy.deepcopy(q)
    add_act_quant_(hooked, 4, group_size=16)
    plain = copy.deepcopy(q)
    apply_serq_(ref, plain, stats, 0, act_bits=4, act_group_size=16, smooth_alpha=None, permute=None)
    torch.testing.assert_close(plain(x), hooked(x))
    # with SERQ, groups are formed over perm (salient channels first) and R reads x'_q[:, :k]
    m = copy.deepcopy(q)
    apply_serq_(ref, m, stats, 10 ** 6, k=8, act_bits=4, act_group_size=16, smooth_alpha=0.5, permute="sorted")
    layer = m[0]
    assert torch.equal(layer.perm[:8], layer.idx)
    m2 = copy.deepcopy(q)
    apply_serq_(ref, m2, stats, 10 ** 6, k=8, act_bits=4, act_group_size=16, smooth_alpha=0.5, permute="salient")
    rest = m2[0].perm[8:]
    assert torch.equal(m2[0].perm[:8], layer.idx) and torch.equal(rest, rest.sort().values)
    m3 = copy.deepcopy(q)
    apply_serq_(ref, m3, stats, 10 ** 6, k=8, act_bits=4, act_group_size=16, smooth_alpha=0.5)  # default: no perm
    assert m3[0].perm is None
    xs3 = x * m3[0].in_scale
    xq3 = fake_quant_activation(xs3, 4, 16)
    expected3 = xq3 @ m3[0].dequantize(torch.float32).t() + m3[0].bias + xq3[:, m3[0].idx] @ m3[0].R.t()
    torch.testing.assert_close(m3[0](x), expected3, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="permute 'random'"):
        apply_serq_(ref, copy.deepcopy(q), stats, 0, permute="random")
    xs = x * layer.in_scale
    xqp = fake_quant_activation(xs[:, layer.perm], 4, 16)
    W = layer.dequantize(torch.float32)
    expected = xqp @ W[:, layer.perm].t() + layer.bias + xqp[:, :8] @ layer.R.t()
    torch.testing.assert_close(layer(x), expected, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="0: K=64 channels are not divisible by activation group_size=24"):
        apply_serq_(ref, copy.deepcopy(q), stats, 0, act_bits=4, act_group_size=24)
