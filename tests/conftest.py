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


@pytest.fixture(params=["native", "sm_120"])
def forced_arch(request, monkeypatch):
    """The configs the ops launch: this GPU's, or sm_120's (the RTX PRO 6000 class, sized for its 100 KB of shared
    memory per SM) forced on it, compiled for this GPU: the logits, the top-k and the rescoring select as on sm_120."""
    if request.param == "sm_120":
        from cupy_dsa import logits, rescore, runtime, topk

        for module in (logits, rescore, topk):
            monkeypatch.setattr(module, "runtime", runtime.ReportedArch("sm_120"))
    return request.param


@pytest.fixture
def seed():
    """A fresh seed per test run (printed on failure), overridable with CUPY_DSA_SEED."""
    s = int(os.environ.get("CUPY_DSA_SEED", torch.seed() % (2**31)))
    torch.manual_seed(s)
    return s


# A GPU session selecting at least this many GPU tests compiles every declared config up front (one NVRTC program
# per source, about a minute cold); a smaller selection (one test, a -k subset) compiles what it launches on first
# use. CUPY_DSA_PRELOAD=1 / 0 forces either.
PRELOAD_MIN_GPU_TESTS = 50


def preload_declared(n_gpu_tests: int, env=os.environ) -> bool:
    """Whether a session that selected ``n_gpu_tests`` GPU tests should compile every declared config first."""
    forced = env.get("CUPY_DSA_PRELOAD")
    if forced in ("0", "1"):
        return forced == "1"
    return n_gpu_tests >= PRELOAD_MIN_GPU_TESTS


@pytest.fixture(scope="session", autouse=True)
def _declared_kernels_loaded(request):
    """Large GPU sessions: every declared config of this GPU's arch (product and experimental) compiled in one
    NVRTC program per source before the first test, instead of one program per experimental config on first use."""
    if not HAS_GPU or not preload_declared(sum("gpu" in item.keywords for item in request.session.items)):
        return
    from cupy_dsa import launch, runtime

    idx = torch.cuda.current_device()
    runtime.warm_up_expressions(idx, launch.declared_expressions(runtime.device_arch(idx)))
