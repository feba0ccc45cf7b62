"""What every scenario shares: the check registry (each check isolated: one failing check does not hide the
others), a refusal's assertion, the switch set for a block, SGLang's plugin loading, an indexer pool, whether a
hook is in place (one, every one, none).

Importing it makes SGLang importable on a CPU-only machine first (``scripts/_sglang_env.py``)."""
from __future__ import annotations

import os
import sys
import tempfile
import traceback
import types

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "scripts"))
import _sglang_env  # noqa: E402

_sglang_env.install()

import torch  # noqa: E402

from cupy_dsa.sglang import core, guard, hooks  # noqa: E402  (none imports SGLang)

ENV = "SGLANG_CUPY_DSA_INDEX_K"
RESULTS: dict[str, dict] = {}
INFO: dict[str, object] = {}


def check(fn):
    try:
        fn()
        RESULTS[fn.__name__] = {"ok": True}
    except BaseException:  # noqa: BLE001 - every failure is reported, not raised
        RESULTS[fn.__name__] = {"ok": False, "error": traceback.format_exc()}
    return fn


def assert_refused(call, fragments, accepted, error=RuntimeError):
    """call() raises ``error`` with every fragment in its message; ``accepted``: the failure if it returns."""
    try:
        call()
    except error as e:
        assert all(f in str(e) for f in fragments), str(e)
    else:
        raise AssertionError(accepted)


def mode_env(value):
    """Temporarily set the switch (None: unset; the plugin caches it per process: reset on entry and exit)."""
    return core.env_vars({ENV: value})


def server_args_from_yaml(text):
    """SGLang's ``prepare_server_args`` on a ``--config`` YAML file holding ``text`` (the file is removed after)."""
    from sglang.srt.server_args import prepare_server_args

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(text)
    try:
        return prepare_server_args(["--config", f.name])
    finally:
        os.unlink(f.name)


def assert_argparse_rejects(args):
    """SGLang's argument parser itself rejects ``args`` (a choice or a value type), not a plugin refusal."""
    from sglang.srt.server_args import prepare_server_args

    try:
        prepare_server_args(["--model-path", "dummy"] + list(args))
    except SystemExit as e:
        assert not isinstance(e, core.StartupRefused), str(e)
    else:
        raise AssertionError(f"argparse accepted {args}")


def run_resolution(index_topk=None, **fields):
    """SGLang's resolution step (``handle_model_specific_adjustments``, by name) on a ServerArgs of ``fields``, with
    the plugin's hook around it; index_topk: the model config SGLang's step builds (model_config_of's memo). Returns
    the ServerArgs."""
    from sglang.srt.arg_groups.resolution_hooks import run_hook
    from sglang.srt.server_args import ServerArgs

    def handle_model_specific_adjustments(server_args):  # SGLang's step, by name
        server_args._builtin_ran = True
        if index_topk is not None:
            server_args._model_config = types.SimpleNamespace(hf_config=types.SimpleNamespace(
                architectures=["DeepseekV4ForCausalLM"], index_topk=index_topk))

    sa = ServerArgs(model_path="dummy", **fields)
    run_hook(handle_model_specific_adjustments, sa)
    assert sa._builtin_ran, "SGLang's own step must run first"
    return sa


def assert_resolution_leaves_environment(**fields):
    """The resolution step on ``fields`` is accepted and writes no environment variable."""
    before = dict(os.environ)
    run_resolution(**fields)
    changed = {k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k)}
    assert not changed, f"the resolution hook wrote the environment: {changed}"


def resolution_refusal(what, **fields):
    """The message of the start-up refusal (a SystemExit, no traceback: every refusal reads the same way) the
    resolution step raises on ``fields`` (``what`` names who accepted them otherwise)."""
    from cupy_dsa.sglang.core import StartupRefused

    try:
        run_resolution(**fields)
    except StartupRefused as e:
        assert "Refusing to start" in str(e), str(e)
        return str(e)
    except (TypeError, AssertionError) as e:  # a field this SGLang validates before the hook
        raise AssertionError(f"{fields}: {e}") from e
    raise AssertionError(f"{what} accepted {fields}")


def hicache_model_name():
    """The model name SGLang's HiCache storage keys DeepSeek-V4's pages by (one rank, MLA): the plugin tags it with
    the index-key layout."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=True, enable_storage_metrics=False, is_page_first_layout=False,
                                model_name="deepseek-ai/DeepSeek-V4").model_name


def forward_cases(decode_route, extend_route, verify_route):
    """The three forwards the scenarios run through SGLang's: (what, ForwardMode, batch, page setup, the logits
    route expected)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return (("decode", ForwardMode.DECODE, 4, dict(lens=(2560, 2400, 2100, 1800)), decode_route),
            ("extend", ForwardMode.EXTEND, 2, dict(lens=(2000, 2001, 2002, 2560), groups=(3, 1)), extend_route),
            ("verify n=2", ForwardMode.TARGET_VERIFY, 2, dict(lens=(2300, 2301, 2500, 2501), groups=(2, 2)),
             verify_route))


def assert_check_command_says(mode, fragments):
    """``cupy-dsa check``'s mode section for this process's settings finds ``mode`` and names every fragment."""
    from cupy_dsa.sglang import check as check_cmd

    found, lines = check_cmd._mode_lines()
    text = " ".join(t for _, t in lines)
    missing = [f for f in fragments if f not in text]
    assert found == mode and not missing, (found, missing, text)


def load():
    from sglang.srt.plugins import load_plugins

    load_plugins()


def make_index_pool(layers=1, size=2560):
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4IndexerPool

    return DeepSeekV4IndexerPool(size, 64, torch.bfloat16, 128, layers, "cpu", False, use_fp4_indexer=False,
                                 global_page_size=256)


def patched(target):
    """Whether cupy_dsa applied its hook on ``target`` in this process (it applies them itself)."""
    return target in hooks.installed_targets() and _is_wrapped(target)


def _is_wrapped(target):
    owner, attr, raw, _ = guard.resolve_target(target)
    fn = raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw
    return hasattr(fn, "__wrapped__")


def every_hook_in_place():
    """Every cupy_dsa hook is in place (what nothing_patched denies): every target wrapped, the resolution hook
    registered."""
    from sglang.srt.arg_groups.resolution_hooks import _HOOKS

    missing = [t for t in hooks.ALWAYS_TARGETS + hooks.SWITCHED_TARGETS if not patched(t)]
    assert not missing, f"not patched: {missing}"
    assert hooks.validate_config in _HOOKS.get(guard.RESOLUTION_STEP, []), "H5 not registered"


def nothing_patched():
    """No cupy_dsa hook is in place: no wrapped target, no resolution hook, no env field."""
    from sglang.srt.arg_groups.resolution_hooks import _HOOKS
    from sglang.srt.environ import Envs

    wrapped = [t for t in hooks.ALWAYS_TARGETS + hooks.SWITCHED_TARGETS if _is_wrapped(t)]
    assert not wrapped, f"still wrapped: {wrapped}"
    assert not hooks.installed_targets(), hooks.installed_targets()
    assert hooks.validate_config not in _HOOKS.get(guard.RESOLUTION_STEP, []), "resolution hook left in"
    assert ENV not in Envs.__dict__, "env field registered"
    from sglang.srt.mem_cache import deepseek_v4_memory_pool as mp
    from sglang.srt.model_executor import pool_configurator as pc

    assert pc.get_dsv4_indexer_bytes_per_token is mp.get_dsv4_indexer_bytes_per_token
    assert not hasattr(pc.get_dsv4_indexer_bytes_per_token, "__wrapped__"), "pool_configurator's copy still wrapped"
