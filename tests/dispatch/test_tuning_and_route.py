"""Kernel-level helpers of the tuned configs and tuning, without a GPU: the table values the kernels' own
config checks accept, the weight-layout cache, the tuner's re-timing, the labs' table edits."""
import glob
import os

import pytest
import torch

from spear_compile.dispatch import keys as TK
from spear_compile.dispatch import route as RT
from spear_compile.dispatch import tuning


def test_shipped_tables_are_well_formed():
    """The checks of each kind's values that need the kernels' own config checks (``dispatch/table.py``
    validates the structure of every entry when it loads)."""
    from spear_compile.dispatch import table as TT

    files = glob.glob(os.path.join(TT.SHIPPED_DIR, "*.json"))
    assert any("configs_" in f for f in files) and any("crossover_" in f for f in files)
    for f in files:
        typed = TT.read(f)
        table = {str(k): typed[k] for k in typed}
        for key, val in table.items():
            if "configs_" in f:
                kind = key.split("|")[0]
                assert kind in ("gemv", "gemv1", "gemv1tma", "gemv1pdl", "gemv1tmaec", "gemv1self", "gemm", "gemmwg",
                                "gemmra", "ecself", "ecstruct", "gemv1selfr")
                if kind == "gemv1selfr":  # the one-launch decode EC's per-rank choice: a pair, or a gemv1self value
                    parts = key.split("|")
                    R = int(parts[4])
                    assert len(parts) == 5 and R >= 1 and R & (R - 1) == 0
                    generic = table.get("|".join(["gemv1self"] + parts[1:4]))
                    assert val == ["pair"] or (generic is not None and val == generic), (key, val, generic)
                    if val[0] == "tma":  # its pieces fit the grid at the bucket's rank (132 SMs: the H200)
                        from spear_compile.lowering.ec_self import self_plan
                        from spear_compile.lowering.w4a16_gemv_tma import tile_geometry

                        N_, K_ = int(parts[1]), int(parts[2])
                        cfg = tuple(val[1:])
                        assert self_plan(R, K_, -(-N_ // tile_geometry(cfg)[0]), 32 * cfg[0], 132) is not None, key
                    continue
                if kind == "ecself":  # the in-launch EC's own register-operand launch config (no stream-K element)
                    from spear_compile.lowering.w4a16_gemm_wgmma_ra import check_ra_config

                    assert len(val) in (4, 5) and len(key.split("|")) == 5
                    check_ra_config(tuple(val))
                    continue
                if kind == "gemmra" or (kind == "gemm" and val[0] == "wgmma_ra"):  # the register-operand GEMM
                    from spear_compile.lowering.w4a16_gemm_wgmma_ra import check_ra_config

                    check_ra_config(tuple(val if kind == "gemmra" else val[1:]))
                    continue
                if kind == "gemmwg" or (kind == "gemm" and val[0] == "wgmma"):  # the Hopper wgmma GEMM
                    from spear_compile.lowering.w4a16_gemm_wgmma import check_config

                    check_config(tuple(val[1:] if kind == "gemm" else val))
                    continue
                if kind == "gemv1self":  # the one-launch decode EC: which kernel, in which config
                    from spear_compile.lowering.w4a16_gemv_tma import unpack_config

                    assert val[0] in ("cc", "tma") and len(key.split("|")) == 4
                    if val[0] == "tma":
                        from spear_compile.lowering.w4a16_gemv_tma import ec_ok

                        unpack_config(tuple(val[1:]))
                        assert ec_ok(tuple(val[1:])), (key, val)  # one CTA per row block, no K-split
                    else:
                        assert len(val) == 5 and all(isinstance(v, int) and v >= 0 for v in val[1:])
                    continue
                if kind == "gemv1tmaec":  # which decode EC pair a single EC takes (1: the TMA one)
                    assert val in (0, 1) and len(key.split("|")) == 4
                    continue
                if kind == "ecstruct":  # the measured prefill EC structure
                    from spear_compile.dispatch.route import OVERLAP_STRUCTURES

                    assert val in OVERLAP_STRUCTURES and val != "auto"
                    continue
                if kind == "gemv1tma":  # (WARPS, RB, CH, STAGES, OPS[, SPLIT]) of w4a16_gemv_tma
                    from spear_compile.lowering.w4a16_gemv_tma import OPS_SMEM, unpack_config

                    warps, rb, ch, stages, ops, split = unpack_config(val)
                    assert all(isinstance(v, int) and v > 0 for v in (warps, rb, ch, stages, split))
                    assert 0 <= ops <= OPS_SMEM and stages >= 2 and len(key.split("|")) == 4
                    continue
                if kind in ("gemv1", "gemv1pdl"):  # (BLOCK_N, BLOCK_W, num_warps, prefetch 0/1)
                    assert len(val) == 4 and all(isinstance(v, int) and v > 0 for v in val[:3]) and val[3] in (0, 1)
                    continue
                if kind == "gemm" and val[0] == "gemv_tma_rows":  # the multi-row TMA GEMV's (WARPS, RB, CH, STAGES)
                    from spear_compile.lowering.w4a16_gemv_tma_rows import tile_config

                    tile_config(tuple(val[1:]))
                    continue
                if kind == "gemm" and isinstance(val[0], str):  # dequantize + cuBLAS, one pass or row slices
                    assert val == ["dequant_cublas"] or (val[0] == "dequant_cublas_pipe" and len(val) == 2
                                                         and isinstance(val[1], int) and val[1] >= 2)
                    continue
                assert (len(val) == (5 if kind == "gemm" else 4)
                                                     and all(isinstance(v, int) and v > 0 for v in val))
            else:
                assert "x" in key and isinstance(val, int) and val >= 1


def test_derived_layouts_are_not_made_inside_a_graph_capture(monkeypatch):
    """A weight layout made on first use inside a CUDA graph capture would be re-made at every replay:
    refused with an error that says what to do; a layout made before the capture is still served."""
    from spear_compile.lowering.layout_cache import derived_cached

    cache, w, made = {}, torch.zeros(4, 8, dtype=torch.uint8), []
    assert derived_cached(cache, [w], lambda: made.append(1) or "layout") == "layout"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert derived_cached(cache, [w], lambda: made.append(1) or "again") == "layout" and made == [1]
    with pytest.raises(RuntimeError, match=r"shapes \[\(2, 8\)\].*run the model \(or op\) once before capturing"):
        derived_cached(cache, [torch.zeros(2, 8)], lambda: "new")


def test_refine_retimes_finalists_interleaved_and_takes_the_lowest_median(monkeypatch):
    """``tuning.refine``: every finalist timed once per round, rounds interleaved (a, b, a, b, ...), the lowest
    median wins - here b, although a's single best sample is lower (one outlier)."""
    order = []
    a, b = ("a", 1), ("b", 2)
    samples = {a: iter([50.0, 100.0, 101.0]), b: iter([90.0, 91.0, 92.0])}

    def fake_bench(fn, copies, **kw):
        name = fn(0)
        order.append(name)
        return next(samples[name])

    monkeypatch.setattr(tuning, "bench_graph", fake_bench)
    best, t = tuning.refine(lambda c: (lambda i: c), [list(a), b], copies=1)  # (a list is taken as its tuple)
    assert order == [a, b] * 3
    assert (best, t) == (b, 91.0)


def test_in_gemm_self_takes_the_register_operand_gemm_config_whatever_wins_the_w4_table(monkeypatch):
    """``dispatch.route.wgmma_ra_config``: the table's GEMM where it is the register-operand one; else that GEMM's own
    measured config (``gemmra`` key); else None (the structure then runs "in_gemm")."""
    from spear_compile.dispatch import route as RT
    from spear_compile.lowering import w4a16_triton as T
    from tests.helpers import use_tuned_table

    M, N, K, G = 256, 4096, 4096, 128
    use_tuned_table(monkeypatch, {TK.gemm_key(M, N, K, G): [T.WGMMA_RA, 64, 256, 4, 4],
                                      TK.wgmma_ra_key(M, N, K, G): [128, 256, 4, 8]})
    assert RT.wgmma_ra_config(M, N, K, G) == (64, 256, 4, 4)
    use_tuned_table(monkeypatch, {TK.gemm_key(M, N, K, G): ["dequant_cublas"],
                                      TK.wgmma_ra_key(M, N, K, G): [64, 128, 4, 4]})
    assert RT.wgmma_ra_config(M, N, K, G) == (64, 128, 4, 4)
    assert RT.wgmma_ra_config(200, N, K, G) == (64, 128, 4, 4)  # M = 200: the 256 bucket
    assert RT.wgmma_ra_config(300, N, K, G) is None  # M = 300: the 512 bucket, nothing measured


def test_in_gemm_self_prefers_its_own_measured_launch_config(monkeypatch):
    """``dispatch.route.ec_self_config``: the in-launch EC's own measured config (``ecself`` key) over the W4 table's
    register-operand GEMM (whose tile can be a poor host for the shrink roles), else ``wgmma_ra_config``; and
    the dispatch hands that config to the in-launch kernel."""
    from spear_compile.lowering import w4a16_triton as T
    from tests.helpers import use_tuned_table

    M, N, K, G = 256, 11008, 4096, 128
    table = use_tuned_table(monkeypatch, {TK.gemm_key(M, N, K, G): [T.WGMMA_RA, 64, 128, 4, 4, 2],
                                          TK.ec_self_key(M, N, K, G): [128, 256, 4, 8, 2]})
    assert RT.ec_self_config(M, N, K, G) == (128, 256, 4, 8, 2)
    assert RT.wgmma_ra_config(M, N, K, G) == (64, 128, 4, 4, 2)  # (the W4 GEMM keeps its own)
    del table[TK.ec_self_key(M, N, K, G)]
    assert RT.ec_self_config(M, N, K, G) == (64, 128, 4, 4, 2)
    assert RT.ec_self_config(1024, N, K, G) is None


def test_drop_gemv1self_ranks_removes_only_that_shapes_per_rank_entries(monkeypatch):
    """``drop_gemv1self_ranks``: the labs' reset of one shape's per-rank decode-EC choices; the rank-free entry and
    other shapes (also one whose N starts with the same digits) stay."""
    from tests.helpers import use_tuned_table

    keep = {TK.gemv1self_key(4096, 4096, 128): ["tma", 4, 2, 2, 2, 2], TK.gemv1self_rank_key(40960, 4096, 128, 16): ["pair"],
            TK.gemv1self_rank_key(4096, 4096, 64, 16): ["pair"]}
    table = dict(keep)
    table.update({TK.gemv1self_rank_key(4096, 4096, 128, r): ["pair"] for r in (4, 16, 64)})
    use_tuned_table(monkeypatch, table)
    TK.drop_gemv1self_ranks(4096, 4096, 128)
    assert dict(TK.tuned_table()) == keep
