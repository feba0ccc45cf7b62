"""The launch layer: every kernel template as a spec object, every op's choice of variant as a family.

* :class:`Kernel` -- one ``__global__`` template of ``kernels/``: its source file, its named template
  parameters, its named and typed arguments in signature order (checked against the CUDA source by
  ``tests/test_compile.py``), its block size and its dynamic shared memory, both functions of the config.
* :class:`Config` -- a kernel with values for its template parameters (one instantiation) and for its host
  parameters (launch-geometry knobs that need no other instantiation). ``config.launch(device, grid,
  name=value, ...)`` marshals the named arguments and launches on torch's current stream.
* :class:`Family` -- the kernels that can serve one op's problem and ``select(problem, arch) -> Config``.
  Its *product* configs on an arch are what ``select`` returns over its declared problem space (so
  :func:`warm_up` compiles exactly what callers can launch); its *experimental* configs are reachable only
  through :meth:`Family.forced` (the ``cupy-dsa bench variants`` timings and tests). An experimental config
  has to serve a problem of its family, so no kernel ships that no config reaches.

Ops register their families here (:func:`register`, at import); the runtime below knows nothing of ops.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import numpy as np
import torch

from . import arch as arch_limits
from . import runtime

# Kernel-argument types: a tensor's data pointer (None for a null one), 32/64-bit ints, fp32. Scalars become
# NumPy scalars (CuPy passes a Python int as 64 bits and a float as a double); constructing one costs ~0.5 us,
# so ints are cached.
PTR, I32, I64, F32 = "ptr", "i32", "i64", "f32"
C_TYPES = {PTR: "pointer", I32: "int", I64: "long long", F32: "float"}

_i32 = functools.lru_cache(maxsize=8192)(np.int32)
_i64 = functools.lru_cache(maxsize=8192)(np.int64)
_f32 = functools.lru_cache(maxsize=256)(np.float32)


def _ptr(t):
    return 0 if t is None else t.data_ptr()


_CONVERT = {PTR: _ptr, I32: _i32, I64: _i64, F32: _f32}


class Kernel:
    """One ``__global__`` template: source, name, template parameters, arguments, block, shared memory.

    ``params``: template parameter names in order; ``host``: host parameters with their defaults (they shape
    the grid, not the instantiation); ``args``: ``(name, type)`` pairs in signature order; ``threads(cfg)``
    and ``smem(cfg)``: block size and dynamic shared-memory bytes of a config; ``smem_check``: the C++ constant
    the kernel lays its shared memory out with, formatted with the config's values (``tests/test_compile.py``
    checks it equals ``smem``); ``render(name, value)``: the template argument's spelling (default ``str``)."""

    def __init__(self, source: str, name: str, *, params=(), host=None, args, threads: Callable[[Any], int],
                 smem: Callable[[Any], int] = lambda cfg: 0, smem_check: str | None = None,
                 render: Callable[[str, Any], str] | None = None):
        self.source, self.name = source, name
        self.smem_check = smem_check
        self.params = tuple(params)
        self.host = dict(host or {})
        self.args = tuple(args)
        self.threads, self.smem = threads, smem
        self._render = render or (lambda _name, value: str(value))
        names = [n for n, _ in self.args]
        if len(set(names)) != len(names) or any(t not in _CONVERT for _, t in self.args):
            raise ValueError(f"{name}: argument names must be unique and typed with one of {tuple(_CONVERT)}")
        self.pack = self._packer()

    def _packer(self):
        """``pack(**named) -> tuple`` in signature order. Generated once per kernel: keyword binding checks
        the names (a missing or unknown one is a TypeError naming it) at the cost of one Python call."""
        names = [n for n, _ in self.args]
        body = ", ".join(f"_{t}({n})" for n, t in self.args)
        src = f"def pack(*, {', '.join(names)}):\n    return ({body},)\n"
        scope = {f"_{t}": f for t, f in _CONVERT.items()}
        exec(compile(src, f"<launch args of {self.name}>", "exec"), scope)
        return scope["pack"]

    def config(self, **values) -> "Config":
        """The config with these template (all required) and host (defaults) parameter values."""
        unknown = set(values) - set(self.params) - set(self.host)
        missing = [p for p in self.params if p not in values]
        if unknown or missing:
            raise TypeError(f"{self.name}: unknown parameters {sorted(unknown)} / missing {missing}; template "
                            f"parameters are {self.params}, host parameters {tuple(self.host)}")
        host = tuple((k, values.get(k, d)) for k, d in self.host.items())
        return Config(self, tuple(values[p] for p in self.params), host)

    def expression(self, template_values) -> str:
        if not self.params:
            return self.name
        return f"{self.name}<{', '.join(self._render(p, v) for p, v in zip(self.params, template_values))}>"

    def __repr__(self):
        return f"Kernel({self.name})"


@dataclass(frozen=True)
class Config:
    """One instantiation of a kernel (template values) plus its host parameters; hashable, comparable."""

    kernel: Kernel
    template: tuple
    host: tuple = ()
    expr: str = field(init=False, compare=False)
    block: tuple = field(init=False, compare=False)
    smem: int = field(init=False, compare=False)
    _values: dict = field(init=False, compare=False, repr=False)
    _hash: int = field(init=False, compare=False, repr=False)

    def __post_init__(self):
        values = dict(zip(self.kernel.params, self.template))
        values.update(self.host)
        set_ = functools.partial(object.__setattr__, self)
        set_("_values", values)
        set_("_hash", hash((self.kernel, self.template, self.host)))   # configs key per-call caches
        set_("expr", self.kernel.expression(self.template))
        set_("block", (self.kernel.threads(self), 1, 1))
        set_("smem", self.kernel.smem(self))

    def __hash__(self):
        return self._hash

    def __getattr__(self, name):
        values = self.__dict__.get("_values")
        if values is not None and name in values:
            return values[name]
        raise AttributeError(f"{type(self).__name__} of {self.__dict__.get('expr', '?')} has no parameter {name!r}")

    @property
    def source(self) -> str:
        return self.kernel.source

    @property
    def values(self) -> dict:
        return dict(self._values)

    def replace(self, **values) -> "Config":
        return self.kernel.config(**{**self._values, **values})

    def __str__(self):
        # host parameters at their defaults are left out (the config launched by the ops)
        return self.expr + "".join(f" {k}={v}" for k, v in self.host if v != self.kernel.host[k])

    def launch(self, device: torch.device, grid, **args) -> None:
        """Launch on torch's current stream of ``device`` with the kernel's named arguments."""
        try:
            packed = self.kernel.pack(**args)
        except TypeError as e:
            raise TypeError(f"{self.kernel.name}: {e} (arguments: {[n for n, _ in self.kernel.args]})") from None
        except (AttributeError, ValueError, OverflowError) as e:
            raise TypeError(f"{self.kernel.name}: {_bad_argument(self.kernel, args) or e}") from None
        idx = device.index if device.index is not None else torch.cuda.current_device()
        if idx not in _LOADED.get(self.kernel.source, ()):
            _load_source(idx, self.kernel.source)
        runtime.launch(self.kernel.source, self.expr, device, grid, self.block, packed, shared_mem=self.smem)

    def resident_ctas_per_sm(self, device_index: int) -> int:
        return runtime.resident_ctas_per_sm(self.kernel.source, self.expr, device_index, self.block[0], self.smem)

    def residency_on(self, arch: str, ptxas: dict) -> "arch_limits.Residency":
        """CTAs and warps per SM on ``arch`` (its limits table), from ``ptxas``: this config's entry of
        :func:`runtime.ptxas_resources` compiled for that arch (registers, static shared memory)."""
        return arch_limits.residency(arch, threads=self.block[0], smem_bytes=self.smem + ptxas["static_smem"],
                                     registers=ptxas["registers"])


def _bad_argument(kernel: Kernel, args: dict) -> str | None:
    for name, typ in kernel.args:
        try:
            _CONVERT[typ](args[name])
        except (AttributeError, ValueError, OverflowError, TypeError):
            want = "a torch.Tensor or None" if typ == PTR else f"a {C_TYPES[typ]} value"
            return f"argument {name}: expected {want}, got {args[name]!r:.80}"
    return None


class Family:
    """The kernels that serve one op, and which config a problem gets on an arch.

    ``problems``: the discrete problem space (hashable keys: what ``select`` reads); ``select(problem, arch)``:
    the product config; ``serves(config, problem)``: whether a config computes that problem (a forced config
    must); ``experimental(arch)``: the declared bench / test variants on that arch."""

    def __init__(self, name: str, *, problems: Iterable, select: Callable[[Any, str], Config],
                 serves: Callable[[Config, Any], bool], experimental: Callable[[str], Iterable[Config]] = lambda a: ()):
        self.name = name
        self.problems = tuple(problems)
        self._select, self._serves, self._experimental = select, serves, experimental
        self._chosen: dict[tuple, Config] = {}
        self._forced: Config | None = None
        self._selects_for: str | None = None   # :meth:`selecting_for`'s target arch
        self._lock = threading.Lock()

    def select(self, problem, arch: str) -> Config:
        """The config a call with this problem launches on ``arch`` (cached; :meth:`forced` wins, then
        :meth:`selecting_for`)."""
        forced = self._forced
        if forced is not None:
            if not self._serves(forced, problem):
                raise ValueError(f"{self.name}: the forced config {forced} does not serve problem {problem}")
            return forced
        target = self._selects_for
        key = (problem, arch) if target is None else (problem, arch, target)
        cfg = self._chosen.get(key)
        if cfg is None:
            cfg = self._select(problem, arch if target is None else target)
            if target is not None and arch is not None and not self._is_declared(cfg, arch):
                raise ValueError(f"{self.name}: {target}'s config {cfg} for problem {problem} is not declared on {arch}")
            self._chosen[key] = cfg
        return cfg

    def product(self, arch: str) -> list[Config]:
        return list(dict.fromkeys(self._select(p, arch) for p in self.problems))

    def experimental(self, arch: str) -> list[Config]:
        product = set(self.product(arch))
        return [c for c in dict.fromkeys(self._experimental(arch)) if c not in product]

    def declared(self, arch: str) -> list[Config]:
        return self.product(arch) + self.experimental(arch)

    def serves(self, config: Config, problem) -> bool:
        return self._serves(config, problem)

    def candidates(self, problem, arch: str) -> list[Config]:
        """Every declared config on ``arch`` that computes ``problem`` (the product one first)."""
        return [c for c in self.declared(arch) if self._serves(c, problem)]

    @contextlib.contextmanager
    def forced(self, config: Config, arch: str | None = None):
        """Within the block every call of this family launches ``config`` (bench variants and tests). Its
        instantiation must be declared for ``arch`` (when given; host parameters are free, they need no other
        instantiation) and it must serve each call's problem; one forced config at a time."""
        if arch is not None and not self._is_declared(config, arch):
            raise ValueError(f"{self.name}: {config} is not a declared config on {arch}")
        with self._lock:
            if self._forced is not None:
                raise RuntimeError(f"{self.name}: a config is already forced ({self._forced})")
            self._forced = config
        try:
            yield config
        finally:
            self._forced = None

    @contextlib.contextmanager
    def selecting_for(self, target: str):
        """Within the block every call of this family launches the config ``target``'s selection gives its problem
        (``cupy-dsa bench serve --arch-configs``: another arch's product configs timed here, at this GPU's
        residency). Each must be declared on the arch the call runs on (heuristics.EMULATED_ARCHS' are, on every
        arch); one target at a time, and not while a config is forced."""
        with self._lock:
            if self._forced is not None or self._selects_for is not None:
                raise RuntimeError(f"{self.name}: a config is already forced ({self._forced or self._selects_for})")
            self._selects_for = target
        try:
            yield target
        finally:
            self._selects_for = None

    def _is_declared(self, config: Config, arch: str) -> bool:
        return any(c.kernel is config.kernel and c.template == config.template for c in self.declared(arch))

    def __repr__(self):
        return f"Family({self.name})"


# --------------------------------------------------------------------------------------------------
# Registry (ops register their families at import), warm-up, the compile matrix
# --------------------------------------------------------------------------------------------------

_FAMILIES: dict[str, Family] = {}
_LOADED: dict[str, set[int]] = {}   # source -> devices whose product configs of that source are loaded


def register(family: Family) -> Family:
    if _FAMILIES.setdefault(family.name, family) is not family:
        raise ValueError(f"a kernel family named {family.name!r} is already registered")
    return family


# The op modules register their families when imported, and they import this module: the registry's readers
# import them by name first, so that every family is there whatever the caller imported (``import cupy_dsa`` loads
# none of them until a public name is used).
_OP_MODULES = ("cupy_dsa.store", "cupy_dsa.logits", "cupy_dsa.query", "cupy_dsa.rescore", "cupy_dsa.topk")


def _registered() -> dict[str, Family]:
    import importlib

    for name in _OP_MODULES:
        importlib.import_module(name)
    return _FAMILIES


def families() -> dict[str, Family]:
    return dict(_registered())


def _by_source(configs: Iterable[Config]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for c in configs:
        lst = out.setdefault(c.source, [])
        if c.expr not in lst:
            lst.append(c.expr)
    return out


def product_expressions(arch: str) -> dict[str, list[str]]:
    """``{source: [name expressions]}`` of every product config on ``arch``: what :func:`warm_up` loads."""
    return _by_source(c for f in _registered().values() for c in f.product(arch))


def declared_expressions(arch: str) -> dict[str, list[str]]:
    """Product and experimental configs on ``arch``: what the CI compile matrix compiles."""
    return _by_source(c for f in _registered().values() for c in f.declared(arch))


def _load_source(device_index: int, source: str) -> None:
    """First launch of a source on a device: load all its product configs in one NVRTC program."""
    exprs = product_expressions(runtime.device_arch(device_index)).get(source, [])
    runtime.warm_up_expressions(device_index, {source: exprs})
    _LOADED.setdefault(source, set()).add(device_index)


def warm_up(device: torch.device | str | int | None = None) -> int:
    """Compile and load every product config of every op on ``device`` (call before graph capture;
    experimental configs compile on first use).

    ``device``: ``None`` (torch's current CUDA device), a ``torch.device``, a string (``"cuda"``,
    ``"cuda:1"``) or a device index. Raises ``RuntimeError`` without a CUDA GPU (the ops need no warm-up
    on CPU: they run their torch references) and ``ValueError`` for a non-CUDA or missing device.
    Returns the number of instantiations loaded."""
    idx = runtime.cuda_device_index(device)
    exprs = product_expressions(runtime.device_arch(idx))
    n = runtime.warm_up_expressions(idx, exprs)
    for source in exprs:
        _LOADED.setdefault(source, set()).add(idx)
    return n
