"""Scenario "on", part: never the wrong format; the switch is read once; off means SGLang's own code. The store
refusal assertions serve the fp8cupy scenario too."""
from __future__ import annotations

import os
import types

import torch

from cupy_dsa.sglang import core, guard, hooks

from checks_store import decode_plan, index_cache, store_inputs
from harness import assert_refused, check, ENV, mode_env


class Spy:
    def __init__(self):
        self.calls = []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return "original"


def _store_call(cache, **extra):
    kv, w, fc = store_inputs(2)
    plan = decode_plan((8, 12))
    kw = dict(norm_weight=w, norm_eps=1e-6, freq_cis=fc, out_loc=torch.tensor([3, 9]), kvcache=cache, page_size=64)
    kw.update(extra)
    return kv, plan, kw


def assert_stores_refused(cache, cases, fragments, what):
    """A store into ``cache`` with each case's extra keywords raises, naming the case's fragment, "does not
    recognise" and ``fragments``: the hook neither stores nor hands a call it does not recognise to SGLang."""
    from sglang.kernels.ops.attention.dsv4 import compress

    for extra, fragment in cases:
        kv, plan, kw = _store_call(cache, **extra)
        assert_refused(lambda: compress.compress_norm_rope_store(kv, plan, **kw),
                       (fragment, "does not recognise", *fragments), f"{what} with {extra} was accepted")


def assert_hook_refuses(kv, plan, kw, fragment, accepted):
    """The store hook raises, naming ``fragment``, and never calls SGLang's store."""
    spy = Spy()
    assert_refused(lambda: hooks._store_hook(spy, kv, plan, **kw), (fragment,), accepted)
    assert not spy.calls, "a refused store went to SGLang's store"


def assert_fp8_keyed_store_strictness(mode, caches, fragments):
    """The store of a mode on SGLang's fp8 index cache (``caches[0]``, with its residual pages after it if any): a call
    with keywords it does not recognise is refused naming ``fragments`` and writes none of ``caches``; a bf16 cache
    (not this mode's) is refused and left unwritten; SGLang's other caches go to SGLang's own store."""
    assert_stores_refused(caches[0], ((dict(use_fp4=True), "use_fp4=True"), (dict(page_size=256), "page_size=256"),
                                      (dict(new_option=1), "unknown keyword new_option")),
                          fragments, f"an {mode} store")
    assert not any(c.any() for c in caches), "a refused call wrote a page"
    bf16_cache = torch.zeros(44, 16384, dtype=torch.uint8)  # a bf16 cache cannot be this mode's
    kv, plan, kw = _store_call(bf16_cache)
    assert_hook_refuses(kv, plan, kw, f"{ENV}={mode} in this process", f"{mode} wrote a bf16 cache")
    assert not bf16_cache.any()
    main_kv = torch.zeros(4, 64 * 584, dtype=torch.uint8)  # SGLang's other caches: its own store
    kv, plan, kw = _store_call(main_kv)
    spy = Spy()
    assert hooks._store_hook(spy, kv, plan, **kw) == "original" and len(spy.calls) == 1


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

        cache = index_cache()
        assert_stores_refused(cache, ((dict(use_fp4=True), "use_fp4=True"), (dict(page_size=256), "page_size=256"),
                                      (dict(layout=KVLayout.V41), "layout="), (dict(fp8_2buff=True), "fp8_2buff=True"),
                                      (dict(bf16_store=True), "bf16_store=True"),
                                      (dict(rope_cache=(torch.zeros(1), torch.zeros(1))), "rope_cache="),
                                      (dict(new_option=1), "unknown keyword new_option")), (), "a bf16-cache store")
        kv, plan, kw = _store_call(cache)
        assert_refused(lambda: compress.compress_norm_rope_store(kv[:, :64].contiguous(), plan, **kw),
                       ("kv of shape (2, 64)",), "a 64-wide kv was stored into a bf16 index cache")
        assert not cache.any(), "a refused call wrote the cache"
        with mode_env("fp8"):  # switch off but a bf16 cache: still never SGLang's fp8 store
            assert_hook_refuses(kv, plan, kw, f"{ENV}=fp8", "switch off: a bf16 cache went to SGLang's store")

    @check
    def store_fp8_cache_goes_to_sglang_unchanged():
        with mode_env("fp8"):
            cache = index_cache()
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
