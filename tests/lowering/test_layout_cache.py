"""State the kernels keep across calls is made outside any CUDA memory pool the caller holds
(``layout_cache.outside_pools``): transformers' continuous batching warms up inside its CUDA graphs'
shared pool, and state made there was clobbered by the graphs' buffers (the one-launch decode EC spun to
its limit, a compiled engine hit illegal memory accesses)."""
import pytest
import torch

from spear_compile.lowering.layout_cache import derived_cached, outside_pools

CUDA = torch.cuda.is_available()
on_cuda = pytest.mark.skipif(not CUDA, reason="CUDA memory pools need a GPU")


def test_outside_pools_returns_the_value_without_autograd_and_reraises():
    w = torch.ones(4, requires_grad=True)
    out = outside_pools(lambda: w * 2)
    assert torch.equal(out, torch.full((4,), 2.0)) and not out.requires_grad

    def boom():
        raise ValueError("made wrong")
    with pytest.raises(ValueError, match="made wrong"):
        outside_pools(boom)


def _in_pool(t: torch.Tensor, pool) -> bool:
    segs = [s for s in torch.cuda.memory._snapshot()["segments"] if tuple(s.get("segment_pool_id", ())) == tuple(pool.id)]
    p = t.data_ptr()
    return any(s["address"] <= p < s["address"] + s["total_size"] for s in segs)


@on_cuda
def test_state_made_under_a_callers_memory_pool_lives_outside_it():
    pool = torch.cuda.MemPool()
    w = torch.randn(64, 64, device="cuda")
    cache: dict = {}
    with torch.cuda.use_mem_pool(pool):
        plain = torch.zeros(1 << 16, device="cuda")
        kept = outside_pools(lambda: torch.zeros(1 << 16, device="cuda"))
        layout = derived_cached(cache, [w], lambda: w.t().contiguous())
    assert _in_pool(plain, pool)  # the check sees the pool
    assert not _in_pool(kept, pool) and not _in_pool(layout, pool)
    assert torch.equal(layout, w.t()) and torch.equal(kept, torch.zeros_like(kept))


@on_cuda
def test_kernel_workspaces_made_under_a_callers_memory_pool_live_outside_it():
    from spear_compile.lowering.ec_self import SelfPlan, self_workspace
    from spear_compile.lowering.w4a16_triton import ec_workspace

    pool = torch.cuda.MemPool()
    A = torch.randn(16, 256, device="cuda")
    with torch.cuda.use_mem_pool(pool):
        ticket, slots = self_workspace(A, 8, SelfPlan(256, 1, 16, 2, 1, 8))
        ws, cnt = ec_workspace(torch.device("cuda", torch.cuda.current_device()), 4096)  # an r_p no one else uses
    for t in (ticket, slots, ws, cnt):
        assert not _in_pool(t, pool)
        assert not t.any()
