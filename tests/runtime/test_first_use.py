"""The counters of first-use costs (CUDA graphs held by the engine, graphs compiled by torch.compile)."""
import torch

from spear_compile.runtime.first_use import FirstUseMarker, compiled_graph_count, cuda_graph_count


class CudaGraphBuffer:  # the name transformers' buffer has: found by type name, wherever it sits
    def __init__(self):
        self._storage = {}


class _Holder:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def test_graph_buffers_are_found_under_the_manager_and_counted():
    a, b = CudaGraphBuffer(), CudaGraphBuffer()
    eng = _Holder(_manager=_Holder(processor=_Holder(io=_Holder(graphs=a)), extra=[{"x": b}], n=3))
    assert cuda_graph_count(eng) == 0
    marker = FirstUseMarker(eng)
    m0 = marker()
    a._storage[(64, 256)] = object()
    b._storage[(128, 512)] = object()
    assert cuda_graph_count(eng) == 2
    m1 = marker()
    assert m1[0] == m0[0] + 2 and m1[1] == m0[1]
    assert marker() == m1  # nothing new: the marker stays
    assert cuda_graph_count(_Holder()) == 0  # no manager (not started)


def test_a_compiled_graph_moves_the_marker():
    marker = FirstUseMarker(_Holder())
    before = marker()
    f = torch.compile(lambda x: x * 3 + 1, backend="eager")
    f(torch.ones(3))
    after = marker()
    assert after[1] > before[1] and after[1] == compiled_graph_count()
    assert after[0] == before[0] == 0


def test_the_marker_does_not_keep_a_stopped_engines_graphs_alive():
    import gc
    import weakref

    a = CudaGraphBuffer()
    a._storage[(64, 256)] = object()
    eng = _Holder(_manager=_Holder(graphs=a))
    marker = FirstUseMarker(eng)
    assert marker()[0] == 1
    gone = weakref.ref(a)
    eng._manager, a = None, None  # the engine stopped and dropped its manager
    gc.collect()
    assert gone() is None
    assert marker()[0] == 0  # looks again, finds nothing
