"""Make SGLang 0.5.23 importable on a CPU-only test machine (SGLang installed with --no-deps), and on a
GPU machine without SGLang's kernel packages (:func:`install_kernel_stubs`, for scripts/gpu_sglang_path.py).

SGLang's model-side imports reach ``import torchvision.transforms`` (a multimodal helper), and PyPI has no
CPU build of torchvision that loads next to CPU torch. No DeepSeek-V4 code path calls torchvision, so tests
serve every ``torchvision`` / ``torchvision.*`` import as a permissive dummy module. ``install()`` must run
before the first ``import sglang``; it is a no-op when a real torchvision imports.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types


class _Dummy:
    """Any attribute, call, subscript or base-class use gives another dummy."""

    def __init__(self, name="torchvision_stub"):
        self._name = name

    def __getattr__(self, item):
        if item.startswith("__") and item.endswith("__"):
            raise AttributeError(item)
        return _Dummy(f"{self._name}.{item}")

    def __call__(self, *args, **kwargs):
        return _Dummy(f"{self._name}()")

    def __getitem__(self, item):
        return _Dummy(f"{self._name}[]")

    def __iter__(self):
        return iter(())

    def __mro_entries__(self, bases):
        return (object,)

    def __repr__(self):
        return f"<{self._name}>"


class _StubModule(types.ModuleType):
    dummy = _Dummy  # what the module's attributes are

    def __getattr__(self, item):
        if item.startswith("__") and item.endswith("__"):
            raise AttributeError(item)
        return self.dummy(f"{self.__name__}.{item}")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves every module of the top-level packages ``names`` as a ``module_type`` stub."""

    def __init__(self, names, module_type):
        self.names = tuple(names)
        self.module_type = module_type

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.names:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = self.module_type(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0+cupy_dsa_stub"
        return module

    def exec_module(self, module):
        pass


def _finder_installed(module_type) -> bool:
    return any(isinstance(f, _StubFinder) and f.module_type is module_type for f in sys.meta_path)


def _real_torchvision_works() -> bool:
    if importlib.util.find_spec("torchvision") is None:
        return False
    try:
        import torchvision  # noqa: F401
        import torchvision.transforms  # noqa: F401
    except Exception:
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]
        return False
    return True


def install() -> None:
    """Install the stub finder once (before ``import sglang``), unless a working torchvision exists."""
    if _finder_installed(_StubModule):
        return
    if "torchvision" in sys.modules or _real_torchvision_works():
        return
    sys.meta_path.insert(0, _StubFinder(("torchvision",), _StubModule))


# --------------------------------------------------------------------------------------------------
# Kernel-package stubs (GPU machine without sgl-kernel, DeepGEMM, FlashMLA, FlashInfer)
# --------------------------------------------------------------------------------------------------

KERNEL_PACKAGES = ("sgl_kernel", "deep_gemm", "flash_mla", "flashinfer")
_STRICT = [False]


class _KernelDummy(_Dummy):
    """Like the torchvision dummy while SGLang imports (module-level decorators and aliases work); once
    :func:`strict_kernel_stubs` ran, calling anything raises an error naming it, so a piece of SGLang that
    needs a missing kernel package fails loudly instead of computing with dummies."""

    def __getattr__(self, item):
        if item.startswith("__") and item.endswith("__"):
            raise AttributeError(item)
        return _KernelDummy(f"{self._name}.{item}")

    def __call__(self, *args, **kwargs):
        if _STRICT[0]:
            raise RuntimeError(f"{self._name} was called, but {self._name.split('.')[0]} is an import stub on "
                               "this machine (not installed): use SGLang's torch fallback for this piece")
        return _KernelDummy(f"{self._name}()")


class _KernelStubModule(_StubModule):
    dummy = _KernelDummy


def install_kernel_stubs(names=KERNEL_PACKAGES) -> list[str]:
    """Serve imports of the kernel packages among ``names`` that are not installed (before ``import
    sglang``); returns the stubbed names."""
    missing = [n for n in names if n not in sys.modules and importlib.util.find_spec(n) is None]
    if missing and not _finder_installed(_KernelStubModule):
        sys.meta_path.insert(0, _StubFinder(missing, _KernelStubModule))
    return missing


def strict_kernel_stubs() -> None:
    """From now on a call into a stubbed kernel package raises (call after the SGLang imports)."""
    _STRICT[0] = True
