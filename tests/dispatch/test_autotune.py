"""``dispatch.autotune`` and ``spear_compile.tune`` / ``spear tune``: which shapes a model needs, which jobs
measure them, the time budget, and that what a run writes is what the route then reads (the measuring
itself runs on a GPU: here a stand-in measures)."""
import json

import pytest
import torch

import spear_compile as spear
from spear_compile import cli
from spear_compile.dispatch import autotune as AT
from spear_compile.dispatch import keys as TK
from spear_compile.dispatch import route as R
from spear_compile.dispatch import table as TT
from spear_compile.tuner import shapes_from_config, shapes_of
from tests.helpers import use_tuned_table

QWEN = {"model_type": "qwen2", "hidden_size": 3584, "num_attention_heads": 28, "num_key_value_heads": 4,
        "intermediate_size": 18944}


def test_shapes_of_a_gqa_config_include_the_concatenations():
    got = {(s.N, s.K, s.G, s.decode, s.prefill) for s in shapes_from_config(QWEN)}
    # the concatenations run as one GEMV at decode and one GEMM at M = 2..256: both kinds of entry
    assert got == {(3584, 3584, 128, True, True), (512, 3584, 128, True, True), (18944, 3584, 128, True, True),
                   (3584, 18944, 128, True, True), (3584 + 2 * 512, 3584, 128, True, True),
                   (2 * 18944, 3584, 128, True, True)}
    assert {s.G for s in shapes_from_config(QWEN, group_size=0)} == {3584, 18944}  # per channel
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        shapes_from_config({"model_type": "gpt2"})


def test_shapes_of_a_quantized_model_without_a_compiled_plan():
    from spear_compile.models.tiny import tiny_llama

    model = tiny_llama(hidden=128, intermediate=256, heads=4, kv_heads=2)
    with pytest.raises(ValueError, match="no quantized linear"):
        shapes_of(model)
    spear.quantize_(model, spear.QuantConfig(group_size=64))
    got = {(s.N, s.K, s.G, s.prefill) for s in shapes_of(model)}
    assert {(128, 128, 64, True), (64, 128, 64, True), (256, 128, 64, True), (128, 256, 64, True)} <= got
    assert (128 + 2 * 64, 128, 64, True) in got and (512, 128, 64, True) in got  # the concatenations


def test_shapes_of_a_per_channel_model_include_the_concatenations():
    """Per channel, each linear's group is its own K (128 or 256 here): the concatenations read hidden, so they
    are per channel over hidden."""
    from spear_compile.models.tiny import tiny_llama

    model = tiny_llama(hidden=128, intermediate=256, heads=4, kv_heads=2)
    spear.quantize_(model, spear.QuantConfig(group_size=None))
    got = {(s.N, s.K, s.G, s.prefill) for s in shapes_of(model)}
    assert (128 + 2 * 64, 128, 128, True) in got and (512, 128, 128, True) in got
    assert (128, 256, 256, True) in got  # down: per channel over the intermediate width


def test_jobs_are_one_per_table_entry_decode_first():
    shapes = [AT.LinearShape(4096, 4096, 128), AT.LinearShape(12288, 4096, 128, prefill=False)]
    jobs = AT.jobs_for(shapes + shapes[:1], ms=[1, 3, 4, 100])
    assert [j.describe() for j in jobs] == ["gemv1 4096x4096 g128", "gemv1 12288x4096 g128",
                                            "gemm 4096x4096 g128 M=4", "gemm 4096x4096 g128 M=128"]
    assert AT.jobs_for(shapes, ms=[8]) == [AT.Job("gemm", 4096, 4096, 128, 8)]
    with pytest.raises(ValueError, match="positive integers"):
        AT.jobs_for(shapes, ms=[0])
    with pytest.raises(ValueError, match="K=4095 must be even"):
        AT.LinearShape(8, 4095, 4095)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_run_stops_at_the_budget_and_the_route_reads_what_it_wrote(monkeypatch, tmp_path):
    monkeypatch.setenv("SPEAR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(TT, "gpu_key", lambda device=None: "TEST_GPU")
    use_tuned_table(monkeypatch, {})
    clock = Clock()
    jobs = AT.jobs_for([AT.LinearShape(4096, 4096, 128)], ms=[1, 64, 256])

    def measure(job):
        clock.t += 10.0
        if job.M == 256:
            raise RuntimeError("no kernel config ran")
        if job.family == "gemv1":
            return {TK.gemv1_key(job.N, job.K, job.G, False): [8, 256, 2, 1]}
        return {TK.gemm_key(job.M, job.N, job.K, job.G): [64, 128, 64, 4, 4]}

    rep = AT.run(jobs, budget_s=25, progress=False, measure_fn=measure, clock=clock)
    assert [j.describe() for j, _, _ in rep.done] == ["gemv1 4096x4096 g128", "gemm 4096x4096 g128 M=64"]
    assert [j.describe() for j, _ in rep.failed] == ["gemm 4096x4096 g128 M=256"] and rep.left == []
    rep2 = AT.run(jobs, budget_s=15, progress=False, save=False, measure_fn=measure, clock=clock)
    assert len(rep2.done) == 2 and [j.M for j in rep2.left] == [256]
    saved = TT.read(rep.path)  # this GPU's user table, under the cache directory
    assert rep.path.startswith(str(tmp_path)) and "TEST_GPU" in rep.path
    assert saved[TK.gemm_key(64, 4096, 4096, 128)] == [64, 128, 64, 4, 4]
    p = R.Problem(op="w4a16", M=40, N=4096, K=4096, G=128, dtype=torch.bfloat16,
                  param_dtypes=(torch.bfloat16, torch.bfloat16), device=torch.device("cuda"))
    assert R.gemm_route(p).config == (64, 128, 64, 4, 4)  # the process's table holds it at once
    assert R.tuned_key(TK.gemm_key(64, 3584, 3584, 128)) == TK.gemm_key(64, 4096, 4096, 128)  # and stands in near
    with pytest.raises(ValueError, match="budget_s"):
        AT.run(jobs, budget_s=0)


def test_tune_needs_a_gpu_and_the_cli_lists_the_jobs_without_one(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(QWEN))
    assert cli.main(["tune", str(tmp_path), "--dry-run", "--ms", "1", "16"]) == 0
    out = capsys.readouterr().out
    assert "6 shapes, 12 jobs" in out and "gemv1 4608x3584 g128" in out and "gemm 512x3584 g128 M=16" in out
    assert "gemm 4608x3584 g128 M=16" in out  # the q / k / v concatenation runs as one GEMM at M = 2..256
    with pytest.raises(SystemExit, match="no config at"):
        cli.main(["tune", str(tmp_path / "missing"), "--dry-run"])
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA GPU"):
            spear.tune(shapes=[AT.LinearShape(4096, 4096, 128)])


def test_shapes_of_a_compiled_model_are_the_ops_its_graphs_run(tmp_path, monkeypatch):
    """From the backend's plan: the decode graph's concatenations (decode only), a batched graph's (M = 8: one
    GEMM each, so tuned as GEMMs) and the prefill graph's separate linears (M = 300, past the concatenation's
    range), with the rows each runs at. (Its own registry of compiled graphs and a Dynamo reset after: the
    graphs of this model must not stand in for other tests' models.)"""
    import torch._dynamo

    from spear_compile.models.tiny import tiny_llama
    from spear_compile.passes import compiled_plans

    monkeypatch.setenv("SPEAR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compiled_plans, "_GRAPHS", [])
    torch.manual_seed(0)
    m = tiny_llama(hidden=96, intermediate=160, layers=2).eval()  # 4 heads of 24, 2 KV heads
    spear.quantize_(m, spear.QuantConfig(group_size=32), progress=False)
    try:
        c = torch.compile(m, backend="spear", dynamic=False)
        with torch.no_grad():
            c(torch.randint(0, 100, (1, 8)))  # batched (M = 8)
            c(torch.randint(0, 100, (1, 300)))  # prefill (M = 300)
            c(torch.randint(0, 100, (1, 1)))  # decode (M = 1)
        got = {(s.N, s.K, s.G, s.decode, s.prefill) for s in shapes_of(c)}
        jobs = AT.jobs_for(shapes_of(c), ms=[1, 8])
    finally:
        torch._dynamo.reset()
    assert (96 + 2 * 48, 96, 32, True, False) in got  # q / k / v concatenated at decode
    assert {(96 + 2 * 48, 96, 32, False, True), (2 * 160, 96, 32, False, True)} <= got  # and at M = 8
    assert {(96, 96, 32, False, True), (48, 96, 32, False, True), (160, 96, 32, False, True),
            (96, 160, 32, False, True)} <= got  # each linear alone at prefill
    assert {j.family for j in jobs} == {"gemv1", "gemm"}
    assert all(j.M == 8 for j in jobs if j.family == "gemm")
