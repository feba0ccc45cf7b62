"""NVRTC compile of every declared kernel instantiation for every target arch, without a GPU."""
import pytest

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
