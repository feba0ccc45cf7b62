"""Scenario "refusals": start-up stops cleanly and nothing stays patched (one process: every refusal undoes
everything, which the last check proves by registering successfully afterwards); ``refuse_installed``: the
installed SGLang (another version layered on PYTHONPATH) must stop start-up."""
from __future__ import annotations

import functools
import os
import sys

from cupy_dsa.sglang import guard, hooks

from harness import check, ENV, every_hook_in_place, INFO, mode_env, nothing_patched


def _load_expect_refusal(*fragments, loader=None):
    """Run SGLang's real load_plugins() (or ``loader``) and return the StartupRefused message."""
    import sglang.srt.plugins as sp

    from cupy_dsa.sglang.core import StartupRefused

    sp._plugins_loaded = False
    try:
        (loader or sp.load_plugins)()
    except StartupRefused as e:
        msg = str(e)
        assert isinstance(e, SystemExit) and not isinstance(e, Exception), "load_plugins would swallow it"
        for f in fragments:
            assert f in msg, f"{f!r} not in: {msg}"
        INFO.setdefault("refusals", []).append(msg)
        return msg
    raise AssertionError("start-up was not refused")


def scenario_refusals():
    assert os.environ.get(ENV) == "bf16" and os.environ.get("SGLANG_PLUGINS") == "cupy_dsa"

    @check
    def refuses_other_version():
        orig = guard.sglang_version
        guard.sglang_version = lambda: "0.5.22"
        try:
            msg = _load_expect_refusal("found SGLang 0.5.22", "written for SGLang 0.5.23", f"unset {ENV}",
                                       "Nothing was patched")
        finally:
            guard.sglang_version = orig
        nothing_patched()
        INFO["refusal_version"] = msg

    @check
    def refuses_source_fingerprint_mismatch():
        sig, digest = guard.FINGERPRINT[guard.T_STORE]
        guard.FINGERPRINT[guard.T_STORE] = (sig, "0" * 16)
        try:
            _load_expect_refusal("found SGLang 0.5.23, but its code differs", guard.T_STORE + ": source differs")
        finally:
            guard.FINGERPRINT[guard.T_STORE] = (sig, digest)
        nothing_patched()

    @check
    def refuses_signature_mismatch():
        from sglang.srt.mem_cache import deepseek_v4_memory_pool as mp

        orig = mp.get_dsv4_indexer_bytes_per_token

        def get_dsv4_indexer_bytes_per_token(index_head_dim, use_fp4_indexer, extra=0):
            return orig(index_head_dim, use_fp4_indexer)

        mp.get_dsv4_indexer_bytes_per_token = get_dsv4_indexer_bytes_per_token
        try:
            _load_expect_refusal(guard.T_BYTES + ": signature (index_head_dim, use_fp4_indexer, extra=0)")
        finally:
            mp.get_dsv4_indexer_bytes_per_token = orig
        nothing_patched()

    @check
    def hook_failure_undoes_applied_hooks():
        from sglang.srt.plugins.hook_registry import HookRegistry

        real = HookRegistry._apply_target.__func__
        applied = []

        def failing(cls, target, entries):
            if target == guard.T_WARM_UP:  # the last hook: every other one was applied before it
                raise ImportError("No module named 'sgl_kernel' (simulated)")
            applied.append(target)
            return real(cls, target, entries)

        # functools.wraps: the fingerprint check sees SGLang's function (unwrapped), as for any hook
        HookRegistry._apply_target = classmethod(functools.wraps(real)(failing))
        try:
            _load_expect_refusal(f"the hook on {guard.T_WARM_UP} failed to apply", "sgl_kernel",
                                 f"the {len(applied) or 10} hook(s) applied before it were undone")
        finally:
            HookRegistry._apply_target = classmethod(real)
        assert len(applied) == 10, applied
        nothing_patched()

    @check
    def hook_failing_after_its_patch_counts_only_earlier_hooks():
        from sglang.srt.plugins.hook_registry import HookRegistry

        real = HookRegistry._apply_target.__func__

        def failing(cls, target, entries):
            out = real(cls, target, entries)
            if target == guard.T_WARM_UP:  # the last hook: patched, then a failure (e.g. in propagation)
                raise RuntimeError("propagation failed (simulated)")
            return out

        HookRegistry._apply_target = classmethod(functools.wraps(real)(failing))
        try:
            _load_expect_refusal(f"the hook on {guard.T_WARM_UP} failed to apply", "simulated",
                                 "the 10 hook(s) applied before it were undone, and so was its own partial patch")
        finally:
            HookRegistry._apply_target = classmethod(real)
        nothing_patched()

    @check
    def resolution_hook_failure_undoes_hooks():
        from sglang.srt.arg_groups import resolution_hooks

        orig = resolution_hooks.register_resolution_hook

        def broken(name):
            raise ValueError(f"{name!r} is not an overridable resolution hook (simulated)")

        resolution_hooks.register_resolution_hook = functools.wraps(orig)(broken)
        try:
            _load_expect_refusal(f"resolution step {guard.RESOLUTION_STEP} failed to apply")
        finally:
            resolution_hooks.register_resolution_hook = orig
        nothing_patched()

    def invalid(loader=None):
        with mode_env("bf8"):
            msg = _load_expect_refusal(f"{ENV}='bf8'", "bf16-fp4sim", "Refusing to start", loader=loader)
        nothing_patched()
        return msg

    @check
    def invalid_value_direct_load_plugins():
        invalid()

    @check
    def invalid_value_engine():
        import sglang

        invalid(lambda: sglang.Engine(model_path="dummy"))

    @check
    def invalid_value_ray_worker_hook():
        invalid(hooks.ray_worker_setup)

    @check
    def invalid_rescore_setting_refused_before_patching():
        # the query setting and fp8-rescore's settings: a bad value, or a value with a mode that does not take it,
        # stops start-up in load_plugins() before any hook is applied
        from cupy_dsa.sglang import core

        Q, K = core.QUERY_ENV, core.RESCORE_KPRIME_ENV
        for mode, name, value, fragments in (
                ("fp8-rescore", Q, "fp16", (f"{Q}='fp16'", "expected one of fp8, bf16")),
                ("bf16", Q, "fp16", (f"{Q}='fp16'", "expected one of fp8, bf16")),
                ("fp8-cupy", Q, "int8", (f"{Q}='int8'", "expected one of fp8, bf16")),
                ("bf16-reference", Q, "bf16", (f"{Q}='bf16' set with {ENV}=bf16-reference",
                                               "its query (fp4sim) is part of the mode")),
                ("bf16-reference", Q, "fp8", (f"{Q}='fp8' set with {ENV}=bf16-reference",)),
                ("bf16", K, "2x", (f"{K} set with {ENV}=bf16", "fp8-rescore only"))):
            with core.env_vars({name: value}), mode_env(mode):
                _load_expect_refusal(*fragments, "Refusing to start")
            nothing_patched()

    @check
    def switch_off_hook_failure_leaves_sglang_unchanged():
        import sglang.srt.plugins as sp
        from sglang.srt.plugins.hook_registry import HookRegistry

        real = HookRegistry._apply_target.__func__

        def failing(cls, target, entries):
            if target == guard.T_CLI_FROM:
                raise AttributeError("simulated")
            return real(cls, target, entries)

        HookRegistry._apply_target = classmethod(functools.wraps(real)(failing))
        try:
            with mode_env("fp8"):
                sp._plugins_loaded = False
                sp.load_plugins()  # no refusal with the switch off: SGLang runs unchanged
        finally:
            HookRegistry._apply_target = classmethod(real)
        nothing_patched()

    @check
    def registers_after_refusals():
        import sglang.srt.plugins as sp

        sp._plugins_loaded = False
        sp.load_plugins()
        every_hook_in_place()
        from sglang.srt.mem_cache import deepseek_v4_memory_pool as mp
        from sglang.srt.model_executor import pool_configurator as pc

        assert pc.get_dsv4_indexer_bytes_per_token(128, False) == 256
        assert mp.get_dsv4_indexer_bytes_per_token(128, False) == 256


def refuse_installed():
    """The installed SGLang (e.g. another version layered on PYTHONPATH), switch on: load_plugins() must
    stop start-up; prints the message. Exit status 3 if it did not."""
    from sglang.srt.plugins import load_plugins

    load_plugins()
    print("NOT REFUSED", flush=True)
    sys.exit(3)
