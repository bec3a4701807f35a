"""``dispatch.route``: which kernel runs a problem, asserted on ``Route`` objects (no GPU: the device
capability is faked where a test needs a Hopper-class GPU; nothing is launched)."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spear_compile.dispatch import keys as TK
from spear_compile.dispatch import route as R
from spear_compile.dispatch import table as TT
from spear_compile.lowering import device as capability
from spear_compile.lowering import w4a16_gemv_tma as GT
from spear_compile.lowering import w4a16_triton as T
from tests.helpers import use_tuned_table

CUDA = torch.device("cuda")


def problem(op="w4a16", M=1, N=512, K=1024, G=128, **kw):
    kw.setdefault("param_dtypes", (torch.bfloat16, torch.bfloat16))
    return R.Problem(op=op, M=M, N=N, K=K, G=G, device=kw.pop("device", CUDA), **kw)


def hopper(monkeypatch, pdl=True):
    monkeypatch.setattr(capability, "is_sm90", lambda device: True)
    monkeypatch.setattr(capability, "pdl", lambda device: pdl)
    monkeypatch.setattr(capability, "pdl_launch", lambda device: pdl)


@pytest.mark.parametrize("lowering,M,crossover,expected", [
    ("fused", 1, 16, True), ("fused", 4, 2, True), ("fused", 5, 16, False),
    ("overlapped", 1, 16, False), ("dispatch", 1, 2, True), ("dispatch", 2, 2, False), ("auto", 3, 16, True),
])
def test_use_fused(lowering, M, crossover, expected):
    assert R.use_fused(lowering, M, crossover) is expected


def test_w4_gemv_only_for_decode():
    assert R.W4_GEMV_MAX_M == 1
    use_tuned_table(pytest.MonkeyPatch(), {})
    # (512 rows: dequantize + cuBLAS off the interpreter)
    assert R.route(problem(M=2)).kernel in ("gemm", "dequant_cublas")


def test_reference_where_the_triton_kernels_do_not_run():
    for p, why in [(problem(device=torch.device("cpu")), "activations on cpu"),
                   (problem(dtype=torch.float32), "activations torch.float32"),
                   (problem(layout="tinygemm_cuda"), "layout 'tinygemm_cuda'")]:
        rt = R.route(p)
        if not R._triton.HAS_TRITON:
            pytest.skip("needs Triton")
        assert rt.kernel == "reference" and rt.reasons[0].startswith(why), rt


def test_the_tma_gemv_only_where_the_table_picks_it(monkeypatch):
    """M = 1 without an EC: the TMA-fed kernel for a shape with a ``gemv1tma`` entry on a Hopper-class GPU
    (faked), else the CUDA-core GEMV; the kill switch turns it off."""
    if not GT.HAS_TMA:
        pytest.skip("needs Triton with Gluon TMA")
    use_tuned_table(monkeypatch, {TK.tma_key(512, 1024, 128): [4, 2, 2, 2, 2]})
    hopper(monkeypatch)
    assert R.route(problem()) == R.Route("gemv1_tma", (4, 2, 2, 2, 2), R.route(problem()).reasons)
    assert R.route(problem(N=256)).kernel == "gemv1"  # no entry for this shape
    assert R.route(problem(dtype=torch.float16)).kernel == "gemv1"
    assert R.route(problem(param_dtypes=(torch.float16,))).kernel == "gemv1"
    assert R.route(problem(K=1000)).kernel == "gemv"  # not whole 32-column chunks
    monkeypatch.setenv("SPEAR_NO_TMA_GEMV", "1")
    rt = R.route(problem())
    assert rt.kernel == "gemv1" and any("SPEAR_NO_TMA_GEMV" in r for r in rt.reasons)


def test_gemm_takes_the_tables_kernel_where_it_can_run(monkeypatch):
    M, N, K, G = 256, 4096, 4096, 128
    use_tuned_table(monkeypatch, {TK.gemm_key(M, N, K, G): ["wgmma_ra", 64, 128, 4, 4, 2],
                                  TK.gemm_key(4096, N, K, G): ["dequant_cublas_pipe", 4]})
    hopper(monkeypatch)
    assert R.route(problem(M=M, N=N, K=K)) .kernel == "gemm_wgmma_ra"
    assert R.route(problem(M=M, N=N, K=K)).config == (64, 128, 4, 4, 2)
    assert R.route(problem(M=4096, N=N, K=K)).config == (4,)  # dequantize + cuBLAS in 4 slices
    default = "gemm" if T.INTERPRET else "dequant_cublas"  # M = 256's default (the interpreter: the Triton GEMM)
    rt = R.route(problem(M=M, N=N, K=K, dtype=torch.float16))  # measured for bf16: M's default instead
    assert rt.kernel == default and "cannot run here" in rt.reasons[-2]
    rt = R.route(problem(M=M, N=N, K=K, zeros_integer=False))
    assert rt.kernel == default and "not small integers" in rt.reasons[-2]
    # nothing measured: the default (the register-operand GEMM on a Hopper GPU; the interpreter: the Triton GEMM)
    assert R.route(problem(M=100, N=N, K=K)).kernel == ("gemm" if T.INTERPRET else "gemm_wgmma_ra")


def test_untuned_shapes_take_the_default_heuristic(monkeypatch):
    """Nothing tuned at or near a shape: dequantize + cuBLAS for outputs of at most 1024 rows, the register-operand
    GEMM's small tiles at M <= 64 with a K split that fills the SMs (the H100's tuned choices), its 64 x 128 tile at
    M = 65-256, M's fixed default elsewhere and where that GEMM cannot run; a tuned geometry nearby still wins."""
    monkeypatch.setattr(T, "INTERPRET", False)
    monkeypatch.setattr(capability, "sm_count", lambda device: 132)
    hopper(monkeypatch)
    use_tuned_table(monkeypatch, {})
    rt = R.route(problem(M=16, N=512, K=3584))
    assert rt.kernel == "dequant_cublas" and any("N = 512 <= 1024" in r for r in rt.reasons)
    cfg = lambda **kw: R.route(problem(**kw)).config  # noqa: E731
    assert R.route(problem(M=8, N=4096, K=4096)).kernel == "gemm_wgmma_ra"
    assert cfg(M=8, N=4096, K=4096) == (64, 16, 8, 4, 2, 4)  # 64 tiles: a split of 4 fills 1.5 x 132 SMs
    assert cfg(M=2, N=3584, K=18944) == (64, 16, 6, 4, 2, 8)  # 296 steps: runs of 37
    assert cfg(M=16, N=11008, K=4096) == (64, 16, 8, 4, 2, 2)
    assert cfg(M=16, N=37888, K=3584) == (64, 16, 8, 4, 2)  # 592 tiles fill the SMs whole-K
    assert cfg(M=32, N=8192, K=8192) == (64, 32, 8, 4, 2, 4)
    assert cfg(M=64, N=28672, K=8192) == (64, 64, 6, 4, 2, 4)
    assert cfg(M=16, N=4096, K=4160, G=64) == (64, 16, 8, 4, 2)  # 65 steps: no split divides them
    assert cfg(M=100, N=4096, K=4096) == (64, 128, 4, 4, 2)
    assert R.route(problem(M=512, N=4096, K=4096)).kernel == "dequant_cublas"  # M's fixed default
    rt = R.route(problem(M=8, N=4096, K=4096, zeros_integer=False))
    assert rt.kernel == "gemm" and rt.config == T._default_gemm(8)
    use_tuned_table(monkeypatch, {TK.gemm_key(8, 4096, 4096, 128): [16, 32, 512, 4, 3]})
    rt = R.route(problem(M=8, N=3584, K=3584))  # the nearest tuned geometry
    assert rt.kernel == "gemm" and rt.config == (16, 32, 512, 4, 3)
    rt = R.route(problem(M=8, N=1024, K=4096))  # two octaves away, but a 4096-row tile for 1024 rows: not taken
    assert rt.kernel == "dequant_cublas" and any("stand-in with 4096 rows" in r for r in rt.reasons)


def test_ec_structure_follows_the_measured_table(monkeypatch):
    """"auto" takes the measured structure; a C-operand choice only where the table's GEMM for the
    shape is dequantize + cuBLAS (the structure is built on it); nothing measured -> "side"."""
    use_tuned_table(monkeypatch, {
        TK.ec_structure_key(1024, 64, 32, 32): "c_operand_hi", TK.gemm_key(1024, 64, 32, 32): ["dequant_cublas"],
        TK.ec_structure_key(1024, 96, 32, 32): "c_operand", TK.gemm_key(1024, 96, 32, 32): [64, 64, 32, 4, 3],
        TK.ec_structure_key(256, 64, 32, 32): "side_hi"})
    ec = dict(op="ec", K=32, G=32, rank=8, lowering="overlapped")
    rt = R.route(problem(M=1000, N=64, **ec))  # M buckets to 1024
    assert (rt.kernel, rt.option("high_priority")) == ("ec_c_operand", True)
    rt = R.route(problem(M=1024, N=96, **ec))
    assert rt.kernel == "ec_side" and rt.parts[0] == R.Route("gemm", (64, 64, 32, 4, 3), rt.parts[0].reasons)
    assert R.route(problem(M=256, N=64, **ec)).option("high_priority") is True
    rt = R.route(problem(M=4096, N=64, **ec))
    assert (rt.kernel, rt.option("high_priority")) == ("ec_side", False)
    with pytest.raises(ValueError, match="structure"):
        R.ec_overlapped_route(problem(M=4096, N=64, **ec), "sideways")


def test_in_gemm_self_where_its_launch_config_is_measured(monkeypatch):
    M, N, K, G = 256, 11008, 4096, 128
    use_tuned_table(monkeypatch, {TK.ec_structure_key(M, N, K, G): "in_gemm_self",
                                  TK.gemm_key(M, N, K, G): ["wgmma_ra", 64, 128, 4, 4, 2],
                                  TK.ec_self_key(M, N, K, G): [128, 256, 4, 8, 2]})
    hopper(monkeypatch)
    ec = dict(op="ec", M=M, N=N, K=K, rank=64, gate_width=8, lowering="overlapped")
    assert R.route(problem(**ec)) .kernel == "ec_in_gemm_self"
    assert R.route(problem(**ec)).config == (128, 256, 4, 8, 2)
    rt = R.route(problem(**{**ec, "rank": 128}))  # the shrink MMA takes ranks up to 64: the expand in the GEMM
    assert rt.kernel == "ec_in_gemm_ra" and rt.config == (64, 128, 4, 4, 2) and rt.option("pdl") is True


def test_ec_pdl_tile_prefers_its_own_measurement(monkeypatch):
    """The decode EC's PDL pair takes the tile measured for it (gemv1pdl), else the plain W4 tile of
    the shape, else (nothing tuned within two octaves) the first config."""
    table = use_tuned_table(monkeypatch, {TK.gemv1_key(256, 1024, 128, False): [8, 512, 4, 0]})
    assert R.ec_pdl_config(256, 1024, 128) == (8, 512, 4, 0)
    table[TK.gemv1pdl_key(256, 1024, 128)] = [8, 128, 1, 1]
    assert R.ec_pdl_config(256, 1024, 128) == (8, 128, 1, 1)
    assert R.ec_pdl_config(512, 1024, 128) == (8, 128, 1, 1)  # untuned: the nearest tuned geometry's
    assert R.ec_pdl_config(8192, 1024, 128) == tuple(T.GEMV1_CONFIGS[0])  # five octaves away: nothing near
    hopper(monkeypatch)
    assert R.route(problem(op="ec", N=256, rank=16, lowering="fused")) .kernel == "ec_pair"
    assert R.route(problem(op="ec", N=256, rank=16, lowering="fused")).config == (8, 128, 1, 1)


def test_single_ec_takes_the_pair_the_table_measured_faster(monkeypatch):
    """Decode EC: the TMA GEMV's EC pair where the TMA kernel runs the shape, unless the table's gemv1tmaec
    entry says the CUDA-core PDL pair measured faster there (0)."""
    if not GT.HAS_TMA:
        pytest.skip("needs Triton with Gluon TMA")
    hopper(monkeypatch)
    p = problem(op="ec", N=512, rank=16, lowering="fused")
    use_tuned_table(monkeypatch, {TK.tma_key(512, 1024, 128): [4, 2, 2, 2, 2]})
    assert R.route(p).kernel == "ec_pair_tma"
    use_tuned_table(monkeypatch, {TK.tma_key(512, 1024, 128): [4, 2, 2, 2, 2], TK.gemv1tmaec_key(512, 1024, 128): 0})
    rt = R.route(p)
    assert rt.kernel == "ec_pair" and any("gemv1tmaec" in r for r in rt.reasons)
    use_tuned_table(monkeypatch, {TK.tma_key(512, 1024, 128): [4, 2, 4, 2, 2, 2]})  # a K-split: no EC epilogue
    assert R.route(p).kernel == "ec_pair"
    use_tuned_table(monkeypatch, {TK.tma_key(512, 1024, 128): [4, 2, 2, 2, 2]})
    assert R.route(p.replace(rank=R.EC_RC_MAX + 1)).kernel == "ec_pair"  # its operands would spill
    monkeypatch.setenv("SPEAR_NO_TMA_EC", "1")
    assert R.route(p).kernel == "ec_pair"


def test_one_launch_decode_ec_follows_the_per_rank_entry(monkeypatch):
    """gemv1selfr (per rank bucket) over gemv1self: the one launch on the TMA kernel where measured fastest,
    a pair where the rank's entry says so; without PDL the EC in the CUDA-core GEMV's launch."""
    if not GT.HAS_TMA:
        pytest.skip("needs Triton with Gluon TMA")
    hopper(monkeypatch)
    monkeypatch.setattr(R._es, "sm_count", lambda device: 132)
    N, K, G = 11008, 4096, 128
    use_tuned_table(monkeypatch, {TK.gemv1self_key(N, K, G): ["tma", 4, 2, 2, 2, 2],
                                  TK.gemv1self_rank_key(N, K, G, 16): ["pair"],
                                  TK.tma_key(N, K, G): [4, 2, 2, 2, 2]})
    p = problem(op="ec", N=N, K=K, rank=64, lowering="fused")
    assert R.route(p) .kernel == "ec_self_tma"
    assert R.route(p.replace(rank=16)).kernel == "ec_pair_tma"  # the rank's entry: a pair
    assert R.route(p.replace(a_contiguous=False)).kernel == "ec_pair_tma"
    hopper(monkeypatch, pdl=False)
    assert R.route(p).kernel in ("ec_self", "ec_pair")


def test_concatenations_route_to_the_tma_kernel_only_where_it_takes_the_fusion(monkeypatch):
    if not GT.HAS_TMA:
        pytest.skip("needs Triton with Gluon TMA")
    hopper(monkeypatch)
    F, K, G = 256, 1024, 128
    use_tuned_table(monkeypatch, {TK.tma_key(2 * F, K, G): [4, 2, 2, 2, 2]})
    cat = problem(op="w4a16_cat", N=2 * F, K=K, parts=(F, F))
    assert R.route(cat).kernel == "cat_tma" and R.route(cat.replace(norm=True)).kernel == "cat_tma"
    glu = problem(op="w4a16_glu", N=F, K=K, parts=(F, F))
    assert R.route(glu).kernel == "glu_tma"
    rt = R.route(glu.replace(zeros_consistent=False))
    assert rt.kernel == "glu_of" and rt.parts[0].kernel == "parts"
    assert R.route(problem(op="ec_glu", N=F, K=K, parts=(F, F), rank=16)).kernel == "ec_glu_tma"
    assert R.route(problem(op="ec_cat", N=2 * F, K=K, parts=(F, F), rank=16, rank_total=32)).kernel == "ec_cat_tma"
    use_tuned_table(monkeypatch, {TK.tma_key(2 * F, K, G): [4, 2, 2, 2, 1]})  # x not staged in shared memory
    assert R.route(cat.replace(norm=True)).kernel == "cat_gemv1"
    rt = R.route(problem(op="ec_cat", N=2 * F, K=K, parts=(F, F), rank=16, rank_total=32, norm=True))
    assert rt.kernel == "ec_cat_gemv1" and rt.parts[0].kernel in ("ec_self", "ec_pair")


def test_batched_concatenations_route_to_one_gemm_up_to_256_rows(monkeypatch):
    hopper(monkeypatch)
    cat = problem(op="w4a16_cat", M=16, N=3 * 512, K=1024, parts=(512, 512, 512))
    rt = R.route(cat)
    assert rt.kernel == "cat_gemm" and rt.parts[0] == R.route(problem(M=16, N=3 * 512, K=1024))
    assert R.route(cat.replace(M=R.CAT_GEMM_MAX_M)).kernel == "cat_gemm"
    assert R.route(cat.replace(M=R.CAT_GEMM_MAX_M + 1)).kernel == "parts"  # not measured there
    assert R.route(cat.replace(zeros_consistent=False)).kernel == "parts"
    ec = problem(op="ec_cat", M=16, N=1024, K=1024, parts=(512, 512), rank=16, rank_total=32)
    rt = R.route(ec)  # with ECs: the same GEMM, each EC beside it
    assert rt.kernel == "ec_cat_gemm" and rt.parts == R.route(cat.replace(N=1024, parts=(512, 512))).parts
    assert R.route(ec.replace(M=1)).kernel != "ec_cat_gemm"
    # a part's EC measured fastest in another structure: not this route
    use_tuned_table(monkeypatch, {**dict(TK.tuned_table()), TK.ec_structure_key(16, 512, 1024, 128): "in_gemm_self"})
    rt = R.route(ec)
    assert rt.kernel != "ec_cat_gemm" and "measured fastest as 'in_gemm_self'" in " ".join(rt.all_reasons())
    two = ec.replace(N=768, parts=(512, 256))
    assert R.route(two).kernel != "ec_cat_gemm"
    assert R.route(two.replace(plain_parts=(0,), rank_total=16)).kernel == "ec_cat_gemm"  # (that part has no EC)
    ec = ec.replace(M=R.CAT_GEMM_MAX_M + 1)
    assert R.route(ec).kernel == "parts"  # not measured there
    # run as its parts, a part without an EC (a plain linear fused beside an EC one) takes the plain W4 route
    rt = R.route(ec.replace(plain_parts=(1,), rank_total=16))
    M = R.CAT_GEMM_MAX_M + 1
    assert rt.kernel == "parts" and [r.kernel for r in rt.parts] == [R.route(ec.replace(op="ec", N=512, parts=())).kernel,
                                                                      R.route(problem(M=M, N=512, K=1024)).kernel]
    assert rt.parts[1] == R.route(problem(M=M, N=512, K=1024)), rt.describe()


def test_a_batched_concatenation_with_fractional_zero_points_avoids_the_integer_only_gemm(monkeypatch):
    """The concatenation's GEMM is the table's for the concatenated shape; where that is the register-operand
    GEMM (integral zero points only) and the op's probe finds fractional ones, the GEMM of M's default runs."""
    hopper(monkeypatch)
    M, N, K, G = 16, 3 * 4096, 4096, 128
    use_tuned_table(monkeypatch, {TK.gemm_key(M, N, K, G): ["wgmma_ra", 64, 16, 8, 4, 2]})
    cat = problem(op="w4a16_cat", M=M, N=N, K=K, parts=(4096,) * 3, has_zeros=True)
    assert R.route(cat.replace(zeros_probe=lambda: True)).parts[0].kernel == "gemm_wgmma_ra"
    rt = R.route(cat.replace(zeros_probe=lambda: False))
    assert rt.kernel == "cat_gemm" and rt.parts[0].kernel != "gemm_wgmma_ra", rt.describe()


def test_problem_of_reads_the_tensor_facts():
    x = torch.zeros(3, 64, dtype=torch.bfloat16)
    q = torch.zeros(32, 32, dtype=torch.uint8)
    s = torch.ones(32, 1, dtype=torch.bfloat16)
    ec = (torch.zeros(8, 64).t().contiguous().t(), torch.zeros(32, 8), torch.zeros(4, 8))
    p = R.problem_of("ec", x, q, s, None, 64, None, ec)
    assert (p.M, p.N, p.K, p.G, p.rank, p.gate_width, p.has_zeros) == (3, 32, 64, 64, 8, 4, False)
    assert not p.a_contiguous and p.b_contiguous and p.param_dtypes == (torch.bfloat16,)


def test_each_kernel_file_names_its_own_constraints(monkeypatch):
    """``can_implement`` lives in the kernel files (the route only chooses): each returns (ok, reason), the
    reason naming the constraint and the value; ``Problem`` comes from the leaf ``lowering/problem.py``."""
    from spear_compile.lowering import _triton, ec_gemm_self, ec_self, ec_shrink_splitk, problem as P
    from spear_compile.lowering import w4a16_gemm_wgmma as WG
    from spear_compile.lowering import w4a16_gemm_wgmma_ra as RA
    from spear_compile.lowering import w4a16_gemv_tma_ec as GTE

    assert R.Problem is P.Problem
    hopper(monkeypatch)
    p = problem(op="ec", M=256, N=512, K=1024, rank=8, ec_dtypes=(torch.bfloat16, torch.bfloat16))
    assert _triton.can_implement(p)[0] == _triton.HAS_TRITON
    assert T.can_implement(p) == (False, "M = 256 (needs M = 1)")
    assert "K = 1000" in T.can_implement(p.replace(M=1, K=1000))[1]
    assert WG.can_implement(p)[0] and "rank 200 > 128" in WG.can_implement(p.replace(rank=200), ec=True)[1]
    assert "torch.float16" in WG.can_implement(p.replace(dtype=torch.float16))[1]
    assert RA.can_implement(p.replace(zeros_integer=False)) == (False, "zero points are not small integers")
    assert "R <= 64" in ec_gemm_self.can_implement(p.replace(rank=96))[1]
    assert "gate of 32" in ec_gemm_self.can_implement(p.replace(gate_width=32))[1]
    assert ec_shrink_splitk.can_implement(p.replace(a_contiguous=False)) == (False, "A is not contiguous")
    assert "EC rank 65 > 64" in GTE.can_implement(p.replace(M=1), (4, 2, 2, 2, 2), rc=65)[1]
    assert "K-split" in GTE.can_implement(p.replace(M=1), (4, 2, 2, 2, 2, 2))[1]
    monkeypatch.setattr(GT, "HAS_TMA", True)
    monkeypatch.setattr(GT, "_tma_capable", lambda device: True)
    monkeypatch.setattr(GT, "gluon_ok", lambda M, K, G, dtype: True)
    assert "needs bf16" in GT.can_implement(p.replace(M=1, param_dtypes=(torch.float16,)))[1]
    assert "RMSNorm" in GT.can_implement(p.replace(M=1), (8, 2, 1, 3, 0), norm=True)[1]
    assert not ec_self.can_implement(p.replace(M=1, K=1 << 20), 64, 1, 1)[0]


def test_an_untuned_shape_takes_the_nearest_tuned_geometry_and_a_tuned_one_keeps_its_absences(monkeypatch):
    """``tuned_key``: a shape whose family anchor (the plain ``gemv1`` tile; the GEMM's M bucket) is in the
    table answers from its own entries, so an absent ``gemv1tma`` still means "the TMA GEMV was not
    faster"; a shape never tuned answers from the nearest tuned geometry of the same group size (and M
    bucket) within two octaves of N and of K, else from the kernels' defaults."""
    if not GT.HAS_TMA:
        pytest.skip("needs Triton with Gluon TMA")
    tma = [4, 2, 2, 2, 2]
    use_tuned_table(monkeypatch, {
        TK.gemv1_key(4096, 4096, 128, False): [8, 512, 4, 0],  # tuned; the TMA kernel lost here
        TK.gemv1_key(4096, 11008, 128, False): [8, 256, 2, 1], TK.tma_key(4096, 11008, 128): tma,
        TK.gemm_key(64, 4096, 4096, 128): [128, 256, 64, 8, 3],
        TK.gemm_key(64, 11008, 4096, 128): [64, 128, 64, 4, 4]})
    hopper(monkeypatch)
    assert R.route(problem(N=4096, K=4096)).kernel == "gemv1"  # tuned: the absent gemv1tma keeps its meaning
    rt = R.route(problem(N=3584, K=9728))  # untuned: nearest is 4096x11008 (0.19 + 0.18 octaves)
    assert rt.kernel == "gemv1_tma" and rt.config == tuple(tma)
    assert any("nearest tuned geometry 4096x11008" in r for r in rt.reasons), rt.reasons
    assert R.tuned_key(TK.gemv1_key(3584, 3584, 128, False)) == TK.gemv1_key(4096, 4096, 128, False)
    assert R.route(problem(N=3584, K=3584)).config == (8, 512, 4, 0)
    assert R.tuned_key(TK.tma_key(3584, 9728, 64)) == TK.tma_key(3584, 9728, 64)  # another group size
    assert R.tuned_key(TK.tma_key(512, 4096, 128)) == TK.tma_key(512, 4096, 128)  # three octaves in N: too far
    # the GEMMs: the same M bucket only
    assert R.gemm_route(problem(M=40, N=12288, K=4096)).config == (64, 128, 64, 4, 4)
    assert R.tuned_key(TK.gemm_key(128, 12288, 4096, 128)) == TK.gemm_key(128, 12288, 4096, 128)
    rt = R.gemm_route(problem(M=128, N=12288, K=4096))  # nothing in M = 128's bucket: the default for the shape
    assert rt.reasons[-1].startswith("M = 128 default" if T.INTERPRET else "nothing measured")


def test_a_nearest_tma_config_whose_k_split_does_not_divide_k_is_not_taken(monkeypatch):
    if not GT.HAS_TMA:
        pytest.skip("needs Triton with Gluon TMA")
    split2 = [4, 2, 2, 2, 2, 2]
    use_tuned_table(monkeypatch, {TK.gemv1_key(4096, 4096, 128, False): [8, 512, 4, 0],
                                  TK.tma_key(4096, 4096, 128): split2})
    hopper(monkeypatch)
    step = GT.tile_geometry(tuple(split2))[1]
    odd = step * 5  # five K steps: a split in two does not divide them
    rt = R.route(problem(N=4096, K=odd))
    assert rt.kernel == "gemv1" and any("does not divide" in r for r in rt.reasons), rt.reasons


_DIMS = [512, 1024, 2048, 3584, 4096, 8192, 11008, 14336, 28672]


@settings(max_examples=60, deadline=None)
@given(anchors=st.lists(st.tuples(st.sampled_from(_DIMS), st.sampled_from(_DIMS), st.sampled_from([64, 128])),
                        max_size=6),
       query=st.tuples(st.sampled_from(_DIMS), st.sampled_from(_DIMS), st.sampled_from([64, 128])),
       kind=st.sampled_from(["tma", "gemv1pdl", "gemv1selfr", "gemm"]))
def test_tuned_key_properties(anchors, query, kind):
    """``tuned_key`` only moves N and K; keeps a tuned shape's own key; else goes to an anchored geometry of
    the same G (and M bucket) within two octaves, and none is nearer."""
    import math

    M = 64
    entries = {}
    for N, K, G in anchors:
        entries[TK.gemv1_key(N, K, G, False)] = [8, 512, 4, 0]
        entries[TK.gemm_key(M, N, K, G)] = [64, 128, 64, 4, 4]
    mp = pytest.MonkeyPatch()
    try:
        use_tuned_table(mp, entries)
        N, K, G = query
        key = {"tma": TK.tma_key(N, K, G), "gemv1pdl": TK.gemv1pdl_key(N, K, G),
               "gemv1selfr": TK.gemv1self_rank_key(N, K, G, 24), "gemm": TK.gemm_key(40, N, K, G)}[kind]
        got = R.tuned_key(key)
        assert type(got) is type(key) and got.G == key.G
        assert {f: v for f, v in got.fields().items() if f not in ("N", "K")} == \
               {f: v for f, v in key.fields().items() if f not in ("N", "K")}
        same = [(n, k) for n, k, g in anchors if g == G]
        if (N, K) in same:
            assert got == key
            return

        def dist(n, k):
            return abs(math.log2(n / N)) + abs(math.log2(k / K))
        near = [(n, k) for n, k in same if max(abs(math.log2(n / N)), abs(math.log2(k / K))) <= R.NEAREST_MAX_OCTAVES]
        if not near:
            assert got == key
        else:
            assert (got.N, got.K) in near and dist(got.N, got.K) == min(dist(n, k) for n, k in near)
    finally:
        mp.undo()


def test_small_m_tiles_searched_are_those_whose_x_block_holds_m_and_that_take_the_shape(monkeypatch):
    """``ra_small_choices``: the smallest x block that holds M (16 for M <= 16, 32, then 64), only on shapes the
    register-operand kernel takes (K a multiple of 64), never the K-split tiles (not yet run on a GPU); the GEMM
    search includes them up to M = 128."""
    from spear_compile.lowering import w4a16_gemm_wgmma as WG
    from spear_compile.lowering import w4a16_gemm_wgmma_ra as RA

    monkeypatch.setattr(R._t, "INTERPRET", False)
    monkeypatch.setattr(WG, "HAS_WGMMA", True)
    assert {c[2] for c in R.ra_small_choices(5, 4096, 4096, 128)} == {16}
    assert {c[2] for c in R.ra_small_choices(17, 4096, 4096, 128)} == {32}
    assert R.ra_small_choices(64) == [("wgmma_ra",) + c for c in RA.SMALL_CONFIGS if c[1] == 64]
    assert R.ra_small_choices(16, 4096, 4000, 4000) == []  # K not a multiple of 64
    got = R.ra_small_choices(16)  # ("wgmma_ra", BNW, BMX, STAGES, WARPS, PF[, KS]): whole K and split K
    assert {len(c) for c in got} == {6, 7} and {c[6] for c in got if len(c) == 7} <= set(RA.KSPLITS) - {1}
    assert set(R.ra_small_choices(32, 4096, 4096, 128)) <= set(R.gemm_choices(32, 4096, 4096, 128))
    assert {c[2] for c in R.ra_small_choices(128, 4096, 4096, 128)} == {64}  # two x blocks of the largest
    assert not [c for c in R.gemm_choices(256, 4096, 4096, 128) if c[0] == "wgmma_ra"]
