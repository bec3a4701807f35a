"""The engine on CUDA with transformers' CUDA graphs and the step's exact token counts.

transformers runs an eager warm-up before each graph capture inside its graphs' shared memory pool. Kernel
state made there (weight layouts, EC workspaces, tickets) was clobbered by later graphs' buffers: the
one-launch decode EC spun to its limit (4.28 ms per launch) and a compiled engine with ECs hit an illegal
memory access on the first replay of a prefill graph (H200, ``benchmarks/results/engine_profile/
2026-12-04_h200_graph_pool/``). Here: ECs on every linear, one engine with graphs and one without, each
serving the same prompts twice (the second time replays the graphs the first captured); the tokens must
agree everywhere (same kernels, same shapes).
"""
import pytest
import torch

import spear_compile as spear
from spear_compile.compensators.init import random_ecs
from spear_compile.models.tiny import tiny_llama
from spear_compile.runtime import Engine, StaticChunkPolicy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="transformers' CUDA graphs need a GPU")


def test_graphed_engine_with_ecs_replays_and_gives_the_tokens_of_the_ungraphed_one(monkeypatch):
    import torch._dynamo

    from spear_compile.passes import compiled_plans

    monkeypatch.setattr(compiled_plans, "_GRAPHS", [])  # this model's graphs stand in for no other test's
    model = tiny_llama(hidden=256, layers=2, heads=4, kv_heads=2, intermediate=512, vocab=512,
                       dtype=torch.bfloat16).cuda()
    spear.quantize_(model, spear.QuantConfig(group_size=128), progress=False)
    ecs = random_ecs(model, spear.ECConfig(rank=16, gate_hidden=4), seed=0)
    spear.attach_(model, {k: ec.to(device="cuda", dtype=torch.bfloat16) for k, ec in ecs.items()})
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 9)]
    outs = {}
    for graphs in (False, True):
        eng = Engine(model, None, policy=StaticChunkPolicy(64), compile=True, max_batch_tokens=128, block_size=256,
                     num_blocks=16, cb_config={"q_padding_interval_size": 1, "use_cuda_graph": graphs})
        eng.start()
        try:
            first = eng.generate(prompts, max_new_tokens=8)
            second = eng.generate(prompts, max_new_tokens=8)  # with graphs: replays of the captured ones
        finally:
            eng.stop()
            torch._dynamo.reset()
        assert first == second, graphs
        assert all(len(o) > 0 for o in first)
        outs[graphs] = first
    assert outs[True] == outs[False]


def test_async_batching_engine_gives_the_tokens_of_the_synchronous_one_and_times_steps_one_call_later(monkeypatch):
    """transformers' asynchronous batching plans step k while step k - 1 runs: the same greedy tokens as the
    synchronous loop, and the engine's step timing (``step_gaps``) shifted by one call."""
    import torch._dynamo

    from spear_compile.passes import compiled_plans

    monkeypatch.setattr(compiled_plans, "_GRAPHS", [])
    model = tiny_llama(hidden=256, layers=2, heads=4, kv_heads=2, intermediate=512, vocab=512,
                       dtype=torch.bfloat16).cuda()
    spear.quantize_(model, spear.QuantConfig(group_size=128), progress=False)
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 9, 40)]
    outs = {}
    for asy in (False, True):
        eng = Engine(model, None, policy=StaticChunkPolicy(16), compile=True, max_batch_tokens=128, block_size=256,
                     num_blocks=16, attention="varlen", async_batching=asy)
        eng.start()
        try:
            assert eng.step_lag == int(asy) and eng._scheduler_cls.lag == int(asy)
            outs[asy] = eng.generate(prompts, max_new_tokens=12)
        finally:
            eng.stop()
            torch._dynamo.reset()
    assert all(len(o) == 12 for o in outs[False])
    assert outs[True] == outs[False]
