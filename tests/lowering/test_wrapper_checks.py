"""The Triton launch wrappers check what their kernels assume of x (K equal to the weight's, unit stride along
K, fp16 / bf16 / fp32, one row for the M = 1 kernel) and raise a ValueError naming the kernel, the argument and
its shape, instead of computing from the wrong memory (run on CPU under TRITON_INTERPRET=1)."""
import pytest
import torch

from spear_compile.lowering import w4a16_triton as T
from spear_compile.lowering._triton import HAS_TRITON
from spear_compile.ops.w4a16_ref import w4a16_linear_ref
from tests.helpers import DEV, packed_weight

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
LAUNCHES = {"w4a16_gemv1": T.w4a16_gemv1, "w4a16_gemv": T.w4a16_gemv_small, "w4a16_gemm": T.w4a16_gemm_triton}


@pytest.mark.parametrize("name", list(LAUNCHES))
def test_x_whose_K_differs_from_the_weights_is_refused(name):
    q, s, z, b, G = packed_weight(32, 128, 64, torch.float32)
    x = torch.randn(1, 96, device=DEV)
    with pytest.raises(ValueError, match=rf"{name}: x has K=96 columns but the packed weight \(32, 64\) holds K=128"):
        LAUNCHES[name](x, q, s, z, G, b)


@pytest.mark.parametrize("name", ["w4a16_gemv", "w4a16_gemm"])
def test_x_strided_along_K_is_refused(name):
    q, s, z, b, G = packed_weight(32, 128, 64, torch.float32)
    x = torch.randn(2, 256, device=DEV)[:, ::2]
    with pytest.raises(ValueError, match=rf"{name}: x \(2, 128\) stride \(256, 2\) is not contiguous along K"):
        LAUNCHES[name](x, q, s, z, G, b)


def test_the_m1_gemv_takes_one_contiguous_row_and_copies_a_strided_one():
    q, s, z, b, G = packed_weight(32, 128, 64, torch.float32)
    with pytest.raises(ValueError, match=r"w4a16_gemv1: x \(2, 128\) has M=2 rows"):
        T.w4a16_gemv1(torch.randn(2, 128, device=DEV), q, s, z, G, b)
    x = torch.randn(1, 256, device=DEV)[:, ::2]
    torch.testing.assert_close(T.w4a16_gemv1(x, q, s, z, G, b), w4a16_linear_ref(x, q, s, z, G, b),
                               rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("name", list(LAUNCHES))
def test_x_of_another_dtype_is_refused(name):
    q, s, z, b, G = packed_weight(32, 128, 64, torch.float32)
    with pytest.raises(ValueError, match=rf"{name}: x dtype torch.int32"):
        LAUNCHES[name](torch.zeros(1, 128, dtype=torch.int32, device=DEV), q, s, z, G, b)
