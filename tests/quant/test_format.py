"""Packed int4 format, RTN quantizer and their error messages."""
import pytest
import torch

from spear_compile import QuantConfig, QuantFormatError
from spear_compile.ops.w4a16_ref import dequantize_ref
from spear_compile.quant import pack_int4, quantize_rtn, unpack_int4
from spear_compile.quant.format import check_spear_weight


@pytest.mark.parametrize("N,K", [(1, 2), (5, 64), (123, 320)])
def test_pack_unpack_roundtrip(N, K):
    q = torch.randint(0, 16, (N, K), dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.shape == (N, K // 2) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), q)
    # nibble order: column 2j in the low nibble
    assert int(packed[0, 0]) == int(q[0, 0]) | (int(q[0, 1]) << 4)


def test_pack_rejects_out_of_range_and_odd_k():
    with pytest.raises(QuantFormatError, match=r"\[0, 15\]"):
        pack_int4(torch.tensor([[0, 16]]))
    with pytest.raises(QuantFormatError, match="K=3 must be even"):
        pack_int4(torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(QuantFormatError, match="integer"):
        pack_int4(torch.zeros(2, 4))


@pytest.mark.parametrize("group_size", [None, 32, 64, 128])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rtn_error_is_within_half_a_step(group_size, symmetric, dtype):
    torch.manual_seed(0)
    N, K = 48, 256
    w = (torch.randn(N, K) * 0.05).to(dtype)
    qw = quantize_rtn(w, QuantConfig(group_size=group_size, symmetric=symmetric))
    G = group_size or K
    assert qw.group_size == G and qw.scales.shape == (N, K // G) and qw.scales.dtype == dtype
    deq = qw.dequantize(torch.float32)
    step = qw.scales.float().repeat_interleave(G, dim=1)
    err = (deq - w.float()).abs()
    # inside the representable range the error is at most half a step (+ storage rounding of the scale)
    assert (err <= 0.5 * step * 1.02 + 1e-6).float().mean() > 0.99
    assert err.max() <= 1.0 * step.max() + 1e-6


def test_rtn_exact_on_representable_grid():
    s = 0.01
    q = torch.randint(0, 16, (8, 64))
    q[:, 0], q[:, 1] = 0, 15  # pin min and max so RTN finds the same grid
    w = (q.float() - 3) * s
    qw = quantize_rtn(w, QuantConfig())
    assert torch.allclose(qw.dequantize(), w, atol=1e-6)


def test_dequantize_ref_matches_manual_formula():
    N, K, G = 6, 64, 32
    q = torch.randint(0, 16, (N, K), dtype=torch.uint8)
    s, z = torch.rand(N, K // G), torch.randint(0, 16, (N, K // G)).float()
    manual = (q.float().view(N, K // G, G) - z[..., None]) * s[..., None]
    assert torch.equal(dequantize_ref(pack_int4(q), s, z, G, "spear"), manual.view(N, K))
    assert torch.equal(dequantize_ref(q, s, z, G, "unpacked"), manual.view(N, K))


def test_k_not_divisible_by_group_names_it():
    with pytest.raises(QuantFormatError, match=r"layers\.0\.q_proj: in_features K=96 is not divisible by group_size=64"):
        quantize_rtn(torch.randn(4, 96), QuantConfig(group_size=64), where="layers.0.q_proj")


def test_wrong_packed_shape_and_dtype_are_named():
    s = torch.ones(4, 1)
    with pytest.raises(QuantFormatError, match=r"packed qweight has shape \(4, 16\), expected \[N, K/2\] = \[N, 32\]"):
        check_spear_weight(torch.zeros(4, 16, dtype=torch.uint8), s, s, 64, 64, "mod.a")
    with pytest.raises(QuantFormatError, match="mod.a: packed qweight must be uint8, got torch.int32"):
        check_spear_weight(torch.zeros(4, 32, dtype=torch.int32), s, s, 64, 64, "mod.a")
    with pytest.raises(QuantFormatError, match=r"scales has shape \(4, 2\), expected \[N, K/G\] = \[4, 1\]"):
        check_spear_weight(torch.zeros(4, 32, dtype=torch.uint8), torch.ones(4, 2), s, 64, 64, "mod.a")


def test_quant_config_validates():
    assert QuantConfig(group_size=0).group_size is None
    with pytest.raises(ValueError, match="bits=3"):
        QuantConfig(bits=3)
    with pytest.raises(ValueError, match="group_size=48"):
        QuantConfig(group_size=48)
    assert QuantConfig.from_dict(QuantConfig(group_size=64).to_dict()) == QuantConfig(group_size=64)
    with pytest.raises(ValueError, match="unknown keys"):
        QuantConfig.from_dict({"bitz": 4})
