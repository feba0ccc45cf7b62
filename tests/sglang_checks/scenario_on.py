"""Scenario "on": SGLANG_CUPY_DSA_INDEX_K=bf16, SGLANG_PLUGINS=cupy_dsa: every hook, the store, recall, guards."""
from __future__ import annotations

import os
import types

import torch

from cupy_dsa.sglang import guard, hooks

from checks_guard import guard_checks
from checks_indexer import indexer_checks
from checks_store import check_store, i32, key_f64, plan_rows, store_inputs, u16x2
from checks_strictness import strictness_checks
from harness import check, ENV, load, make_index_pool, mode_env, patched


def scenario_on():
    load()

    @check
    def hooks_applied():
        missing = [t for t in hooks.ALWAYS_TARGETS + hooks.SWITCHED_TARGETS if not patched(t)]
        assert not missing, f"not patched: {missing}"
        from sglang.srt.arg_groups.resolution_hooks import _HOOKS

        assert hooks.validate_config in _HOOKS.get(guard.RESOLUTION_STEP, []), "H5 not registered"
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
        from sglang.kernels.ops.attention.dsv4.compress import CompressorDecodePlan

        kv, w, fc = store_inputs(4)
        seq = [8, 9, 12, 400]
        plan = CompressorDecodePlan(4, plan_rows([(s, i32(0), 0, 0) for s in seq]))
        out_loc = torch.tensor([5, 6, 7, 70], dtype=torch.int64)
        # seq_len 9 is not a compression boundary: skipped; position = seq_len - 4
        check_store(plan, kv, w, fc, out_loc, [(0, 5, 4), (2, 7, 8), (3, 70, 396)])

    @check
    def store_prefill_plan():
        from sglang.kernels.ops.attention.dsv4.compress import CompressorPrefillPlan

        kv, w, fc = store_inputs(4)
        rows = [(4, 2), (0xFFFFFFFF, 0), (16, 5), (64, 1)]
        plan = CompressorPrefillPlan(4, plan_rows([(s, u16x2(r, 4), 0, 0) for s, r in rows]),
                                     torch.zeros(4, 8, dtype=torch.uint8))
        out_loc = torch.tensor([100, 101, 102, 103, 104, 105, 106, 107], dtype=torch.int64)
        # invalid entry skipped; location = out_loc[ragged_id]
        check_store(plan, kv, w, fc, out_loc, [(0, 102, 0), (2, 105, 12), (3, 101, 60)])

    @check
    def store_via_sglang_call_site():
        # SGLang's own CompressorBackendMixin._forward_compress_all_in_one (indexer branch) with its CUDA-JIT
        # compress_forward replaced by a stand-in that returns the compressed rows: the hooked store must
        # accept exactly the keywords SGLang passes and write the planned slots.
        from sglang.kernels.ops.attention.dsv4.compress import CompressorDecodePlan
        from sglang.srt.layers.attention.dsv4 import compressor_v2

        kv, w, fc = store_inputs(3)
        plan = CompressorDecodePlan(4, plan_rows([(s, i32(0), 0, 0) for s in (16, 18, 20)]))
        cache = make_index_pool(size=256).index_k_with_scale_buffer[0]

        class Backend(compressor_v2.CompressorBackendMixin):
            forward_metadata = types.SimpleNamespace(c4_compress_metadata=plan)

        seen = {}

        def fake_compress_forward(**kw):
            seen["plan"] = kw["plan"]
            return kv

        orig = compressor_v2.compress_forward
        compressor_v2.compress_forward = fake_compress_forward
        try:
            Backend()._forward_compress_all_in_one(
                kv_score_buffer=torch.zeros(8, 512), kv_score_input=torch.zeros(3, 512), ape=torch.zeros(4, 128),
                head_dim=128, norm=types.SimpleNamespace(weight=w, variance_epsilon=1e-6), freqs_cis_cache=fc,
                kv_cache=cache, is_indexer=True, rotate=True, compress_ratio=4, page_size=64,
                out_loc=torch.tensor([11, 12, 13]))
        finally:
            compressor_v2.compress_forward = orig
        assert seen["plan"] is plan
        written = sorted(int(i) for i in (cache.view(-1, 256) != 0).any(1).nonzero().flatten())
        assert written == [11, 13], written
        for row, loc, pos in ((0, 11, 12), (2, 13, 16)):
            ref = key_f64(kv[row:row + 1], torch.tensor([pos]), w, fc)[0]
            err = (cache.view(torch.bfloat16).view(-1, 128)[loc].double() - ref).abs().max().item()
            assert err <= 1e-2 * ref.abs().max().item() + 1e-3, f"slot {loc}: max error {err:.3g}"

    @check
    def store_fp4sim():
        from sglang.kernels.ops.attention.dsv4.compress import CompressorDecodePlan
        from sglang.srt.layers.attention.dsv4 import compressor_v2

        kv, w, fc = store_inputs(2)
        plan = CompressorDecodePlan(4, plan_rows([(8, i32(0), 0, 0), (12, i32(0), 0, 0)]))
        cache = make_index_pool(size=256).index_k_with_scale_buffer[0]
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
