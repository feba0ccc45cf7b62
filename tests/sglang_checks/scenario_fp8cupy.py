"""Scenario "fp8cupy": SGLANG_CUPY_DSA_INDEX_K=fp8-cupy, SGLANG_PLUGINS=cupy_dsa: SGLang's fp8 index keys (its
pool, its 132-byte entries) written by cupy_dsa's store and scored by cupy_dsa's logits, through SGLang's real
classes.

* the pool and the KV budget are SGLang's (132 B per entry);
* the store writes the bytes a CPU emulation of SGLang's fp8 store writes (SGLang's CUDA store kernel itself is
  not compared: it needs a GPU; its RoPE may fuse multiply-adds that cupy_dsa's store and this emulation keep
  separate, so a scale word could differ by one ulp there): the emulation (SGLang's quantization
  ``scale = max(amax, 1e-4) / 448``, ``e4m3(RNE(k * (1 / scale)))``, and SGLang's own page packing
  ``fp8_mqa_logits_make_fused_kv``, at SGLang's plan addressing) applied to the same fp32 key gives the same
  pages, and the stored key is the fp64 index key up to fp8 rounding;
* the top-k of SGLang's forward with cupy_dsa's logits equals the top-k of SGLang's own fp8 forward (its torch
  fp8 logits) up to ties at SGLang's bf16 precision, on decode, varlen extend, grouped verify and small rows,
  and each route is the one the plugin picks;
* PD tag, HiCache namespace, refusals and strictness as for the bf16 modes.
"""
from __future__ import annotations

import os
import types

import torch

from cupy_dsa import rotate_index_k_reference
from cupy_dsa.sglang import core

from checks_indexer import _indexer_setup, one_attention_cp_rank, spied_logits_routes
from checks_store import (call_site_case, decode_case, index_cache, key_f64, prefill_case, store_through_binding,
                          store_through_sglang_call_site)
from checks_strictness import assert_fp8_keyed_store_strictness
from harness import (ENV, INFO, assert_check_command_says, assert_resolution_leaves_environment, check,
                     every_hook_in_place, hicache_model_name, load, make_index_pool, mode_env, resolution_refusal,
                     server_args_from_yaml)

MODE = "fp8-cupy"
FP8_PAGE = 8448


# --------------------------------------------------------------------------------------------------
# SGLang's fp8 store, stood in on CPU (its JIT kernel needs CUDA)
# --------------------------------------------------------------------------------------------------

def sglang_fp8_pages(num_pages, items, kv, w, fc, eps=1e-6):
    """The page rows SGLang's fp8 index-key store leaves in a zeroed cache after writing ``items`` (row of kv,
    out_loc, position): SGLang's per-token quantization of the fp32 key, packed by SGLang's own
    ``fp8_mqa_logits_make_fused_kv`` (values block then fp32 scale block per 64-slot page)."""
    from sglang.srt.layers.attention.dsa.utils import fp8_mqa_logits_make_fused_kv

    codes = torch.zeros(num_pages * 64, 128, dtype=torch.float8_e4m3fn)
    scales = torch.zeros(num_pages * 64, dtype=torch.float32)
    rows = torch.tensor([r for r, _, _ in items])
    locs = torch.tensor([loc for _, loc, _ in items])
    pos = torch.tensor([p for _, _, p in items])
    k = rotate_index_k_reference(kv[rows], pos, w, core.rope_table(fc), eps=eps)  # fp32 [n, 128], the kernel's key
    amax = k.abs().amax(-1)
    scale = torch.maximum(amax, torch.tensor(1e-4)) / torch.tensor(448.0)  # plain fp32, not UE8M0
    inv = torch.tensor(1.0) / scale
    codes[locs] = (k * inv[:, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)  # RNE, saturating
    scales[locs] = scale
    fused = fp8_mqa_logits_make_fused_kv(codes.view(num_pages, 64, 128), scales.view(num_pages, 64), 64, 128)
    return fused.reshape(num_pages, FP8_PAGE)


def assert_sglang_fp8_pages(cache, case):
    """An SGLang fp8 index cache after the hooked store: bytes equal to SGLang's store stand-in, keys equal to the
    fp64 key up to fp8 rounding at exactly the expected slots."""
    assert tuple(cache.shape[1:]) == (FP8_PAGE,), cache.shape
    kv, w, fc, expected = case.kv, case.w, case.fc, case.expected
    want = sglang_fp8_pages(cache.shape[0], expected, kv, w, fc)
    diff = (cache != want).nonzero()
    assert diff.numel() == 0, f"{diff.shape[0]} bytes differ from SGLang's fp8 store, first at (page, byte) {diff[0].tolist()}"
    values = cache[:, :8192].reshape(-1, 128).view(torch.float8_e4m3fn)
    scales = cache[:, 8192:].contiguous().view(torch.float32).reshape(-1)
    written = sorted(int(i) for i in (scales != 0).nonzero().flatten())
    assert written == sorted(loc for _, loc, _ in expected), (written, expected)
    for row, loc, p in expected:
        ref = key_f64(kv[row:row + 1], torch.tensor([p]), w, fc)[0]
        got = values[loc].double() * float(scales[loc])
        err = ((got - ref).abs() - ref.abs() / 16 - 2.0 ** -9 * float(scales[loc])).max().item()
        assert err <= 1e-6, f"slot {loc}: the stored key is not the index key up to fp8 rounding ({err:.3g})"


# --------------------------------------------------------------------------------------------------
# Top-k up to ties
# --------------------------------------------------------------------------------------------------

def _oracle(q, w, pages, page_table, lens):
    """fp64 logits over the fp8 keys as stored (dequantized): [rows, width]."""
    values = pages[:, :8192].reshape(pages.shape[0], 64, 128).view(torch.float8_e4m3fn).double()
    scales = pages[:, 8192:].contiguous().view(torch.float32).double()
    k = (values * scales[..., None])[page_table.long()].reshape(page_table.shape[0], -1, 128)
    logits = (torch.relu(torch.einsum("rhd,rnd->rhn", q.double(), k)) * w.double()[:, :, None]).sum(1)
    return logits


def _setup(**kw):
    """checks_indexer's setup (one set of keys in a bf16 pool and in an SGLang fp8 pool, the rows' q, weights and
    page table, a runner of SGLang's forward), its bf16 pool sized as in a bf16 mode."""
    with mode_env("bf16"):
        return _indexer_setup(**kw)


def _selected(md, r):
    return {int(i) for i in md.c4_sparse_raw_indices[r].tolist() if i >= 0}


def _same_up_to_ties(ours, theirs, oracle, lens, topk, what, tol_rel):
    """Per row: both selections hold the trivial 0..len-1 when len <= topk; otherwise every key in one selection
    and not the other scores within ``tol_rel * max|logit|`` of the oracle's k-th score (a tie at that
    precision), and each selection reaches the oracle's k-th score up to the same tolerance."""
    stats = []
    for r, n in enumerate(lens):
        a, b = _selected(ours, r), _selected(theirs, r)
        k = min(topk, n)
        assert len(a) == k and len(b) == k, (what, r, len(a), len(b), k)
        if n <= topk:
            assert a == b == set(range(n)), (what, r)
            continue
        scores = oracle[r, :n]
        kth = scores.topk(k).values[-1].item()
        tol = tol_rel * scores.abs().max().item()
        for name, sel in (("cupy_dsa", a), ("SGLang", b)):
            worst = scores[sorted(sel)].min().item()
            assert worst >= kth - tol, f"{what} row {r}: {name} selected a key {kth - worst:.3g} below the k-th"
        off = sorted(a ^ b)
        far = [i for i in off if abs(scores[i].item() - kth) > tol]
        assert not far, f"{what} row {r}: selections differ beyond ties at keys {far[:8]} (k-th {kth:.6g})"
        stats.append(len(a & b) / k)
    return stats


def _run_both(mode_, batch, **setup):
    """SGLang's own fp8 forward and the hooked fp8-cupy forward on the same SGLang fp8 pool, q and weights, with
    spies on cupy_dsa's three logits routes: (ours, theirs, oracle, lens, routes taken, page table)."""
    run, _, _, fp8_pool, lens = _setup(**setup)
    with one_attention_cp_rank():
        with mode_env("fp8"):   # SGLang's own forward_c4_indexer (torch fp8 logits: SGLANG_FP8_PAGED_MQA_LOGITS_TORCH=1)
            theirs, page_table = run(fp8_pool, mode_, batch)
        with spied_logits_routes("with fp8-cupy on") as calls:
            ours, _ = run(fp8_pool, mode_, batch)
    q, w = calls[0][1][:2]  # the rows' q and weights, as the hooked forward passed them to cupy_dsa's logits
    oracle = _oracle(q, w, fp8_pool.index_k_with_scale_buffer[0], page_table, lens)
    return ours, theirs, oracle, lens, [route for route, _ in calls], page_table


# SGLang's torch fp8 logits round each head's dot product to bf16 (torch.bmm of bf16): 2^-9 relative per head
SGLANG_TIE = 4e-3


def scenario_fp8cupy():
    load()

    @check
    def hooks_applied_fp8cupy():
        from sglang.srt.environ import envs

        every_hook_in_place()
        assert envs.SGLANG_CUPY_DSA_INDEX_K.get() == MODE and core.index_k_mode() == MODE

    @check
    def pool_and_budget_are_sglangs():
        from sglang.srt.mem_cache import deepseek_v4_memory_pool as mp
        from sglang.srt.model_executor import pool_configurator as pc

        assert hasattr(mp.get_dsv4_indexer_bytes_per_token, "__wrapped__"), "H1 not in place"
        for fn in (mp.get_dsv4_indexer_bytes_per_token, pc.get_dsv4_indexer_bytes_per_token):
            assert fn(128, False) == 132 and fn(128, use_fp4_indexer=True) == 68
        cfg = object.__new__(pc.DSV4PoolConfigurator)
        cfg.c4_shrink_factor = 1
        cfg._get_paged_kv_bytes_per_token = lambda ratio: 0
        cfg.indexer_bytes_per_token = pc.get_dsv4_indexer_bytes_per_token(128, False)
        assert cfg._compressed_bytes_per_full_token(4) == 33  # 132 / 4, as stock
        pool = make_index_pool(layers=2)
        assert [tuple(b.shape) for b in pool.contiguous_page_row_buffers()] == [(44, FP8_PAGE)] * 2
        assert pool.get_bytes_per_token() == 132

    @check
    def store_fp8_decode_plan_matches_sglang():
        case = decode_case()
        case.kv[4] *= 1e-6  # a key whose amax is below 1e-4 (SGLang's scale floor)
        assert_sglang_fp8_pages(store_through_binding(case), case)

    @check
    def store_fp8_prefill_plan_matches_sglang():
        case = prefill_case()
        case.kv[1] *= 300.0  # a large key: the scale carries it, the codes stay in range
        assert_sglang_fp8_pages(store_through_binding(case), case)

    @check
    def store_fp8_via_sglang_call_site():
        case, cache = call_site_case(), index_cache()
        stores = store_through_sglang_call_site(case, cache)
        assert len(stores) == 1 and stores[0]["kvcache"] is cache, "the fp8 index cache did not go to cupy_dsa's store"
        assert_sglang_fp8_pages(cache, case)

    @check
    def store_fp8cupy_strictness():
        assert_fp8_keyed_store_strictness(MODE, (index_cache(),), ("fp8 index cache",))

    @check
    def indexer_topk_matches_sglang_fp8_decode():
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        ours, theirs, oracle, lens, taken, pt = _run_both(ForwardMode.DECODE, 3)
        assert taken == ["paged_logits"], taken
        INFO["fp8cupy_overlap_decode"] = _same_up_to_ties(ours, theirs, oracle, lens, 512, "decode", SGLANG_TIE)
        # cupy_dsa's own selection is the oracle's up to fp32 accumulation
        _same_up_to_ties(ours, ours, oracle, lens, 512, "decode vs oracle", 1e-5)
        raw = ours.c4_sparse_raw_indices.long()
        exp = torch.where(raw >= 0, pt.long().gather(1, raw.clamp(min=0) // 64) * 64 + raw % 64, -1)
        assert torch.equal(ours.c4_sparse_page_indices.long(), exp), "page indices are not SGLang's slot transform"

    @check
    def indexer_topk_matches_sglang_fp8_extend_and_verify():
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        cases = (("extend", ForwardMode.EXTEND, 3, dict(lens=(900, 901, 1300, 600, 601, 602, 2000), groups=(2, 4, 1)),
                  ["extend_logits"]),
                 ("prefill, one request", ForwardMode.EXTEND, 1, dict(lens=(700, 701, 702, 703, 1500),
                                                                      one_request=True), ["extend_logits"]),
                 ("verify n=2", ForwardMode.TARGET_VERIFY, 3,
                  dict(lens=(1000, 1001, 1300, 1301, 1600, 1601), groups=(2, 2, 2)), ["verify_logits"]),
                 ("verify n=4", ForwardMode.TARGET_VERIFY, 2,
                  dict(lens=(1000, 1001, 1001, 1002, 1300, 1301, 1301, 1302), groups=(4, 4)), ["verify_logits"]),
                 ("ragged verify", ForwardMode.TARGET_VERIFY, 2, dict(lens=(900, 901, 902), groups=(2, 1)),
                  ["paged_logits"]))
        for what, mode_, batch, setup, route in cases:
            ours, theirs, oracle, lens, taken, _ = _run_both(mode_, batch, **setup)
            assert taken == route, (what, taken)
            INFO[f"fp8cupy_overlap_{what}"] = _same_up_to_ties(ours, theirs, oracle, lens, 512, what, SGLANG_TIE)

    @check
    def indexer_fp8cupy_small_rows_and_padding():
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        ours, theirs, oracle, lens, *_ = _run_both(ForwardMode.DECODE, 2, lens=(300, 64))
        _same_up_to_ties(ours, theirs, oracle, lens, 512, "small rows", SGLANG_TIE)

    @check
    def indexer_fp8cupy_refuses_a_bf16_pool():
        run, _, bf16_pool, _, _ = _setup(lens=(700, 900))
        try:
            run(bf16_pool)
        except RuntimeError as e:
            assert f"expected uint8 [P, {FP8_PAGE}]" in str(e) and f"{ENV}={MODE}" in str(e), str(e)
        else:
            raise AssertionError("fp8-cupy scored a bf16 pool")

    @check
    def pd_layout_and_hicache_fp8cupy():
        from sglang.kernels.ops.attention.dsv4.kv_layout import KVLayout
        from sglang.srt.disaggregation.utils import get_pd_kv_layout
        from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool
        from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import _dsv4_indexer_regions

        pool = object.__new__(DeepSeekV4TokenToKVPool)
        pool.uniform_fp8 = True
        assert get_pd_kv_layout(pool) == KVLayout.UNIFORM_FP8.value + ",c4idx:fp8-cupy", get_pd_kv_layout(pool)
        with mode_env("fp8"):
            assert get_pd_kv_layout(pool) == KVLayout.UNIFORM_FP8.value
        (region,) = _dsv4_indexer_regions(types.SimpleNamespace(c4_indexer_kv_pool=make_index_pool()), 256)
        assert region.item_bytes == FP8_PAGE and region.page_aligned_only is False, region  # SGLang's, unchanged
        assert hicache_model_name() == "deepseek-ai/DeepSeek-V4_c4idx-fp8-cupy"

    @check
    def resolution_fp8cupy():
        assert_resolution_leaves_environment()
        for fields, fragment in ((dict(enable_deepseek_v4_fp4_indexer=True), "--enable-deepseek-v4-fp4-indexer"),
                                 (dict(enable_nvidia_megakernel=True), "--enable-nvidia-megakernel"),
                                 (dict(device="npu"), "NPU")):
            msg = resolution_refusal(MODE, **fields)
            assert fragment in msg and f"{ENV}={MODE}" in msg and "fp8 C4 index keys on cupy_dsa" in msg, msg

    @check
    def flag_and_yaml_key_take_fp8cupy():
        from sglang.srt.server_args import prepare_server_args

        with mode_env(None):
            prepare_server_args(["--model-path", "dummy", "--cupy-dsa-index-k-dtype", "FP8-Cupy"])
            assert os.environ.get(ENV) == MODE and core.index_k_mode() == MODE, os.environ.get(ENV)
        with mode_env(None):
            server_args_from_yaml("model-path: dummy\ncupy-dsa-index-k-dtype: fp8-cupy\n")
            assert os.environ.get(ENV) == MODE, os.environ.get(ENV)

    @check
    def check_command_describes_fp8cupy():
        assert_check_command_says(MODE, ("SGLang's fp8 C4 index keys on cupy_dsa's store and kernels (132 B per entry)",
                                         "query: SGLang's fused fp8 q"))
