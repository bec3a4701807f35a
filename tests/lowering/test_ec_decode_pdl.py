"""The two-launch decode EC (``lowering/ec_decode_triton.py``) against the reference.

On CPU the producer grid and the GEMV run in stream order under ``TRITON_INTERPRET=1``
(no PDL there); several producers (split K) and one, odd r and gate width, and a second
call that relies on the first having reset the counter.
"""
import pytest
import torch

from spear_compile.lowering import device as capability

from spear_compile.ops.ec_ref import ec_linear_ref

from tests.helpers import DEV, close_to as _close, ec_operands as _ec, packed_weight as _weight

ED = pytest.importorskip("spear_compile.lowering.ec_decode_triton")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("R,D", [(8, 4), (5, 3)])
@pytest.mark.parametrize("producers", [None, 1, 3])
@pytest.mark.parametrize("act", ["silu", "gelu"])
def test_ec_pdl_matches_reference_and_resets_counter(dtype, R, D, producers, act):
    from spear_compile.lowering._triton import next_pow2
    from spear_compile.lowering.w4a16_triton import ec_workspace

    qweight, scales, zeros, bias, Gs = _weight(123, 320, 64, dtype)
    ec = _ec(123, 320, R, D, dtype)
    for rep in range(2):
        x = torch.randn(1, 320, generator=torch.Generator().manual_seed(rep)).to(DEV, dtype)
        y = torch.full((1, 123), float("nan"), dtype=dtype, device=DEV)
        ED.w4a16_gemv1_ec_pdl(x, qweight, scales, zeros, Gs, bias, ec, act=act, producers=producers, out=y)
        _close(y, ec_linear_ref(x, qweight, scales, zeros, Gs, bias, *ec, act), dtype)
    assert int(ec_workspace(torch.device(DEV), next_pow2(R))[1].abs().sum()) == 0


def _gh_ref(x, ec, act):
    """g * h of the EC on x [1, K] in fp32 (what the producer grid publishes)."""
    from spear_compile.ops.ec_ref import _ACTS

    A, B, W1, b1, W2, b2, alpha = (t.float() for t in ec)
    h = x.float() @ A.t()
    g = torch.sigmoid(_ACTS[act](h @ W1.t() + b1) @ W2.t() + b2)
    return (g * h)[0]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("producers", [None, 3])
def test_producer_normalises_x_as_the_model_does(dtype, producers):
    """ec_produce with an RMSNorm prologue publishes g * h of rms_norm_ref(x) (each producer sums the
    squares of all of x itself); without the norm, of x. A mutant that skipped the norm fails."""
    from spear_compile.ops.refs import rms_norm_ref
    from spear_compile.lowering.w4a16_triton import GH_COPIES

    K, R = 320, 5
    ec = _ec(123, K, R, 3, dtype)
    x = (torch.randn(1, K, generator=torch.Generator().manual_seed(3)) * 3).to(DEV, dtype)
    w = (torch.rand(K, generator=torch.Generator().manual_seed(4)) + 0.5).to(DEV, dtype)
    for norm, xr in (((w, 1e-5), rms_norm_ref(x, w, 1e-5)), (None, x)):
        gh, _ = ED.ec_produce(x, ec, "silu", norm, producers=producers)
        ref = _gh_ref(xr, ec, "silu")
        assert gh.shape[0] == GH_COPIES
        for c in (0, GH_COPIES - 1):  # every copy holds the same values
            _close(gh[c, :R], ref, dtype)  # (bf16: the normalised x may round the other way by one ulp)
    gh, _ = ED.ec_produce(x, ec, "silu", None, producers=producers)
    assert (gh[0, :R] - _gh_ref(rms_norm_ref(x, w, 1e-5), ec, "silu")).abs().max() > 1e-2  # the norm matters
    with pytest.raises(ValueError, match=r"norm weight \(64,\)"):
        ED.ec_produce(x, ec, "silu", (w[:64], 1e-5))


def test_ec_rows_equal_the_block_diagonal_b():
    """ec_rows (each row's own part of the concatenated EC's B, alpha folded, with its g * h offset) gives,
    through the TMA epilogue's arithmetic (ec_rows_emulated), the block-diagonal B g h of concatenated_ecs;
    parts of different rank and alpha."""
    from spear_compile.lowering.ec_cat import concatenated_ecs, ec_rows, ec_rows_emulated

    parts = [_ec(n, 64, r, 4, torch.bfloat16, seed=s) for s, (n, r) in enumerate([(48, 8), (16, 5), (32, 8)])]
    parts = [p[:6] + (torch.tensor(a, device=DEV),) for p, a in zip(parts, (1.25, -0.5, 2.0))]
    qs = [torch.zeros(n, 32, dtype=torch.uint8, device=DEV) for n in (48, 16, 32)]  # (only their row counts count)
    cat = concatenated_ecs(*[list(v) for v in zip(*parts)], qs)
    rows, offs = ec_rows([p[1] for p in parts], [p[6] for p in parts], qs)
    assert rows.shape == (96, 8) and offs.dtype == torch.int32 and offs.tolist() == [0] * 48 + [8] * 16 + [13] * 32
    gh = torch.randn(21, generator=torch.Generator().manual_seed(0)).to(DEV)
    ref = cat[1].float() @ gh
    torch.testing.assert_close(ec_rows_emulated(gh, rows, offs, 21), ref, rtol=1e-5, atol=1e-5)
    bad = offs.clone()
    bad[48:64] = 0  # a mutant reading the first part's g * h for the second part's rows
    assert (ec_rows_emulated(gh, rows, bad, 21) - ref).abs().max() > 1e-3


def test_parts_without_an_ec_get_zero_rows_and_no_rank():
    """A plain linear fused beside EC ones (None in the EC lists): no A rows or gate in the concatenated EC,
    zero rows of B and of ec_rows, the next part's offset unmoved; through the epilogue's arithmetic the
    plain rows get nothing and the EC rows what they get alone."""
    from spear_compile.lowering.ec_cat import concatenated_ecs, ec_rows, ec_rows_emulated

    e0, e2 = (_ec(n, 64, r, 4, torch.bfloat16, seed=s) for s, (n, r) in enumerate([(48, 8), (32, 5)]))
    parts = [e0, (None,) * 7, e2]
    qs = [torch.zeros(n, 32, dtype=torch.uint8, device=DEV) for n in (48, 16, 32)]
    A, B, W1, b1, W2, b2, alpha = concatenated_ecs(*[list(v) for v in zip(*parts)], qs)
    assert A.shape == (13, 64) and B.shape == (96, 13) and W1.shape == (8, 13) and b1.shape == (8,)
    assert float(B[48:64].abs().max()) == 0.0 and float(alpha) == 1.0
    rows, offs = ec_rows([p[1] for p in parts], [p[6] for p in parts], qs)
    assert rows.shape == (96, 8) and offs.tolist() == [0] * 48 + [13] * 16 + [8] * 32  # (13: past every rank)
    assert float(rows[48:64].abs().max()) == 0.0
    gh = torch.randn(13, generator=torch.Generator().manual_seed(0)).to(DEV)
    torch.testing.assert_close(ec_rows_emulated(gh, rows, offs, 13), B.float() @ gh, rtol=1e-5, atol=1e-5)
    assert bool(torch.isfinite(ec_rows_emulated(torch.full_like(gh, float("nan")), rows, offs, 13)[48:64]).all())
    alone = concatenated_ecs(*[list(v) for v in zip(e0, e2)], [qs[0], qs[2]])  # without the plain part
    torch.testing.assert_close(B[64:].float(), alone[1][48:].float())


def test_spear_no_pdl_keeps_the_kernels_and_drops_only_the_dependent_launch(monkeypatch):
    """SPEAR_NO_PDL=1 (diagnostic) must not change which kernels run (``pdl_ok`` routes them), only whether
    the pair's GEMV is PDL-launched behind its producer (``pdl_launch_ok``)."""
    from spear_compile.lowering import ec_decode_triton as E

    monkeypatch.setattr(capability, "pdl", lambda device: True)
    dev = torch.device("cpu")
    monkeypatch.delenv("SPEAR_NO_PDL", raising=False)
    assert E.pdl_launch_ok(dev)
    monkeypatch.setenv("SPEAR_NO_PDL", "1")
    assert not E.pdl_launch_ok(dev) and E.pdl_ok(dev)
    monkeypatch.setenv("SPEAR_NO_PDL", "0")
    assert E.pdl_launch_ok(dev)
