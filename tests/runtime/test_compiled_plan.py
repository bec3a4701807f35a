"""The backend's record of what it compiled, the plan built from it, and scheduler_for on top."""
from __future__ import annotations

import pytest
import torch

import spear_compile as spear
from spear_compile import QuantConfig, runtime
from spear_compile.models.tiny import tiny_llama
from spear_compile.passes import compiled_plans
from spear_compile.quant.linear import QuantLinear
from spear_compile.runtime.plan import PlannedOp, ops_at
from spear_compile.runtime.state import KVCache, RunningDecode, SchedulerState, WaitingRequest

EC_ON = ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj")


def _ec(d_in, d_out, rank, seed):
    torch.manual_seed(seed)
    ec = spear.ErrorCompensator(d_in, d_out, spear.ECConfig(rank=rank, gate_hidden=4))
    with torch.no_grad():
        for p in ec.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return ec


def _model(ecs: bool = True):
    torch.manual_seed(0)
    m = tiny_llama(layers=2).eval()
    spear.quantize_(m, QuantConfig(group_size=32), progress=False)
    if ecs:
        mods = dict(m.named_modules())
        spear.attach_(m, {n: _ec(mods[n].in_features, mods[n].out_features, 4 + i, i) for i, n in enumerate(EC_ON)})
    return m


def _compiled(m):
    c = torch.compile(m, backend="spear", dynamic=False)
    with torch.no_grad():
        c(torch.randint(0, 100, (1, 8)))  # a prefill graph (M = 8)
        c(torch.randint(0, 100, (1, 1)))  # a decode graph (M = 1)
    return c


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPEAR_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_plan_of_a_model_not_compiled_says_what_to_do():
    with pytest.raises(runtime.PlanError, match="compile it"):
        runtime.plan_of(_model(ecs=False))


def test_plan_covers_every_quantized_linear_once_with_its_ec_rank(cache_dir):
    m = _model()
    plan = runtime.plan_of(_compiled(m))
    quant = {n: mod for n, mod in m.named_modules() if isinstance(mod, QuantLinear)}
    # every weight's rows counted exactly once over the plan's linears
    assert sum(lin.count * lin.out_features for lin in plan.linears) == sum(q.out_features for q in quant.values())
    with_ec = [lin for lin in plan.linears if lin.ec_rank]
    assert sorted(lin.ec_rank for lin in with_ec) == [4, 5]  # the ranks attached to EC_ON
    # layer 0's q (EC) fused at decode with its plain k and v: one linear named by its weights (the last, v)
    assert {lin.name.split(".")[-1].split("#")[0] for lin in with_ec} == {"v_proj", "down_proj"}
    qkv = next(lin for lin in with_ec if lin.ec_rank == 4)
    assert "q_proj" in qkv.name and "k_proj" in qkv.name and qkv.count == 1
    for lin in plan.linears:  # both graphs recorded: a route at decode and at prefill
        assert lin.route_at(1) != "unknown" and lin.route_at(8) != "unknown"
        assert {o.m_lo for o in lin.ops} == {1, 8}
    # the decode graph fused gate / up into one GLU op (CPU rewrites too); at M = 8 one concatenated GEMM
    glu = next(lin for lin in plan.linears if "gate_proj" in lin.name)
    assert [o.op for o in ops_at(glu.ops, 1)] == ["w4a16_glu"]
    assert [o.op for o in ops_at(glu.ops, 8)] == ["w4a16_cat"]
    assert (plan.n_layers, plan.n_heads, plan.n_kv_heads, plan.head_dim) == (2, 4, 2, 16)
    assert plan.dtype == "float32" and plan.vocab_size == m.config.vocab_size


def test_records_survive_a_cache_hit_and_rerun_the_passes_when_none_is_saved(cache_dir, monkeypatch):
    first = runtime.plan_of(_compiled(_model()))
    again = _model()
    second = runtime.plan_of(_compiled(again))  # the same graphs: Inductor's cache may answer
    assert second.linears == first.linears and second.config_hash == first.config_hash
    assert {g.source for g in compiled_plans.graphs_of(again)} <= {"passes", "cache"}
    # no saved record and a cache hit: the backend compiles once more with the caches off
    monkeypatch.setattr(compiled_plans, "load", lambda key: None)
    third = _model()
    assert runtime.plan_of(_compiled(third)).linears == first.linears
    assert {g.source for g in compiled_plans.graphs_of(third)} == {"passes"}


def test_saved_records_round_trip(cache_dir):
    recs = [{"op": "w4a16", "weights": ["a"], "parts": [[8, 0, 0]], "K": 64}]
    assert compiled_plans.save("k1", recs, "fp") is not None
    assert compiled_plans.load("k1") == recs
    assert compiled_plans.load("other") is None
    (cache_dir / "plans" / "k2.json").write_text("{not json")
    assert compiled_plans.load("k2") is None


def test_scheduler_for_measures_once_then_reads_the_cache(cache_dir):
    c = _compiled(_model())
    logs: list = []
    policy = runtime.scheduler_for(c, slo_itl_ms=1000.0, max_chunk=32, min_chunk=8, progress=False,
                                   log=logs.append, reps=2, warmup=1)
    assert any("measuring the latency model" in s for s in logs)
    assert (cache_dir / "latency").is_dir() and list((cache_dir / "latency").iterdir())
    logs.clear()
    again = runtime.scheduler_for(c, slo_itl_ms=1000.0, max_chunk=32, min_chunk=8, progress=False, log=logs.append)
    assert not any("measuring" in s for s in logs)
    assert again.model.to_dict() == policy.model.to_dict()
    padded = runtime.scheduler_for(c, slo_itl_ms=1000.0, max_chunk=32, min_chunk=8, progress=False,
                                   log=logs.append, token_pad=16)
    assert padded.model == policy.model.with_token_pad(16) and policy.model.token_pad == 1  # the cache unpadded
    state = SchedulerState(decodes=(RunningDecode("d", 40),), waiting=(WaitingRequest("w", 1, 100),),
                           kv=KVCache(block_size=16, free_blocks=64))
    plan = policy.plan(state)
    assert plan.decode_ids == ("d",) and 8 <= plan.prefill_tokens <= 32


def test_planned_op_checks_and_nearest_ops():
    with pytest.raises(ValueError, match="op='gemm'"):
        PlannedOp("gemm", ((8, 0, 0),), 64, 32)
    with pytest.raises(ValueError, match="m_hi=1 < m_lo=8"):
        PlannedOp("w4a16", ((8, 0, 0),), 64, 32, m_lo=8, m_hi=1)
    dec = PlannedOp("w4a16_cat", ((8, 0, 0), (8, 0, 0)), 64, 32, m_lo=1, m_hi=1, routes=((1, "cat"),))
    pre = PlannedOp("w4a16", ((8, 0, 0),), 64, 32, m_lo=8, m_hi=8, routes=((8, "gemm"),))
    assert ops_at((dec, pre), 1) == (dec,) and ops_at((dec, pre), 8) == (pre,)
    assert ops_at((dec, pre), 64) == (pre,) and ops_at((dec, pre), 3) == (dec,)  # nearest graph


def test_eager_plan_has_one_op_per_quantized_linear_at_every_m():
    m = _model()
    plan = runtime.plan_of(m, eager=True)
    quant = {n: mod for n, mod in m.named_modules() if isinstance(mod, QuantLinear)}
    assert sum(lin.count for lin in plan.linears) == len(quant)
    assert sorted(lin.ec_rank for lin in plan.linears if lin.ec_rank) == [4, 5]
    for lin in plan.linears:
        (op,) = lin.ops
        assert op.op in ("w4a16", "ec") and op.m_lo == 1 and op.m_hi is None
        assert lin.route_at(1) == lin.route_at(4096) == "reference"  # CPU: the PyTorch reference
    assert plan.config_hash != runtime.plan_of(_compiled(_model())).config_hash


def test_a_layer_frames_graph_counts_for_every_layer_it_serves():
    """A forward that breaks its graph inside a layer (the engine's paged attention) compiles each layer
    frame once, its weights named from the frame's module, and runs that code for every layer that passes
    its guards: the plan repeats such a graph for each module prefix whose linears have the rows, EC rank
    and gate width it compiled, so every quantized linear is counted once, with its own EC."""
    from spear_compile.runtime.compiled import instance_records, planned_linears

    m = _model()  # two layers; layer 0's q_proj and layer 1's down_proj carry ECs of rank 4 and 5
    eager = {r["weights"][0]: r for r in runtime.compiled.eager_records(m)}

    def frame(names, layer: int, relative: bool = True):
        recs = [eager[f"model.layers.{layer}.{n}"] for n in names]
        recs = [{**r, "weights": [n.split(".", 1)[1] if n.startswith("self_attn.") else n]} if relative else r
                for r, n in zip(recs, names)]
        return compiled_plans.CompiledGraph(f"{names[0]}{layer}", recs, "", [], "passes")

    attn = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
    mlp = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    # the attention frame named from the attention module (q_proj), the rest of the layer from the layer
    # (mlp.gate_proj); layer 1's MLP in a graph named from the root; the head's graph has no record
    graphs = [frame(attn, 0), frame(attn, 1), frame(mlp, 0), frame(mlp, 1, relative=False),
              compiled_plans.CompiledGraph("head", [], "", [], "passes")]
    recs = instance_records(graphs, m)
    assert sorted(w for r in recs for w in r["weights"]) == sorted(eager)  # each linear once, named from the root
    assert {w: r["parts"] for r in recs for w in r["weights"]} == {w: r["parts"] for w, r in eager.items()}
    plan = planned_linears(recs)
    assert sum(lin.count for lin in plan) == len(eager) == 14
    assert sorted(lin.ec_rank for lin in plan if lin.ec_rank) == [4, 5]
    # one frame compiled for several layers: both layers' o_proj (no EC) come from layer 0's attention graph
    # when layer 1's has the same structure
    same = [frame(("self_attn.o_proj",), 0)]
    assert [r["weights"] for r in instance_records(same, m)] == [["model.layers.0.self_attn.o_proj"],
                                                                 ["model.layers.1.self_attn.o_proj"]]
    # a graph no module fits (compiled before the ECs changed, or for another model of the same shapes,
    # named from a frame or from the root) is left out; if no graph fits, the plan is refused
    stale = [compiled_plans.CompiledGraph("x", [{**eager["model.layers.0.self_attn.q_proj"], "weights": ["q_proj"],
                                                 "parts": [[128, 9, 4]]}], "", [], "passes"),
             compiled_plans.CompiledGraph("y", [{**eager["model.layers.1.mlp.down_proj"], "parts": [[64, 0, 0]]}],
                                          "", [], "passes")]
    assert instance_records(stale + graphs, m) == recs
    with pytest.raises(runtime.PlanError, match=r"\['q_proj'\]"):
        instance_records(stale, m)
