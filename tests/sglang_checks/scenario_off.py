"""Scenario "off" (SGLang unchanged; the CLI flag and the YAML key set the switch) and scenario "excluded"
(SGLANG_PLUGINS does not list cupy_dsa: nothing installed)."""
from __future__ import annotations

import os

from cupy_dsa.sglang import guard, hooks

from harness import check, ENV, load, make_index_pool, mode_env, patched, server_args_from_yaml


def scenario_off():
    assert ENV not in os.environ
    load()

    @check
    def entry_point_loaded():
        assert patched(guard.T_CLI_ADD) and patched(guard.T_CLI_FROM), "register() did not run"
        assert not any(patched(t) for t in hooks.SWITCHED_TARGETS), "data-path hooks installed while off"
        from sglang.srt.environ import envs

        assert envs.SGLANG_CUPY_DSA_INDEX_K.get() == "fp8"

    @check
    def sglang_unchanged():
        from sglang.kernels.ops.attention.dsv4 import compress
        from sglang.srt.layers.attention.dsv4.indexer import C4IndexerBackendMixin
        from sglang.srt.mem_cache import deepseek_v4_memory_pool as mp
        from sglang.srt.model_executor import pool_configurator as pc

        for fn in (mp.get_dsv4_indexer_bytes_per_token, pc.get_dsv4_indexer_bytes_per_token,
                   compress.compress_norm_rope_store, C4IndexerBackendMixin.forward_c4_indexer,
                   mp.DeepSeekV4TokenToKVPool.pd_kv_layout):
            assert not hasattr(fn, "__wrapped__"), f"{fn.__qualname__} is wrapped"
        assert mp.get_dsv4_indexer_bytes_per_token(128, False) == 132
        assert pc.get_dsv4_indexer_bytes_per_token(128, False) == 132
        assert [tuple(b.shape) for b in make_index_pool(layers=2).contiguous_page_row_buffers()] == [(44, 8448)] * 2

    @check
    def resolution_off_is_noop():
        from sglang.srt.arg_groups.resolution_hooks import run_hook
        from sglang.srt.server_args import ServerArgs

        def handle_model_specific_adjustments(server_args):
            pass

        os.environ.pop("SGLANG_OPT_DSV4_NONPAGED_INDEXER", None)
        run_hook(handle_model_specific_adjustments, ServerArgs(model_path="dummy", enable_deepseek_v4_fp4_indexer=True))
        assert "SGLANG_OPT_DSV4_NONPAGED_INDEXER" not in os.environ

    @check
    def cli_flag_sets_switch():
        from sglang.srt.server_args import prepare_server_args

        with mode_env(None):
            prepare_server_args(["--model-path", "dummy", "--cupy-dsa-index-k-dtype", "bf16"])
            assert os.environ.get(ENV) == "bf16"
        with mode_env(None):
            prepare_server_args(["--model-path", "dummy"])
            assert ENV not in os.environ, "no flag must leave the switch alone"
        with mode_env(None):
            try:
                prepare_server_args(["--model-path", "dummy", "--cupy-dsa-index-k-dtype", "int8"])
            except SystemExit:
                pass
            else:
                raise AssertionError("argparse accepted an invalid choice")

    @check
    def cli_flag_disagreeing_with_env_refused():
        from sglang.srt.server_args import prepare_server_args

        from cupy_dsa.sglang.core import StartupRefused

        with mode_env("bf16"):
            try:
                prepare_server_args(["--model-path", "dummy", "--cupy-dsa-index-k-dtype", "fp8"])
            except StartupRefused as e:
                msg = str(e)
                assert "--cupy-dsa-index-k-dtype fp8" in msg and f"{ENV}='bf16'" in msg, msg
                assert "Refusing to start" in msg, msg
            else:
                raise AssertionError("the flag silently overrode the environment variable")
            assert os.environ[ENV] == "bf16"
        with mode_env("BF16"):  # the same mode in both is fine
            prepare_server_args(["--model-path", "dummy", "--cupy-dsa-index-k-dtype", "bf16"])
            assert os.environ[ENV] == "bf16"

    @check
    def refusal_after_cli_flag_names_the_hooks_in_place():
        # launcher: register() ran with the switch off (CLI hooks and the check in place), then the flag turned
        # it on and the check finds an unsupported SGLang: the message must not claim that nothing was patched
        from sglang.srt.arg_groups.resolution_hooks import run_hook
        from sglang.srt.server_args import prepare_server_args

        from cupy_dsa.sglang.core import StartupRefused

        def handle_model_specific_adjustments(server_args):
            pass

        with mode_env(None):
            sa = prepare_server_args(["--model-path", "dummy", "--cupy-dsa-index-k-dtype", "bf16"])
            orig = guard.sglang_version
            guard.sglang_version = lambda: "0.5.22"
            try:
                run_hook(handle_model_specific_adjustments, sa)
            except StartupRefused as e:
                msg = str(e)
            else:
                raise AssertionError("the launcher accepted bf16 on SGLang 0.5.22")
            finally:
                guard.sglang_version = orig
        assert "found SGLang 0.5.22" in msg and "Nothing was patched" not in msg, msg
        assert "No index-key hook was applied" in msg and "ServerArgs.add_cli_args" in msg, msg
        assert "ServerArgs.from_cli_args" in msg and guard.RESOLUTION_STEP in msg, msg

    @check
    def yaml_config_sets_switch():
        with mode_env(None):
            server_args_from_yaml("model-path: dummy\ncupy-dsa-index-k-dtype: bf16-fp4sim\n")
            assert os.environ.get(ENV) == "bf16-fp4sim", os.environ.get(ENV)


def scenario_excluded():
    assert os.environ.get(ENV) == "bf16" and os.environ.get("SGLANG_PLUGINS") == "someone_else"
    load()

    @check
    def allow_list_respected():
        from sglang.srt.environ import Envs
        from sglang.srt.mem_cache import deepseek_v4_memory_pool as mp


        assert not any(patched(t) for t in hooks.ALWAYS_TARGETS + hooks.SWITCHED_TARGETS)
        assert ENV not in Envs.__dict__
        assert mp.get_dsv4_indexer_bytes_per_token(128, False) == 132
