"""Scenario "on", part: guards (PD layout, HiCache, configuration refusals)."""
from __future__ import annotations

import types

from cupy_dsa.sglang import guard

from harness import (ENV, INFO, assert_refused, assert_resolution_leaves_environment, check, hicache_model_name,
                     make_index_pool, mode_env, resolution_refusal, run_resolution)


def pd_decode_handshake(local_layout: str, prefill_layout: str):
    """SGLang's decode-side PD handshake (``CommonKVManager.try_ensure_parallel_info``) of a manager with
    ``local_layout`` against a prefill peer that answers ``prefill_layout`` (its HTTP reply stood in), so the
    layout check runs as SGLang runs it; raises what SGLang raises."""
    from sglang.srt.disaggregation.common import conn

    mgr = object.__new__(conn.CommonKVManager)
    mgr.kv_args = types.SimpleNamespace(page_size=256, state_types=())
    mgr.kv_cache_dtype_str = "fp8_e4m3"
    mgr.kv_layout = local_layout
    mgr.prefill_info_table = {}
    mgr.dsv41_spec_layout = None
    mgr.attn_tp_size = 1
    data = dict(attn_tp_size=1, attn_cp_size=1, dp_size=1, pp_size=1, page_size=256,
                kv_cache_dtype="fp8_e4m3", follow_bootstrap_room=True, kv_layout=prefill_layout)

    class Resp:
        status_code = 200

        def json(self):
            return data

    orig = conn.requests.get
    conn.requests.get = lambda *a, **k: Resp()
    try:
        return mgr.try_ensure_parallel_info("127.0.0.1:1")
    finally:
        conn.requests.get = orig


def assert_pd_layout_accepted(layout: str):
    """A decode peer and a prefill peer that both answer ``layout`` pass SGLang's layout check (what the handshake
    checks after it needs a real manager: its other errors are not the layout check's)."""
    try:
        pd_decode_handshake(layout, layout)
    except RuntimeError as e:
        assert "KV layout mismatch" not in str(e), str(e)
    except Exception:
        pass


def guard_checks():
    @check
    def pd_layout_mismatch_refused():
        from sglang.kernels.ops.attention.dsv4.kv_layout import KVLayout
        from sglang.srt.disaggregation.utils import get_pd_kv_layout
        from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool

        pool = object.__new__(DeepSeekV4TokenToKVPool)
        pool.uniform_fp8 = True
        bf16_layout = get_pd_kv_layout(pool)
        assert bf16_layout == KVLayout.UNIFORM_FP8.value + ",c4idx:bf16", bf16_layout
        with mode_env("fp8"):
            fp8_layout = get_pd_kv_layout(pool)
        assert fp8_layout == KVLayout.UNIFORM_FP8.value

        try:
            pd_decode_handshake(fp8_layout, bf16_layout)
        except RuntimeError as e:
            assert "KV layout mismatch" in str(e) and "c4idx:bf16" in str(e), str(e)
            INFO["pd_mismatch"] = str(e)  # the README quotes it (test_sglang_scenarios.py checks)
        else:
            raise AssertionError("an fp8 decode peer accepted a bf16 prefill peer")
        assert_pd_layout_accepted(bf16_layout)

    @check
    def hicache_guards():
        from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import _dsv4_indexer_regions

        bf16_pool = make_index_pool()
        (region,) = _dsv4_indexer_regions(types.SimpleNamespace(c4_indexer_kv_pool=bf16_pool), 256)
        assert region.item_bytes == 16384 and region.page_aligned_only is True, region
        with mode_env("fp8"):
            fp8_pool = make_index_pool()
            (region,) = _dsv4_indexer_regions(types.SimpleNamespace(c4_indexer_kv_pool=fp8_pool), 256)
        assert region.item_bytes == 8448 and region.page_aligned_only is False, region
        assert hicache_model_name() == "deepseek-ai/DeepSeek-V4_c4idx-bf16"
        with mode_env("fp8"):
            assert hicache_model_name() == "deepseek-ai/DeepSeek-V4"

    def refused(fragment, **fields):
        msg = resolution_refusal("the resolution step", **fields)
        assert fragment in msg and ENV in msg, msg
        INFO.setdefault("refusals", []).append(msg)

    @check
    def resolution_accepts_without_env_writes():
        assert_resolution_leaves_environment()

    @check
    def resolution_refuses_fp4_indexer():
        refused("--enable-deepseek-v4-fp4-indexer", enable_deepseek_v4_fp4_indexer=True)

    @check
    def resolution_refuses_megakernel():
        refused("--enable-nvidia-megakernel", enable_nvidia_megakernel=True)

    @check
    def resolution_refuses_npu_xpu():
        refused("NPU", device="npu")
        refused("XPU", device="xpu")

    @check
    def resolution_refuses_hip_and_hooks_raise_on_hip():
        import sglang.srt.utils as su
        from sglang.srt.mem_cache import deepseek_v4_memory_pool as mp

        orig = su.is_hip
        su.is_hip = lambda: True
        try:
            refused("HIP")
            try:
                mp.get_dsv4_indexer_bytes_per_token(128, False)
            except RuntimeError as e:
                assert "HIP" in str(e)
            else:
                raise AssertionError("the pool hook sized a bf16 pool on HIP")
        finally:
            su.is_hip = orig

    @check
    def resolution_refuses_invalid_value():
        from cupy_dsa.sglang.core import StartupRefused

        with mode_env("bf8"):
            try:
                run_resolution()
            except StartupRefused as e:
                assert "bf16-fp4sim" in str(e) and "Refusing to start" in str(e), str(e)
            else:
                raise AssertionError("an invalid switch value was accepted")

    @check
    def resolution_checks_version_when_flag_turns_switch_on():
        # launcher: register() ran with the switch off, then --cupy-dsa-index-k-dtype bf16 set it
        from cupy_dsa.sglang.core import StartupRefused

        orig = guard.sglang_version
        guard.sglang_version = lambda: "0.5.22"
        try:
            assert_refused(run_resolution, ("found SGLang 0.5.22",), "the launcher accepted bf16 on SGLang 0.5.22",
                           error=StartupRefused)
        finally:
            guard.sglang_version = orig
