"""Tensor parallelism across spawned CPU processes (gloo on loopback, a FileStore): the sharded tiny Llama
with ECs on every linear (at 2 ranks loaded from a single-process artifact) equals the single-process
model at 2 and 3 ranks, eager, as the fused op, and
compiled by the spear backend (2 ranks: the pass fuses both row-parallel layers, no collective is left
outside the fused op); gating each rank's partial instead changes the output; a peer that dies gives a
PeerTimeoutError naming it on the others, and so does one that stays alive elsewhere past the timeout:
never a hang.

What the ranks run is in ``tp_workers.py``; each writes its measurements for this process to check."""
import os
import time

import pytest
import torch
import torch.multiprocessing as mp

from tests.parallel import tp_workers

TOL = 1e-4  # fp32 logits of magnitude ~1: the partial sums are added in another order than one GEMM's


def _spawn(fn, world: int, tmp_path, *args, limit_s: float = 240.0) -> list[dict]:
    ctx = mp.start_processes(fn, args=(world, str(tmp_path / "store"), str(tmp_path), *args), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + limit_s
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"{world} ranks of {fn.__name__} still running after {limit_s} s")
    out = []
    for r in range(world):
        path = os.path.join(tmp_path, f"rank{r}.pt")
        out.append(torch.load(path) if os.path.exists(path) else {"error": "wrote nothing"})
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """2 ranks, each loading one single-process artifact whole (the reference) and sharded."""
    import spear_compile as spear

    tmp = tmp_path_factory.mktemp("tp2")
    artifact = spear.save(tp_workers.tiny_tp_model(32), str(tmp / "artifact"))
    return _spawn(tp_workers.numerics, 2, tmp, 32, True, artifact)


def test_two_ranks_eager_fused_and_compiled_equal_the_single_process_model(two_ranks):
    for rank, r in enumerate(two_ranks):
        assert "error" not in r, f"rank {rank}: {r['error']}"
        assert r["eager"] < TOL and r["fused_eager"] < TOL and r["compiled"] < TOL, r
        assert r["matched"] == 2, r  # o_proj and down_proj
        assert r["ops"].get("spear.ec_linear_peer_reduce.default") == 2
        assert not any("all_reduce" in op for op in r["ops"]), r["ops"]


def test_gating_the_local_partial_changes_the_output(two_ranks):
    for r in two_ranks:
        assert r["wrong_gate"] > 100 * TOL and r["wrong_gate"] > 0.05 * r["ref_scale"], r


def test_three_ranks_per_channel_equal_the_single_process_model(tmp_path):
    for rank, r in enumerate(_spawn(tp_workers.numerics, 3, tmp_path, None, False)):
        assert "error" not in r, f"rank {rank}: {r['error']}"
        assert r["eager"] < TOL and r["fused_eager"] < TOL, r
        assert r["wrong_gate"] > 100 * TOL, r


@pytest.mark.parametrize("mode,world,timeout_s", [("dies", 2, 10.0), ("hangs", 2, 5.0)])
def test_a_peer_that_dies_or_never_arrives_gives_a_timeout_naming_it(tmp_path, mode, world, timeout_s):
    t0 = time.monotonic()
    res = _spawn(tp_workers.dead_peer, world, tmp_path, timeout_s, mode, limit_s=120.0)
    for rank in range(world - 1):
        r = res[rank]
        assert "error" not in r, f"rank {rank}: {r['error']}"
        assert r["missing"] == (world - 1,) and r["rank"] == rank, r
        assert f"rank {rank} of tensor-parallel group" in r["message"], r["message"]
        assert f"rank(s) {world - 1} did not arrive" in r["message"], r["message"]
    assert time.monotonic() - t0 < 90
