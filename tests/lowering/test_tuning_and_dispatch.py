"""Per-GPU tables (configs, crossovers) and the CUDA dispatch decisions, without a GPU."""
import glob
import os

import pytest
import torch

from spear_compile.lowering import tuning
from spear_compile.lowering.dispatch import W4_GEMV_MAX_M, use_fused


@pytest.mark.parametrize("lowering,M,crossover,expected", [
    ("fused", 1, 16, True), ("fused", 4, 2, True), ("fused", 5, 16, False),
    ("overlapped", 1, 16, False), ("dispatch", 1, 2, True), ("dispatch", 2, 2, False), ("auto", 3, 16, True),
])
def test_use_fused(lowering, M, crossover, expected):
    assert use_fused(lowering, M, crossover) is expected


def test_w4_gemv_only_for_decode():
    assert W4_GEMV_MAX_M == 1


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
                    from spear_compile.lowering.dispatch import OVERLAP_STRUCTURES

                    assert val in OVERLAP_STRUCTURES and val != "auto"
                    continue
                if kind == "gemv1tma":  # (WARPS, RB, CH, STAGES, OPS[, SPLIT[, PERSIST]]) of w4a16_gemv_tma
                    from spear_compile.lowering.w4a16_gemv_tma import OPS_SMEM, unpack_config

                    warps, rb, ch, stages, ops, split, _ = unpack_config(val)
                    assert all(isinstance(v, int) and v > 0 for v in (warps, rb, ch, stages, split))
                    assert 0 <= ops <= OPS_SMEM and stages >= 2 and len(key.split("|")) == 4
                    continue
                if kind in ("gemv1", "gemv1pdl"):  # (BLOCK_N, BLOCK_W, num_warps, prefetch 0/1)
                    assert len(val) == 4 and all(isinstance(v, int) and v > 0 for v in val[:3]) and val[3] in (0, 1)
                    continue
                if kind == "gemm" and isinstance(val[0], str):  # dequantize + cuBLAS, one pass or row slices
                    assert val == ["dequant_cublas"] or (val[0] == "dequant_cublas_pipe" and len(val) == 2
                                                         and isinstance(val[1], int) and val[1] >= 2)
                    continue
                assert (len(val) == (5 if kind == "gemm" else 4)
                                                     and all(isinstance(v, int) and v > 0 for v in val))
            else:
                assert "x" in key and isinstance(val, int) and val >= 1


def test_phase_dispatch_names_where_the_crossover_came_from():
    import torch.nn as nn

    import spear_compile as spear
    from spear_compile import CompileConfig
    from spear_compile.inspect import capture

    m = spear.quantize_(nn.Sequential(nn.Linear(64, 64)), spear.QuantConfig(), progress=False)
    rec = capture(m, (torch.randn(3, 64),)).linears[0]
    assert rec["crossover_source"] == "default" and rec["crossover"] == 16 and rec["reason"].endswith("(default)")
    assert rec["kernel"] == "pytorch reference"  # CPU tensors
    rec = capture(m, (torch.randn(3, 64),), config=CompileConfig(crossover_m=2)).linears[0]
    assert rec["crossover_source"] == "configured" and rec["lowering"] == "overlapped"


def test_kernel_for_cuda_nodes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from spear_compile.lowering._triton import HAS_TRITON
    from spear_compile.passes.phase_dispatch import kernel_for

    with FakeTensorMode():
        x = torch.empty(1, 64, dtype=torch.bfloat16, device="cuda")
        x32 = torch.empty(1, 64, dtype=torch.float32, device="cuda")
    if HAS_TRITON:
        pdl = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
        assert kernel_for(x, "spear", "fused", True) == (
            "EC producer launch + PDL-launched" if pdl else "in-kernel EC producers +") + " triton GEMV with EC epilogue"
        assert kernel_for(x, "spear", "overlapped", True) == (
            "triton GEMM (M < 256) / dequant + cuBLAS / wgmma in-loop-dequant GEMM (shared-memory or register-operand "
            "weight) (per the tuned table) + EC in the structure measured per shape: shrink and gate on a side "
            "stream, or first and into the GEMM's C operand, or as one more K step of the wgmma GEMM (PDL-launched "
            "behind the gate on the register-operand one)")
        assert kernel_for(x, "spear", "fused", False).startswith("triton GEMV (M = 1)")
        assert kernel_for(x, "spear", "dispatch", False).startswith("runtime branch")
    assert kernel_for(x32, "spear", "fused", True) == "pytorch reference"
    assert kernel_for(x, "tinygemm_cuda", "fused", False) == "pytorch reference"


def test_report_names_the_tma_gemv_only_where_the_table_picks_it(monkeypatch):
    """``gemv_name``: the TMA-fed kernel for a shape with a ``gemv1tma`` entry on a Hopper-class GPU
    (faked here: the check is the table and the kernel's constraints, not a launch), else the
    triton GEMV; the env switch turns it off."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from spear_compile.lowering import w4a16_gemv_tma as GT
    from spear_compile.lowering import w4a16_triton as T
    from spear_compile.passes.phase_dispatch import gemv_name

    if not GT.HAS_GLUON:
        pytest.skip("needs Triton with Gluon")
    with FakeTensorMode():
        x = torch.empty(1, 1024, dtype=torch.bfloat16, device="cuda")
    monkeypatch.setattr(T, "_TABLE", {GT.tma_key(512, 1024, 128): [4, 2, 2, 2, 2]})
    monkeypatch.setattr(GT, "_tma_capable", lambda device: True)
    assert gemv_name(512, 1024, 128, x).startswith("gluon TMA-ring GEMV")
    assert gemv_name(256, 1024, 128, x) == "triton GEMV (M = 1)"  # no entry for this shape
    assert gemv_name(512, 1024, 128, x.to(torch.float16)) == "triton GEMV (M = 1)"
    assert gemv_name(None, 1024, 128, x) == "triton GEMV (M = 1)"
    monkeypatch.setenv("SPEAR_NO_TMA_GEMV", "1")
    assert gemv_name(512, 1024, 128, x) == "triton GEMV (M = 1)"


def test_ec_structure_follows_the_measured_table(monkeypatch):
    """"auto" takes the measured structure; a C-operand choice only where the table's GEMM for the
    shape is dequantize + cuBLAS (the structure is built on it); nothing measured -> "side"."""
    from spear_compile.lowering import w4a16_triton as T

    table = {T.ec_structure_key(1024, 64, 32, 32): "c_operand_hi", T.gemm_key(1024, 64, 32, 32): ["dequant_cublas"],
             T.ec_structure_key(1024, 96, 32, 32): "c_operand", T.gemm_key(1024, 96, 32, 32): [64, 64, 32, 4, 3],
             T.ec_structure_key(256, 64, 32, 32): "side_hi"}
    monkeypatch.setattr(T, "tuned_table", lambda: table)
    assert T.ec_structure(1000, 64, 32, 32) == "c_operand_hi"  # M buckets to 1024
    assert T.ec_structure(1024, 96, 32, 32) == "side"
    assert T.ec_structure(256, 64, 32, 32) == "side_hi"
    assert T.ec_structure(4096, 64, 32, 32) == "side"


def test_ec_pdl_tile_prefers_its_own_measurement(monkeypatch):
    """The decode EC's PDL pair takes the tile measured for it (gemv1pdl), else the plain W4 tile of
    the shape, else the first config."""
    from spear_compile.lowering import w4a16_triton as T

    table = {T.gemv1_key(256, 1024, 128, False): [8, 512, 4, 0]}
    monkeypatch.setattr(T, "_TABLE", table)
    assert T.ec_pdl_config(256, 1024, 128) == (8, 512, 4, 0)
    table[T.gemv1pdl_key(256, 1024, 128)] = [8, 128, 1, 1]
    assert T.ec_pdl_config(256, 1024, 128) == (8, 128, 1, 1)
    assert T.ec_pdl_config(512, 1024, 128) == tuple(T.GEMV1_CONFIGS[0])


def test_derived_layouts_are_not_made_inside_a_graph_capture(monkeypatch):
    """A weight layout made on first use inside a CUDA graph capture would be re-made at every replay:
    refused with an error that says what to do; a layout made before the capture is still served."""
    from spear_compile.lowering.w4a16_triton import derived_cached

    cache, w, made = {}, torch.zeros(4, 8, dtype=torch.uint8), []
    assert derived_cached(cache, [w], lambda: made.append(1) or "layout") == "layout"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert derived_cached(cache, [w], lambda: made.append(1) or "again") == "layout" and made == [1]
    with pytest.raises(RuntimeError, match=r"shapes \[\(2, 8\)\].*run the model \(or op\) once before capturing"):
        derived_cached(cache, [torch.zeros(2, 8)], lambda: "new")


def test_single_ec_takes_the_pair_the_table_measured_faster(monkeypatch):
    """gemv1_ec: the TMA GEMV's EC pair where the TMA kernel runs the shape, unless the table's gemv1tmaec
    entry says the CUDA-core PDL pair measured faster there (0)."""
    from spear_compile.lowering import ec_cat as C
    from spear_compile.lowering import ec_decode_triton as ED
    from spear_compile.lowering import w4a16_triton as T

    asked = []
    monkeypatch.setattr(ED, "pdl_ok", lambda device: True)
    monkeypatch.setattr(C, "ec_tma_config", lambda *a: asked.append(a) or None)  # (then the CUDA-core pair)
    monkeypatch.setattr(ED, "w4a16_gemv1_ec_pdl", lambda *a, **k: "cuda-core pair")
    x, q = torch.zeros(1, 256), torch.zeros(64, 128, dtype=torch.uint8)
    ec = (torch.zeros(4, 256), torch.zeros(64, 4)) + (None,) * 5
    monkeypatch.setattr(T, "_TABLE", {})
    assert T.gemv1_ec(x, q, None, None, 128, None, ec) == "cuda-core pair" and len(asked) == 1
    monkeypatch.setattr(T, "_TABLE", {T.gemv1tmaec_key(64, 256, 128): 0})
    assert T.gemv1_ec(x, q, None, None, 128, None, ec) == "cuda-core pair" and len(asked) == 1  # not asked
    monkeypatch.setattr(T, "_TABLE", {T.gemv1tmaec_key(64, 256, 128): 1})
    T.gemv1_ec(x, q, None, None, 128, None, ec)
    assert len(asked) == 2


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
    """``w4a16_triton.wgmma_ra_config``: the table's GEMM where it is the register-operand one; else that GEMM's own
    measured config (``gemmra`` key); else None (the structure then runs "in_gemm")."""
    from spear_compile.lowering import w4a16_triton as T

    M, N, K, G = 256, 4096, 4096, 128
    monkeypatch.setattr(T, "_TABLE", {T.gemm_key(M, N, K, G): [T.WGMMA_RA, 64, 256, 4, 4],
                                      T.wgmma_ra_key(M, N, K, G): [128, 256, 4, 8]})
    assert T.wgmma_ra_config(M, N, K, G) == (64, 256, 4, 4)
    monkeypatch.setattr(T, "_TABLE", {T.gemm_key(M, N, K, G): ["dequant_cublas"],
                                      T.wgmma_ra_key(M, N, K, G): [64, 128, 4, 4]})
    assert T.wgmma_ra_config(M, N, K, G) == (64, 128, 4, 4)
    assert T.wgmma_ra_config(200, N, K, G) == (64, 128, 4, 4)  # M = 200: the 256 bucket
    assert T.wgmma_ra_config(300, N, K, G) is None  # M = 300: the 512 bucket, nothing measured


def test_in_gemm_self_prefers_its_own_measured_launch_config(monkeypatch):
    """``w4a16_triton.ec_self_config``: the in-launch EC's own measured config (``ecself`` key) over the W4 table's
    register-operand GEMM (whose tile can be a poor host for the shrink roles), else ``wgmma_ra_config``; and
    the dispatch hands that config to the in-launch kernel."""
    from spear_compile.lowering import w4a16_triton as T

    M, N, K, G = 256, 11008, 4096, 128
    table = {T.gemm_key(M, N, K, G): [T.WGMMA_RA, 64, 128, 4, 4, 2], T.ec_self_key(M, N, K, G): [128, 256, 4, 8, 2]}
    monkeypatch.setattr(T, "_TABLE", table)
    assert T.ec_self_config(M, N, K, G) == (128, 256, 4, 8, 2)
    assert T.wgmma_ra_config(M, N, K, G) == (64, 128, 4, 4, 2)  # (the W4 GEMM keeps its own)
    del table[T.ec_self_key(M, N, K, G)]
    assert T.ec_self_config(M, N, K, G) == (64, 128, 4, 4, 2)
    assert T.ec_self_config(1024, N, K, G) is None


def test_drop_gemv1self_ranks_removes_only_that_shapes_per_rank_entries(monkeypatch):
    """``drop_gemv1self_ranks``: the labs' reset of one shape's per-rank decode-EC choices; the rank-free entry and
    other shapes (also one whose N starts with the same digits) stay."""
    from spear_compile.lowering import w4a16_triton as T

    keep = {T.gemv1self_key(4096, 4096, 128): ["tma", 4, 2, 2, 2, 2], T.gemv1self_rank_key(40960, 4096, 128, 16): ["pair"],
            T.gemv1self_rank_key(4096, 4096, 64, 16): ["pair"]}
    table = dict(keep)
    table.update({T.gemv1self_rank_key(4096, 4096, 128, r): ["pair"] for r in (4, 16, 64)})
    monkeypatch.setattr(T, "_TABLE", table)
    T.drop_gemv1self_ranks(4096, 4096, 128)
    assert T.tuned_table() == keep
