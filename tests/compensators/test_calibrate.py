"""Self-sampled KL calibration and input statistics."""
import copy
import dataclasses

import pytest
import torch

import spear_compile as spear
from spear_compile import ECConfig, ErrorCompensator
from spear_compile.compensators.calibrate import CalibConfig, calibrate_, mean_kl, sample_sequences
from spear_compile.quant.stats import collect_input_stats
from spear_compile.models import tiny_llama


def _setup(seed=0):
    ref = tiny_llama(hidden=64, layers=2, vocab=256, seed=seed)
    q = spear.quantize_(copy.deepcopy(ref), spear.QuantConfig(group_size=None), progress=False)
    seqs = sample_sequences(ref, 16, 24, bos_token_id=ref.config.bos_token_id, batch_size=8, seed=seed, progress=False)
    stats = collect_input_stats(q, [seqs[:8]])
    ecs = {}
    ref_mods = dict(ref.named_modules())
    for name, m in spear.quantized_linears(q).items():
        ecs[name] = ErrorCompensator.from_weight_error(ref_mods[name].weight, m.dequantize(), ECConfig(rank=4),
                                                       act_scale=stats[name].mean_sq.sqrt())
    spear.attach_(q, ecs)
    return ref, q, seqs


def test_sampling_is_seeded_and_shaped():
    ref = tiny_llama(vocab=256)
    a = sample_sequences(ref, 5, 7, bos_token_id=1, batch_size=2, seed=3, progress=False)
    b = sample_sequences(ref, 5, 7, bos_token_id=1, batch_size=2, seed=3, progress=False)
    assert a.shape == (5, 7) and torch.equal(a, b) and bool((a[:, 0] == 1).all())
    assert not torch.equal(a, sample_sequences(ref, 5, 7, bos_token_id=1, batch_size=2, seed=4, progress=False))


def test_input_stats_match_manual():
    ref = tiny_llama(vocab=256)
    q = spear.quantize_(copy.deepcopy(ref), spear.QuantConfig(), progress=False)
    ids = torch.randint(0, 256, (2, 5))
    seen = {}
    def grab(mod, args, out):
        seen.setdefault("x", args[0])  # returns None: a hook's return value would replace the output

    h = q.model.layers[0].mlp.down_proj.register_forward_hook(grab)
    q(ids)
    h.remove()
    # two batches: the accumulators (kept on the activations' device while collecting) add up
    st = collect_input_stats(q, [ids[:1], ids[1:]], full=True)["model.layers.0.mlp.down_proj"]
    x = seen["x"].reshape(-1, seen["x"].shape[-1]).double()
    assert st.n == x.shape[0] == 10
    torch.testing.assert_close(st.mean_sq.double(), (x * x).mean(0), rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(st.mean_abs.double(), x.abs().mean(0), rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(st.rxx, x.t() @ x / x.shape[0], rtol=1e-6, atol=1e-9)
    assert all(t.device.type == "cpu" for t in (st.sum_sq, st.sum_abs, st.xtx))  # handed over on the CPU


def test_calibration_lowers_kl_on_held_out_self_samples_and_is_deterministic():
    ref, q, seqs = _setup()
    train, held = seqs[:12], seqs[12:]
    before = mean_kl(ref, q, held)
    cfg = CalibConfig(steps=25, batch_size=4, lr=5e-3, lr_ab=1e-3, seed=0)
    log = calibrate_(q, ref, train, cfg, progress=False)
    after = mean_kl(ref, q, held)
    assert log["steps"] == 25 and after < before
    ref2, q2, seqs2 = _setup()
    log2 = calibrate_(q2, ref2, seqs2[:12], cfg, progress=False)
    assert log2["losses"] == log["losses"]
    # nothing is left requiring grad, and the compiled model agrees with eager after training
    assert not any(p.requires_grad for m in spear.quantized_linears(q).values() for p in m.ec.parameters())
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(q, backend="spear")(held[:1]).logits, q(held[:1]).logits,
                                   rtol=1e-4, atol=1e-4)


def test_cached_teacher_matches_recomputed_teacher():
    """The fp16 teacher cache changes the loss only by fp16 rounding of log-probabilities."""
    cfg = CalibConfig(steps=4, batch_size=4, lr=5e-3, lr_ab=1e-3, seed=0)
    logs = []
    for cache in (2 << 30, 0):
        ref, q, seqs = _setup()
        logs.append(calibrate_(q, ref, seqs, dataclasses.replace(cfg, teacher_cache_bytes=cache),
                               progress=False)["losses"])
    assert logs[0] != logs[1]  # the two paths really differ (one reads fp16 log-probs)
    # fp16 rounding of log-probs (error <= 8e-3 for |log p| < 16) moves a token-mean KL by
    # ~1e-5 nats; this toy model's KL is ~1e-4, SmolLM2's 0.1-0.5.
    torch.testing.assert_close(torch.tensor(logs[0]), torch.tensor(logs[1]), rtol=0, atol=3e-5)


def test_dense_weights_change_speed_not_losses():
    """Dequantizing once per run (dense_weights) computes the same losses as the op per call,
    and leaves the modules' own forward in place afterwards."""
    cfg = CalibConfig(steps=4, batch_size=4, lr=5e-3, lr_ab=1e-3, seed=0)
    logs = []
    for dense in (True, False):
        ref, q, seqs = _setup()
        logs.append(calibrate_(q, ref, seqs, dataclasses.replace(cfg, dense_weights=dense), progress=False)["losses"])
        assert all("forward" not in vars(m) for m in spear.quantized_linears(q).values())
    assert logs[0][0] == logs[1][0]  # the same forward math, bit for bit
    # later steps: gradients summed in another order (autograd of mm vs the op's VJP) -> float
    # rounding only; this toy model's KL is ~1e-4
    torch.testing.assert_close(torch.tensor(logs[0]), torch.tensor(logs[1]), rtol=0, atol=1e-7)


def test_calibrate_needs_ecs():
    ref = tiny_llama(vocab=256)
    q = spear.quantize_(copy.deepcopy(ref), spear.QuantConfig(), progress=False)
    with pytest.raises(ValueError, match="no attached ECs"):
        calibrate_(q, ref, torch.randint(0, 256, (2, 4)), CalibConfig(steps=1), progress=False)


def test_cosine_schedule_starts_at_full_lr_then_decays():
    def trained(schedule, steps):
        ref, q, seqs = _setup()
        calibrate_(q, ref, seqs, CalibConfig(steps=steps, batch_size=4, lr=5e-3, lr_ab=1e-3, schedule=schedule),
                   progress=False)
        return torch.cat([p.detach().flatten() for m in q.modules() if getattr(m, "ec", None) is not None
                          for p in m.ec.parameters()])

    assert torch.equal(trained("cosine", 1), trained("constant", 1))   # step 0 uses the full rate
    c, k = trained("cosine", 3), trained("constant", 3)
    assert not torch.equal(c, k)
    with pytest.raises(ValueError, match="schedule"):
        CalibConfig(schedule="linear")


@pytest.mark.parametrize("train_quant", [False, True])
def test_cuda_graph_step_trains_like_the_eager_loop(train_quant):
    """``cuda_graph=True``: on CUDA each step after the warm-up is one graph replay, with the same
    minibatches and cosine learning rates as the eager loop (losses and trained parameters, scales
    and zeros with ``train_quant``, agree); without CUDA the flag falls back to the eager loop exactly."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"

    def run(graph):
        ref, q, seqs = _setup()
        ref.to(dev), q.to(dev)
        log = calibrate_(q, ref, seqs.to(dev), CalibConfig(steps=8, batch_size=4, lr=5e-3, lr_ab=1e-3,
                                                           schedule="cosine", cuda_graph=graph,
                                                           train_quant=train_quant), progress=False)
        params = torch.cat([p.detach().flatten().cpu() for m in q.modules() if getattr(m, "ec", None) is not None
                            for p in [*m.ec.parameters(), m.scales, m.zeros]])
        return torch.tensor(log["losses"]), params

    (l_eager, p_eager), (l_graph, p_graph) = run(False), run(True)
    assert len(l_graph) == 8 and bool(l_graph[-1] < l_graph[0])
    if dev == "cpu":
        assert torch.equal(l_eager, l_graph) and torch.equal(p_eager, p_graph)
    else:  # capturable Adam computes its bias corrections on the device: equal up to rounding
        torch.testing.assert_close(l_graph, l_eager, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(p_graph, p_eager, rtol=1e-3, atol=1e-5)


def test_short_context_pieces_restart_from_bos():
    from spear_compile.compensators.calibrate import short_context

    seqs = torch.arange(2 * 10).reshape(2, 10) + 100
    out = short_context(seqs, bos_token_id=1, max_len=4)  # pieces [0:4], [BOS]+[5:8]; tail [8:10] dropped
    assert out.shape == (4, 4)
    assert torch.equal(out[:2], seqs[:, :4])
    assert torch.equal(out[2:, 0], torch.tensor([1, 1])) and torch.equal(out[2:, 1:], seqs[:, 5:8])
    assert short_context(seqs, 1, max_len=10) is seqs


def test_train_norms_moves_only_when_asked_and_restores_grad_flags():
    from spear_compile.compensators.calibrate import norm_parameters

    cfg = CalibConfig(steps=6, batch_size=4, lr=5e-3, lr_ab=1e-3, seed=0)
    ref, q, seqs = _setup()
    norms = norm_parameters(q)
    assert len(norms) == 2 * 2 + 1  # two per decoder layer + the final norm
    before = [p.detach().clone() for p in norms]
    flags = [p.requires_grad for p in norms]
    calibrate_(q, ref, seqs, cfg, progress=False)
    assert all(torch.equal(a, p) for a, p in zip(before, norms))  # default: norms untouched
    log = calibrate_(q, ref, seqs, dataclasses.replace(cfg, train_norms=True, lr_norm=1e-2), progress=False)
    assert any(not torch.equal(a, p) for a, p in zip(before, norms)) and len(log["losses"]) == 6
    assert [p.requires_grad for p in norms] == flags


def test_teacher_cache_is_capped_by_free_gpu_memory(monkeypatch):
    """A preset sized for an H200 must not run a smaller GPU out of memory: on CUDA the cache also
    has to fit half the free memory (else the teacher is recomputed per minibatch)."""
    from spear_compile.compensators.calibrate import teacher_cache_fits

    assert teacher_cache_fits(10, 10, "cpu") and not teacher_cache_fits(11, 10, "cpu")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (30, 100))
    assert teacher_cache_fits(15, 10**9, "cuda:0") and not teacher_cache_fits(16, 10**9, "cuda:0")
    assert not teacher_cache_fits(12, 10, "cuda:0")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_train_quant_starts_at_the_base_and_writes_back_what_it_trained(dtype, monkeypatch):
    """``QuantParams`` rebuild the dequantized weight exactly at their zero start; after training,
    the packed codes are unchanged, scales and zeros hold exactly the values training ended with
    (in the buffers' dtype: a bf16 model trains through that rounding), and the module's own
    (packed-op) forward computes what the training forward computed."""
    from spear_compile.compensators import calibrate as C

    ref, q, seqs = _setup()
    ref.to(dtype), q.to(dtype)
    from spear_compile.ops.w4a16_ref import dequantize_ref

    for m in spear.quantized_linears(q).values():  # (q - z) * s in fp32, whatever the buffers' dtype
        w = dequantize_ref(m.qweight, m.scales, m.zeros, m.group_size, "spear", dtype=torch.float32)
        assert torch.equal(C.QuantParams(m).weight(), w)
    made, orig = [], C.quant_params
    monkeypatch.setattr(C, "quant_params", lambda model: made.extend(orig(model)) or made)
    mods = spear.quantized_linears(q)
    codes = {n: m.qweight.clone() for n, m in mods.items()}
    before = {n: (m.scales.clone(), m.zeros.clone()) for n, m in mods.items()}
    calibrate_(q, ref, seqs, CalibConfig(steps=6, batch_size=4, lr=5e-3, lr_ab=1e-3, train_quant=True,
                                         lr_quant=1e-2), progress=False)
    assert len(made) == len(mods)
    for qp in made:
        m, (s0, z0) = qp.module, before[qp.module.name]
        s, z = qp.scales_zeros()
        assert torch.equal(m.scales, s.to(dtype)) and torch.equal(m.zeros, z.to(dtype))
        assert not torch.equal(m.scales, s0) and not torch.equal(m.zeros, z0)
        assert torch.equal(m.qweight, codes[m.name])
        assert not (m.scales.requires_grad or m.zeros.requires_grad)
    with torch.no_grad(), C._dense_forward(q, True, made):
        dense = q(seqs[:2]).logits
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(q(seqs[:2]).logits, dense, rtol=tol, atol=tol)


def test_train_quant_leaves_the_base_unchanged_after_an_error(monkeypatch):
    """Only a finished or Ctrl-C-stopped run writes scales and zeros back: an error mid-run (a
    failed graph capture, a NaN) must not leave a half-trained base behind."""
    from spear_compile.compensators import calibrate as C

    ref, q, seqs = _setup()
    before = {n: (m.scales.clone(), m.zeros.clone()) for n, m in spear.quantized_linears(q).items()}
    calls = []
    real = C.kl_logp_q

    def failing(*a):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom")
        return real(*a)

    monkeypatch.setattr(C, "kl_logp_q", failing)
    with pytest.raises(RuntimeError, match="boom"):
        calibrate_(q, ref, seqs, CalibConfig(steps=6, batch_size=4, train_quant=True, lr_quant=1e-2), progress=False)
    for n, m in spear.quantized_linears(q).items():
        assert torch.equal(m.scales, before[n][0]) and torch.equal(m.zeros, before[n][1])
    monkeypatch.setattr(C, "kl_logp_q", lambda *a: real(*a) * float("nan"))
    with pytest.raises(FloatingPointError, match="the KL is nan at step 0"):
        calibrate_(q, ref, seqs, CalibConfig(steps=2, batch_size=4, train_quant=True), progress=False)
    assert all(torch.equal(m.scales, before[n][0]) for n, m in spear.quantized_linears(q).items())
    # the write-back itself is all or none: one non-finite offset and nothing is written
    qps = C.quant_params(q)
    with torch.no_grad():
        qps[0].u.fill_(float("inf"))
        qps[1].u.fill_(0.5)
    with pytest.raises(FloatingPointError, match="non-finite scales or zeros in 1 module"):
        C._write_back(qps)
    assert all(torch.equal(m.scales, before[n][0]) for n, m in spear.quantized_linears(q).items())


def test_a_kl_that_blows_up_restores_the_ecs_and_says_so(monkeypatch):
    """Two good steps move the ECs, the third KL is NaN: calibrate_ raises, naming the learning
    rates, and the ECs are back where they started, not left NaN or half-trained."""
    from spear_compile.compensators import calibrate as C

    ref, q, seqs = _setup()
    ecs = {n: m.ec for n, m in spear.quantized_linears(q).items() if m.ec is not None}
    assert ecs
    start = {n: {k: v.clone() for k, v in ec.state_dict().items()} for n, ec in ecs.items()}
    calls, real = [], C.kl_logp_q

    def nan_third(*a):
        calls.append(1)
        return real(*a) * (float("nan") if len(calls) == 3 else 1.0)

    monkeypatch.setattr(C, "kl_logp_q", nan_third)
    with pytest.raises(FloatingPointError, match=r"the KL is nan at step 2.*lr_ab=0.01"):
        calibrate_(q, ref, seqs, CalibConfig(steps=5, batch_size=4, lr_ab=1e-2), progress=False)
    for n, ec in ecs.items():
        for k, v in ec.state_dict().items():
            assert torch.equal(v, start[n][k]), (n, k)


def test_train_quant_alone_lowers_held_out_kl_and_needs_dense_weights():
    """With no ECs at all (the zero-byte ablation), training scales and zeros still lowers the KL
    on held-out self-samples; without the dense forward it is refused up front."""
    ref = tiny_llama(hidden=64, layers=2, vocab=256, seed=0)
    q = spear.quantize_(copy.deepcopy(ref), spear.QuantConfig(group_size=None), progress=False)
    seqs = sample_sequences(ref, 16, 24, bos_token_id=ref.config.bos_token_id, batch_size=8, seed=0, progress=False)
    before = mean_kl(ref, q, seqs[12:])
    log = calibrate_(q, ref, seqs[:12], CalibConfig(steps=25, batch_size=4, train_quant=True, lr_quant=1e-2),
                     progress=False)
    assert log["steps"] == 25 and mean_kl(ref, q, seqs[12:]) < 0.9 * before
    with pytest.raises(ValueError, match="train_quant=True needs dense_weights"):
        CalibConfig(train_quant=True, dense_weights=False)
