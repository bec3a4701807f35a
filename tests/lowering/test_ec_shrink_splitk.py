"""The split-K shrink + gate (``lowering/ec_shrink_splitk.py``) against ``ec_delta_ref``'s ``g * h``.

On CPU under ``TRITON_INTERPRET=1`` (programs run one after another, so the last arriver is the last
slice); on a GPU the compiled kernel, whose programs arrive in any order. Tolerance: h is fp32 in both;
the gate's dots run in tf32 on a GPU, hence 1e-2 of max |ref|.
"""
import pytest
import torch

from spear_compile.lowering._triton import HAS_TRITON
from spear_compile.ops.ec_ref import ec_delta_ref

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is a test dependency; install .[test]")

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _ec(K, R, D, dtype, seed=1):
    gen = torch.Generator().manual_seed(seed)
    A = torch.randn(R, K, generator=gen) / K ** 0.5
    W1, b1 = torch.randn(D, R, generator=gen) / R ** 0.5, torch.randn(D, generator=gen) * 0.1
    W2, b2 = torch.randn(R, D, generator=gen) / D ** 0.5, torch.randn(R, generator=gen) * 0.1
    alpha = torch.tensor(0.7)
    return [t.to(DEV, dtype) for t in (A, W1, b1, W2, b2, alpha)]


def _ref_hg(x, A, W1, b1, W2, b2, alpha, act):
    """alpha g * h: ``ec_delta_ref`` with B = I (in fp32)."""
    eye = torch.eye(A.shape[0], device=x.device)
    return ec_delta_ref(x.float(), A, eye, W1, b1, W2, b2, alpha, act)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("M,K,R,D,act", [(17, 320, 12, 5, "silu"), (3, 320, 16, 8, "relu"), (40, 200, 7, 3, "gelu")])
def test_splitk_shrink_gate_matches_reference(dtype, M, K, R, D, act):
    from spear_compile.lowering.ec_shrink_splitk import INTERPRET_PROGRAMS, ec_shrink_gate_splitk, splitk_geometry

    A, W1, b1, W2, b2, alpha = _ec(K, R, D, dtype)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(0)).to(DEV, dtype)
    if DEV == "cpu":
        assert splitk_geometry(M, K, INTERPRET_PROGRAMS)[0] > 1  # the partials really are summed across programs
    hg = ec_shrink_gate_splitk(x, A, W1, b1, W2, b2, act, alpha=alpha, dtype=torch.float32)
    ref = _ref_hg(x, A, W1, b1, W2, b2, alpha, act)
    assert hg.shape == (M, max(16, 1 << (R - 1).bit_length()))
    err = (hg[:, :R] - ref).abs().max().item()
    assert err / ref.abs().max().item() < 1e-2, err
    assert hg[:, R:].abs().sum().item() == 0.0  # padding columns (if any) written as zeros
    wrong = ec_shrink_gate_splitk(x, A, W1, b1, W2, b2, act, dtype=torch.float32)  # alpha dropped: must differ
    assert (wrong[:, :R] - ref).abs().max().item() / ref.abs().max().item() > 0.1


def test_splitk_is_deterministic_and_leaves_its_counters_at_zero():
    """Launch after launch the same bits (the last arriver sums the slices in order), and every launch
    resets the row blocks' counters it used, so the next one starts from zero."""
    from spear_compile.lowering import ec_shrink_splitk as S

    dtype = torch.bfloat16
    A, W1, b1, W2, b2, alpha = _ec(256, 16, 8, dtype)
    x = torch.randn(33, 256, generator=torch.Generator().manual_seed(2)).to(DEV, dtype)
    outs = [S.ec_shrink_gate_splitk(x, A, W1, b1, W2, b2, "silu", alpha=alpha) for _ in range(3)]
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    blocks = -(-33 // S.BLOCK_M)
    cnt = S._counters(A, blocks)
    assert cnt.shape[0] >= blocks and int(cnt.abs().sum()) == 0
    assert outs[0].dtype == dtype


def test_splitk_geometry_covers_k_once():
    from spear_compile.lowering.ec_shrink_splitk import BLOCK_K, BLOCK_M, MAX_KS, splitk_geometry

    for M, K, programs in [(1024, 4096, 132), (256, 8192, 132), (4096, 4096, 132), (17, 320, 8), (1, 64, 132),
                           (300, 640, 132)]:
        ks, chunk = splitk_geometry(M, K, programs)
        assert chunk % BLOCK_K == 0 and (ks - 1) * chunk < K <= ks * chunk  # every slice non-empty, K covered
        assert ks == 1 or -(-M // BLOCK_M) * ks <= programs  # at most the programs asked for
        assert ks <= MAX_KS


def test_splitk_refuses_bad_operands_with_a_clear_error():
    from spear_compile.lowering.ec_shrink_splitk import ec_shrink_gate_splitk

    A, W1, b1, W2, b2, alpha = _ec(128, 8, 4, torch.bfloat16)
    x = torch.randn(4, 128).to(DEV, torch.bfloat16)
    with pytest.raises(ValueError, match=r"A \(8, 128\) must be a contiguous \[r, 64\]"):
        ec_shrink_gate_splitk(x[:, :64], A, W1, b1, W2, b2)
    with pytest.raises(ValueError, match="x dtype torch.float32"):
        ec_shrink_gate_splitk(x.float(), A, W1, b1, W2, b2)
    with pytest.raises(ValueError, match="contiguous rows"):
        ec_shrink_gate_splitk(x.t(), A, W1, b1, W2, b2)


def test_splitk_program_fits_beside_a_register_operand_gemm_cta():
    """Compiled for sm_90 (offline ptxas): at most 96 registers per thread (4 warps: 12,288, what an SM has
    left beside the GEMM's 256-thread, 208-register CTA) and at most 16 KB of shared memory, so the GEMM
    launched behind it by PDL is not kept off the SMs that hold a shrink program."""
    from tests.helpers import run_compiled

    code = ("import re\n"
            "from spear_compile.lowering.ec_shrink_splitk import compile_sm90\n"
            "from tests.lowering.sass_wgmma import compile_sass\n"
            "for dt in ('bf16', 'fp16'):\n"
            "    k = compile_sm90(dt)\n"
            "    assert 'griddepcontrol.launch_dependents' in k.asm['ptx'], dt\n"
            "    log, _ = compile_sass(k.asm['ptx'])\n"
            "    regs = int(re.search(r'Used (\\d+) registers', log).group(1))\n"
            "    assert regs <= 96 and re.search(r'\\b0 bytes spill stores', log), (dt, log[-300:])\n"
            "    assert k.metadata.shared <= 16384, (dt, k.metadata.shared)\n"
            "print('ok')\n")
    run_compiled(code)
