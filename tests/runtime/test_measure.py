"""Measuring on CPU with tiny shapes: the tables, the whole-step check, the plan's routes."""
import pytest

from spear_compile.runtime import latency_cache as lc
from spear_compile.runtime.fit import check
from spear_compile.runtime.measure import (SyntheticStep, default_buckets, default_step_grid, measure_and_fit,
                                           measure_latency_model, measure_steps)
from spear_compile.runtime.plan import Plan, PlannedLinear


def tiny_plan(ec_rank=0, routes=()):
    lins = (PlannedLinear("qkv", 32, 96, count=2, routes=routes), PlannedLinear("o", 32, 32, ec_rank=ec_rank, count=2),
            PlannedLinear("mlp", 32, 64, count=2))
    return Plan("tiny", "cfg0", lins, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, hidden_size=32, vocab_size=64)


def test_default_buckets():
    assert default_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert default_buckets(48) == (1, 2, 4, 8, 16, 32, 48)
    # every multiple of 64 to 512 (the padded Ms a graphed engine runs; the route keys configs by the next
    # power of two, so 192 is not the midpoint of 128 and 256), then 1.5x steps, and max_m itself
    assert default_buckets(256) == (1, 2, 4, 8, 16, 32, 64, 128, 192, 256)
    assert default_buckets(2048) == (1, 2, 4, 8, 16, 32, 64, 128, 192, 256, 320, 384, 448, 512, 768, 1024, 1536,
                                     2048)
    assert default_buckets(1000)[-4:] == (448, 512, 768, 1000)
    with pytest.raises(ValueError, match="max_m=0"):
        default_buckets(0)


def test_measure_on_cpu_is_quick_and_positive(capsys):
    m = measure_latency_model(tiny_plan(ec_rank=4), max_m=32, max_context=64, warmup=1, reps=2, progress=False)
    assert "measuring the latency model" in capsys.readouterr().out
    assert [lt.name for lt in m.linears] == ["qkv", "o", "mlp"] and m.max_bucket == 32
    a = m.predict_step_ms([10], [(16, 0)])
    assert a > 0 and m.predict_step_ms([10] * 4, [(32, 8)]) >= a  # monotone in the work


def test_measure_and_check_whole_steps():
    plan = tiny_plan()
    grid = default_step_grid(32, contexts=(16,), decode_batches=(0, 2), prefill_tokens=(0, 8))
    model, samples = measure_and_fit(plan, max_m=32, max_context=64, grid=grid, warmup=1, reps=2, progress=False)
    assert len(samples) == len(grid)
    rep = check(model, samples)
    assert rep.n == len(grid) and 0 <= rep.median_abs_rel_err <= rep.p90_abs_rel_err <= rep.max_abs_rel_err


def test_synthetic_step_runs_every_shape():
    step = SyntheticStep(tiny_plan(ec_rank=2), max_m=32, max_context=64)
    out = measure_steps(step, [((5, 9), ((3, 4),)), ((), ((32, 0),))], warmup=0, reps=1, progress=False)
    assert all(s.measured_ms > 0 for s in out)


def test_unknown_route_is_named():
    plan = tiny_plan(routes=((16, "reference"), (4096, "w4_tma_gemm")))
    assert plan.routes == ("reference", "w4_tma_gemm")
    with pytest.raises(ValueError, match="w4_tma_gemm"):
        measure_latency_model(plan, max_m=8, progress=False, log=lambda s: None)
    seen = []

    def runner(lin, m, device, dtype):
        seen.append((lin.name, m))
        return lambda: None

    measure_latency_model(plan, max_m=32, reps=1, warmup=0, progress=False, log=lambda s: None,
                          runners={"w4_tma_gemm": runner}, attention_grid=((1, 0),))
    assert seen == [("qkv", 32)]  # the route above M = 16 only


def test_plan_validates_and_keys_the_cache(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="n_kv_heads"):
        Plan("m", "h", (), 1, 3, 2, 8, 8, 8)
    with pytest.raises(ValueError, match="strictly increasing"):
        PlannedLinear("x", 4, 4, routes=((8, "a"), (8, "b")))
    with pytest.raises(ValueError, match="unique"):
        Plan("m", "h", (PlannedLinear("x", 4, 4), PlannedLinear("x", 4, 4)), 1, 2, 2, 8, 8, 8)
    monkeypatch.setenv("SPEAR_CACHE_DIR", str(tmp_path))
    key = lc.CacheKey.for_plan(tiny_plan(), device="cpu")
    assert (key.gpu, key.model_id, key.config_hash) == ("cpu", "tiny", "cfg0")
