"""SGLang 0.5.23 general plugin: bf16 index keys for DeepSeek-V4's C4 indexer (or SGLang's fp8 keys on cupy_dsa's kernels).

Entry point ``cupy_dsa = cupy_dsa.sglang.plugin:register`` in group ``sglang.srt.plugins``; SGLang calls
:func:`register` in every process that runs ``load_plugins()`` (launcher, each scheduler, DP controller,
detokenizer). The switch is ``SGLANG_CUPY_DSA_INDEX_K`` (``fp8`` = SGLang unchanged, the default;
``bf16``; ``bf16-fp4sim``; ``bf16-reference``; ``fp8-cupy``: SGLang's 132-byte fp8 keys in SGLang's format and pool
memory (their bytes checked against a CPU emulation of SGLang's fp8 store, not its CUDA kernel), written by cupy_dsa's
store and scored by cupy_dsa's kernels; ``fp8-rescore``: those fp8 keys plus a
132-byte int8 residual page per entry, each row's top-k rescored among its K' best fp8 logits), or the server flag
``--cupy-dsa-index-k-dtype`` (also a ``--config`` YAML key), which sets the variable in the launcher before the
schedulers are spawned. The query (``--cupy-dsa-index-q`` / ``SGLANG_CUPY_DSA_INDEX_Q``: SGLang's fp8 q or the
rotated q rounded to bf16; fp8-rescore's stage-2 query) and fp8-rescore's settings (``--cupy-dsa-rescore-stage1`` /
``SGLANG_CUPY_DSA_RESCORE_STAGE1``, ``--cupy-dsa-rescore-kprime`` / ``SGLANG_CUPY_DSA_RESCORE_KPRIME``) have flags,
variables and ``--config`` keys of their own; a mode that does not take one refuses it. What differs between modes
is read from their records (:class:`~cupy_dsa.sglang.core.IndexMode`).

Start-up is all or nothing. With the switch on, :func:`register` first checks that the installed SGLang is
one the hooks were written for (:data:`~cupy_dsa.sglang.guard.SUPPORTED_SGLANG` and
:data:`~cupy_dsa.sglang.guard.FINGERPRINT`: the signature, and a hash
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

* H1 AROUND ``get_dsv4_indexer_bytes_per_token``: 256 B/token for the non-FP4 pool in the bf16 modes, which
  sizes both the allocation and the KV memory budget (the hook registry re-points ``pool_configurator``'s
  imported name); SGLang's 132 B/token in fp8-cupy; 264 B/token in fp8-rescore (both pages; SGLang's own buffer is
  still allocated with its 132-byte rows, see the pool hooks below);
* H2 AROUND ``compress_norm_rope_store``: a store into the mode's index cache (uint8 rows of 16384 bytes, or
  SGLang's 8448-byte fp8 rows in fp8-cupy) goes to ``cupy_dsa.store_index_k_from_plan`` on SGLang's own plan
  rows, and any call there it does not recognise raises; every other cache goes to SGLang unchanged;
* H3 AROUND ``C4IndexerBackendMixin.forward_c4_indexer``: SGLang's body order, with the logits from
  ``cupy_dsa.paged_mqa_logits`` (decode / verify / extend) or ``cupy_dsa.mqa_logits`` (single-request
  eager prefill, where SGLang would run its non-paged fp8 reader); SGLang's top-k backends, raw indices,
  HiSparse epilogue and top-k capturer are called as SGLang calls them; in fp8-rescore the top-k is
  ``cupy_dsa.rescore``'s (stage 1 from SGLang's own fp8 logits call or cupy_dsa's kernels), in SGLang's output form;
* pool hooks (fp8-rescore; otherwise SGLang's): AROUND ``DeepSeekV4IndexerPool._create_buffer`` (SGLang's fp8
  buffer, then a lo buffer of the same shape in the same memory region) and AFTER
  ``DeepSeekV4IndexerPool.contiguous_page_row_buffers`` (PD registers the lo buffers too);
* H4 AFTER ``DeepSeekV4TokenToKVPool.pd_kv_layout``: appends ``,c4idx:<mode>`` so PD peers with
  different index-key formats refuse to pair (fp8-cupy too: its pages are in SGLang's format, but a prefill peer on
  SGLang's kernel would pick that side's top-k, and a run labelled fp8-cupy would not be cupy_dsa's kernels);
* HiCache: AFTER ``_dsv4_indexer_regions`` (bf16 index pages move page-aligned only; fp8-rescore's lo pages are a
  second region, the twin of SGLang's fp8 region) and AROUND
  ``HiCacheStorageConfig.__post_init__`` (a distinct L3 namespace: ``model_name`` gets ``_c4idx-<mode>``,
  so fp8 pages persisted by another server are never read as bf16);
* warm-up: BEFORE ``ModelRunner.init_cuda_graphs`` compiles and loads the kernels this server launches
  (:func:`cupy_dsa.sglang.core.warm_expressions`) before the first CUDA-graph capture.

This module imports SGLang only inside functions; CuPy and the kernels load only on the CUDA path.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import threading

import torch

from .. import layouts
from . import core, forward
from .core import CLI_FLAG, ENV_NAME, MODES, StartupRefused, index_k_mode
from .guard import (RESOLUTION_STEP, T_BYTES, T_CLI_ADD, T_CLI_FROM, T_HICACHE_L3, T_HICACHE_REGIONS, T_INDEXER,
                    T_PD_BUFFERS, T_PD_LAYOUT, T_POOL_BUFFER, T_STORE, T_WARM_UP, compatibility_problems, off_hint,
                    refusal_message, resolve_target, sglang_version)

logger = logging.getLogger(__name__)

ALWAYS_TARGETS = (T_CLI_ADD, T_CLI_FROM)
SWITCHED_TARGETS = (T_BYTES, T_STORE, T_INDEXER, T_PD_LAYOUT, T_HICACHE_REGIONS, T_HICACHE_L3, T_POOL_BUFFER,
                    T_PD_BUFFERS, T_WARM_UP)

_INDEXER_POOL_NAME = "deepseek_v4_c4_indexer"

_installed: list[tuple] = []       # (target, owner, attr, raw before, raw after), in install order
_resolution_installed = False
_registered_always = False
_registered_switched = False


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
        raise StartupRefused(refusal_message(mode, problems, _patched_so_far()))


# --------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------

def _resolve_switch(final: bool = False) -> str:
    """The switch, or a start-up refusal naming the bad value (never a silent fp8); with it on (or ``final``: the
    launcher's resolution step, after the CLI flag and YAML key have set the variables), the query setting and
    fp8-rescore's settings too: an invalid one, or one set for a mode that does not take it (the switch off
    included), is refused the same way. With the switch off at ``register()`` they are not read yet: the flag may
    still turn it on."""
    try:
        mode = index_k_mode()
    except ValueError as e:
        raise StartupRefused(f"cupy_dsa: {e}. Refusing to start. {off_hint()}") from None
    if core.record(mode).hooked or final:
        problem = core.settings_problem(mode)
        if problem:
            raise StartupRefused(f"cupy_dsa ({ENV_NAME}={mode}): {problem}. Refusing to start. {off_hint()}")
    return mode


def register() -> None:
    """SGLang general-plugin entry point (idempotent within a process).

    Switch on: check the installed SGLang (:func:`compatibility_problems`), then install every hook, guards
    included, or none (a failure undoes the ones already applied and stops start-up with
    :class:`StartupRefused`, which SGLang's ``load_plugins()`` does not swallow). Switch off: only the CLI
    flag and the launcher check are installed; if they cannot be, SGLang runs without them (unchanged)."""
    global _registered_always, _registered_switched
    mode = _resolve_switch()
    rec = core.record(mode)
    if rec.hooked and not _registered_switched:  # every hook
        require_compatible_sglang(mode)
        entries = [] if _registered_always else _always_entries()
        try:
            _install(entries + _switched_entries(), resolution=not _registered_always)
        except HookInstallError as e:
            raise StartupRefused(f"cupy_dsa ({ENV_NAME}={mode}): {e}; start-up stops. {off_hint()}") from e
        _registered_always = _registered_switched = True
        register_env_field()
        logger.info("cupy_dsa: %s=%s, hooks registered for %s (SGLang %s)", ENV_NAME, mode, core.describe(mode),
                    sglang_version())
        logger.info("cupy_dsa: %s: %s", mode, core.describe_query(mode, core.index_query()))
        if rec.two_level:
            logger.info("cupy_dsa: %s: %s", mode, core.rescore_settings().describe())
        logger.info("%s", core.pd_layout_hint(mode))
    elif not rec.hooked and not _registered_always:
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
            (T_POOL_BUFFER, _create_buffer_hook, HookType.AROUND),
            (T_PD_BUFFERS, _page_row_buffers_hook, HookType.AFTER),
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
            owner, attr, before, _ = resolve_target(target)
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


def refusal_reasons(cfg, mode: str, index_topk: int | None = None) -> list[str]:
    """Why this (resolved) server configuration cannot run in ``mode`` (bf16 index keys, or fp8-cupy's cupy_dsa
    kernels on SGLang's fp8 keys); empty if it can. fp8-cupy is refused where the bf16 modes are. ``index_topk``:
    the model's (two-level scoring's K' must reach it), when known."""
    reasons = []
    if getattr(cfg, "enable_deepseek_v4_fp4_indexer", False):
        reasons.append(
            f"--enable-deepseek-v4-fp4-indexer: the FP4 indexer keeps 68-byte FP4 index keys and FP4 logits, "
            f"which {ENV_NAME}={mode} does not replace. Drop --enable-deepseek-v4-fp4-indexer (use "
            f"{ENV_NAME}=bf16-fp4sim to keep FP4-rounded keys in bf16), or set {ENV_NAME}=fp8.")
    if getattr(cfg, "enable_nvidia_megakernel", False):
        what = ("its decode and verify steps would score the keys with the megakernel's indexer, not cupy_dsa's"
                if core.record(mode).cache_layout == "fp8" else
                f"which are 256-byte bf16 pages with {ENV_NAME}={mode}")
        reasons.append(
            f"--enable-nvidia-megakernel: the megakernel runs its own fp8 indexer over SGLang's 132-byte "
            f"index pages; {what}. Drop --enable-nvidia-megakernel, or set {ENV_NAME}=fp8.")
    problem = _platform_problem(getattr(cfg, "device", None))
    if problem:
        reasons.append(problem)
    if core.record(mode).two_level:
        reasons += _rescore_refusals(cfg, mode)
        k_prime = core.rescore_settings().k_prime_problem(index_topk) if index_topk is not None else None
        if k_prime:
            reasons.append(f"{k_prime}: the model's index_topk is {index_topk}, and the first C4 forward (CUDA-graph "
                           f"capture, or the first request) would raise")
    return reasons


def _rescore_refusals(cfg, mode: str) -> list[str]:
    """Configurations fp8-rescore was not written for (the other modes serve them on the one-row-per-token route)."""
    reasons = []
    other = "or set " + ENV_NAME + "=fp8-cupy to keep SGLang's fp8 keys on cupy_dsa's kernels without the rescoring"
    cp = getattr(cfg, "attn_cp_size", 1) or 1
    if int(cp) > 1:
        reasons.append(
            f"--attn-cp-size {cp} (context parallel): {mode} was not written for it. Under context parallelism "
            f"SGLang splits a request's tokens over ranks with metadata of its own (InterleaveContextParallelMetadata), "
            f"which neither the two-stage top-k nor the residual pages' store and transfer were checked against. Run "
            f"without context parallelism, {other}.")
    if getattr(cfg, "enable_two_batch_overlap", False):
        reasons.append(
            f"--enable-two-batch-overlap: {mode} was not written for it (each micro-batch reaches the indexer as a "
            f"rewritten batch; the two-stage top-k and its per-forward plans were not checked on one). Drop "
            f"--enable-two-batch-overlap, {other}.")
    return reasons


def model_index_topk(server_args) -> int | None:
    """The model's ``index_topk`` from the model config SGLang's own resolution step built and kept on the server
    arguments (``model_config_of``'s memo; nothing is loaded here), or None when there is none (no model: tests, an
    instance connector)."""
    from sglang.srt.arg_groups import model_override_base as mob

    views = tuple(getattr(mob, n) for n in ("ResolvedView", "ResolvingConfig") if hasattr(mob, n))
    record = mob.record_of(server_args) if views and isinstance(server_args, views) else server_args
    hf_config = getattr(getattr(record, "_model_config", None), "hf_config", None)
    value = getattr(hf_config, "index_topk", None)
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def validate_config(server_args, previous) -> None:
    """H5 (resolution step ``handle_model_specific_adjustments``; runs once, in the launcher)."""
    previous(server_args)
    # an invalid value (the switch's, the query's, fp8-rescore's settings), or a setting the mode does not take,
    # stops the launch here
    mode = _resolve_switch(final=True)
    if not core.record(mode).hooked:
        return
    # the CLI flag / YAML key may have turned the switch on after register() ran with it off
    require_compatible_sglang(mode)
    from sglang.srt.arg_groups.model_override_base import resolving_view

    index_topk = model_index_topk(server_args) if core.record(mode).two_level else None
    reasons = refusal_reasons(resolving_view(server_args), mode, index_topk)
    if reasons:   # a SystemExit as every start-up refusal: one message, no traceback
        raise StartupRefused(f"cupy_dsa ({ENV_NAME}={mode}, {core.describe(mode)}) cannot run with this "
                             "configuration:\n  - " + "\n  - ".join(reasons) + f"\nRefusing to start. {off_hint()}")
    # No environment is written: SGLang's fp8-only non-paged prefill reader is reached only from SGLang's
    # own forward_c4_indexer body, which the H3 hook does not call while the switch is on.


# --------------------------------------------------------------------------------------------------
# CLI flag and --config YAML key
# --------------------------------------------------------------------------------------------------

def _k_prime_arg(value: str) -> str:
    try:
        core.parse_k_prime(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).split(": ", 1)[1]) from None
    return value.strip().lower()


def _flag(flag, variable, parse, help_text, **argparse_kw):
    """(flag, variable, parser of a value, argparse keywords) of one flag the plugin adds; its help ends naming the
    variable it sets."""
    return flag, variable, parse, dict(argparse_kw, help=f"{help_text} Same as {variable}.")


# every flag the plugin adds
def _flags():
    return (
        _flag(CLI_FLAG, ENV_NAME, core.parse_mode,
              "[cupy_dsa plugin] DeepSeek-V4 C4 index-key format: fp8 (SGLang's, default), bf16, bf16-fp4sim or "
              "bf16-reference (256-byte bf16 keys, cupy_dsa kernels), fp8-cupy (SGLang's 132-byte fp8 keys on "
              "cupy_dsa's store and kernels), fp8-rescore (SGLang's fp8 keys plus a 132-byte int8 residual page, "
              "264 B per entry; each row's top-k rescored among its K' best fp8 logits).",
              type=str.lower, choices=MODES),
        _flag(core.RESCORE_STAGE1_FLAG, core.RESCORE_STAGE1_ENV, core.parse_stage1,
              "[cupy_dsa plugin, fp8-rescore] stage 1 (the fp8 logits that choose each row's K' candidates): sglang "
              "(default: SGLang's own fp8 logits call) or cupy (cupy_dsa's fp8-key kernels).",
              type=str.lower, choices=core.STAGE1_CHOICES),
        _flag(core.RESCORE_KPRIME_FLAG, core.RESCORE_KPRIME_ENV, core.parse_k_prime,
              f"[cupy_dsa plugin, fp8-rescore] K', the fp8 candidates per row that stage 2 rescores: a multiple of "
              f"index_topk (default {core.DEFAULT_KPRIME}) or a count (>= index_topk).",
              type=_k_prime_arg, metavar="{Nx,N}"),
        _flag(core.QUERY_FLAG, core.QUERY_ENV, core.parse_query,
              "[cupy_dsa plugin] the indexer query: fp8 (SGLang's fused fp8 q, one scale per token and head) or bf16 "
              "(the rotated q rounded to bf16 once); for "
              + ", ".join(f"{m.name} (default {m.query})" for m in core.MODE_RECORDS.values() if m.query_settable)
              + "; fp8-rescore's is its stage-2 query. Refused with the other modes.",
              type=str.lower, choices=core.QUERY_CHOICES),
    )


def _add_cli_args_hook(result, *args, **kwargs):
    parser = kwargs.get("parser", args[0] if args else None)
    if parser is None:
        return None
    for flag, _, _, kw in _flags():
        if not any(flag in a.option_strings for a in parser._actions):
            parser.add_argument(flag, default=None, **kw)
    return None


def _from_cli_args_hook(result, *args, **kwargs):
    ns = kwargs.get("args", args[-1] if args else None)
    values = [(flag, env, parse, getattr(ns, flag.lstrip("-").replace("-", "_"), None))
              for flag, env, parse, _ in _flags()]
    for flag, env, parse, value in values:  # every disagreement first: nothing is set when one is refused
        if value is not None:
            _refuse_flag_env_disagreement(value, flag, env, parse)
    for flag, env, parse, value in values:
        if value is None:
            continue
        if env == ENV_NAME:
            core.set_mode(value)  # the environment (for the schedulers) and this process's cached switch
        else:
            os.environ[env] = value
            core.reset_mode()  # the cached settings (and switch) are read again
    return None


def _refuse_flag_env_disagreement(flag_value: str, flag: str = CLI_FLAG, env: str = ENV_NAME,
                                  parse=core.parse_mode) -> None:
    """The flag (or YAML key) and the variable both set, to different values: refuse rather than let one win
    silently (the operator meant one of them)."""
    env_value = os.environ.get(env)
    if env_value is None or not env_value.strip():
        return
    try:
        same = parse(env_value) == parse(flag_value)
    except ValueError:
        same = False
    if not same:
        raise StartupRefused(
            f"cupy_dsa: {flag} {flag_value} (or the {flag[2:]} --config key) and {env}={env_value!r} "
            f"in the environment disagree. Refusing to start: set only one of them, or both to the same value.")


# --------------------------------------------------------------------------------------------------
# H1: bytes per index token (allocation and budget)
# --------------------------------------------------------------------------------------------------

def _bytes_args(index_head_dim, use_fp4_indexer):
    return index_head_dim, use_fp4_indexer


# Set while SGLang's own _create_buffer allocates fp8-rescore's hi pages (thread-local: a pool is built on one thread)
_HI_PAGES_ONLY = threading.local()


@contextlib.contextmanager
def _allocating_hi_pages():
    _HI_PAGES_ONLY.on = True
    try:
        yield
    finally:
        _HI_PAGES_ONLY.on = False


def _bytes_per_token_hook(original, *args, **kwargs):
    index_head_dim, use_fp4 = _bytes_args(*args, **kwargs)
    rec = core.mode_record()
    if use_fp4 or rec.cache_layout != "bf16":
        # fp4 pools (incl. V4.1 low-ratio, forced fp4) stay as they are; fp8 and fp8-cupy keep SGLang's 132 B
        if use_fp4 or not rec.two_level or getattr(_HI_PAGES_ONLY, "on", False):
            return original(*args, **kwargs)
        # fp8-rescore: an entry is SGLang's fp8 bytes plus as many residual bytes, which the KV budget (and the
        # pool's own count) must see; SGLang's buffer itself is allocated with its fp8 rows (_create_buffer_hook)
        _require_supported_platform()
        return 2 * int(original(*args, **kwargs))
    _require_supported_platform()
    return 2 * int(index_head_dim)


# --------------------------------------------------------------------------------------------------
# fp8-rescore's residual pages: allocated with SGLang's fp8 index pages, moved by PD with them
# --------------------------------------------------------------------------------------------------

def _is_rescore_pool(pool) -> bool:
    """A C4 indexer pool of fp8-rescore: SGLang's fp8 layout (not FP4, not the split HIP layout), 64-slot pages of
    128-dim keys."""
    return (core.mode_record().two_level and not getattr(pool, "use_fp4_indexer", False)
            and not getattr(pool, "uses_aiter_fp4_layout", False)
            and getattr(pool, "page_size", None) == layouts.PAGE_SLOTS
            and getattr(pool, "index_head_dim", None) == layouts.HEAD_DIM)


def _create_buffer_hook(original, self, *args, **kwargs):
    """``DeepSeekV4IndexerPool._create_buffer``: in fp8-rescore, SGLang's own buffers with SGLang's fp8 rows (the hi
    pages; the pool's per-token bytes count both pages, see H1), then one lo buffer per layer of the same shape on
    the same device, in the same memory-saver region and memory pool (``index_k_lo_buffer``)."""
    if not _is_rescore_pool(self):
        return original(self, *args, **kwargs)
    _require_supported_platform()
    with _allocating_hi_pages():
        result = original(self, *args, **kwargs)
    his = self.index_k_with_scale_buffer
    if not his or any(core.index_cache_layout(b) != "fp8" for b in his):
        raise RuntimeError(f"cupy_dsa ({ENV_NAME}={index_k_mode()}): SGLang's indexer pool allocated "
                           f"{[tuple(b.shape) for b in his or []]} page rows, expected uint8 [P, "
                           f"{layouts.FP8_PAGE_BYTES}] per C4 layer for the fp8 (hi) pages")
    from contextlib import nullcontext

    from sglang.srt.mem_cache import deepseek_v4_memory_pool as mp

    with self.memory_saver_adapter.region(mp.GPU_MEMORY_TYPE_KV_CACHE):
        with (torch.cuda.use_mem_pool(self.custom_mem_pool) if self.custom_mem_pool else nullcontext()):
            self.index_k_lo_buffer = [torch.zeros_like(hi) for hi in his]
    for hi, lo in zip(his, self.index_k_lo_buffer):
        core.register_lo_cache(hi, lo)
    return result


def _page_row_buffers_hook(result, self, *args, **kwargs):
    """``DeepSeekV4IndexerPool.contiguous_page_row_buffers`` (every buffer PD registers, by page): in fp8-rescore the
    lo buffers follow the fp8 ones, so a prefill peer's residual pages travel with its fp8 pages (both peers run
    fp8-rescore: the PD layout tag)."""
    lo = getattr(self, "index_k_lo_buffer", None)
    if not lo or not _is_rescore_pool(self):
        return None
    return list(result) + list(lo)


# --------------------------------------------------------------------------------------------------
# H2: the index-K store
# --------------------------------------------------------------------------------------------------

# The keywords SGLang 0.5.23's compressor passes (compressor_v2.py) and the value each must have for a C4
# index-key store into the mode's page (bf16, or fp8 in fp8-cupy); anything else on that cache is refused, never
# handed to SGLang's fp8 store.
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
    layout = core.index_cache_layout(kvcache)
    mode = index_k_mode()
    rec = core.record(mode)
    if layout is None or (layout == "fp8" and not (rec.hooked and rec.cache_layout == "fp8")):
        # SGLang's formats (fp8 index keys outside fp8-cupy, fp4 index keys, main KV) unchanged
        return original(kv, plan, *args, **kwargs)
    bad = _unrecognised_store_call(kv, plan, args, kwargs)
    if rec.cache_layout != layout:
        bad.insert(0, f"{ENV_NAME}={mode} in this process")
    if bad:
        why = ("let SGLang's fp8 store write into bf16 pages" if layout == "bf16" else
               f"hand it to SGLang's store: {ENV_NAME}={mode} writes every index key with cupy_dsa's store"
               + (" (the fp8 page and its residual page in one launch)" if rec.two_level else ""))
        raise RuntimeError(
            f"cupy_dsa store: compress_norm_rope_store was called on a {layout} index cache (uint8 "
            f"[P, {layouts.page_bytes(layout)}]) with a call it does not recognise: {'; '.join(bad)}. Refusing to "
            f"{why}.")
    _require_supported_platform()
    lo_cache = core.require_lo_cache(kvcache, "the index-key store") if rec.two_level else None
    core.store_index_k_bf16(
        kv, plan[1], is_decode=bool(plan.is_decode), compress_ratio=int(plan.compress_ratio),
        norm_weight=kwargs["norm_weight"], norm_eps=kwargs["norm_eps"], freq_cis=kwargs["freq_cis"],
        out_loc=kwargs["out_loc"], kvcache=kvcache, mode=mode, lo_cache=lo_cache)
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
    return forward.forward_c4_indexer_bf16(self, **a)


# --------------------------------------------------------------------------------------------------
# H4 (PD layout tag), HiCache guards, warm-up
# --------------------------------------------------------------------------------------------------

def _pd_kv_layout_hook(result, *args, **kwargs):
    mode = index_k_mode()
    if not core.record(mode).hooked:
        return None
    return f"{result}{core.pd_layout_tag(mode)}"


def _hicache_args(kvcache, page_size):
    return kvcache, page_size


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
    if core.mode_record().two_level:
        out = _with_lo_region(out, _hicache_args(*args, **kwargs)[0])
    return out


def _with_lo_region(regions, kvcache):
    """fp8-rescore: the lo pages as a second C4 indexer region, the twin of SGLang's fp8 region (same item bytes,
    slot pages and transfer rule, so whatever copies a hi page copies its lo page), under the name SGLang gives the
    second buffer of a split C4 indexer (``DEEPSEEK_V4_C4_INDEXER_SCALE``, otherwise used only by the FP4 and NPU
    layouts, which fp8-rescore refuses). HiCache's host pools, its layer-wise loads, the cache linker and L3
    storage then carry both; the L3 namespace of the mode (``_c4idx-fp8-rescore``) keeps them apart from other
    servers'."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    his = [r for r in regions if str(r.name) == _INDEXER_POOL_NAME]
    pool = getattr(kvcache, "c4_indexer_kv_pool", None)
    lo = getattr(pool, "index_k_lo_buffer", None)
    fp8_buffers = getattr(pool, "index_k_with_scale_buffer", None) or []
    same = (len(his) == 1 and len(his[0].device_buffers) == len(fp8_buffers)
            and all(a is b for a, b in zip(his[0].device_buffers, fp8_buffers)))
    if not same or not lo or any(str(r.name) == str(PoolName.DEEPSEEK_V4_C4_INDEXER_SCALE) for r in regions):
        raise RuntimeError(
            f"cupy_dsa ({ENV_NAME}={index_k_mode()}): HiCache's C4 indexer regions are "
            f"{[(str(r.name), r.item_bytes) for r in regions]} and the pool has "
            f"{'no' if not lo else len(lo)} residual (lo) buffers; expected SGLang's one fp8 region and the pool's lo "
            f"buffers, to carry the lo pages beside it. Refusing to build HiCache without them (its restored pages "
            f"would be rescored from stale residuals).")
    return regions + [dataclasses.replace(his[0], name=PoolName.DEEPSEEK_V4_C4_INDEXER_SCALE, device_buffers=lo)]


def _hicache_storage_config_hook(original, self, *args, **kwargs):
    result = original(self, *args, **kwargs)
    mode = index_k_mode()
    if core.record(mode).hooked:  # the key format's namespace; the query does not change the pages
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

