"""GPU timing of the latency model's parts (``measure.gpu_time_ms``): CUDA-graph replay, no host launch cost."""
import pytest
import torch

from spear_compile.runtime.measure import gpu_time_ms, part_time_ms, time_ms

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and events need a GPU")


def test_graph_time_drops_the_launch_cost_of_small_kernels():
    x = torch.randn(64, device="cuda")
    fn = lambda: x.add_(1.0)  # noqa: E731  one tiny kernel: its wall time is the host's launch and sync
    wall, gpu = time_ms(fn, "cuda", reps=20), gpu_time_ms(fn, "cuda", reps=20)
    assert 0 < gpu < wall
    assert gpu < 0.02  # a 64-element add is a few microseconds of GPU time


def test_graph_time_scales_with_the_work():
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    one = gpu_time_ms(lambda: a @ a, "cuda", reps=10)
    three = gpu_time_ms(lambda: (a @ a, a @ a, a @ a), "cuda", reps=10)
    assert 2.4 < three / one < 3.6


def test_part_time_takes_the_gpu_path_on_cuda_and_the_wall_clock_on_cpu():
    x = torch.randn(64, device="cuda")
    assert part_time_ms(lambda: x.add_(1.0), "cuda", reps=10) < time_ms(lambda: x.add_(1.0), "cuda", reps=10)
    y = torch.randn(64)
    assert part_time_ms(lambda: y.add_(1.0), "cpu", reps=3) > 0


def test_compiled_linear_tables_read_their_weights_from_hbm():
    """Timed over weight copies past the L2 cache, a W4 linear at M = 1 cannot beat the HBM (an H200's
    4.8 TB/s)."""
    import spear_compile  # noqa: F401  (registers torch.ops.spear)
    from spear_compile.runtime.measure import weight_copies
    from spear_compile.runtime.op_runner import linear_bytes, op_runner
    from spear_compile.runtime.plan import PlannedLinear, PlannedOp

    lin = PlannedLinear("q", 4096, 4096, ops=(PlannedOp("w4a16", ((4096, 0, 0),), 4096, 128),))
    n = weight_copies(lin, 1, "cuda")
    assert n > 1
    with torch.inference_mode():
        ms = part_time_ms(op_runner(lin, 1, "cuda", torch.bfloat16, {}, copies=n), "cuda", reps=10, calls=max(10, n))
    assert linear_bytes(lin, 1) / (ms * 1e-3) / 1e12 < 5.5


def test_synthetic_steps_are_graph_replays_over_weight_copies_on_cuda():
    """``measure_steps`` captures a ``SyntheticStep`` in a CUDA graph on CUDA: its compiled linears run
    layer by layer over weight sets that sweep past L2 (every set's first-use state is made before the
    capture, which refuses to make it), and the graph replay drops the host's launch cost."""
    import spear_compile  # noqa: F401  (registers torch.ops.spear)
    from spear_compile.runtime.measure import SyntheticStep, measure_steps
    from spear_compile.runtime.plan import Plan, PlannedLinear, PlannedOp

    ec = PlannedOp("ec", ((4096, 64, 16),), 4096, 128)
    lins = (PlannedLinear("w4", 4096, 4096, count=3, ops=(PlannedOp("w4a16", ((4096, 0, 0),), 4096, 128),)),
            PlannedLinear("ec", 4096, 4096, ec_rank=64, count=2, ops=(ec,)))
    plan = Plan("t", "h", lins, n_layers=2, n_heads=32, n_kv_heads=32, head_dim=128, hidden_size=4096,
                vocab_size=32000, dtype="bfloat16")
    step = SyntheticStep(plan, "cuda", max_m=64)
    grid = [((100,) * 8, ((8, 0),)), ((300,), ())]
    graphed = measure_steps(step, grid, "cuda", reps=3, progress=False)
    wall = [time_ms(lambda: step(d, p), "cuda", reps=3) for d, p in grid]
    assert all(0 < s.measured_ms < w for s, w in zip(graphed, wall))
