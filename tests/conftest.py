"""Shared test setup: deterministic seeds, a fresh Dynamo per test, small thread count."""
import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch.manual_seed(0)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
