"""Compile, cache and launch the CUDA sources in ``kernels/`` on torch tensors.

Every kernel is a C++ template in one ``.cu`` file under ``kernels/``; a variant is a *name expression*
such as ``store_index_k<0, 1, 0, true, float, 0>``. This module:

* compiles a (file, name expression) pair once per (device, arch, options) with ``cupy.RawModule``
  (NVRTC; CuPy keeps its own disk cache, keyed on source, options and name expressions, so the source it is
  given carries a digest of the headers it includes: :func:`module_source`);
* launches on **torch's current stream** of the tensors' device with raw ``data_ptr()`` arguments, so a
  launch needs no DLPack conversion, no CuPy allocation and no host sync and can be captured by
  ``torch.cuda.graph`` once the kernel was warmed up outside the capture;
* compiles for an arbitrary arch **without a GPU** (:func:`compile_cubin`), used by the CI compile matrix.

Which instantiations exist, and which of them ship, is declared by the ops through the launch layer
(``cupy_dsa.launch``); this module knows nothing of ops.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import itertools
import os
import re
import threading
import warnings
from pathlib import Path

import torch

# Options shared by run-time compiles and the GPU-free compile matrix. CuPy itself appends
# -ftz=true and --device-as-default-execution-space; the matrix adds the same two.
_BASE_OPTIONS = ("-std=c++17",)
# The oldest arch the kernels compile for: bf16 tensor-core mma and cp.async arrived with sm_80 (Ampere).
MIN_ARCH = 80

_FUNCTIONS: dict[tuple, object] = {}
_STREAMS: dict[int, object] = {}
_SMEM_OPT_IN: dict[tuple, int] = {}
_OCCUPANCY: dict[tuple, int] = {}
_ARCHS: dict[int, str] = {}
_LOCK = threading.Lock()


def kernel_dir() -> Path:
    """Directory holding the CUDA sources: inside the installed package, or ``kernels/`` of a checkout."""
    here = Path(__file__).resolve().parent
    for cand in (here / "kernels", here.parent / "kernels"):
        if (cand / "common.cuh").is_file():
            return cand
    raise FileNotFoundError(f"cupy_dsa kernel sources not found next to {here}")


@functools.lru_cache(maxsize=None)
def read_source(filename: str) -> str:
    return (kernel_dir() / filename).read_text()


_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.M)


def included_headers(filename: str) -> list[str]:
    """The ``kernels/`` headers ``filename`` includes, directly or through another header (sorted)."""
    seen, todo = set(), [filename]
    while todo:
        for name in _INCLUDE.findall(read_source(todo.pop())):
            if name not in seen and (kernel_dir() / name).is_file():
                seen.add(name)
                todo.append(name)
    return sorted(seen)


@functools.lru_cache(maxsize=None)
def module_source(filename: str) -> str:
    """The source NVRTC compiles: the file, then a comment holding a digest of every header it includes. CuPy's
    disk cache keys on the source text and the options only; a header reached through ``-I`` is not part of the
    key, so without the digest a header changed by an upgrade would keep serving the cubin built from the old one."""
    digest = hashlib.sha256()
    for name in included_headers(filename):
        digest.update(f"{name}\0{read_source(name)}\0".encode())
    return read_source(filename) + f"\n// cupy_dsa headers: {digest.hexdigest()}\n"


def compile_options(arch: str | None = None) -> tuple[str, ...]:
    """NVRTC options. On Hopper (``sm_90``) we build for ``sm_90a`` so sources may use wgmma / setmaxnreg
    behind ``__CUDA_ARCH_FEAT_SM90_ALL`` (CuPy appends ``-arch=sm_90``; NVRTC keeps the ``a`` variant)."""
    opts = _BASE_OPTIONS + (f"-I{kernel_dir()}",)
    if arch in ("sm_90", "sm_90a", "90"):
        opts += ("-arch=sm_90a",)
    return opts


class ReportedArch:
    """This module with :func:`device_arch` reporting ``arch`` for every device. An op module whose ``runtime`` is
    replaced by it selects ``arch``'s product configs, compiled for the GPU at hand: how the GPU tests and the
    sanitizer runs hold sm_120's configs (100 KB of shared memory per SM) on an sm_90 GPU."""

    def __init__(self, arch: str):
        self.arch = arch

    def __getattr__(self, name):
        return globals()[name]

    def device_arch(self, device_index: int) -> str:
        return self.arch


def device_arch(device_index: int) -> str:
    """``sm_XY`` of a device (cached)."""
    a = _ARCHS.get(device_index)
    if a is None:
        major, minor = torch.cuda.get_device_capability(device_index)
        if 10 * major + minor < MIN_ARCH:
            raise RuntimeError(
                f"cuda:{device_index} ({torch.cuda.get_device_name(device_index)}) is sm_{major}{minor}; cupy_dsa's "
                f"kernels need sm_{MIN_ARCH} or newer (bf16 tensor-core mma, cp.async). Run on an Ampere or newer "
                f"NVIDIA GPU; the SGLang plugin: keep SGLang's fp8 index keys (SGLANG_CUPY_DSA_INDEX_K=fp8).")
        a = _ARCHS[device_index] = f"sm_{major}{minor}"
    return a


# --------------------------------------------------------------------------------------------------
# CuPy import guard
# --------------------------------------------------------------------------------------------------

_CUPY_DISTS = ("cupy-cuda12x", "cupy-cuda13x", "cupy")


@functools.lru_cache(maxsize=None)
def cupy_module():
    """Import CuPy lazily, with an install hint naming the extra that matches torch's CUDA major."""
    found = []
    for dist in _CUPY_DISTS:
        try:
            importlib.metadata.version(dist)
            found.append(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    torch_major = (torch.version.cuda or "").split(".")[0]
    if not found:
        extra = "cu12" if torch_major == "12" else "cu13"
        raise ImportError(
            "cupy_dsa needs CuPy for its GPU kernels: install cupy_dsa with its [%s] extra from a checkout "
            "or a built wheel (pip install '.[%s]'), or pip install cupy-cuda%sx "
            "(cu13 for a torch built with CUDA 13, cu12 for CUDA 12)" % (extra, extra, extra[2:])
        )
    if len(found) > 1:
        warnings.warn(f"several CuPy wheels are installed ({', '.join(found)}); uninstall all but one")
    import cupy

    cupy_major = str(cupy.cuda.runtime.runtimeGetVersion() // 1000)
    if torch_major and torch_major != cupy_major:
        warnings.warn(f"CuPy is built for CUDA {cupy_major} but torch for CUDA {torch_major}; "
                      f"install cupy-cuda{torch_major}x (the [cu{torch_major}] extra of cupy_dsa)")
    return cupy


# --------------------------------------------------------------------------------------------------
# Run-time compile and launch
# --------------------------------------------------------------------------------------------------

def get_function(filename: str, name_expression: str, device_index: int):
    """The compiled kernel for one instantiation on one device (compiled on first use, then cached). The
    launch layer loads a source's product instantiations together first (:func:`warm_up_expressions`)."""
    fn = _FUNCTIONS.get((device_index, filename, name_expression))
    if fn is None:
        warm_up_expressions(device_index, {filename: [name_expression]})
        fn = _FUNCTIONS[(device_index, filename, name_expression)]
    return fn


def _current_stream_ptr(idx: int) -> int:
    """Raw pointer of torch's current stream on device ``idx`` (~0.3 us through torch's C hook; the
    public ``torch.cuda.current_stream(device)`` costs ~10 us per call)."""
    getter = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if getter is not None:
        return getter(idx)
    return torch.cuda.current_stream(idx).cuda_stream


def _stream_for(device: torch.device):
    """CuPy wrapper of torch's current stream on ``device``, cached by stream pointer (never by device:
    inside ``torch.cuda.graph`` the current stream is the capture stream)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    ptr = _current_stream_ptr(idx)
    s = _STREAMS.get(ptr)
    if s is None:
        cp = cupy_module()
        s = cp.cuda.Stream.from_external(_StreamRef(ptr))
        _STREAMS[ptr] = s
    return s


class _StreamRef:
    """Minimal ``__cuda_stream__`` provider (works on torch versions without the protocol)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)


def _opt_in_shared_mem(fn, key, shared_mem: int) -> None:
    """Let ``fn`` take ``shared_mem`` bytes of dynamic shared memory (once per function and size): the default
    allows 48 KiB of static + dynamic shared memory, a kernel's static part included."""
    if shared_mem > 0 and _SMEM_OPT_IN.get(key, 0) < shared_mem:
        fn.max_dynamic_shared_size_bytes = shared_mem
        _SMEM_OPT_IN[key] = shared_mem


def launch(filename: str, name_expression: str, device: torch.device, grid, block, args,
           shared_mem: int = 0) -> None:
    """Launch one instantiation on torch's current stream of ``device``.

    ``args`` must already be kernel-typed: ``int`` pointers from ``data_ptr()`` and NumPy scalars
    (``np.int32``, ``np.float32``, ...); a Python float would be passed as a double.
    """
    idx = device.index if device.index is not None else torch.cuda.current_device()
    fn = get_function(filename, name_expression, idx)
    _opt_in_shared_mem(fn, (idx, filename, name_expression), shared_mem)
    stream = _stream_for(device)
    cp = cupy_module()
    if cp.cuda.runtime.getDevice() != idx:
        with cp.cuda.Device(idx):
            fn(grid, block, args, shared_mem=shared_mem, stream=stream)
    else:
        fn(grid, block, args, shared_mem=shared_mem, stream=stream)


def resident_ctas_per_sm(filename: str, name_expression: str, device_index: int, threads: int,
                         shared_mem: int) -> int:
    """CTAs of one instantiation that fit on one SM at once (the driver's occupancy calculator; cached).
    Sizes the one-wave grids of the balanced decode kernels."""
    key = (device_index, filename, name_expression, threads, shared_mem)
    n = _OCCUPANCY.get(key)
    if n is None:
        fn = get_function(filename, name_expression, device_index)
        _opt_in_shared_mem(fn, key[:3], shared_mem)
        cp = cupy_module()
        with cp.cuda.Device(device_index):
            n = cp.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.kernel.ptr, threads, shared_mem)
        if n < 1:
            raise RuntimeError(f"{name_expression}: no CTA of {threads} threads and {shared_mem} B of shared "
                               f"memory fits on an SM of device {device_index}")
        _OCCUPANCY[key] = n
    return n


def cuda_device_index(device: torch.device | str | int | None) -> int:
    """The CUDA device index of ``device`` (``None``: torch's current device; a ``torch.device``; ``"cuda"`` /
    ``"cuda:1"``; an index). TypeError / ValueError naming ``device`` for anything else or a missing device,
    RuntimeError without a CUDA GPU (on CPU the ops run their torch references and need no warm-up)."""
    if isinstance(device, bool) or not (device is None or isinstance(device, (torch.device, str, int))):
        raise TypeError(f"device: expected None, a torch.device, a device string or an int, got "
                        f"{type(device).__name__}")
    try:
        dev = None if device is None else torch.device(device if not isinstance(device, int) else f"cuda:{device}")
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"device: expected 'cuda', 'cuda:N' or N, got {device!r} ({e})") from None
    if dev is not None and dev.type != "cuda":
        raise ValueError(f"device: warm_up compiles CUDA kernels, got {str(dev)!r}; on CPU the ops run their "
                         "torch references and need no warm-up")
    if not torch.cuda.is_available():
        raise RuntimeError("warm_up: no CUDA GPU is available (torch.cuda.is_available() is False); on CPU the "
                           "ops run their torch references and need no warm-up")
    idx = torch.cuda.current_device() if (dev is None or dev.index is None) else dev.index
    if not 0 <= idx < torch.cuda.device_count():
        raise ValueError(f"device: cuda:{idx} does not exist ({torch.cuda.device_count()} CUDA device(s))")
    return idx


def warm_up_expressions(device_index: int, exprs: dict[str, list[str]]) -> int:
    """Compile and load exactly ``exprs`` (``{source_file: [name expressions]}``) on one device, one NVRTC
    program per file (e.g. what one SGLang server launches); expressions already loaded are skipped, any
    other instantiation compiles on first use. Returns the number of instantiations now loaded from
    ``exprs``."""
    n = 0
    for filename, wanted in exprs.items():
        todo = [e for e in dict.fromkeys(wanted) if (device_index, filename, e) not in _FUNCTIONS]
        n += len(dict.fromkeys(wanted)) - len(todo)
        if not todo:
            continue
        with _LOCK:
            todo = [e for e in todo if (device_index, filename, e) not in _FUNCTIONS]
            if todo:
                cp = cupy_module()
                with cp.cuda.Device(device_index):
                    module = cp.RawModule(code=module_source(filename),
                                          options=compile_options(device_arch(device_index)), name_expressions=todo)
                    for expr in todo:
                        f = module.get_function(expr)
                        f.compile()  # load the module now, not inside a capture
                        _FUNCTIONS[(device_index, filename, expr)] = f
        n += len(todo)
    return n


# --------------------------------------------------------------------------------------------------
# GPU-free compile (CI compile matrix)
# --------------------------------------------------------------------------------------------------

def cuda_include_dir() -> str:
    """Directory of the CUDA runtime headers (cuda_bf16.h, cuda_fp8.h) that NVRTC needs."""
    env = os.environ.get("CUDA_PATH")
    if env and (Path(env) / "include" / "cuda_bf16.h").is_file():
        return str(Path(env) / "include")
    from cuda.pathfinder import find_nvidia_header_directory

    inc = find_nvidia_header_directory("cudart")
    if inc is None:
        raise FileNotFoundError("CUDA runtime headers not found: install cupy_dsa with its [cu13] (or [cu12]) extra, "
                                "e.g. pip install '.[cu13]' in a checkout, or pip install 'cuda-toolkit[nvrtc,cudart]==13.*'")
    return str(inc)


def compile_cubin(filename: str, name_expressions, arch: str, *, source: str | None = None,
                  resource_usage: bool = False) -> tuple[bytes, dict[str, str]] | tuple[bytes, dict[str, str], str]:
    """Compile ``kernels/filename`` (or ``source``, with ``kernels/`` on the include path) with NVRTC for
    ``arch`` (e.g. ``"sm_90"``) without a GPU.

    Uses the same options as run time plus the two CuPy appends. Returns the cubin and the lowered name of
    every expression, and with ``resource_usage`` also ptxas's report (``-v``: registers, spills, shared
    memory per kernel; see :func:`ptxas_resources`); raises ``RuntimeError`` with NVRTC's log on failure.
    """
    src = module_source(filename) if source is None else source
    if not resource_usage:
        return _nvrtc_compile(filename, src, name_expressions, arch, False)
    # Where a CUDA driver is installed, NVRTC may take ptxas's output for PTX it compiled before from the driver's
    # compute cache, and ptxas then prints no report (seen on an H100: a second identical compile in one process
    # returned an empty log; cuda-python issue 1124 reports the same). CUDA_CACHE_DISABLE=1 asks for no cache;
    # where the report is still missing, one empty kernel with a unique name makes the PTX new.
    saved = os.environ.get("CUDA_CACHE_DISABLE")
    os.environ["CUDA_CACHE_DISABLE"] = "1"
    try:
        cubin, lowered, log = _nvrtc_compile(filename, src, name_expressions, arch, True)
        if name_expressions and not ptxas_resources(log, lowered):
            nonce = f"\n__global__ void cupy_dsa_ptxas_report_{os.getpid()}_{next(_REPORT_NONCE)}() {{}}\n"
            cubin, lowered, log = _nvrtc_compile(filename, src + nonce, name_expressions, arch, True)
    finally:
        if saved is None:
            os.environ.pop("CUDA_CACHE_DISABLE", None)
        else:
            os.environ["CUDA_CACHE_DISABLE"] = saved
    return cubin, lowered, log


_REPORT_NONCE = itertools.count()


def _nvrtc_compile(filename: str, src: str, name_expressions, arch: str, resource_usage: bool):
    cp = cupy_module()
    nvrtc = cp.cuda.nvrtc
    # sm_90 is built as sm_90a, exactly as at run time (compile_options adds the flag)
    opts = compile_options(arch) + (f"-I{cuda_include_dir()}",) + (() if arch == "sm_90" else (f"-arch={arch}",)) \
        + ("-ftz=true", "--device-as-default-execution-space") + (("--ptxas-options=-v",) if resource_usage else ())
    prog = nvrtc.createProgram(src, filename, (), ())
    try:
        for expr in name_expressions:
            nvrtc.addNameExpression(prog, expr)
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError as e:
            raise RuntimeError(f"NVRTC failed for {filename} ({arch}):\n{nvrtc.getProgramLog(prog)}") from e
        cubin = nvrtc.getCUBIN(prog)
        lowered = {expr: nvrtc.getLoweredName(prog, expr) for expr in name_expressions}
        log = nvrtc.getProgramLog(prog) if resource_usage else None
    finally:
        nvrtc.destroyProgram(prog)
    return (cubin, lowered) if log is None else (cubin, lowered, log)


_PTXAS_FUNCTION = re.compile(r"Function properties for (\S+)")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")   # smem may precede "cmem"


def ptxas_resources(log: str, lowered: dict[str, str]) -> dict[str, dict[str, int]]:
    """``{name expression: {registers, stack, spill_stores, spill_loads, static_smem}}`` from ptxas's ``-v``
    report of :func:`compile_cubin` (kernels that were not asked for by name are left out)."""
    by_lowered = {v: k for k, v in lowered.items()}
    out: dict[str, dict[str, int]] = {}
    current = None
    for line in log.splitlines():
        m = _PTXAS_FUNCTION.search(line)
        if m:
            current = by_lowered.get(m.group(1))
            if current is not None:
                out[current] = {"registers": 0, "stack": 0, "spill_stores": 0, "spill_loads": 0, "static_smem": 0}
            continue
        if current is None:
            continue
        m = _PTXAS_SPILLS.search(line)
        if m:
            out[current].update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        m = _PTXAS_USED.search(line.strip())
        if m:
            out[current].update(registers=int(m.group(1)), static_smem=int(m.group(2) or 0))
    return out


# --------------------------------------------------------------------------------------------------
# torch <-> CuPy zero-copy helpers (for users; the ops themselves pass raw pointers)
# --------------------------------------------------------------------------------------------------

_FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))


def to_cupy(t: torch.Tensor):
    """A CuPy array sharing ``t``'s memory, ordered on torch's current stream.

    fp8 tensors come back as ``uint8`` (CuPy has no fp8 dtype); bf16 needs ``ml_dtypes`` installed
    (otherwise pass ``t.view(torch.int16)``).
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"t: expected a torch.Tensor, got {type(t).__name__}")
    if not t.is_cuda:
        raise ValueError(f"t: expected a CUDA tensor, got device {t.device}")
    cp = cupy_module()
    if t.dtype in _FP8_DTYPES:
        t = t.view(torch.uint8)
    with cp.cuda.Device(t.device.index), _stream_for(t.device):
        return cp.from_dlpack(t)


def to_torch(a) -> torch.Tensor:
    """A torch tensor sharing the CuPy array's memory (torch's current stream waits on CuPy's)."""
    if not hasattr(a, "__dlpack__"):
        raise TypeError(f"a: expected a CuPy array (or another object with __dlpack__), got {type(a).__name__}")
    return torch.from_dlpack(a)
