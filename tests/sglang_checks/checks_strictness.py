"""Scenario "on", part: never the wrong format; the switch is read once; off means SGLang's own code."""
from __future__ import annotations

import os
import types

import torch

from cupy_dsa.sglang import core, guard, hooks

from checks_store import i32, plan_rows, store_inputs
from harness import check, ENV, make_index_pool, mode_env


class Spy:
    def __init__(self):
        self.calls = []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return "original"


def _store_call(cache, **extra):
    from sglang.kernels.ops.attention.dsv4.compress import CompressorDecodePlan

    kv, w, fc = store_inputs(2)
    plan = CompressorDecodePlan(4, plan_rows([(8, i32(0), 0, 0), (12, i32(0), 0, 0)]))
    kw = dict(norm_weight=w, norm_eps=1e-6, freq_cis=fc, out_loc=torch.tensor([3, 9]), kvcache=cache, page_size=64)
    kw.update(extra)
    return kv, plan, kw


def strictness_checks():
    @check
    def fingerprint_matches_installed():
        assert guard.compatibility_problems() == []
        table = guard.fingerprint_table()
        diff = {k: (table.get(k), v) for k, v in guard.FINGERPRINT.items() if table.get(k) != v}
        assert not diff and set(table) == set(guard.FINGERPRINT), diff

    @check
    def store_refuses_unrecognised_calls():
        from sglang.kernels.ops.attention.dsv4 import compress
        from sglang.kernels.ops.attention.dsv4.kv_layout import KVLayout

        cache = make_index_pool(size=256).index_k_with_scale_buffer[0]
        for extra, fragment in ((dict(use_fp4=True), "use_fp4=True"), (dict(page_size=256), "page_size=256"),
                                (dict(layout=KVLayout.V41), "layout="), (dict(fp8_2buff=True), "fp8_2buff=True"),
                                (dict(bf16_store=True), "bf16_store=True"),
                                (dict(rope_cache=(torch.zeros(1), torch.zeros(1))), "rope_cache="),
                                (dict(new_option=1), "unknown keyword new_option")):
            kv, plan, kw = _store_call(cache, **extra)
            try:
                compress.compress_norm_rope_store(kv, plan, **kw)
            except RuntimeError as e:
                assert fragment in str(e) and "does not recognise" in str(e), str(e)
            else:
                raise AssertionError(f"a bf16-cache store with {extra} was accepted")
        kv, plan, kw = _store_call(cache)
        try:
            compress.compress_norm_rope_store(kv[:, :64].contiguous(), plan, **kw)
        except RuntimeError as e:
            assert "kv of shape (2, 64)" in str(e), str(e)
        else:
            raise AssertionError("a 64-wide kv was stored into a bf16 index cache")
        assert not cache.any(), "a refused call wrote the cache"
        with mode_env("fp8"):  # switch off but a bf16 cache: still never SGLang's fp8 store
            spy = Spy()
            try:
                hooks._store_hook(spy, kv, plan, **kw)
            except RuntimeError as e:
                assert f"{ENV}=fp8" in str(e), str(e)
            else:
                raise AssertionError("switch off: a bf16 cache went to SGLang's store")
            assert not spy.calls

    @check
    def store_fp8_cache_goes_to_sglang_unchanged():
        with mode_env("fp8"):
            cache = make_index_pool(size=256).index_k_with_scale_buffer[0]
        assert tuple(cache.shape[1:]) == (8448,)
        for mode in ("fp8", "bf16"):
            with mode_env(mode):
                kv, plan, kw = _store_call(cache, use_fp4=False)
                spy = Spy()
                assert hooks._store_hook(spy, kv, plan, **kw) == "original"
                (args, kwargs), = spy.calls
                assert args[0] is kv and args[1] is plan and kwargs == kw

    @check
    def indexer_off_calls_sglang_original():
        with mode_env("fp8"):
            spy = Spy()
            self_ = object()
            ci = types.SimpleNamespace(use_fp4_indexer=False)
            assert hooks._forward_c4_indexer_hook(spy, self_, 1, 2, ci, 4, enable_multi_stream=True) == "original"
            assert spy.calls == [((self_, 1, 2, ci, 4), {"enable_multi_stream": True})]
        spy = Spy()  # on, but an FP4 indexer layer: SGLang's too
        ci = types.SimpleNamespace(use_fp4_indexer=True)
        assert hooks._forward_c4_indexer_hook(spy, self_, 1, 2, ci, 4) == "original" and spy.calls

    @check
    def switch_read_once_per_process():
        assert core.index_k_mode() == "bf16"
        os.environ[ENV] = "bf16-fp4sim"
        try:
            assert core.index_k_mode() == "bf16", "the switch was re-read from the environment"
            core.reset_mode()
            assert core.index_k_mode() == "bf16-fp4sim"
        finally:
            os.environ[ENV] = "bf16"
            core.reset_mode()
        assert core.index_k_mode() == "bf16"
