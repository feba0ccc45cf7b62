"""Scenario "on": SGLANG_CUPY_DSA_INDEX_K=bf16, SGLANG_PLUGINS=cupy_dsa: every hook, the store, recall, guards."""
from __future__ import annotations

import os

import torch

from checks_guard import guard_checks
from checks_indexer import indexer_checks
from checks_store import (assert_bf16_keys, call_site_case, decode_case, decode_plan, index_cache, prefill_case,
                          store_inputs, store_through_binding, store_through_sglang_call_site)
from checks_strictness import strictness_checks
from harness import check, ENV, every_hook_in_place, load, make_index_pool, mode_env


def scenario_on():
    load()

    @check
    def hooks_applied():
        every_hook_in_place()
        import sglang.kernels.ops.attention.dsv4 as dsv4_pkg
        from sglang.kernels.ops.attention.dsv4 import compress
        from sglang.srt.layers.attention import deepseek_v4_backend
        from sglang.srt.layers.attention.dsv4 import compressor_v2

        for mod in (compress, compressor_v2, dsv4_pkg):
            assert hasattr(mod.compress_norm_rope_store, "__wrapped__"), f"{mod.__name__} binding not wrapped"
        fwd = deepseek_v4_backend.DeepseekV4AttnBackend.forward_c4_indexer
        assert hasattr(fwd, "__wrapped__"), "DeepseekV4AttnBackend.forward_c4_indexer is not the hooked one"

    @check
    def env_field():
        from sglang.srt.environ import envs, exportable_env_vars

        assert envs.SGLANG_CUPY_DSA_INDEX_K.get() == "bf16"
        assert exportable_env_vars().get(ENV) == "bf16"
        with envs.SGLANG_CUPY_DSA_INDEX_K.override("bf16-fp4sim"):
            assert os.environ[ENV] == "bf16-fp4sim"

    @check
    def bytes_per_token_on():
        from sglang.srt.mem_cache import deepseek_v4_memory_pool as mp
        from sglang.srt.model_executor import pool_configurator as pc

        assert pc.get_dsv4_indexer_bytes_per_token is mp.get_dsv4_indexer_bytes_per_token
        for fn in (mp.get_dsv4_indexer_bytes_per_token, pc.get_dsv4_indexer_bytes_per_token):
            assert fn(128, False) == 256, fn(128, False)
            assert fn(128, use_fp4_indexer=False) == 256
            assert fn(128, use_fp4_indexer=True) == 68, "fp4 pools must stay 68 B/token"
        with mode_env("fp8"):
            assert pc.get_dsv4_indexer_bytes_per_token(128, False) == 132
        # the budget's per-full-token price of one C4 layer's index keys: 256 / 4 = 64 B (fp8: 33 B)
        cfg = object.__new__(pc.DSV4PoolConfigurator)
        cfg.c4_shrink_factor = 1
        cfg._get_paged_kv_bytes_per_token = lambda ratio: 0
        cfg.indexer_bytes_per_token = pc.get_dsv4_indexer_bytes_per_token(128, False)  # as __init__ does
        assert cfg._compressed_bytes_per_full_token(4) == 64

    @check
    def pool_pages_on():
        pool = make_index_pool(layers=2)
        rows = [tuple(b.shape) for b in pool.contiguous_page_row_buffers()]
        assert rows == [(44, 16384), (44, 16384)], rows
        assert pool.get_bytes_per_token() == 256
        with mode_env("fp8"):
            assert tuple(make_index_pool().index_k_with_scale_buffer[0].shape) == (44, 8448)

    @check
    def store_decode_plan():
        case = decode_case()
        assert_bf16_keys(store_through_binding(case), case)

    @check
    def store_prefill_plan():
        case = prefill_case()
        assert_bf16_keys(store_through_binding(case), case)

    @check
    def store_via_sglang_call_site():
        case, cache = call_site_case(), index_cache()
        store_through_sglang_call_site(case, cache)
        assert_bf16_keys(cache, case)

    @check
    def store_fp4sim():
        from sglang.srt.layers.attention.dsv4 import compressor_v2

        kv, w, fc = store_inputs(2)
        plan = decode_plan((8, 12))
        cache = index_cache()
        with mode_env("bf16-fp4sim"):
            compressor_v2.compress_norm_rope_store(kv, plan, norm_weight=w, norm_eps=1e-6, freq_cis=fc,
                                                  out_loc=torch.tensor([3, 9]), kvcache=cache, page_size=64)
        k = cache.view(torch.bfloat16).view(-1, 128)[[3, 9]].float().view(2, 4, 32)
        # each 32-element block holds e2m1 values times one power of two
        amax = k.abs().amax(-1, keepdim=True)
        scaled = k / torch.exp2(torch.ceil(torch.log2(amax / 6.0)))  # ue8m0 (power-of-two) block scale
        grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])
        dist = (scaled.abs()[..., None] - grid).abs().min(-1).values
        assert dist.max().item() < 1e-3, f"not on the e2m1 grid: {dist.max().item()}"

    indexer_checks()
    guard_checks()
    strictness_checks()
