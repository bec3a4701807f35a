"""The tuned table's keys in a kernel's own terms: ``gemm_key(M, N, K, G)``, ``gemv1_key(N, K, G, ec)``, ...

Each builder returns the typed key of ``table.py`` for one kernel family's measured entry, with M bucketed
the way the table stores it (``table.m_bucket``) and an EC rank bucketed to its power of two. The route
(``route.py``) reads the table through them, and the tuners (``benchmarks/kernels.py``,
``benchmarks/decode_ec_ranks.py``) write through them, so both sides name an entry the same way. The
kernels below this layer never read the table: the route hands them their config.
"""
from __future__ import annotations

from ..lowering._triton import next_pow2
from . import table as _table
from .table import TunedTable


def tuned_table() -> TunedTable:
    """This GPU's tuned configs (``table.configs``: the user's table, else the shipped one)."""
    return _table.configs()


def gemv_key(N: int, K: int, G: int, has_ec: bool) -> _table.GemvKey:
    """The M > 1 GEMV's tile (``w4a16_triton.w4a16_gemv_small``), with or without the fused EC."""
    return _table.GemvKey(N, K, G, int(has_ec))


def gemv1_key(N: int, K: int, G: int, has_ec: bool) -> _table.Gemv1Key:
    """The CUDA-core M = 1 GEMV's tile (``w4a16_triton.w4a16_gemv1``), with or without the EC."""
    return _table.Gemv1Key(N, K, G, int(has_ec))


def gemv1pdl_key(N: int, K: int, G: int) -> _table.Gemv1PdlKey:
    """The GEMV tile of the decode EC's PDL pair (``kernels.py --lab gemv --ec-pdl R``)."""
    return _table.Gemv1PdlKey(N, K, G)


def gemv1tmaec_key(N: int, K: int, G: int) -> _table.Gemv1TmaEcKey:
    """1 if a single decode EC of this shape measured faster as the TMA GEMV's EC pair than as the
    CUDA-core PDL pair, 0 if slower (``kernels.py --lab gemv --tma --ec-pdl R``); absent: the TMA pair
    wherever the TMA kernel runs the shape (``route.py``)."""
    return _table.Gemv1TmaEcKey(N, K, G)


def tma_key(N: int, K: int, G: int) -> _table.Gemv1TmaKey:
    """The TMA GEMV config measured fastest (and faster than the CUDA-core kernel) for the shape."""
    return _table.Gemv1TmaKey(N, K, G)


def gemv1self_key(N: int, K: int, G: int) -> _table.Gemv1SelfKey:
    """The one-launch decode EC (``ec_self.py``) where the lab measured it fastest (``kernels.py --lab gemv
    --ec-pdl R``): ``["cc", BLOCK_N, BLOCK_W, warps, prefetch]`` (the CUDA-core kernel) or ``["tma", WARPS,
    RB, CH, STAGES, OPS]`` (the TMA kernel); absent: one of the two-launch pairs."""
    return _table.Gemv1SelfKey(N, K, G)


def gemv1self_rank_key(N: int, K: int, G: int, R: int) -> _table.Gemv1SelfRankKey:
    """The one-launch decode EC's choice for one rank bucket (the power of two at or above ``R``): the
    ``gemv1self`` value to use at that rank, or ``["pair"]`` where a two-launch pair measured faster there.
    Why per rank: ``gemv1self`` is measured at r = 64; at 11008x4096 the one launch took 15.2 / 15.8 us at
    r = 16 / 32 against 13.8 / 14.7 for the TMA pair, and 13.0 against 13.9 at r = 64 (H200,
    ``benchmarks/decode_ec_ranks.py``). Absent: the rank-free ``gemv1self`` entry decides."""
    return _table.Gemv1SelfRankKey(N, K, G, next_pow2(R))


def drop_gemv1self_ranks(N: int, K: int, G: int) -> None:
    """Remove every per-rank entry (``gemv1self_rank_key``) of this shape from the tuned table: what the labs
    do before they remake them, or when the rank-free entry they were measured against changes."""
    table = tuned_table()
    for k in table.keys_of(_table.Gemv1SelfRankKey):
        if (k.N, k.K, k.G) == (N, K, G):
            table.pop(k)


def gemm_key(M: int, N: int, K: int, G: int) -> _table.GemmKey:
    """The W4 GEMM's choice for M's bucket: a Triton tile, dequantize + cuBLAS, or a wgmma kernel."""
    return _table.GemmKey(_table.m_bucket(M), N, K, G)


def wgmma_key(M: int, N: int, K: int, G: int) -> _table.GemmWgKey:
    """The Hopper in-loop-dequant GEMM's own config for M's bucket."""
    return _table.GemmWgKey(_table.m_bucket(M), N, K, G)


def wgmma_ra_key(M: int, N: int, K: int, G: int) -> _table.GemmRaKey:
    """The register-operand wgmma GEMM's own config for M's bucket."""
    return _table.GemmRaKey(_table.m_bucket(M), N, K, G)


def ec_self_key(M: int, N: int, K: int, G: int) -> _table.EcSelfKey:
    """The in-launch prefill EC's own measured config for M's bucket."""
    return _table.EcSelfKey(_table.m_bucket(M), N, K, G)


def ec_structure_key(M: int, N: int, K: int, G: int) -> _table.EcStructKey:
    """The prefill EC structure measured fastest for M's bucket (side stream, in-GEMM, ...)."""
    return _table.EcStructKey(_table.m_bucket(M), N, K, G)
