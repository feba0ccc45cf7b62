"""NVRTC compile of every declared kernel instantiation for every target arch, without a GPU."""
import pytest
import torch

from cupy_dsa import runtime

ARCHS = ["sm_80", "sm_89", "sm_90", "sm_100", "sm_120"]


def _cases():
    return [(f, a) for f in sorted(runtime.instantiations()) for a in ARCHS]


def test_every_source_declares_instantiations():
    inst = runtime.instantiations()
    assert set(inst) == {"store_index_k.cu", "mqa_logits.cu"}
    assert all(len(v) > 0 for v in inst.values())


@pytest.mark.parametrize("filename,arch", _cases())
def test_nvrtc_compiles(filename, arch):
    exprs = runtime.instantiations()[filename]
    cubin, lowered = runtime.compile_cubin(filename, exprs, arch)
    assert cubin[:4] == b"\x7fELF"
    assert set(lowered) == set(exprs) and all(lowered.values())


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu"), "gpu0", "cuda:x"])
def test_warm_up_rejects_non_cuda_devices(device):
    with pytest.raises(ValueError, match="device"):
        runtime.warm_up(device)


@pytest.mark.parametrize("device", [None, "cuda", "cuda:1", torch.device("cuda", 0), 0, 1])
def test_warm_up_without_a_gpu_says_so(device, monkeypatch):
    """Device strings, torch.device and ints are accepted; without a GPU the error says what is missing."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="no CUDA GPU is available"):
        runtime.warm_up(device)


@pytest.mark.parametrize("device", [1.5, True, [0]])
def test_warm_up_rejects_other_types(device):
    with pytest.raises(TypeError, match="device"):
        runtime.warm_up(device)


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["none", "str", "device", "int"])
def test_warm_up_accepts_every_device_form(form):
    idx = torch.cuda.current_device()
    arg = {"none": None, "str": f"cuda:{idx}", "device": torch.device("cuda", idx), "int": idx}[form]
    assert runtime.warm_up(arg) == sum(len(v) for v in runtime.instantiations().values())
