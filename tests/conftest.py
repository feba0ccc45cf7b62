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


@pytest.fixture(scope="session", autouse=True)
def _declared_kernels_loaded(request):
    """GPU sessions: every declared config of this GPU's arch (product and experimental) compiled in one NVRTC
    program per source before the first test, instead of one program per experimental config on first use."""
    if not HAS_GPU or not any("gpu" in item.keywords for item in request.session.items):
        return
    from cupy_dsa import launch, runtime

    idx = torch.cuda.current_device()
    runtime.warm_up_expressions(idx, launch.declared_expressions(runtime.device_arch(idx)))
