"""Test configuration: GPU tests carry ``@pytest.mark.gpu`` and are skipped without a CUDA device."""
import os

import pytest
import torch

HAS_GPU = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def seed():
    """A fresh seed per test run (printed on failure), overridable with CUPY_DSA_SEED."""
    s = int(os.environ.get("CUPY_DSA_SEED", torch.seed() % (2**31)))
    torch.manual_seed(s)
    return s
