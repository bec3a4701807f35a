"""The measurement's op runner: a planned linear's compiled ops on random weights, and weight copies."""
import pytest
import torch

import spear_compile  # noqa: F401  (registers torch.ops.spear)
from spear_compile.runtime.measure import weight_copies
from spear_compile.runtime.op_runner import linear_bytes, op_bytes, op_runner
from spear_compile.runtime.plan import PlannedLinear, PlannedOp


def _lin(rank: int = 0) -> PlannedLinear:
    op = PlannedOp("ec" if rank else "w4a16", ((48, rank, 8 if rank else 0),), 64, 32)
    return PlannedLinear("proj", 64, 48, ec_rank=rank, ops=(op,))


def test_op_bytes_counts_the_packed_weight_scales_zeros_and_ec():
    lin = _lin()
    assert op_bytes(lin.ops[0]) == 48 * 32 + 48 * 2 * 2 * 2   # int4 codes + bf16 scales and zeros, 2 groups
    ec = _lin(rank=4)
    extra = (4 * 64 + 48 * 4 + 2 * 8 * 4 + 8 + 4) * 2            # A, B, the gate's two layers and biases
    assert op_bytes(ec.ops[0]) == op_bytes(lin.ops[0]) + extra
    assert linear_bytes(ec, 1) == op_bytes(ec.ops[0])


def test_copies_cycle_over_independent_weight_sets():
    lin, weights = _lin(), {}
    run = op_runner(lin, 4, "cpu", torch.float32, weights, copies=3)
    for _ in range(4):
        run()
    sets = [weights[(lin.ops[0], j)] for j in range(3)]
    assert len(weights) == 3
    assert not torch.equal(sets[0][0][0], sets[1][0][0])          # each copy its own random codes
    one = op_runner(lin, 4, "cpu", torch.float32, weights)       # copy 0 again: the same weights reused
    one()
    assert len(weights) == 3
    with pytest.raises(ValueError, match="copies"):
        op_runner(lin, 4, "cpu", torch.float32, copies=0)


def test_weight_copies_only_on_cuda():
    assert weight_copies(_lin(), 4, "cpu") == 1


def test_gpu_timing_warms_every_weight_copy_before_the_capture(monkeypatch):
    """A copy first called inside the capture would make its weight layout there (the layout cache raises):
    the timing's warm-up must reach every copy. The tuner's graph timing is replaced by one that records
    its warm-up count (no GPU here)."""
    import contextlib

    from spear_compile.dispatch import tuning
    from spear_compile.runtime.measure import gpu_time_ms

    seen = {}

    def fake_bench_graph(fn, copies=1, calls=20, replays=15, warmup=3):
        seen["warmup"], seen["calls"] = warmup, calls
        return 1.0

    monkeypatch.setattr(tuning, "bench_graph", fake_bench_graph)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    run = op_runner(_lin(), 4, "cpu", torch.float32, {}, copies=7)
    assert run.copies == 7
    gpu_time_ms(run, "cpu", warmup=2, calls=10)
    assert seen["warmup"] >= 7
    gpu_time_ms(lambda: None, "cpu", warmup=2)                      # a plain callable: the warm-up asked for
    assert seen["warmup"] == 2
