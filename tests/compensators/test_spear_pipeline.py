"""fit_spear_: damage -> plan -> QERA-exact init -> KL training, end to end on a tiny Llama."""
import copy

import pytest
import torch

import spear_compile as spear
from spear_compile import ECConfig
from spear_compile.compensators.calibrate import CalibConfig, mean_kl, sample_sequences
from spear_compile.compensators.init import random_ecs
from spear_compile.compensators.selection import ec_bytes
from spear_compile.compensators.spear import SpearConfig, fit_spear_
from spear_compile.models import tiny_llama


def _setup():
    ref = tiny_llama(hidden=64, layers=2, vocab=256, seed=1)
    q = spear.quantize_(copy.deepcopy(ref), spear.QuantConfig(), progress=False)
    seqs = sample_sequences(ref, 12, 24, bos_token_id=ref.config.bos_token_id, batch_size=6, seed=1, progress=False)
    return ref, q, seqs


@pytest.mark.parametrize("allocation", ["greedy", "shared"])
def test_fit_spear_respects_budget_and_lowers_held_out_kl(allocation):
    ref, q, seqs = _setup()
    train, held = seqs[:8], seqs[8:]
    before = mean_kl(ref, q, held)
    budget = 6 * ec_bytes(64, 64, 4)
    cfg = SpearConfig(allocation=allocation, calib=CalibConfig(steps=15, batch_size=4, lr=5e-3, lr_ab=1e-3))
    ecs, log = fit_spear_(ref, q, train, budget, cfg, progress=False)
    assert ecs and sum(ec_bytes(e.out_features, e.in_features, e.rank) for e in ecs.values()) <= budget
    attached = {n for n, m in spear.quantized_linears(q).items() if m.ec is not None}
    assert attached == set(ecs) == {m["name"] for m in log["plan"]["modules"]}
    if allocation == "shared":
        assert len({e.rank for e in ecs.values()}) == 1
    assert set(log["seconds"]) == {"damage", "stats", "init", "calibrate", "total"}
    assert len(log["losses"]) == 15
    assert mean_kl(ref, q, held) < 0.8 * before


def test_fit_spear_errors_name_the_problem():
    ref, q, seqs = _setup()
    with pytest.raises(ValueError, match=r"seqs must be \[n, T\]"):
        fit_spear_(ref, q, seqs[0], 10_000, progress=False)
    with pytest.raises(ValueError, match="no quantized linears"):
        fit_spear_(ref, copy.deepcopy(ref), seqs, 10_000, progress=False)
    with pytest.raises(ValueError, match="allocation"):
        SpearConfig(allocation="uniform")
    with pytest.raises(ValueError, match="integer token ids, got torch.float32"):
        fit_spear_(ref, q, seqs.float(), 10_000, progress=False)
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 256\)"):
        fit_spear_(ref, q, seqs + 1000, 10_000, progress=False)
    with pytest.raises(ValueError, match="budget_bytes=-1: expected an integer >= 0"):
        fit_spear_(ref, q, seqs, -1, progress=False)
    with pytest.raises(ValueError, match="ref must be the full-precision model"):
        fit_spear_(q, q, seqs, 10_000, progress=False)
    name = next(iter(spear.quantized_linears(q)))
    spear.attach_(q, {name: random_ecs(q, ECConfig(rank=2))[name]})
    with pytest.raises(ValueError, match=r"1 module\(s\) of the model already carry ECs"):
        fit_spear_(ref, q, seqs, 10_000, progress=False)


def test_spear_config_replace_routes_fields_and_names_unknown_ones():
    from spear_compile.compensators.spear import SpearConfig

    c = SpearConfig().replace(select="all", steps=7, lr_ab=1e-3, min_rank=1)
    assert (c.select, c.min_rank, c.calib.steps, c.calib.lr_ab) == ("all", 1, 7, 1e-3)
    assert SpearConfig().calib.steps != 7                      # the default is untouched
    with pytest.raises(ValueError, match="stepz"):
        SpearConfig().replace(stepz=3)
    with pytest.raises(ValueError, match="min_rank"):
        SpearConfig(allocation="shared", min_rank=2)


def test_gpu_preset_is_the_sweep_winner_and_presets_follow_the_device():
    """GPU_PRESET must be exactly what benchmarks/spear_sweep.py chose on the development plays
    (its best.json), so the reported H200 numbers are the library's default there."""
    import json
    import os

    from spear_compile.compensators.spear import CPU_PRESET, GPU_PRESET, SpearConfig, parse_overrides, preset

    best = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "results", "quality",
                        "2026-11-30_h200_sweep_calib_tokens", "best.json")
    with open(best) as f:
        assert GPU_PRESET == SpearConfig().replace(**json.load(f))
    assert preset("cpu") is CPU_PRESET and preset("cuda:0") is GPU_PRESET
    assert preset("cpu", "gpu") is GPU_PRESET and preset("cuda", "cpu") is CPU_PRESET
    from spear_compile.config import default_device

    assert default_device("cuda:1") == torch.device("cuda", 1)
    assert default_device().type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert preset() is (GPU_PRESET if torch.cuda.is_available() else CPU_PRESET)
    with pytest.raises(ValueError, match="name='tpu'"):
        preset(name="tpu")
    assert parse_overrides("select=all, steps=240,lr_ab=1e-3") == {"select": "all", "steps": 240, "lr_ab": 1e-3}
    with pytest.raises(ValueError, match="key=value"):
        parse_overrides("steps")


def test_gate_init_bias_reaches_the_ecs_and_sets_how_far_the_gate_moves():
    """At the default bias 6 the sigmoid's slope is 0.0025, so the trained gate stays nearly constant
    over inputs; at 0 the same training makes it input-dependent (what the gate is for)."""
    ref, q, seqs = _setup()
    budget = 6 * ec_bytes(64, 64, 4)
    spread = {}
    for bias in (6.0, 0.0):
        qb = copy.deepcopy(q)
        cfg = SpearConfig(gate_init_bias=bias, calib=CalibConfig(steps=15, batch_size=4, lr=5e-3, lr_ab=1e-3))
        ecs, _ = fit_spear_(ref, qb, seqs[:8], budget, cfg, progress=False)
        assert ecs and all(e.cfg.gate_init_bias == bias for e in ecs.values())
        torch.manual_seed(0)
        gains = []
        for ec in ecs.values():
            h = torch.randn(256, ec.in_features) @ ec.A.detach().T
            z = torch.nn.functional.silu(h @ ec.W1.detach().T + ec.b1.detach()) @ ec.W2.detach().T + ec.b2.detach()
            gains.append((ec.alpha.detach() * torch.sigmoid(z)).std(0).mean())  # per-component spread over inputs
        spread[bias] = torch.stack(gains).mean().item()
    assert spread[0.0] > 10 * spread[6.0], spread


def test_fit_spear_with_train_quant_runs_at_zero_budget():
    """The zero-byte ablation (``train_quant`` with no EC budget): no EC is planned or attached,
    the scales and zeros alone are trained, and the held-out KL drops."""
    ref, q, seqs = _setup()
    before = mean_kl(ref, q, seqs[8:])
    cfg = SpearConfig(calib=CalibConfig(steps=15, batch_size=4, lr=5e-3, lr_ab=1e-3, train_quant=True,
                                        lr_quant=1e-2))
    ecs, log = fit_spear_(ref, q, seqs[:8], 0, cfg, progress=False)
    assert not ecs and log["plan"]["modules"] == [] and len(log["losses"]) == 15
    assert mean_kl(ref, q, seqs[8:]) < before
