"""SGLang 0.5.23 general plugin: bf16 index keys for DeepSeek-V4's C4 indexer.

Entry point ``cupy_dsa = cupy_dsa.sglang.plugin:register`` in group ``sglang.srt.plugins``; SGLang calls
:func:`register` in every process that runs ``load_plugins()`` (launcher, each scheduler, DP controller,
detokenizer). The switch is ``SGLANG_CUPY_DSA_INDEX_K`` (``fp8`` = SGLang unchanged, the default;
``bf16``; ``bf16-fp4sim``), or the server flag ``--cupy-dsa-index-k-dtype`` (also a ``--config`` YAML key),
which sets the variable in the launcher before the schedulers are spawned.

Start-up is all or nothing. With the switch on, :func:`register` first checks that the installed SGLang is
one the hooks were written for (:data:`SUPPORTED_SGLANG` and :data:`FINGERPRINT`: the signature, and a hash
of the source, of every function the hooks wrap, replace or copy), then applies every hook itself, guards
included; a mismatch, an invalid switch value or a hook that fails to apply (the ones already applied are
undone) stops start-up with :class:`~cupy_dsa.sglang.core.StartupRefused`, a ``SystemExit`` that SGLang's
``load_plugins()`` does not swallow (it logs and ignores every ``Exception``).

Always installed (they are how the switch gets turned on and checked):

* the env field in SGLang's ``Envs`` registry (shows up in SGLang's env dumps);
* CLI: AFTER ``ServerArgs.add_cli_args`` (adds the flag), AFTER ``ServerArgs.from_cli_args`` (sets the switch);
* H5: resolution hook on ``handle_model_specific_adjustments`` (launcher): the version check when the flag
  turned the switch on, and refusals of the FP4 indexer, the NVIDIA megakernel and HIP / XPU / NPU.

Installed when the switch is on at ``register()`` time (the schedulers inherit the variable; the switch is
read once per process), each delegating to SGLang's original when it is off:

* H1 AROUND ``get_dsv4_indexer_bytes_per_token``: 256 B/token for the non-FP4 pool, which sizes both the
  allocation and the KV memory budget (the hook registry re-points ``pool_configurator``'s imported name);
* H2 AROUND ``compress_norm_rope_store``: a store into a bf16 index cache (uint8 rows of 16384 bytes) goes
  to ``cupy_dsa.store_index_k_from_plan`` on SGLang's own plan rows, and any call there it does not
  recognise raises; every other cache goes to SGLang unchanged;
* H3 AROUND ``C4IndexerBackendMixin.forward_c4_indexer``: SGLang's body order, with the logits from
  ``cupy_dsa.paged_mqa_logits`` (decode / verify / extend) or ``cupy_dsa.mqa_logits`` (single-request
  eager prefill, where SGLang would run its non-paged fp8 reader); SGLang's top-k backends, raw indices,
  HiSparse epilogue and top-k capturer are called as SGLang calls them;
* H4 AFTER ``DeepSeekV4TokenToKVPool.pd_kv_layout``: appends ``,c4idx:<mode>`` so PD peers with
  different index-key formats refuse to pair;
* HiCache: AFTER ``_dsv4_indexer_regions`` (bf16 index pages move page-aligned only) and AROUND
  ``HiCacheStorageConfig.__post_init__`` (a distinct L3 namespace: ``model_name`` gets ``_c4idx-<mode>``,
  so fp8 pages persisted by another server are never read as bf16);
* warm-up: BEFORE ``ModelRunner.init_cuda_graphs`` compiles and loads the kernels this server launches
  (:func:`cupy_dsa.sglang.core.warm_expressions`) before the first CUDA-graph capture.

This module imports SGLang only inside functions; CuPy and the kernels load only on the CUDA path.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import inspect
import logging
import os

import torch

from .. import layouts
from . import core
from .core import CLI_FLAG, ENV_NAME, MODES, StartupRefused, index_k_mode

logger = logging.getLogger(__name__)

T_BYTES = "sglang.srt.mem_cache.deepseek_v4_memory_pool.get_dsv4_indexer_bytes_per_token"
T_STORE = "sglang.kernels.ops.attention.dsv4.compress.compress_norm_rope_store"
T_INDEXER = "sglang.srt.layers.attention.dsv4.indexer.C4IndexerBackendMixin.forward_c4_indexer"
T_PD_LAYOUT = "sglang.srt.mem_cache.deepseek_v4_memory_pool.DeepSeekV4TokenToKVPool.pd_kv_layout"
T_CLI_ADD = "sglang.srt.server_args.ServerArgs.add_cli_args"
T_CLI_FROM = "sglang.srt.server_args.ServerArgs.from_cli_args"
T_HICACHE_REGIONS = "sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler._dsv4_indexer_regions"
T_HICACHE_L3 = "sglang.srt.mem_cache.hicache_storage.HiCacheStorageConfig.__post_init__"
T_WARM_UP = "sglang.srt.model_executor.model_runner.ModelRunner.init_cuda_graphs"
RESOLUTION_STEP = "handle_model_specific_adjustments"

ALWAYS_TARGETS = (T_CLI_ADD, T_CLI_FROM)
SWITCHED_TARGETS = (T_BYTES, T_STORE, T_INDEXER, T_PD_LAYOUT, T_HICACHE_REGIONS, T_HICACHE_L3, T_WARM_UP)

_INDEXER_POOL_NAME = "deepseek_v4_c4_indexer"

# --------------------------------------------------------------------------------------------------
# The SGLang the hooks were written for
# --------------------------------------------------------------------------------------------------

SUPPORTED_SGLANG = ("0.5.23",)

_IX = "sglang.srt.layers.attention.dsv4.indexer."
_HR = "sglang.srt.plugins.hook_registry."
_BE = "sglang.srt.layers.attention.deepseek_v4_backend."
# SGLang 0.5.23: (signature, sha256[:16] of the source) of every function the plugin replaces, wraps, copies
# the logic of or drives by private API; (signature, None) for functions it only calls. Regenerate with
# ``python scripts/_sglang_checks.py fingerprint`` after reviewing the hooks against a new SGLang.
FINGERPRINT: dict[str, tuple[str, str | None]] = {}  # filled below

_installed: list[tuple] = []       # (target, owner, attr, raw before, raw after), in install order
_resolution_installed = False
_registered_always = False
_registered_switched = False


def sglang_version() -> str:
    """The installed SGLang's version string (the imported package's, not some other dist's metadata)."""
    try:
        from sglang.version import __version__
    except Exception:  # noqa: BLE001 - fall back to the distribution metadata
        import importlib.metadata

        return importlib.metadata.version("sglang")
    return str(__version__)


class TargetImportError(ImportError):
    """A module on a hook target's path raised while being imported: ``module`` is that module, ``cause`` the
    innermost import error (for a missing dependency, the ``ModuleNotFoundError`` naming it)."""

    def __init__(self, module: str, cause: BaseException):
        super().__init__(f"{module} does not import ({type(cause).__name__}: {cause})")
        self.module = module
        self.cause = cause


def _innermost_import_error(e: BaseException) -> BaseException:
    """The deepest ImportError in ``e``'s chain (a module that catches an ImportError and raises its own
    error keeps the original as ``__cause__`` / ``__context__``)."""
    found, seen = e, set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, ImportError):
            found = e
        e = e.__cause__ or e.__context__
    return found


def _import_target_module(path: str):
    """(module, attribute names) of a dotted target path: its longest prefix that is a module, imported
    explicitly. ``pkgutil.resolve_name`` treats any ImportError as "not a module" and falls back to
    ``getattr``, which turns a missing dependency of SGLang into an AttributeError that names neither."""
    parts = path.split(".")
    module = importlib.import_module(parts[0])
    for i in range(1, len(parts)):
        name = ".".join(parts[: i + 1])
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:  # no module of that name: the rest of the path are attributes
                return module, parts[i:]
            raise TargetImportError(name, _innermost_import_error(e)) from e
        except Exception as e:  # noqa: BLE001 - any error while a module's top level runs
            raise TargetImportError(name, _innermost_import_error(e)) from e
    raise ValueError(f"{path}: expected a function or class attribute path, got a module")


def _resolve(path: str):
    """(owner, attr, raw attribute, plain function) of a dotted target path."""
    module, attrs = _import_target_module(path)
    owner = module
    for name in attrs[:-1]:
        owner = getattr(owner, name)
    attr = attrs[-1]
    raw = owner.__dict__[attr] if isinstance(owner, type) and attr in owner.__dict__ else getattr(owner, attr)
    fn = raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw
    return owner, attr, raw, inspect.unwrap(fn)


def fingerprint_of(path: str, with_source: bool = True) -> tuple[str, str | None]:
    fn = _resolve(path)[3]
    digest = hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:16] if with_source else None
    return str(inspect.signature(fn)), digest


def _import_problem(cause: BaseException, modules: dict[str, list[str]]) -> str:
    """One problem line per distinct import error: the error, the SGLang modules it stops and, for a missing
    module, what to install."""
    count = sum(len(paths) for paths in modules.values())
    text = (f"{type(cause).__name__}: {cause}, raised while importing {', '.join(modules)} (where {count} of the "
            f"functions the hooks wrap or call live)")
    missing = getattr(cause, "name", None)
    if isinstance(cause, ModuleNotFoundError) and missing:
        top = missing.split(".")[0]
        text += (f". SGLang imports {top!r}, which is not installed here: pip install {top} (or the package that "
                 f"provides the module {top!r}); `pip check` lists every missing requirement of SGLang")
    return text


def compatibility_problems() -> list[str]:
    """Why the installed SGLang is not one the hooks were written for (empty if it is). A version outside
    ``SUPPORTED_SGLANG`` is reported alone (nothing of it is imported); a supported version is checked
    against :data:`FINGERPRINT`. A module that does not import (a missing dependency of SGLang, typically) is
    reported once, with the import that failed, for all the targets it holds."""
    version = sglang_version()
    if version not in SUPPORTED_SGLANG:
        return [f"found SGLang {version}"]
    differs, not_importable = [], {}
    for path, (sig, digest) in FINGERPRINT.items():
        try:
            got_sig, got_digest = fingerprint_of(path, digest is not None)
        except TargetImportError as e:
            key = (type(e.cause).__name__, str(e.cause))
            cause, modules = not_importable.setdefault(key, (e.cause, {}))
            modules.setdefault(e.module, []).append(path)
            continue
        except Exception as e:  # noqa: BLE001 - a missing attribute is a mismatch too
            differs.append(f"{path}: not found ({type(e).__name__}: {e})")
            continue
        if got_sig != sig:
            differs.append(f"{path}: signature {got_sig}, the hooks expect {sig}")
        elif digest is not None and got_digest != digest:
            differs.append(f"{path}: source differs from SGLang {SUPPORTED_SGLANG[0]}'s (sha256 {got_digest}, "
                           f"expected {digest})")
    problems = [_import_problem(cause, modules) for cause, modules in not_importable.values()]
    problems += differs
    if differs and not_importable:
        problems.insert(0, f"found SGLang {version}, but some of its modules do not import here and its code "
                           "differs from the release the hooks were written for")
    elif not_importable:
        problems.insert(0, f"found SGLang {version}, but some of its modules do not import in this environment")
    elif differs:
        problems.insert(0, f"found SGLang {version}, but its code differs from the release the hooks were "
                           "written for")
    return problems


def _off_hint() -> str:
    return (f"To run SGLang unchanged (fp8 index keys), turn the switch off: unset {ENV_NAME} (or set it to fp8) "
            f"and drop {CLI_FLAG} / the {CLI_FLAG[2:]} --config key.")


def refusal_message(mode: str, problems: list[str]) -> str:
    supported = ", ".join(SUPPORTED_SGLANG)
    if "do not import" in problems[0] and "differs" not in problems[0]:
        remedy = "Make SGLang importable (the errors above) before turning the switch on. "
    else:
        remedy = f"Install a supported SGLang: pip install sglang=={SUPPORTED_SGLANG[-1]}. "
    return (f"cupy_dsa ({ENV_NAME}={mode}): refusing to start. The bf16 index-key hooks were written for "
            f"SGLang {supported}; " + problems[0] + "." + "".join(f"\n  - {p}" for p in problems[1:])
            + f"\n{_patched_so_far()} " + remedy + _off_hint())


def _patched_so_far() -> str:
    """What of cupy_dsa is in SGLang when start-up is refused: nothing at ``register()``; in the launcher's
    check (the CLI flag turned the switch on) the flag hooks and that check itself."""
    targets = installed_targets()
    if not targets and not _resolution_installed:
        return "Nothing was patched."
    names = [".".join(t.rsplit(".", 2)[-2:]) for t in targets]
    if _resolution_installed:
        names.append(f"the resolution step {RESOLUTION_STEP}")
    if any(t in SWITCHED_TARGETS for t in targets):
        return f"In place in this process: cupy_dsa's hooks on {', '.join(names)}."
    return (f"No index-key hook was applied; in place are only the hooks that add {CLI_FLAG} and run this check "
            f"({', '.join(names)}).")


def require_compatible_sglang(mode: str) -> None:
    problems = compatibility_problems()
    if problems:
        raise StartupRefused(refusal_message(mode, problems))


# --------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------

def _resolve_switch() -> str:
    """The switch, or a start-up refusal naming the bad value (never a silent fp8)."""
    try:
        return index_k_mode()
    except ValueError as e:
        raise StartupRefused(f"cupy_dsa: {e}. Refusing to start. {_off_hint()}") from None


def register() -> None:
    """SGLang general-plugin entry point (idempotent within a process).

    Switch on: check the installed SGLang (:func:`compatibility_problems`), then install every hook, guards
    included, or none (a failure undoes the ones already applied and stops start-up with
    :class:`StartupRefused`, which SGLang's ``load_plugins()`` does not swallow). Switch off: only the CLI
    flag and the launcher check are installed; if they cannot be, SGLang runs without them (unchanged)."""
    global _registered_always, _registered_switched
    mode = _resolve_switch()
    if mode != "fp8" and not _registered_switched:
        require_compatible_sglang(mode)
        entries = [] if _registered_always else _always_entries()
        try:
            _install(entries + _switched_entries(), resolution=not _registered_always)
        except HookInstallError as e:
            raise StartupRefused(f"cupy_dsa ({ENV_NAME}={mode}): {e}; start-up stops. {_off_hint()}") from e
        _registered_always = _registered_switched = True
        register_env_field()
        logger.info("cupy_dsa: %s=%s, bf16 C4 index-key hooks registered (SGLang %s)", ENV_NAME, mode,
                    sglang_version())
    elif mode == "fp8" and not _registered_always:
        try:
            _install(_always_entries(), resolution=True)
        except HookInstallError as e:
            logger.warning("cupy_dsa: the %s flag is not available (%s); SGLang runs unchanged", CLI_FLAG, e)
            return
        _registered_always = True
        register_env_field()


def ray_worker_setup() -> None:
    """For Ray's ``worker_process_setup_hook`` (SGLang's Ray scheduler actors never call
    ``load_plugins()``): load the plugins there, then make sure cupy_dsa's hooks are in."""
    from sglang.srt.plugins import load_plugins

    load_plugins()
    register()


def installed_targets() -> list[str]:
    return [t for t, *_ in _installed]


def _always_entries():
    from sglang.srt.plugins.hook_registry import HookType

    return [(T_CLI_ADD, _add_cli_args_hook, HookType.AFTER), (T_CLI_FROM, _from_cli_args_hook, HookType.AFTER)]


def _switched_entries():
    from sglang.srt.plugins.hook_registry import HookType

    return [(T_BYTES, _bytes_per_token_hook, HookType.AROUND), (T_STORE, _store_hook, HookType.AROUND),
            (T_INDEXER, _forward_c4_indexer_hook, HookType.AROUND), (T_PD_LAYOUT, _pd_kv_layout_hook, HookType.AFTER),
            (T_HICACHE_REGIONS, _hicache_regions_hook, HookType.AFTER),
            (T_HICACHE_L3, _hicache_storage_config_hook, HookType.AROUND),
            (T_WARM_UP, _warm_up_hook, HookType.BEFORE)]


class HookInstallError(RuntimeError):
    pass


def _install(entries, *, resolution: bool) -> None:
    """Apply ``entries`` (target, hook, HookType) now, through SGLang's own ``HookRegistry`` wrapper (same
    wrapping, propagation to ``from X import f`` copies and "Applied 1 hook(s)" log line), plus the
    resolution hook; all or none. The hooks are applied here rather than left to ``load_plugins()``'s
    ``apply_hooks()``, which logs and skips a target that fails (start-up would go on half patched).
    They are not entered in ``HookRegistry._hooks``, so other plugins' hooks on the same targets are still
    applied by ``apply_hooks()``, on top of these."""
    global _resolution_installed
    from sglang.srt.plugins.hook_registry import HookRegistry, _current_plugin_source

    source = _current_plugin_source.get()
    done = []
    target = pending = None
    try:
        for target, hook, kind in entries:
            owner, attr, before, _ = _resolve(target)
            pending = (target, owner, attr, before)
            HookRegistry._apply_target(target, [(kind, hook, source)])
            after = _current(owner, attr)
            if after is before:
                raise RuntimeError("the registry left it unchanged")
            done.append((target, owner, attr, before, after))
            pending = None
        target = f"resolution step {RESOLUTION_STEP}"
        if resolution and not _resolution_installed:
            from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook

            register_resolution_hook(RESOLUTION_STEP)(validate_config)
            _resolution_installed = True
    except Exception as e:  # noqa: BLE001 - any failure undoes everything
        applied_before = len(done)
        partly = pending is not None and _current(*pending[1:3]) is not pending[3]
        if partly:
            done.append(pending + (_current(*pending[1:3]),))  # failed after it was set
        for entry in reversed(done):
            _uninstall(*entry)
        raise HookInstallError(f"the hook on {target} failed to apply ({type(e).__name__}: {e}); the "
                               f"{applied_before} hook(s) applied before it were undone"
                               + (", and so was its own partial patch" if partly else "")) from e
    _installed.extend(done)


def _current(owner, attr):
    return owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr, None)


def _uninstall(target, owner, attr, before, after) -> None:
    from sglang.srt.plugins.hook_registry import _propagate_patch

    setattr(owner, attr, before)
    if not isinstance(owner, type):
        _propagate_patch(after, before, owner)  # the module-level copies SGLang re-pointed, back


def uninstall_all() -> None:
    """Undo every hook this process applied (tests)."""
    global _registered_always, _registered_switched, _resolution_installed
    while _installed:
        _uninstall(*_installed.pop())
    if _resolution_installed:
        from sglang.srt.arg_groups.resolution_hooks import _HOOKS

        _HOOKS.get(RESOLUTION_STEP, []).remove(validate_config)
        _resolution_installed = False
    _registered_always = _registered_switched = False


def register_env_field() -> None:
    """Declare ``SGLANG_CUPY_DSA_INDEX_K`` in SGLang's ``Envs`` (after the class body, so ``.name`` is set by
    hand: SGLang forbids ``__set_name__`` once ``envs`` exists)."""
    from sglang.srt import environ

    if isinstance(environ.Envs.__dict__.get(ENV_NAME), environ.EnvField):
        return

    class IndexKDtypeEnv(environ.EnvStr):
        def parse(self, value: str) -> str:
            return core.parse_mode(value)

    field = IndexKDtypeEnv(core.DEFAULT_MODE)
    field.name = ENV_NAME
    setattr(environ.Envs, ENV_NAME, field)


# --------------------------------------------------------------------------------------------------
# Platform and configuration checks (H5)
# --------------------------------------------------------------------------------------------------

def _platform_problem(device=None) -> str | None:
    from sglang.srt.utils import is_hip, is_npu, is_xpu

    dev = str(device).split(":", 1)[0].lower() if device is not None else ""
    name = None
    if is_hip() or dev == "hip":
        name = "HIP (ROCm)"
    elif is_xpu() or dev == "xpu":
        name = "XPU"
    elif is_npu() or dev == "npu":
        name = "NPU"
    if name is None:
        return None
    return (f"platform {name}: cupy_dsa's kernels are CUDA (CuPy/NVRTC) and SGLang runs its own indexer "
            f"pools and kernels on {name}. Run on an NVIDIA GPU, or set {ENV_NAME}=fp8 to keep SGLang's "
            f"index keys.")


def _require_supported_platform() -> None:
    problem = _platform_problem()
    if problem:
        raise RuntimeError(f"cupy_dsa ({ENV_NAME}={index_k_mode()}): {problem}")


def refusal_reasons(cfg, mode: str) -> list[str]:
    """Why this (resolved) server configuration cannot run with bf16 index keys; empty if it can."""
    reasons = []
    if getattr(cfg, "enable_deepseek_v4_fp4_indexer", False):
        reasons.append(
            f"--enable-deepseek-v4-fp4-indexer: the FP4 indexer keeps 68-byte FP4 index keys and FP4 logits, "
            f"which {ENV_NAME}={mode} does not replace. Drop --enable-deepseek-v4-fp4-indexer (use "
            f"{ENV_NAME}=bf16-fp4sim to keep FP4-rounded keys in bf16), or set {ENV_NAME}=fp8.")
    if getattr(cfg, "enable_nvidia_megakernel", False):
        reasons.append(
            f"--enable-nvidia-megakernel: the megakernel runs its own fp8 indexer over SGLang's 132-byte "
            f"index pages, which are 256-byte bf16 pages with {ENV_NAME}={mode}. Drop "
            f"--enable-nvidia-megakernel, or set {ENV_NAME}=fp8.")
    problem = _platform_problem(getattr(cfg, "device", None))
    if problem:
        reasons.append(problem)
    return reasons


def validate_config(server_args, previous) -> None:
    """H5 (resolution step ``handle_model_specific_adjustments``; runs once, in the launcher)."""
    previous(server_args)
    mode = _resolve_switch()  # an invalid value stops the launch here
    if mode == "fp8":
        return
    # the CLI flag / YAML key may have turned the switch on after register() ran with it off
    require_compatible_sglang(mode)
    from sglang.srt.arg_groups.model_override_base import resolving_view

    reasons = refusal_reasons(resolving_view(server_args), mode)
    if reasons:
        raise ValueError(f"cupy_dsa ({ENV_NAME}={mode}, bf16 C4 index keys) cannot run with this "
                         "configuration:\n  - " + "\n  - ".join(reasons))
    # No environment is written: SGLang's fp8-only non-paged prefill reader is reached only from SGLang's
    # own forward_c4_indexer body, which the H3 hook does not call while the switch is on.


# --------------------------------------------------------------------------------------------------
# CLI flag and --config YAML key
# --------------------------------------------------------------------------------------------------

def _add_cli_args_hook(result, *args, **kwargs):
    parser = kwargs.get("parser", args[0] if args else None)
    if parser is None or any(CLI_FLAG in a.option_strings for a in parser._actions):
        return None
    parser.add_argument(
        CLI_FLAG, type=str.lower, choices=MODES, default=None,
        help=(f"[cupy_dsa plugin] DeepSeek-V4 C4 index-key format: fp8 (SGLang's, default), bf16 or "
              f"bf16-fp4sim (256-byte bf16 keys, cupy_dsa kernels). Same as {ENV_NAME}."))
    return None


def _from_cli_args_hook(result, *args, **kwargs):
    ns = kwargs.get("args", args[-1] if args else None)
    value = getattr(ns, CLI_FLAG.lstrip("-").replace("-", "_"), None)
    if value is not None:
        _refuse_flag_env_disagreement(value)
        core.set_mode(value)  # the environment (for the schedulers) and this process's cached switch
    return None


def _refuse_flag_env_disagreement(flag_value: str) -> None:
    """The flag (or YAML key) and the variable both set, to different modes: refuse rather than let one win
    silently (the operator meant one of them)."""
    env_value = os.environ.get(ENV_NAME)
    if env_value is None or not env_value.strip():
        return
    try:
        same = core.parse_mode(env_value) == core.parse_mode(flag_value)
    except ValueError:
        same = False
    if not same:
        raise StartupRefused(
            f"cupy_dsa: {CLI_FLAG} {flag_value} (or the {CLI_FLAG[2:]} --config key) and {ENV_NAME}={env_value!r} "
            f"in the environment disagree. Refusing to start: set only one of them, or both to the same value.")


# --------------------------------------------------------------------------------------------------
# H1: bytes per index token (allocation and budget)
# --------------------------------------------------------------------------------------------------

def _bytes_args(index_head_dim, use_fp4_indexer):
    return index_head_dim, use_fp4_indexer


def _bytes_per_token_hook(original, *args, **kwargs):
    index_head_dim, use_fp4 = _bytes_args(*args, **kwargs)
    if use_fp4 or not core.enabled():
        return original(*args, **kwargs)  # fp4 pools (incl. V4.1 low-ratio, forced fp4) stay as they are
    _require_supported_platform()
    return 2 * int(index_head_dim)


# --------------------------------------------------------------------------------------------------
# H2: the index-K store
# --------------------------------------------------------------------------------------------------

# The keywords SGLang 0.5.23's compressor passes (compressor_v2.py) and the value each must have for a C4
# index-key store into a bf16 page; anything else on a bf16 cache is refused, never handed to SGLang's fp8 store.
_STORE_DEFAULTS = {"use_fp4": False, "bf16_store": False, "kvcache_scale": None, "rope_cache": None,
                   "fp4_k_write_metadata": None, "fp8_2buff": False, "kvcache_rope": None}
_STORE_REQUIRED = ("norm_weight", "norm_eps", "freq_cis", "out_loc", "kvcache")


def _unrecognised_store_call(kv, plan, args, kwargs) -> list[str]:
    bad = []
    if args:
        bad.append(f"{len(args)} extra positional argument(s)")
    if not isinstance(kv, torch.Tensor) or kv.dim() != 2 or kv.shape[-1] != layouts.HEAD_DIM:
        bad.append(f"kv of shape {tuple(getattr(kv, 'shape', ()))} (expected [N, {layouts.HEAD_DIM}])")
    if not hasattr(plan, "is_decode") or not hasattr(plan, "compress_ratio"):
        bad.append(f"plan of type {type(plan).__name__} (expected a CompressorDecodePlan / CompressorPrefillPlan)")
    for name in _STORE_REQUIRED:
        if name not in kwargs:
            bad.append(f"no {name}=")
    for name, value in kwargs.items():
        if name in _STORE_REQUIRED:
            continue
        if name == "page_size":
            if value != layouts.PAGE_SLOTS:
                bad.append(f"page_size={value!r} (expected {layouts.PAGE_SLOTS})")
        elif name == "layout":
            if str(getattr(value, "value", value)).lower() != "v4":
                bad.append(f"layout={value!r} (expected KVLayout.V4)")
        elif name in _STORE_DEFAULTS:
            default = _STORE_DEFAULTS[name]
            if (value is not default) if default is None else (bool(value) != default):
                bad.append(f"{name}={value!r}")
        else:
            bad.append(f"unknown keyword {name}=")
    return bad


def _store_hook(original, kv, plan, *args, **kwargs):
    kvcache = kwargs.get("kvcache")
    if not core.is_bf16_index_cache(kvcache):
        return original(kv, plan, *args, **kwargs)  # SGLang's formats (fp8 / fp4 index keys, main KV) unchanged
    mode = index_k_mode()
    bad = _unrecognised_store_call(kv, plan, args, kwargs)
    if mode == "fp8":
        bad.insert(0, f"{ENV_NAME}=fp8 in this process")
    if bad:
        raise RuntimeError(
            f"cupy_dsa store: compress_norm_rope_store was called on a bf16 index cache (uint8 "
            f"[P, {layouts.BF16_PAGE_BYTES}]) with a call it does not recognise: {'; '.join(bad)}. Refusing to "
            f"let SGLang's fp8 store write into bf16 pages.")
    _require_supported_platform()
    core.store_index_k_bf16(
        kv, plan[1], is_decode=bool(plan.is_decode), compress_ratio=int(plan.compress_ratio),
        norm_weight=kwargs["norm_weight"], norm_eps=kwargs["norm_eps"], freq_cis=kwargs["freq_cis"],
        out_loc=kwargs["out_loc"], kvcache=kvcache, mode=mode)
    return None


# --------------------------------------------------------------------------------------------------
# H3: forward_c4_indexer
# --------------------------------------------------------------------------------------------------

def _indexer_args(x, q_lora, c4_indexer, forward_batch, alt_streams=None, enable_multi_stream=False,
                  q_lora_ready=None, skip_compressor=False, q_lora_quant=None):
    return dict(x=x, q_lora=q_lora, c4_indexer=c4_indexer, forward_batch=forward_batch, alt_streams=alt_streams,
                enable_multi_stream=enable_multi_stream, q_lora_ready=q_lora_ready,
                skip_compressor=skip_compressor, q_lora_quant=q_lora_quant)


def _forward_c4_indexer_hook(original, self, *args, **kwargs):
    a = _indexer_args(*args, **kwargs)
    if not core.enabled() or a["c4_indexer"].use_fp4_indexer:
        return original(self, *args, **kwargs)
    _require_supported_platform()
    return forward_c4_indexer_bf16(self, **a)


def _match_rows(t: torch.Tensor, rows: int, value) -> torch.Tensor:
    """SGLang's ``match_num_queries``: trim, or pad the row dimension with ``value``."""
    if t.shape[0] == rows:
        return t
    if t.shape[0] > rows:
        return t[:rows]
    pad = (0, 0) * (t.dim() - 1) + (0, rows - t.shape[0])
    return torch.nn.functional.pad(t, pad, value=value)


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


ROUTE_ROWS, ROUTE_GROUPED, ROUTE_VARLEN = "rows", "grouped", "varlen"


def logits_route(ix, self, forward_batch, rows: int) -> tuple[str, int]:
    """How this forward's rows are launched, ``(route, next_n)``:

    * ``grouped`` (MTP target verify with SGLang's uniform layout: every request n consecutive rows built from
      one repeated page-table row, ``make_forward_metadata_from_raw_verify`` / ``expand_extend_with_same_length``):
      one request of next_n = n per request, its pages read once;
    * ``varlen`` (EXTEND / MIXED: requests own consecutive rows, ``forward_batch.extend_seq_lens``): one
      ``mqa_logits`` launch over all requests, 4-row tiles inside each request;
    * ``rows`` otherwise (decode; ragged verify, context parallel, two-batch overlap, late-layer tails, a
      rewritten batch): SGLang's one row per token, as its own paged path runs them."""
    mode = forward_batch.forward_mode
    if not (mode.is_target_verify() or mode == ix.ForwardMode.EXTEND or mode == ix.ForwardMode.MIXED):
        return ROUTE_ROWS, 1
    if (getattr(forward_batch, "tbo_parent_token_range", None) is not None
            or getattr(forward_batch, "_original_forward_mode", None) is not None
            or ix.get_parallel().attn_cp_size != 1):
        return ROUTE_ROWS, 1
    if mode.is_target_verify():
        n = _uniform_verify_rows(self, forward_batch, rows)
        return (ROUTE_GROUPED, n) if n > 1 else (ROUTE_ROWS, 1)
    if mode == ix.ForwardMode.EXTEND or mode == ix.ForwardMode.MIXED:
        if getattr(self.forward_metadata, "late_layer_tail", None) is not None:
            return ROUTE_ROWS, 1
        lens = getattr(forward_batch, "extend_seq_lens", None)
        lens_cpu = getattr(forward_batch, "extend_seq_lens_cpu", None)
        if (isinstance(lens, torch.Tensor) and lens.dim() == 1 and lens.shape[0] > 0 and lens_cpu is not None
                and len(lens_cpu) == lens.shape[0] and 0 < sum(int(n) for n in lens_cpu) <= rows):
            return ROUTE_VARLEN, 1
    return ROUTE_ROWS, 1


def _uniform_verify_rows(self, forward_batch, rows: int) -> int:
    """n when this target-verify batch has SGLang's uniform layout (n = speculative_num_draft_tokens rows per
    request, 2 <= n <= 4, rows = bs * n), else 0 (ragged verify, the DSpark draft runner, other shapes)."""
    from sglang.srt.speculative.ragged_verify import (RaggedVerifyMode, read_ragged_verify_mode,
                                                      resolve_ragged_verify_layout)

    n = getattr(self, "speculative_num_draft_tokens", None)
    if not isinstance(n, int) or not 2 <= n <= 4 or rows % n or getattr(self, "is_dspark_draft", False):
        return 0
    if (resolve_ragged_verify_layout(forward_batch) is not None
            and read_ragged_verify_mode() is RaggedVerifyMode.COMPACT):
        return 0
    return n


def forward_c4_indexer_bf16(self, *, x, q_lora, c4_indexer, forward_batch, alt_streams=None,
                            enable_multi_stream=False, q_lora_ready=None, skip_compressor=False,
                            q_lora_quant=None) -> None:
    """``C4IndexerBackendMixin.forward_c4_indexer`` with bf16 index keys (same steps, same order)."""
    from sglang.srt.layers.attention.dsv4 import indexer as ix

    if forward_batch.forward_mode.is_idle():
        return
    pool = self.token_to_kv_pool
    metadata = self.forward_metadata
    indexer_metadata = metadata.indexer_metadata
    core_metadata = metadata.core_metadata

    positions = core_metadata.positions
    n = min(x.shape[0], q_lora.shape[0], positions.shape[0])
    if x.shape[0] != n:
        x = x[:n]
    if q_lora.shape[0] != n:
        q_lora = q_lora[:n]
        q_lora_quant = None
    if positions.shape[0] != n:
        positions = positions[:n]

    if enable_multi_stream:
        q, weights = self._forward_prepare_multi_stream(
            x=x, q_lora=q_lora, c4_indexer=c4_indexer, positions=positions, forward_batch=forward_batch,
            alt_streams=alt_streams, q_lora_ready=q_lora_ready)
    else:
        if q_lora_ready is not None:
            raise ValueError("q_lora_ready: only the multi-stream prepare path takes an event")
        q, weights = self._forward_prepare_normal(
            x=x, q_lora=q_lora, c4_indexer=c4_indexer, positions=positions, forward_batch=forward_batch,
            skip_compressor=skip_compressor, q_lora_quant=q_lora_quant)
    if q.dim() != 3 or weights.dim() != 3:
        raise ValueError(f"cupy_dsa indexer: expected q [rows, 64, 128] and weights [rows, 64, 1], got "
                         f"{tuple(q.shape)} and {tuple(weights.shape)}")
    weights = weights.squeeze(2)
    rows = q.shape[0]

    lens = _match_rows(indexer_metadata.compressed_seq_lens, rows, 1)
    page_table = _match_rows(indexer_metadata.page_table, rows, 0)
    page_indices = _match_rows(core_metadata.c4_sparse_page_indices, rows, -1)
    route, next_n = logits_route(ix, self, forward_batch, rows)
    if self.debug_use_external_c4_sparse_indices:
        return

    capturer = ix.get_global_indexer_capturer()
    hisparse = self.hisparse_coordinator
    hisparse_decode = hisparse is not None and forward_batch.forward_mode.is_decode()
    raw_indices = None
    if core_metadata.c4_sparse_raw_indices is not None:
        raw_indices = core_metadata.c4_sparse_raw_indices
    elif capturer is not None:
        raw_indices = torch.empty_like(page_indices)
    elif hisparse_decode:
        raw_indices = hisparse.raw_indices_buffer[: page_indices.size(0)]

    all_rows = slice(0, rows)
    page_size = indexer_metadata.compressed_page_size
    backend = self.dsa_topk_backend

    def run_topk(r: slice, logits: torch.Tensor, topk_plan=None) -> None:
        raw = raw_indices[r] if raw_indices is not None else None
        if backend.is_torch():
            ix.topk_transform_pytorch_vectorized(logits, lens[r], page_table[r], page_indices[r], page_size, raw)
        elif backend.is_flashinfer():
            self.flashinfer_topk_transform(logits, lens[r], page_table[r], page_indices[r], page_size, raw)
        elif backend.should_use_topk_v2():
            if topk_plan is None:
                topk_plan = indexer_metadata.topk_metadata if r == all_rows else ix.plan_topk_v2(lens[r])
            ix.topk_transform_paged_v2(logits, lens[r], page_table[r], page_indices[r], page_size, topk_plan,
                                       raw)
        else:
            ix.topk_transform_paged(logits, lens[r], page_table[r], page_indices[r], page_size, raw)

    kvcache = pool.get_index_k_with_scale_buffer(layer_id=c4_indexer.layer_id)  # keeps HiCache's layer wait
    if not core.is_bf16_index_cache(kvcache):
        raise RuntimeError(
            f"cupy_dsa ({ENV_NAME}={index_k_mode()}): the C4 index cache of layer {c4_indexer.layer_id} has "
            f"{tuple(kvcache.shape)} {kvcache.dtype} page rows, expected uint8 [P, {layouts.BF16_PAGE_BYTES}]. "
            f"The pool was sized with the switch off: set {ENV_NAME} before SGLang starts (every scheduler "
            f"process must see it) and check that SGLANG_PLUGINS, if set, lists cupy_dsa.")

    width = indexer_metadata.max_compressed_seq_len
    capturing = _capturing(q.device)
    rows_per_chunk = indexer_metadata.rows_per_chunk
    if route == ROUTE_GROUPED and rows_per_chunk is not None and rows_per_chunk < rows and rows_per_chunk % next_n:
        route, next_n = ROUTE_ROWS, 1  # SGLang's chunks would split a request's draft rows
    chunks = core.row_chunks(rows, rows_per_chunk, width, capturing, multiple=next_n)
    topk_plans = indexer_metadata.topk_metadata_chunks
    if (topk_plans is None or rows_per_chunk is None or len(topk_plans) != len(chunks)
            or rows != indexer_metadata.compressed_seq_lens.shape[0]
            or any(c.stop - c.start != min(rows_per_chunk, rows - c.start) for c in chunks)):
        topk_plans = None
    plans = core.ForwardPlans.for_layer(indexer_metadata, indexer_metadata.compressed_seq_lens, c4_indexer.layer_id)
    if route == ROUTE_VARLEN:
        def build_requests():
            return core.extend_requests(forward_batch.extend_seq_lens, page_table, rows)
        cu_rows, block_table = plans.get(("requests",), build_requests) if plans else build_requests()
        ks = torch.zeros_like(lens, dtype=torch.int32)
        ke = lens.to(torch.int32)
        if backend.is_sgl_kernel():
            # sgl-kernel top-k fills rows with len <= topk without reading logits: skip their keys
            ke = torch.where(ke > c4_indexer.index_topk, ke, ks)
    for i, r in enumerate(chunks):
        if route == ROUTE_VARLEN:
            logits = core.extend_logits(q, weights, ks, ke, cu_rows, block_table, kvcache, r, plans)
        elif route == ROUTE_GROUPED:
            logits = core.verify_logits(q, weights, lens, page_table, kvcache, width, next_n, r, plans)
        else:
            logits = core.paged_logits(q, weights, lens, page_table, kvcache, width, r, plans)
        run_topk(r, logits, topk_plans[i] if topk_plans is not None else None)
        del logits

    if hisparse is not None:
        compress_layer_id = pool.layer_mapping[c4_indexer.layer_id].compress_layer_id
        if hisparse_decode:
            core_metadata.c4_sparse_page_indices = hisparse.swap_in_selected_pages(
                req_pool_indices=forward_batch.req_pool_indices,
                compressed_seq_lens=indexer_metadata.compressed_seq_lens,
                top_k_result=raw_indices, layer_id=compress_layer_id)
        else:
            # FlashMLA's C4 attention takes int32 page indices
            core_metadata.c4_sparse_page_indices = pool.c4_kv_pool.translate_loc_to_hisparse_device(
                core_metadata.c4_sparse_page_indices).to(torch.int32)

    if capturer is not None:
        capturer.capture(pool.layer_mapping[c4_indexer.layer_id].compress_layer_id, raw_indices)


# --------------------------------------------------------------------------------------------------
# H4 (PD layout tag), HiCache guards, warm-up
# --------------------------------------------------------------------------------------------------

def _pd_kv_layout_hook(result, *args, **kwargs):
    mode = index_k_mode()
    if mode == "fp8":
        return None
    return f"{result}{core.pd_layout_tag(mode)}"


def _hicache_regions_hook(result, *args, **kwargs):
    if not core.enabled():
        return None
    out = []
    for region in result:
        if (str(region.name) == _INDEXER_POOL_NAME and region.item_bytes == layouts.BF16_PAGE_BYTES
                and not region.page_aligned_only):
            # the token-granular host copy hard-codes the 584-byte C4 KV row split; bf16 pages move whole
            region = dataclasses.replace(region, page_aligned_only=True)
        out.append(region)
    return out


def _hicache_storage_config_hook(original, self, *args, **kwargs):
    result = original(self, *args, **kwargs)
    mode = index_k_mode()
    if mode != "fp8":
        tag = f"c4idx-{mode}"
        name = getattr(self, "model_name", None)
        if not (name or "").endswith(tag):
            self.model_name = f"{name}_{tag}" if name else tag
    return result


def _warm_up_hook(self, *args, **kwargs):
    if core.enabled() and torch.cuda.is_available() and str(getattr(self, "device", "cuda")).startswith("cuda"):
        kv_dtype = getattr(self, "dtype", None)
        core.configure_warm(next_ns=core.server_next_ns(getattr(self, "server_args", None)),
                            kv_dtypes=(kv_dtype,) if isinstance(kv_dtype, torch.dtype) else None)
        core.ensure_warm(torch.device("cuda", torch.cuda.current_device()))
    return None


# --------------------------------------------------------------------------------------------------
# Fingerprint table (SGLang 0.5.23)
# --------------------------------------------------------------------------------------------------

# Wrapped, replaced or logic copied: signature and source hash.
_FINGERPRINT_SOURCE = (
    T_BYTES, T_STORE, T_INDEXER, T_PD_LAYOUT, T_HICACHE_REGIONS, T_HICACHE_L3, T_WARM_UP,
    # the row layouts logits_route relies on: uniform verify (one repeated page-table row per request, n rows)
    # and extend (each request's rows consecutive, in extend_seq_lens order)
    _BE + "DeepseekV4AttnBackend.make_forward_metadata_from_raw_verify",
    _BE + "DeepseekV4AttnBackend.expand_extend_with_same_length",
    _BE + "DeepseekV4AttnBackend.init_forward_metadata_prefill",
    _BE + "DeepseekV4AttnBackend._resolve_verify_layout",
    "sglang.srt.speculative.ragged_verify.resolve_ragged_verify_layout",
    _HR + "HookRegistry._apply_target", _HR + "_propagate_patch",  # private registry API used by _install
    "sglang.srt.plugins.load_plugins",                            # swallows Exception, not SystemExit
)
# Only called (or hooked AFTER without reading the body): signature.
_FINGERPRINT_SIGNATURE = (
    T_CLI_ADD, T_CLI_FROM, "sglang.srt.arg_groups.resolution_hooks.register_resolution_hook",
    _IX + "C4IndexerBackendMixin._forward_prepare_normal", _IX + "C4IndexerBackendMixin._forward_prepare_multi_stream",
    _IX + "topk_transform_pytorch_vectorized", _IX + "topk_transform_paged", _IX + "topk_transform_paged_v2",
    _IX + "plan_topk_v2", "sglang.srt.speculative.ragged_verify.read_ragged_verify_mode",
    "sglang.srt.mem_cache.deepseek_v4_memory_pool.DeepSeekV4TokenToKVPool.get_index_k_with_scale_buffer",
)

FINGERPRINT.update({
    T_BYTES: ("(index_head_dim: 'int', use_fp4_indexer: 'bool') -> 'int'", '0c4a8a343a2fc47c'),
    T_STORE: ("(kv: 'torch.Tensor', plan: 'Union[CompressorDecodePlan, CompressorPrefillPlan]', *, norm_weight: 'torch.Tensor', norm_eps: 'float', freq_cis: 'torch.Tensor', out_loc: 'torch.Tensor', kvcache: 'torch.Tensor', page_size: 'int', use_fp4: 'bool' = False, bf16_store: 'bool' = False, kvcache_scale: 'Optional[torch.Tensor]' = None, rope_cache: 'Optional[tuple[torch.Tensor, torch.Tensor]]' = None, fp4_k_write_metadata=None, layout: 'Union[KVLayout, str]' = <KVLayout.V4: 'v4'>, fp8_2buff: 'bool' = False, kvcache_rope: 'Optional[torch.Tensor]' = None) -> 'None'", 'b93ca8199dc8e6bd'),
    T_INDEXER: ("(self, x: 'torch.Tensor', q_lora: 'torch.Tensor', c4_indexer: 'C4Indexer', forward_batch: 'ForwardBatch', alt_streams: 'Optional[List[torch.cuda.Stream]]' = None, enable_multi_stream: 'bool' = False, q_lora_ready: 'Optional[torch.cuda.Event]' = None, skip_compressor: 'bool' = False, q_lora_quant=None) -> 'None'", '9023b14e079277f2'),
    T_PD_LAYOUT: ("(self) -> 'str'", 'e9326267433f910e'),
    T_HICACHE_REGIONS: ("(kvcache: 'Any', page_size: 'int') -> 'list[_IndexerRegion]'", '9d380448dc5f8f14'),
    T_HICACHE_L3: ('(self)', '3c204a687fedc894'),
    T_WARM_UP: ("(self, capture_decode_cuda_graph: 'bool' = True)", '2aa82ac4d99b47a5'),
    _BE + 'DeepseekV4AttnBackend.make_forward_metadata_from_raw_verify': ("(self, raw_metadata: 'DSV4RawVerifyMetadata', online_c128_state_slot_offset: 'int' = 0, graph_backed: 'bool' = False) -> 'DSV4Metadata'", '019d1f789b7441d9'),
    _BE + 'DeepseekV4AttnBackend.expand_extend_with_same_length': ("(self, *, bs: 'int', qo_len: 'int', seq_lens: 'torch.Tensor', req_pool_indices: 'torch.Tensor')", '4ab4cdffb324c069'),
    _BE + 'DeepseekV4AttnBackend.init_forward_metadata_prefill': ("(self, max_seq_len: 'int', req_pool_indices: 'torch.Tensor', seq_lens: 'torch.Tensor', seq_lens_cpu: 'List[int]', out_cache_loc: 'torch.Tensor', num_tokens: 'int', extend_seq_lens: 'torch.Tensor', extend_seq_lens_cpu: 'List[int]', extend_start_loc: 'Optional[torch.Tensor]' = None, need_compress: 'bool' = True, use_prefill_cuda_graph: 'bool' = False, online_c128_state_slot_offset: 'int' = 0, dspark_block_size: 'Optional[int]' = None, forward_batch: 'Optional[ForwardBatch]' = None, swa_replay_start: 'Optional[torch.Tensor]' = None, cp_metadata: 'Optional[InterleaveContextParallelMetadata]' = None, dspark_swa_buffers: 'Optional[Tuple[torch.Tensor, torch.Tensor]]' = None) -> 'DSV4Metadata'", 'ed953a0de307a40a'),
    _BE + 'DeepseekV4AttnBackend._resolve_verify_layout': ("(self, forward_batch: 'ForwardBatch', bs: 'int') -> 'Optional[RaggedVerifyLayout]'", '9878aac3c0b26708'),
    'sglang.srt.speculative.ragged_verify.resolve_ragged_verify_layout': ("(forward_batch) -> 'Optional[RaggedVerifyLayout]'", '2de71b0625fe553b'),
    _HR + 'HookRegistry._apply_target': ('(cls, target: str, hooks: list)', 'e5b36a334656349f'),
    _HR + '_propagate_patch': ('(original: object, wrapped: object, source_module: object) -> int', '49c03f76266054fb'),
    'sglang.srt.plugins.load_plugins': ('()', 'cd2a423a31293f61'),
    T_CLI_ADD: ("(parser: 'argparse.ArgumentParser')", None),
    T_CLI_FROM: ("(cls, args: 'argparse.Namespace')", None),
    'sglang.srt.arg_groups.resolution_hooks.register_resolution_hook': ("(name: 'str')", None),
    _IX + 'C4IndexerBackendMixin._forward_prepare_normal': ("(self, x: 'torch.Tensor', q_lora: 'torch.Tensor', c4_indexer: 'C4Indexer', positions: 'torch.Tensor', forward_batch: 'ForwardBatch', skip_compressor: 'bool' = False, q_lora_quant=None) -> 'Tuple[IndexerQuery, torch.Tensor]'", None),
    _IX + 'C4IndexerBackendMixin._forward_prepare_multi_stream': ("(self, x: 'torch.Tensor', q_lora: 'torch.Tensor', c4_indexer: 'C4Indexer', positions: 'torch.Tensor', forward_batch: 'ForwardBatch', alt_streams: 'Optional[List[torch.cuda.Stream]]' = None, q_lora_ready: 'Optional[torch.cuda.Event]' = None) -> 'Tuple[IndexerQuery, torch.Tensor]'", None),
    _IX + 'topk_transform_pytorch_vectorized': ("(scores: 'torch.Tensor', seq_lens: 'torch.Tensor', page_tables: 'torch.Tensor', out_page_indices: 'torch.Tensor', page_size: 'int', out_raw_indices: 'Optional[torch.Tensor]' = None) -> 'None'", None),
    _IX + 'topk_transform_paged': ("(scores: 'torch.Tensor', seq_lens: 'torch.Tensor', page_tables: 'torch.Tensor', out_page_indices: 'torch.Tensor', page_size: 'int', out_raw_indices: 'Optional[torch.Tensor]' = None) -> 'None'", None),
    _IX + 'topk_transform_paged_v2': ("(scores: 'torch.Tensor', seq_lens: 'torch.Tensor', page_tables: 'Optional[torch.Tensor]', out_page_indices: 'torch.Tensor', page_size: 'int', metadata: 'torch.Tensor', out_raw_indices: 'Optional[torch.Tensor]' = None) -> 'None'", None),
    _IX + 'plan_topk_v2': ("(seq_lens: 'torch.Tensor', static_threshold: 'int' = -1, *, out: 'Optional[torch.Tensor]' = None) -> 'torch.Tensor'", None),
    'sglang.srt.speculative.ragged_verify.read_ragged_verify_mode': ("() -> 'RaggedVerifyMode'", None),
    'sglang.srt.mem_cache.deepseek_v4_memory_pool.DeepSeekV4TokenToKVPool.get_index_k_with_scale_buffer': ("(self, layer_id: 'int') -> 'torch.Tensor'", None),
})


def fingerprint_table() -> dict[str, tuple[str, str | None]]:
    """The installed SGLang's fingerprint in :data:`FINGERPRINT`'s form (``scripts/_sglang_checks.py
    fingerprint`` prints it, to review and paste after checking the hooks against a new SGLang)."""
    return {path: fingerprint_of(path, path in _FINGERPRINT_SOURCE)
            for path in _FINGERPRINT_SOURCE + _FINGERPRINT_SIGNATURE}
