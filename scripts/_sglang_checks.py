"""Plugin checks against SGLang 0.5.23's real classes, run in a fresh process per scenario.

``python scripts/_sglang_checks.py <scenario>`` loads plugins the way SGLang's processes do
(``sglang.srt.plugins.load_plugins()``), runs every check of the scenario (each isolated: one failing
check does not hide the others) and prints one ``RESULTS_JSON:`` line. SGLang's hook registry cannot be
undone, hence one process per scenario; tests/test_sglang_plugin.py runs the scenarios and asserts.

Scenarios (the environment is set by the caller):
  on        SGLANG_CUPY_DSA_INDEX_K=bf16, SGLANG_PLUGINS=cupy_dsa: every hook, recall, guards
  off       switch unset, SGLANG_PLUGINS unset: SGLang unchanged; CLI flag and YAML key
  excluded  switch on but SGLANG_PLUGINS names another plugin only: nothing installed
"""
from __future__ import annotations

import functools
import json
import os
import sys
import tempfile
import traceback
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _sglang_env  # noqa: E402

_sglang_env.install()

import torch  # noqa: E402

from cupy_dsa.sglang import core, forward, guard, hooks  # noqa: E402  (none imports SGLang)

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


class mode_env:
    """Temporarily set the switch (the plugin caches it per process: reset the cache on entry and exit)."""

    def __init__(self, value):
        self.value = value

    def __enter__(self):
        self.old = os.environ.get(ENV)
        if self.value is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = self.value
        core.reset_mode()

    def __exit__(self, *exc):
        if self.old is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = self.old
        core.reset_mode()


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


# ==================================================================================================
# Scenario "on"
# ==================================================================================================

def _plan_rows(fields):
    """uint8 [N, 16] plan rows from per-row (u32, i32/u16 pair, i32, i32) little-endian words."""
    import numpy as np

    arr = np.zeros((len(fields), 16), dtype=np.uint8)
    for i, (w0, w1, w2, w3) in enumerate(fields):
        arr[i] = np.frombuffer(np.array([w0], "<u4").tobytes() + w1 + np.array([w2, w3], "<i4").tobytes(),
                               dtype=np.uint8)
    return torch.from_numpy(arr)


def _i32(v):
    import numpy as np

    return np.array([v], "<i4").tobytes()


def _u16x2(a, b):
    import numpy as np

    return np.array([a, b], "<u2").tobytes()


def _key_f64(kv, pos, w, fc, eps=1e-6):
    """Independent float64 index key: RMSNorm, interleaved RoPE on dims 64..127, Hadamard-128 / sqrt(128)."""
    x = kv.double()
    x = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w.double()
    rot = torch.view_as_complex(x[:, 64:].reshape(-1, 32, 2).contiguous())
    rot = rot * fc[pos].to(torch.complex128)
    x = torch.cat([x[:, :64], torch.view_as_real(rot).reshape(-1, 64)], dim=1)
    h = torch.ones(1, 1, dtype=torch.float64)
    for _ in range(7):
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return x @ h.T / 128 ** 0.5


def _store_inputs(n, max_pos=512):
    kv = torch.randn(n, 128)
    w = torch.rand(128) + 0.5
    ang = torch.rand(max_pos, 32) * 6.28
    fc = torch.polar(torch.ones_like(ang), ang)
    return kv, w, fc


def _check_store(plan, kv, w, fc, out_loc, expected):
    """Run the hooked store (through compressor_v2's binding, as SGLang calls it) and compare."""
    from sglang.srt.layers.attention.dsv4 import compressor_v2

    pool = make_index_pool(size=256)
    cache = pool.index_k_with_scale_buffer[0]
    compressor_v2.compress_norm_rope_store(kv, plan, norm_weight=w, norm_eps=1e-6, freq_cis=fc, out_loc=out_loc,
                                          kvcache=cache, page_size=64)
    flat = cache.view(torch.bfloat16).view(-1, 128)
    written = sorted(int(i) for i in (cache.view(-1, 256) != 0).any(1).nonzero().flatten())
    assert written == sorted(loc for _, loc, _ in expected), f"written slots {written}, expected {expected}"
    for row, loc, pos in expected:
        ref = _key_f64(kv[row:row + 1], torch.tensor([pos]), w, fc)[0]
        got = flat[loc].double()
        err = (got - ref).abs().max().item()
        assert err <= 1e-2 * ref.abs().max().item() + 1e-3, f"slot {loc}: max error {err:.3g}"


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

        kv, w, fc = _store_inputs(4)
        seq = [8, 9, 12, 400]
        plan = CompressorDecodePlan(4, _plan_rows([(s, _i32(0), 0, 0) for s in seq]))
        out_loc = torch.tensor([5, 6, 7, 70], dtype=torch.int64)
        # seq_len 9 is not a compression boundary: skipped; position = seq_len - 4
        _check_store(plan, kv, w, fc, out_loc, [(0, 5, 4), (2, 7, 8), (3, 70, 396)])

    @check
    def store_prefill_plan():
        from sglang.kernels.ops.attention.dsv4.compress import CompressorPrefillPlan

        kv, w, fc = _store_inputs(4)
        rows = [(4, 2), (0xFFFFFFFF, 0), (16, 5), (64, 1)]
        plan = CompressorPrefillPlan(4, _plan_rows([(s, _u16x2(r, 4), 0, 0) for s, r in rows]),
                                     torch.zeros(4, 8, dtype=torch.uint8))
        out_loc = torch.tensor([100, 101, 102, 103, 104, 105, 106, 107], dtype=torch.int64)
        # invalid entry skipped; location = out_loc[ragged_id]
        _check_store(plan, kv, w, fc, out_loc, [(0, 102, 0), (2, 105, 12), (3, 101, 60)])

    @check
    def store_via_sglang_call_site():
        # SGLang's own CompressorBackendMixin._forward_compress_all_in_one (indexer branch) with its CUDA-JIT
        # compress_forward replaced by a stand-in that returns the compressed rows: the hooked store must
        # accept exactly the keywords SGLang passes and write the planned slots.
        from sglang.kernels.ops.attention.dsv4.compress import CompressorDecodePlan
        from sglang.srt.layers.attention.dsv4 import compressor_v2

        kv, w, fc = _store_inputs(3)
        plan = CompressorDecodePlan(4, _plan_rows([(s, _i32(0), 0, 0) for s in (16, 18, 20)]))
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
            ref = _key_f64(kv[row:row + 1], torch.tensor([pos]), w, fc)[0]
            err = (cache.view(torch.bfloat16).view(-1, 128)[loc].double() - ref).abs().max().item()
            assert err <= 1e-2 * ref.abs().max().item() + 1e-3, f"slot {loc}: max error {err:.3g}"

    @check
    def store_fp4sim():
        from sglang.kernels.ops.attention.dsv4.compress import CompressorDecodePlan
        from sglang.srt.layers.attention.dsv4 import compressor_v2

        kv, w, fc = _store_inputs(2)
        plan = CompressorDecodePlan(4, _plan_rows([(8, _i32(0), 0, 0), (12, _i32(0), 0, 0)]))
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

    _indexer_checks()
    _guard_checks()
    _strictness_checks()


# --------------------------------------------------------------------------------------------------
# Never the wrong format; the switch is read once; off means SGLang's own code
# --------------------------------------------------------------------------------------------------

class Spy:
    def __init__(self):
        self.calls = []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return "original"


def _store_call(cache, **extra):
    from sglang.kernels.ops.attention.dsv4.compress import CompressorDecodePlan

    kv, w, fc = _store_inputs(2)
    plan = CompressorDecodePlan(4, _plan_rows([(8, _i32(0), 0, 0), (12, _i32(0), 0, 0)]))
    kw = dict(norm_weight=w, norm_eps=1e-6, freq_cis=fc, out_loc=torch.tensor([3, 9]), kvcache=cache, page_size=64)
    kw.update(extra)
    return kv, plan, kw


def _strictness_checks():
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


# --------------------------------------------------------------------------------------------------
# forward_c4_indexer: SGLang's own (fp8) vs hooked (bf16)
# --------------------------------------------------------------------------------------------------

def _indexer_setup(lens=(2000, 1500, 2560), topk=512, seed=None, one_request=False, groups=None, reference=False):
    """groups: rows per request (consecutive rows of a request share its page table), as SGLang lays out an
    extend or a verify batch; one_request = one group of every row. reference: the bf16 pool holds FP4-simulated
    keys, the indexer layer has SGLang's projections (bf16 wq_b output and weights_proj output, the RoPE table)
    for bf16-reference to build its query from, and the oracle is DeepSeek-V4's reference numerics in fp64."""
    if seed is None:
        seed = int(os.environ.get("CUPY_DSA_SEED", "0"))
    from sglang.srt.layers.attention.dsa.dsa_topk_backend import DSATopKBackend
    from sglang.srt.layers.attention.dsv4.indexer import C4IndexerBackendMixin
    from sglang.srt.layers.attention.dsv4.metadata import PagedIndexerMetadata
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    g = torch.Generator().manual_seed(seed)
    n_slots, n_pages = 2560, 40
    keys = torch.randn(n_slots, 128, generator=g)                      # slot = loc; pages 0..39 used
    bf16_pool = make_index_pool()
    if reference:  # the fp4sim store's output (the store itself is checked against its oracle elsewhere)
        from cupy_dsa import fp4sim_reference
        keys = fp4sim_reference(keys).float()
    bf16_pool.index_k_with_scale_buffer[0].view(torch.bfloat16).view(-1, 128)[:n_slots] = keys.bfloat16()
    with mode_env("fp8"):
        fp8_pool = make_index_pool()
    page = fp8_pool.index_k_with_scale_buffer[0].view(-1, 8448)
    scale = keys.abs().amax(-1).clamp_min(1e-4) / 448.0
    codes = (keys / scale[:, None]).to(torch.float8_e4m3fn).view(torch.uint8)
    page[:n_pages, :8192].view(n_pages, 64, 128)[:] = codes.view(n_pages, 64, 128)
    page[:n_pages, 8192:].view(torch.float32).view(n_pages, 64)[:] = scale.view(n_pages, 64)

    rows = len(lens)
    q = torch.randn(rows, 64, 128, generator=g).to(torch.float8_e4m3fn)
    w = torch.rand(rows, 64, generator=g)
    page_table = torch.stack([torch.randperm(n_pages, generator=g) for _ in range(rows)]).to(torch.int32)
    if one_request:
        groups = (rows,)
    if groups is not None:  # rows of one request share its page table
        assert sum(groups) == rows
        first = torch.repeat_interleave(torch.tensor([sum(groups[:i]) for i in range(len(groups))]),
                                        torch.tensor(groups))
        page_table = page_table[first].contiguous()
    seq_lens = torch.tensor(lens, dtype=torch.int32)

    # the reference: top-k of fp32-key logits over each row's pages
    kr = keys.view(n_pages, 64, 128)[page_table.long()].reshape(rows, -1, 128)
    c4 = types.SimpleNamespace(layer_id=0, use_fp4_indexer=False, index_topk=topk)
    if reference:
        q, w, c4 = _reference_layer(c4, rows, g)
        kr = kr.double()
    ref_logits = (torch.relu(torch.einsum("rhd,rnd->rhn", q.to(kr.dtype), kr)) * w[:, :, None].to(kr.dtype)).sum(1)
    ref_sets = []
    for r in range(rows):
        ref_sets.append(set(ref_logits[r, :lens[r]].topk(min(topk, lens[r])).indices.tolist()))

    class Pool:
        def __init__(self, inner):
            self.inner = inner
            self.layer_mapping = {0: types.SimpleNamespace(compress_layer_id=0)}

        def get_index_k_with_scale_buffer(self, layer_id):
            return self.inner.get_index_k_with_scale_buffer(layer_id)

    class Backend(C4IndexerBackendMixin):
        def __init__(self, pool, mode_, batch):
            super().__init__()
            self.dsa_topk_backend = DSATopKBackend.TORCH
            self.token_to_kv_pool = Pool(pool)
            self.hisparse_coordinator = None
            im = PagedIndexerMetadata(page_size=256, compressed_page_size=64, page_table=page_table,
                                      compressed_seq_lens=seq_lens, use_topk_v2=False)
            cm = types.SimpleNamespace(positions=torch.arange(rows), c4_sparse_raw_indices=torch.full(
                (rows, topk), -1, dtype=torch.int32), c4_sparse_page_indices=torch.full((rows, topk), -1,
                                                                                        dtype=torch.int32))
            self.forward_metadata = types.SimpleNamespace(indexer_metadata=im, core_metadata=cm)
            self.forward_batch = types.SimpleNamespace(forward_mode=mode_, batch_size=batch,
                                                       _original_forward_mode=None, tbo_parent_token_range=None)
            if groups is not None:
                self.forward_batch.extend_seq_lens = torch.tensor(groups, dtype=torch.int32)
                self.forward_batch.extend_seq_lens_cpu = list(groups)
                self.speculative_num_draft_tokens = groups[0]

        def _forward_prepare_normal(self, **kw):
            return q, w[:, :, None]

        def forward_indexer_compressor(self, **kw):  # keys are in the pool already
            pass

    def run(pool, mode_=ForwardMode.DECODE, batch=rows):
        b = Backend(pool, mode_, batch)
        x = torch.zeros(rows, 16)
        b.forward_c4_indexer(x, x, c4, b.forward_batch)
        return b.forward_metadata.core_metadata, page_table

    if reference:
        return run, ref_logits, bf16_pool, lens
    return run, ref_sets, bf16_pool, fp8_pool, lens


def _reference_layer(c4, rows, g, max_pos=4096):
    """An indexer layer with SGLang's projections for bf16-reference, and the fp64 oracle of DeepSeek-V4's
    reference query: (q_ref [rows, 64, 128] fp64 of FP4-simulated values, w_ref [rows, 64] fp64, layer)."""
    from cupy_dsa import fp4sim_reference

    q_raw = torch.randn(rows, 64, 128, generator=g).bfloat16()          # wq_b's output
    w_raw = torch.rand(rows, 64, generator=g).bfloat16()                # weights_proj's output
    angles = torch.outer(torch.arange(max_pos, dtype=torch.float64), 1.6e5 ** (-torch.arange(32) / 32.0))
    freqs_cis = torch.polar(torch.ones_like(angles), angles).to(torch.complex64)
    weight_scale = 128 ** -0.5 * 64 ** -0.5
    layer = types.SimpleNamespace(
        **vars(c4), n_local_heads=64, head_dim=128, freqs_cis=freqs_cis, weight_scale=weight_scale, compressor=None,
        compute_weights=lambda x, skip_scale=False: w_raw, wq_b=lambda a: (q_raw.reshape(rows, -1), None))
    # oracle: complex RoPE of the trailing 64 dims at the row's position, Sylvester Hadamard, FP4 rounding
    z = q_raw.double().clone()
    pairs = torch.view_as_complex(z[..., 64:].reshape(rows, 64, 32, 2).contiguous())
    z[..., 64:] = torch.view_as_real(pairs * freqs_cis[:rows].to(torch.complex128)[:, None, :]).reshape(rows, 64, 64)
    i = torch.arange(128)
    bits = i[:, None] & i[None, :]
    parity = sum(((bits >> b) & 1) for b in range(7)) % 2
    had = (1 - 2 * parity).double() / 128 ** 0.5
    q_ref = fp4sim_reference((z @ had).float()).double()
    return q_ref, w_raw.double() * weight_scale, layer


def _recall(raw, ref_sets):
    out = []
    for r, ref in enumerate(ref_sets):
        got = {int(i) for i in raw[r].tolist() if i >= 0}
        out.append(len(got & ref) / len(ref))
    return out


def _indexer_checks():

    @check
    def indexer_recall_bf16_vs_fp8():
        run, ref_sets, bf16_pool, fp8_pool, lens = _indexer_setup()
        with mode_env("fp8"):  # the hook delegates to SGLang's own body (fp8 torch logits)
            fp8_md, _ = run(fp8_pool)
        bf16_md, page_table = run(bf16_pool)
        r8, r16 = _recall(fp8_md.c4_sparse_raw_indices, ref_sets), _recall(bf16_md.c4_sparse_raw_indices, ref_sets)
        INFO["recall_fp8"], INFO["recall_bf16"] = r8, r16
        assert all(b >= f for b, f in zip(r16, r8)), f"bf16 recall {r16} below fp8 recall {r8}"
        assert min(r16) >= 0.99, f"bf16 recall {r16}"
        # page indices are SGLang's slot transform of the raw indices
        raw = bf16_md.c4_sparse_raw_indices.long()
        exp = torch.where(raw >= 0, page_table.long().gather(1, (raw.clamp(min=0) // 64)) * 64 + raw % 64, -1)
        assert torch.equal(bf16_md.c4_sparse_page_indices.long(), exp)

    def _route_run(mode_, batch, **setup):
        """Run the hooked forward in mode_ with spies on the three logits routes; (metadata, routes taken, the
        top-k of the same rows through the one-row-per-token route)."""
        from sglang.srt.layers.attention.dsv4 import indexer as ix
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        run, _, bf16_pool, _, _ = _indexer_setup(**setup)
        rows_md, _ = run(bf16_pool)  # DECODE: every row its own request (SGLang's paged path as it calls it)
        taken = []
        real = {name: getattr(hooks.core, name) for name in ("paged_logits", "verify_logits", "extend_logits")}

        def spy(name):
            def f(*a, **k):
                taken.append(name)
                return real[name](*a, **k)
            return f

        def nonpaged_reader(*a, **k):
            raise AssertionError("SGLang's fp8 non-paged reader was consulted with bf16 keys")

        orig_gp = ix.get_parallel
        mixin = ix.C4IndexerBackendMixin
        orig_np = mixin._can_use_nonpaged_indexer, mixin._get_nonpaged_indexer_plan
        for name in real:
            setattr(hooks.core, name, spy(name))
        ix.get_parallel = lambda: types.SimpleNamespace(attn_cp_size=1)
        mixin._can_use_nonpaged_indexer = mixin._get_nonpaged_indexer_plan = nonpaged_reader
        try:
            md, _ = run(bf16_pool, mode_, batch)
        finally:
            for name, f in real.items():
                setattr(hooks.core, name, f)
            ix.get_parallel = orig_gp
            mixin._can_use_nonpaged_indexer, mixin._get_nonpaged_indexer_plan = orig_np
        got = [set(r.tolist()) - {-1} for r in md.c4_sparse_raw_indices]
        exp = [set(r.tolist()) - {-1} for r in rows_md.c4_sparse_raw_indices]
        return got, exp, taken

    @check
    def indexer_extend_varlen_path():
        # a multi-request extend (3 requests, one of one row) runs as one varlen mqa_logits launch; a single
        # request above SGLang's non-paged threshold too (the fp8 non-paged reader is never consulted)
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        assert "SGLANG_OPT_DSV4_NONPAGED_INDEXER" not in os.environ
        lens = (900, 901, 1300, 600, 601, 602, 2000)
        got, exp, taken = _route_run(ForwardMode.EXTEND, 3, lens=lens, groups=(2, 4, 1))
        assert taken == ["extend_logits"], taken
        assert got == exp, "varlen top-k differs from the one-row-per-token top-k"
        got, exp, taken = _route_run(ForwardMode.EXTEND, 1, lens=(700, 701, 702, 703, 1500), one_request=True)
        assert taken == ["extend_logits"] and got == exp, taken

    @check
    def indexer_verify_grouped_path():
        # uniform target verify (n draft rows per request, one page-table row each) runs as next_n = n requests
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        for n in (2, 4):
            lens = tuple(1000 + 300 * b + (r + 1) // 2 for b in range(3) for r in range(n))
            got, exp, taken = _route_run(ForwardMode.TARGET_VERIFY, 3, lens=lens, groups=(n,) * 3)
            assert taken == ["verify_logits"], (n, taken)
            assert got == exp, f"grouped verify (n={n}) top-k differs from the one-row-per-token top-k"
        # rows that are not whole requests of n: the one-row-per-token route
        got, exp, taken = _route_run(ForwardMode.TARGET_VERIFY, 2, lens=(900, 901, 902), groups=(2, 1))
        assert taken == ["paged_logits"] and got == exp, taken

    @check
    def indexer_reference_mode_matches_the_reference_oracle():
        # bf16-reference through SGLang's forward: the query from the layer's projections (prepare_index_q), FP4
        # keys, on the decode, varlen extend and grouped verify routes; top-k = the fp64 oracle's up to ties
        from sglang.srt.layers.attention.dsv4 import indexer as ix
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        cases = ((ForwardMode.DECODE, dict(lens=(2000, 1500, 2560))),
                 (ForwardMode.EXTEND, dict(lens=(900, 901, 1300, 600, 601, 602, 2000), groups=(2, 4, 1))),
                 (ForwardMode.TARGET_VERIFY, dict(lens=(1000, 1001, 1300, 1301), groups=(2, 2))))
        orig_gp = ix.get_parallel
        ix.get_parallel = lambda: types.SimpleNamespace(attn_cp_size=1)
        try:
            with mode_env("bf16-reference"):
                for mode_, setup in cases:
                    run, oracle, pool, lens = _indexer_setup(reference=True, **setup)
                    md, _ = run(pool, mode_, len(setup.get("groups", lens)))
                    for r, n in enumerate(lens):
                        got = [int(i) for i in md.c4_sparse_raw_indices[r].tolist() if i >= 0]
                        k = min(512, n)
                        assert len(got) == k == len(set(got)), (mode_, r, len(got))
                        scores = oracle[r, :n]
                        kth = scores.topk(k).values[-1]
                        worst = scores[got].min()
                        # selected keys score at least the oracle's k-th, up to fp32-accumulation ties
                        assert worst >= kth - 1e-5 * scores.abs().max(), (mode_, r, float(worst), float(kth))
        finally:
            ix.get_parallel = orig_gp

    @check
    def indexer_small_rows_and_padding():
        # rows with len <= topk select 0..len-1; metadata with fewer rows than queries is padded (len 1)
        run, _, bf16_pool, _, _ = _indexer_setup(lens=(300, 64), topk=512)
        md, _ = run(bf16_pool)
        raw = md.c4_sparse_raw_indices
        assert sorted(x for x in raw[0].tolist() if x >= 0) == list(range(300))
        assert sorted(x for x in raw[1].tolist() if x >= 0) == list(range(64))

    @check
    def indexer_hisparse_and_capturer():
        from sglang.srt.layers.attention.dsv4 import indexer as ix
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        run, _, bf16_pool, _, _ = _indexer_setup(lens=(700, 900))
        seen = {}

        class Coordinator:
            raw_indices_buffer = torch.full((8, 512), -7, dtype=torch.int32)

            def swap_in_selected_pages(self, **kw):
                seen["swap"] = kw
                return torch.full((2, 512), 42, dtype=torch.int32)

        class Capturer:
            def capture(self, layer, raw):
                seen["capture"] = (layer, raw)


        orig_cap, orig_fwd = ix.get_global_indexer_capturer, forward.forward_c4_indexer_bf16
        holder = {}

        def with_hisparse(self, **kw):
            # same setup in decode mode, plus a HiSparse coordinator and no prefill raw-index buffer
            self.hisparse_coordinator = Coordinator()
            self.forward_metadata.core_metadata.c4_sparse_raw_indices = None
            kw["forward_batch"].req_pool_indices = torch.tensor([3, 4])
            holder["b"] = self
            return orig_fwd(self, **kw)

        ix.get_global_indexer_capturer = lambda: Capturer()
        forward.forward_c4_indexer_bf16 = with_hisparse
        try:
            run(bf16_pool, ForwardMode.DECODE)
        finally:
            ix.get_global_indexer_capturer, forward.forward_c4_indexer_bf16 = orig_cap, orig_fwd
        b = holder["b"]
        md = b.forward_metadata.core_metadata
        assert torch.equal(md.c4_sparse_page_indices, torch.full((2, 512), 42, dtype=torch.int32))
        raw = seen["swap"]["top_k_result"]
        assert raw.shape == (2, 512) and (raw >= 0).all(), "HiSparse did not get the raw top-k buffer"
        assert seen["swap"]["layer_id"] == 0 and torch.equal(seen["swap"]["req_pool_indices"], torch.tensor([3, 4]))
        assert seen["capture"][0] == 0 and seen["capture"][1] is raw


# --------------------------------------------------------------------------------------------------
# Guards: PD layout, HiCache, configuration refusals
# --------------------------------------------------------------------------------------------------

def _guard_checks():
    @check
    def pd_layout_mismatch_refused():
        from sglang.kernels.ops.attention.dsv4.kv_layout import KVLayout
        from sglang.srt.disaggregation.common import conn
        from sglang.srt.disaggregation.utils import get_pd_kv_layout
        from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool

        pool = object.__new__(DeepSeekV4TokenToKVPool)
        pool.uniform_fp8 = True
        bf16_layout = get_pd_kv_layout(pool)
        assert bf16_layout == KVLayout.UNIFORM_FP8.value + ",c4idx:bf16", bf16_layout
        with mode_env("fp8"):
            fp8_layout = get_pd_kv_layout(pool)
        assert fp8_layout == KVLayout.UNIFORM_FP8.value

        def decode_side(local_layout, prefill_layout):
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

        try:
            decode_side(fp8_layout, bf16_layout)
        except RuntimeError as e:
            assert "KV layout mismatch" in str(e) and "c4idx:bf16" in str(e), str(e)
        else:
            raise AssertionError("an fp8 decode peer accepted a bf16 prefill peer")
        try:
            decode_side(bf16_layout, bf16_layout)
        except RuntimeError as e:
            assert "KV layout mismatch" not in str(e), str(e)
        except Exception:
            pass  # later checks of the handshake need a real manager; the layout check passed

    @check
    def hicache_guards():
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
        from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import _dsv4_indexer_regions

        bf16_pool = make_index_pool()
        (region,) = _dsv4_indexer_regions(types.SimpleNamespace(c4_indexer_kv_pool=bf16_pool), 256)
        assert region.item_bytes == 16384 and region.page_aligned_only is True, region
        with mode_env("fp8"):
            fp8_pool = make_index_pool()
            (region,) = _dsv4_indexer_regions(types.SimpleNamespace(c4_indexer_kv_pool=fp8_pool), 256)
        assert region.item_bytes == 8448 and region.page_aligned_only is False, region
        kw = dict(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=True,
                  enable_storage_metrics=False, is_page_first_layout=False, model_name="deepseek-ai/DeepSeek-V4")
        assert HiCacheStorageConfig(**kw).model_name == "deepseek-ai/DeepSeek-V4_c4idx-bf16"
        with mode_env("fp8"):
            assert HiCacheStorageConfig(**kw).model_name == "deepseek-ai/DeepSeek-V4"

    def run_resolution(**fields):
        from sglang.srt.arg_groups.resolution_hooks import run_hook
        from sglang.srt.server_args import ServerArgs

        def handle_model_specific_adjustments(server_args):
            server_args._builtin_ran = True

        sa = ServerArgs(model_path="dummy", **fields)
        run_hook(handle_model_specific_adjustments, sa)
        assert sa._builtin_ran, "SGLang's own step must run first"
        return sa

    def refused(fragment, **fields):
        try:
            run_resolution(**fields)
        except ValueError as e:
            msg = str(e)
            assert fragment in msg and ENV in msg, msg
            INFO.setdefault("refusals", []).append(msg)
            return
        raise AssertionError(f"configuration {fields} was not refused")

    @check
    def resolution_accepts_without_env_writes():
        before = dict(os.environ)
        run_resolution()
        changed = {k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k)}
        assert not changed, f"the resolution hook wrote the environment: {changed}"

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
            run_resolution()
        except StartupRefused as e:
            assert "found SGLang 0.5.22" in str(e), str(e)
        else:
            raise AssertionError("the launcher accepted bf16 on SGLang 0.5.22")
        finally:
            guard.sglang_version = orig


# ==================================================================================================
# Scenario "off": SGLang unchanged; the CLI flag and the YAML key set the switch
# ==================================================================================================

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
        from sglang.srt.server_args import prepare_server_args

        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
            f.write("model-path: dummy\ncupy-dsa-index-k-dtype: bf16-fp4sim\n")
        try:
            with mode_env(None):
                prepare_server_args(["--config", f.name])
                assert os.environ.get(ENV) == "bf16-fp4sim", os.environ.get(ENV)
        finally:
            os.unlink(f.name)


# ==================================================================================================
# Scenario "excluded": SGLANG_PLUGINS does not list cupy_dsa
# ==================================================================================================

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


# ==================================================================================================
# Scenario "refusals": start-up stops cleanly and nothing stays patched (one process: every refusal undoes
# everything, which the last check proves by registering successfully afterwards)
# ==================================================================================================

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
                                 f"the {len(applied) or 8} hook(s) applied before it were undone")
        finally:
            HookRegistry._apply_target = classmethod(real)
        assert len(applied) == 8, applied
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
                                 "the 8 hook(s) applied before it were undone, and so was its own partial patch")
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
        missing = [t for t in hooks.ALWAYS_TARGETS + hooks.SWITCHED_TARGETS if not patched(t)]
        assert not missing, missing
        from sglang.srt.mem_cache import deepseek_v4_memory_pool as mp
        from sglang.srt.model_executor import pool_configurator as pc

        assert pc.get_dsv4_indexer_bytes_per_token(128, False) == 256
        assert mp.get_dsv4_indexer_bytes_per_token(128, False) == 256


def fingerprint():
    """Print the installed SGLang's fingerprint (to review and paste into guard.FINGERPRINT)."""
    for path, value in guard.fingerprint_table().items():
        print(f"    {path!r}: {value!r},")


def refuse_installed():
    """The installed SGLang (e.g. another version layered on PYTHONPATH), switch on: load_plugins() must
    stop start-up; prints the message. Exit status 3 if it did not."""
    from sglang.srt.plugins import load_plugins

    load_plugins()
    print("NOT REFUSED", flush=True)
    sys.exit(3)


if __name__ == "__main__":
    torch.manual_seed(int(os.environ.get("CUPY_DSA_SEED", "0")))
    if sys.argv[1] in ("fingerprint", "refuse_installed"):
        {"fingerprint": fingerprint, "refuse_installed": refuse_installed}[sys.argv[1]]()
        sys.exit(0)
    {"on": scenario_on, "off": scenario_off, "excluded": scenario_excluded,
     "refusals": scenario_refusals}[sys.argv[1]]()
    print("RESULTS_JSON:" + json.dumps({"results": RESULTS, "info": INFO}), flush=True)
