"""Shared test setup: deterministic seeds, a fresh Dynamo per test, small thread count."""
import os

# Triton kernels run in Triton's interpreter on machines without a GPU; this must be set
# before triton is first imported (spear_compile imports it when installed).
try:
    import torch as _t

    if not _t.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover
    pass

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch.manual_seed(0)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
