"""Make SGLang 0.5.23 importable on a CPU-only test machine (SGLang installed with --no-deps).

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
    def __getattr__(self, item):
        if item.startswith("__") and item.endswith("__"):
            raise AttributeError(item)
        return _Dummy(f"{self.__name__}.{item}")


class _TorchvisionStubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0+cupy_dsa_stub"
        return module

    def exec_module(self, module):
        pass


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
    if any(isinstance(f, _TorchvisionStubFinder) for f in sys.meta_path):
        return
    if "torchvision" in sys.modules or _real_torchvision_works():
        return
    sys.meta_path.insert(0, _TorchvisionStubFinder())
