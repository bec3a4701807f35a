"""Linear CKA (streamed) and the static compensators (LoRC, LQER, QERA-exact)."""
import pytest
import torch

from spear_compile.compensators.cka import StreamingCKA, linear_cka, linear_cka_gram
from spear_compile.compensators.static import lorc, lqer, output_error_spectrum, qera_exact


def _acts(n=200, p=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, p, generator=g) @ torch.randn(p, p, generator=g) + 3.0


def test_cka_identity_is_one():
    X = _acts()
    assert linear_cka(X, X) == pytest.approx(1.0, abs=1e-12)


def test_cka_invariant_to_orthogonal_transform_and_isotropic_scaling():
    X = _acts()
    Q, _ = torch.linalg.qr(torch.randn(24, 24, generator=torch.Generator().manual_seed(1), dtype=torch.float64))
    Y = _acts(seed=2)[:, :16]
    base = linear_cka(X, Y)
    assert linear_cka(X.double() @ Q, Y) == pytest.approx(base, rel=1e-9)
    assert linear_cka(7.5 * X.double(), Y) == pytest.approx(base, rel=1e-9)
    assert linear_cka(X, Y) < 0.99  # and it does discriminate


def test_cka_equals_gram_formula_and_streaming_equals_one_batch():
    X, Y = _acts(n=120), _acts(n=120, p=10, seed=5)
    assert linear_cka(X, Y) == pytest.approx(linear_cka_gram(X, Y), rel=1e-9)
    s = StreamingCKA()
    for i in range(0, 120, 37):
        s.update(X[i:i + 37], Y[i:i + 37])
    assert s.value() == pytest.approx(linear_cka(X, Y), rel=1e-9)


def test_cka_rejects_mismatched_rows():
    with pytest.raises(ValueError, match="X has 5 rows, Y has 4"):
        linear_cka(torch.randn(5, 3), torch.randn(4, 3))


def _problem(seed=0, N=48, K=32, n=4096):
    g = torch.Generator().manual_seed(seed)
    err = torch.randn(N, K, generator=g)
    mix = torch.randn(K, K, generator=g) * torch.linspace(0.05, 3.0, K)  # correlated, anisotropic inputs
    x = torch.randn(n, K, generator=g) @ mix
    return err, x


def _out_err(err, A, B, x):
    return ((x @ (err - B @ A).t()) ** 2).mean().item()


@pytest.mark.parametrize("rank", [2, 8])
def test_qera_exact_is_the_output_error_optimum(rank):
    err, x = _problem()
    rxx = x.t() @ x / x.shape[0]
    e_qera = _out_err(err, *qera_exact(err, rank, rxx), x)
    e_lqer = _out_err(err, *lqer(err, rank, x.abs().mean(0)), x)
    e_lorc = _out_err(err, *lorc(err, rank), x)
    assert e_qera < e_lqer and e_qera < e_lorc
    # optimality: no random rank-r perturbation of the QERA factors does better
    A, B = qera_exact(err, rank, rxx)
    g = torch.Generator().manual_seed(9)
    for _ in range(5):
        dA = torch.randn(A.shape, generator=g) * 1e-2
        assert _out_err(err, A + dA, B, x) >= e_qera - 1e-6


def test_lorc_is_the_weight_error_optimum():
    err, _ = _problem()
    A, B = lorc(err, 4)
    U, S, Vh = torch.linalg.svd(err)
    assert torch.linalg.norm(err - B @ A) == pytest.approx(S[4:].norm().item(), rel=1e-5)


def test_output_error_spectrum_measures_what_qera_leaves():
    torch.manual_seed(3)
    err = torch.randn(40, 32)
    x = torch.randn(4096, 32) * torch.linspace(0.2, 3.0, 32)
    rxx = x.t().double() @ x.double() / x.shape[0]
    spec = output_error_spectrum(err, rxx)
    assert spec.shape == (32,) and bool((spec[:-1] >= spec[1:]).all())
    torch.testing.assert_close(spec.sum().double(), (x.double() @ err.double().t()).pow(2).sum(1).mean(),
                               rtol=1e-4, atol=0)
    for r in (1, 5, 20):
        A, B = qera_exact(err, r, rxx)
        left = (x.double() @ (err - B @ A).double().t()).pow(2).sum(1).mean()
        torch.testing.assert_close(spec[r:].sum().double(), left, rtol=1e-3, atol=0)
