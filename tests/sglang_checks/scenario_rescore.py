"""Scenario "rescore": SGLANG_CUPY_DSA_INDEX_K=fp8-rescore, SGLANG_PLUGINS=cupy_dsa: two-level index keys (SGLang's
fp8 page in SGLang's own pool buffer, an int8 residual page beside it) and the two-stage top-k, through SGLang's
real classes.

* the KV budget counts 264 B per entry; SGLang's pool buffer keeps its fp8 rows and a lo buffer of the same shape
  sits beside it; PD registers both;
* the store writes, in one call, SGLang's fp8 bytes (its store stood in, as in the fp8cupy scenario) and the
  residual page of cupy_dsa.rescore's reference;
* the top-k of SGLang's forward (stage 1 from SGLang's own fp8 logits call, or from cupy_dsa's fp8 kernels on the
  plugin's routes) equals ``rescore_topk_reference`` on decode, varlen extend, one-request prefill, grouped and
  ragged verify and small rows, equals the exact top-k where the keys leave no tie at the two-level precision;
  SGLang's own top-k (its transform) is never called, and with stage 1 from SGLang its kernel picks the K'
  candidates (raw positions, k = K'; the CUDA-only kernel stood in by a torch one of the same contract);
* PD tag and pairing, HiCache regions and namespace, a HiCache backup and load of both pages through SGLang's
  host pools (checks_hicache), refusals, flags and the check command.
"""
from __future__ import annotations

import contextlib
import os
import types

import torch

from cupy_dsa import rotate_index_k_reference
from cupy_dsa.rescore import residual_encode_reference, rescore_topk_reference, store_two_level_reference
from cupy_dsa.sglang import core, forward, hooks

from checks_guard import assert_pd_layout_accepted, pd_decode_handshake
from checks_indexer import _indexer_setup, hisparse_decode, one_attention_cp_rank, spied_logits_routes
from checks_store import (call_site_case, decode_case, prefill_case, store_through_binding,
                          store_through_sglang_call_site)
from checks_strictness import _store_call, assert_fp8_keyed_store_strictness, assert_hook_refuses
from harness import (ENV, INFO, assert_argparse_rejects, assert_check_command_says, assert_refused,
                     assert_resolution_leaves_environment, check, every_hook_in_place, forward_cases,
                     hicache_model_name, load, make_index_pool, mode_env, resolution_refusal, run_resolution,
                     server_args_from_yaml)
from scenario_fp8cupy import assert_sglang_fp8_pages

MODE = "fp8-rescore"
FP8_PAGE = 8448
STAGE1, KPRIME, STAGE2_Q = core.RESCORE_STAGE1_ENV, core.RESCORE_KPRIME_ENV, core.QUERY_ENV


def settings_env(stage1=None, kprime=None, stage2_q=None):
    """fp8-rescore's settings and the query setting (its stage-2 query) for a block (None: unset; read once per
    process: the cache is reset on entry and exit)."""
    return core.env_vars({STAGE1: stage1, KPRIME: kprime, STAGE2_Q: stage2_q})


# --------------------------------------------------------------------------------------------------
# Store: hi = SGLang's fp8 bytes, lo = the reference residual
# --------------------------------------------------------------------------------------------------

def rescore_cache():
    """Layer 0's hi pages of a fresh fp8-rescore pool and their lo pages."""
    pool = make_index_pool(size=256)
    return pool.index_k_with_scale_buffer[0], pool.index_k_lo_buffer[0]


def assert_two_level_pages(hi, lo, case):
    """hi: byte-identical to the CPU emulation of SGLang's fp8 store (its CUDA kernel is not run here); lo: byte-identical to cupy_dsa.rescore's reference store of
    the same fp32 keys, and untouched (zero) elsewhere."""
    assert_sglang_fp8_pages(hi, case)
    rows = torch.tensor([r for r, _, _ in case.expected])
    locs = torch.tensor([loc for _, loc, _ in case.expected])
    pos = torch.tensor([p for _, _, p in case.expected])
    k = rotate_index_k_reference(case.kv[rows], pos, case.w, core.rope_table(case.fc), eps=1e-6)
    want_hi, want_lo = torch.zeros_like(hi), torch.zeros_like(lo)
    store_two_level_reference(k, want_hi, want_lo, locs)
    assert torch.equal(hi, want_hi), "hi pages differ from the two-level reference's fp8 page"
    diff = (lo != want_lo).nonzero()
    assert diff.numel() == 0, f"{diff.shape[0]} lo bytes differ from the reference, first at {diff[0].tolist()}"
    _, _, codes, scales = residual_encode_reference(k)
    got = lo[:, :8192].reshape(-1, 128).view(torch.int8)[locs]
    assert torch.equal(got, codes), "lo codes are not the residual's int8 codes"
    assert torch.equal(lo[:, 8192:].contiguous().view(torch.float32).reshape(-1)[locs], scales)


# --------------------------------------------------------------------------------------------------
# Top-k: the reference, the exact oracle, the routes
# --------------------------------------------------------------------------------------------------

def _oracle_exact(ns):
    """fp64 logits of the fp32 keys (before any rounding), [rows, width]."""
    k = ns.keys.double().view(40, 64, 128)[ns.page_table.long()].reshape(ns.page_table.shape[0], -1, 128)
    return (torch.relu(torch.einsum("rhd,rnd->rhn", ns.q.double(), k)) * ns.w.double()[:, :, None]).sum(1)


def _reference(ns, k_prime=None, stage1_logits=None):
    """rescore_topk_reference of the rows, each its own request (1-D lengths, its own page-table row)."""
    hi, lo = ns.pool.index_k_with_scale_buffer[0], ns.pool.index_k_lo_buffer[0]
    lens = torch.tensor(ns.lens, dtype=torch.int32)
    return rescore_topk_reference(ns.q.unsqueeze(1), ns.w, hi, lo, lens, ns.page_table, ns.topk, k_prime,
                                  stage1_logits=stage1_logits)


def _sglang_topk_stand_in(picks):
    """SGLang's v2 / v1 top-k of the raw-position contract (the kernels are CUDA JIT), stood in on the CPU: each row's
    k greatest scores among its first len columns (ties to the lower position) as positions in a scrambled
    order (the kernels write in arrival order), -1 padded; each call recorded in ``picks`` (kernel, k, whether a
    page table was passed)."""
    def top(scores, lens, out):
        k = out.shape[1]
        out.fill_(-1)
        for r in range(scores.shape[0]):
            n = int(lens[r])
            order = torch.sort(scores[r, :n], descending=True, stable=True).indices[:k]
            out[r, :len(order)] = order.flip(0).to(torch.int32)   # not in position or score order

    def v2(scores, seq_lens, page_tables, out_page_indices, page_size, metadata, out_raw_indices=None):
        picks.append(("v2", out_page_indices.shape[1], page_tables is not None))
        top(scores, seq_lens, out_page_indices if out_raw_indices is None else out_raw_indices)

    def v1(scores, seq_lens, page_tables, out_page_indices, page_size, out_raw_indices=None):
        picks.append(("v1", out_page_indices.shape[1], page_tables is not None))
        top(scores, seq_lens, out_raw_indices)

    def plan(seq_lens, static_threshold=-1, *, out=None):
        return torch.zeros(seq_lens.shape[0] + 1, 2, dtype=torch.int32)

    return {"topk_transform_paged_v2": v2, "topk_transform_paged": v1, "plan_topk_v2": plan}


@contextlib.contextmanager
def spied_rescore(what):
    """Spies on the plugin's rescoring routes (route, k_prime) and on SGLang's torch fp8 logits (its outputs), with
    SGLang's top-k transforms and cupy_dsa's plain logits routes refused: the rescored top-k replaces them."""
    from sglang.srt.layers.attention.dsv4 import indexer as ix

    calls, stage1, stage2 = [], [], []
    real = {name: getattr(core, name) for name in ("rescore_rows", "rescore_verify", "rescore_extend")}

    def spy(name):
        def f(*a, **k):
            calls.append((name, a[8] if name == "rescore_rows" else a[9]))  # k_prime
            stage2.append((k.get("q_rescore"), k.get("weights_rescore")))
            return real[name](*a, **k)
        return f

    real_fn = ix.fp8_paged_mqa_logits_torch

    def sglang_logits(*a, **k):
        out = real_fn(*a, **k)
        stage1.append((a, out))
        return out

    def refused(*a, **k):
        raise AssertionError(f"SGLang's top-k was called {what}")

    saved = {n: getattr(ix, n) for n in ("topk_transform_pytorch_vectorized", "topk_transform_paged",
                                         "topk_transform_paged_v2")}
    from sglang.kernels.ops.attention.dsv4 import topk as topk_module

    picks = []
    stand_ins = _sglang_topk_stand_in(picks)
    saved_kernels = {n: getattr(topk_module, n) for n in stand_ins}
    for n, f in stand_ins.items():
        setattr(topk_module, n, f)
    for name in real:
        setattr(core, name, spy(name))
    ix.fp8_paged_mqa_logits_torch = sglang_logits
    for n in saved:
        setattr(ix, n, refused)
    try:
        with spied_logits_routes(what) as plain:
            yield types.SimpleNamespace(calls=calls, stage1=stage1, stage2=stage2, picks=picks)
        assert not plain, f"cupy_dsa's plain logits routes ran {what}: {[r for r, _ in plain]}"
    finally:
        for name, f in real.items():
            setattr(core, name, f)
        ix.fp8_paged_mqa_logits_torch = real_fn
        for n, f in saved.items():
            setattr(ix, n, f)
        for n, f in saved_kernels.items():
            setattr(topk_module, n, f)


def _sets(t):
    return [set(int(i) for i in row.tolist() if i >= 0) for row in t]


def _run(mode_, batch, stage1, ns=None, kprime=None, stage2_q="fp8", topk_backend=None, **setup):
    """The hooked forward in fp8-rescore over a two-level pool: (metadata, spies, setup namespace). ``stage2_q``: fp8
    for the set-ups whose layer has no projections (their q is drawn in fp8, stage 1's and stage 2's); None: the
    default (bf16), which needs :func:`_bf16q_setup`'s layer."""
    ns = ns or _setup(**setup)
    with settings_env(stage1=stage1, kprime=kprime, stage2_q=stage2_q), one_attention_cp_rank(), \
            spied_rescore(f"in {MODE}") as spies:
        md, _ = ns.run(ns.pool, mode_, batch, topk_backend=topk_backend)
    return md, spies, ns


def _setup(**kw):
    with mode_env("bf16"):  # the bf16 and fp8 pools of the shared set-up are sized as in their own modes
        return _indexer_setup(two_level=True, **kw)


def _assert_equal_reference(md, ref, what, exact=True):
    """The forward's outputs are the reference's: raw positions and page indices, -1 padded; ``exact``: element by
    element (same order), else as sets per row (another launch form of the same stage-1 logits)."""
    if exact:
        assert torch.equal(md.c4_sparse_raw_indices, ref.raw_indices), f"{what}: raw indices differ from the reference"
        assert torch.equal(md.c4_sparse_page_indices, ref.page_indices), f"{what}: page indices differ"
        return
    for name, got, want in (("raw", md.c4_sparse_raw_indices, ref.raw_indices),
                            ("page", md.c4_sparse_page_indices, ref.page_indices)):
        bad = [r for r, (a, b) in enumerate(zip(_sets(got), _sets(want))) if a != b]
        assert not bad, f"{what}: {name} indices of rows {bad} differ from the reference"
        assert torch.equal((got >= 0).sum(1), (want >= 0).sum(1)), f"{what}: -1 padding differs"


def _up_to_ties(md, oracle, lens, topk, tol_rel, what):
    """Per row: the selection holds min(len, topk) keys; keys it misses and keys it takes beyond the exact top-k all
    score within ``tol_rel * max|logit|`` of the exact k-th score. Returns each row's recall of the exact top-k."""
    recall = []
    for r, n in enumerate(lens):
        got = _sets(md.c4_sparse_raw_indices[r:r + 1])[0]
        k = min(topk, n)
        assert len(got) == k, (what, r, len(got), k)
        if n <= topk:
            assert got == set(range(n)), (what, r)
            recall.append(1.0)
            continue
        scores = oracle[r, :n]
        top = scores.topk(k)
        kth, exact = top.values[-1].item(), set(top.indices.tolist())
        tol = tol_rel * scores.abs().max().item()
        far = [i for i in sorted(got ^ exact) if abs(scores[i].item() - kth) > tol]
        assert not far, f"{what} row {r}: differs from the exact top-k beyond ties at {far[:8]} (k-th {kth:.6g})"
        recall.append(len(got & exact) / k)
    return recall


# the two-level key's error: |k_hat - k| <= 1.4e-4 of the key's largest element per element (cupy_dsa.rescore)
TWO_LEVEL_TIE = 2e-3


# --------------------------------------------------------------------------------------------------
# Stage 2 with a bf16 query: a layer with SGLang's projections, SGLang's fused fp8 q kernel stood in on CPU
# --------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def sglang_fused_q_on_cpu(calls):
    """SGLang's fused_q_indexer_rope_hadamard_quant (a CUDA JIT kernel) stood in by cupy_dsa's reference of the same
    math (RoPE, Hadamard, per (token, head) fp8 with the scale folded into the weights: dsv4-indexer section 3), with
    SGLang's shapes: (q fp8 [T, 64, 128], weights fp32 [T, 64, 1]); ``calls`` gets its arguments."""
    from sglang.srt.layers.attention.dsv4 import indexer as ix

    from cupy_dsa.query import prepare_index_q_reference

    def fused(q, weight, weight_scale, freqs_cis, positions):
        calls.append((q, weight, weight_scale, positions))
        q8, w8 = prepare_index_q_reference(q.contiguous(), weight, freqs_cis=core.rope_table(freqs_cis),
                                           positions=positions, weight_scale=weight_scale, numerics="fp8")
        return q8, w8.unsqueeze(2)

    orig = ix.fused_q_indexer_rope_hadamard_quant
    ix.fused_q_indexer_rope_hadamard_quant = fused
    try:
        yield
    finally:
        ix.fused_q_indexer_rope_hadamard_quant = orig


def _bf16q_setup(lens, groups=None, seed=11, max_pos=4096):
    """A two-level set-up whose indexer layer has SGLang's projections (wq_b's bf16 output, weights_proj's bf16
    output, the RoPE table, weight_scale): ns.q / ns.w are stage 1's fp8 q and weights (SGLang's kernel, stood in),
    ns.q_bf16 / ns.w_bf16 what stage 2 must get, computed here independently (cupy_dsa's reference RoPE and Hadamard
    stages in fp32, one bf16 rounding; fp32 weights times fp32 weight_scale), ns.q_exact the fp32 rotated q."""
    from cupy_dsa.query import prepare_index_q_reference
    from cupy_dsa.store import HADAMARD_SCALE, _hadamard128, rope_reference

    rows = len(lens)
    g = torch.Generator().manual_seed(seed)
    q_raw = (2 * torch.randn(rows, 64, 128, generator=g)).bfloat16()
    w_raw = torch.rand(rows, 64, generator=g).bfloat16()
    angles = torch.outer(torch.arange(max_pos, dtype=torch.float64), 1.6e5 ** (-torch.arange(32) / 32.0))
    freqs_cis = torch.polar(torch.ones_like(angles), angles).to(torch.complex64)
    weight_scale = 128 ** -0.5 * 64 ** -0.5
    positions = torch.arange(rows)                      # the set-up's core_metadata.positions
    table = core.rope_table(freqs_cis)
    q8, w8 = prepare_index_q_reference(q_raw, w_raw, freqs_cis=table, positions=positions, weight_scale=weight_scale,
                                       numerics="fp8")
    x = rope_reference(q_raw.float().reshape(-1, 128).clone(), table[positions].repeat_interleave(64, dim=0))
    q_exact = (_hadamard128(x.reshape(-1, 32, 4)).reshape(-1, 128) * HADAMARD_SCALE).view(rows, 64, 128)
    projections = []
    layer = types.SimpleNamespace(
        layer_id=0, use_fp4_indexer=False, index_topk=512, n_local_heads=64, head_dim=128, freqs_cis=freqs_cis,
        weight_scale=weight_scale, compressor=None,
        compute_weights=lambda x, skip_scale=False: projections.append(("weights_proj", skip_scale)) or w_raw,
        wq_b=lambda a: projections.append(("wq_b", a)) or (q_raw.reshape(rows, -1), None))
    ns = _setup(lens=lens, groups=groups, q=q8, w=w8, layer=layer)
    ns.q_bf16, ns.w_bf16, ns.q_exact = q_exact.bfloat16(), w_raw.float() * torch.tensor(weight_scale), q_exact
    ns.projections = projections
    return ns


def _reference_bf16q(ns, k_prime=None, stage1_logits=None, bf16=True):
    """rescore_topk_reference of the rows with stage 2's q / weights the bf16 ones (``bf16``) or stage 1's."""
    hi, lo = ns.pool.index_k_with_scale_buffer[0], ns.pool.index_k_lo_buffer[0]
    lens = torch.tensor(ns.lens, dtype=torch.int32)
    extra = dict(q_rescore=ns.q_bf16, weights_rescore=ns.w_bf16) if bf16 else {}
    return rescore_topk_reference(ns.q.unsqueeze(1), ns.w, hi, lo, lens, ns.page_table, ns.topk, k_prime,
                                  stage1_logits=stage1_logits, **extra)


def scenario_rescore():
    load()

    @check
    def hooks_applied_rescore():
        from sglang.srt.environ import envs

        every_hook_in_place()
        assert envs.SGLANG_CUPY_DSA_INDEX_K.get() == MODE and core.index_k_mode() == MODE
        assert core.rescore_settings() == ("sglang", 4, None), core.rescore_settings()
        assert core.index_query() == "bf16"  # the query setting unset: fp8-rescore's default stage-2 query

    @check
    def budget_counts_264_bytes():
        from sglang.srt.mem_cache import deepseek_v4_memory_pool as mp
        from sglang.srt.model_executor import pool_configurator as pc

        for fn in (mp.get_dsv4_indexer_bytes_per_token, pc.get_dsv4_indexer_bytes_per_token):
            assert fn(128, False) == 264 and fn(128, use_fp4_indexer=True) == 68, fn(128, False)
        cfg = object.__new__(pc.DSV4PoolConfigurator)
        cfg.c4_shrink_factor = 1
        cfg._get_paged_kv_bytes_per_token = lambda ratio: 0
        cfg.indexer_bytes_per_token = pc.get_dsv4_indexer_bytes_per_token(128, False)  # as its __init__ does
        assert cfg._compressed_bytes_per_full_token(4) == 66  # 264 / 4 (fp8: 33, bf16: 64)
        assert core.index_bytes_per_entry(MODE) == 264

    @check
    def pool_keeps_sglangs_fp8_buffer_and_adds_lo_pages():
        pool = make_index_pool(layers=2)
        his, los = pool.index_k_with_scale_buffer, pool.index_k_lo_buffer
        assert [tuple(b.shape) for b in his] == [(44, FP8_PAGE)] * 2, [tuple(b.shape) for b in his]
        assert [(tuple(b.shape), b.dtype, b.device) for b in los] == [((44, FP8_PAGE), torch.uint8, his[0].device)] * 2
        assert not any(b.any() for b in los), "lo pages not zeroed"
        ptrs = {b.data_ptr() for b in his + los}
        assert len(ptrs) == 4, "lo pages share memory with other buffers"
        assert pool.get_bytes_per_token() == 264
        assert all(core.lo_cache_of(h) is lo for h, lo in zip(his, los))
        assert core.lo_cache_of(his[0][:, :]) is los[0], "a view of the fp8 rows at the same address finds its lo"
        # PD registers every buffer of contiguous_page_row_buffers(), page by page: the lo pages travel with the fp8
        bufs = pool.contiguous_page_row_buffers()
        assert len(bufs) == 4 and all(a is b for a, b in zip(bufs, his + los)), [tuple(b.shape) for b in bufs]
        with mode_env("fp8-cupy"):  # another fp8 mode: SGLang's buffer only
            other = make_index_pool()
            assert not hasattr(other, "index_k_lo_buffer") and len(other.contiguous_page_row_buffers()) == 1
        assert core.lo_cache_of(other.index_k_with_scale_buffer[0]) is None

    @check
    def pd_registers_the_lo_pages():
        # SGLang's own get_contiguous_buf_infos on a pool object holding one C4 layer's index pool
        from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool

        index_pool = make_index_pool(layers=1)
        kv = object.__new__(DeepSeekV4TokenToKVPool)
        kv.kv_pools, kv.index_pools, kv.compression_ratios = {4: None}, {4: index_pool}, [4]
        kv._stage_start, kv._stage_end, kv._unified_kv, kv._unified_kv_fp8, kv.page_size = 0, 1, False, False, 256
        ptrs, lens, items = kv.get_contiguous_buf_infos()
        hi, lo = index_pool.index_k_with_scale_buffer[0], index_pool.index_k_lo_buffer[0]
        assert ptrs == [hi.data_ptr(), lo.data_ptr()], ptrs
        assert lens == [hi.nbytes, lo.nbytes] and items == [FP8_PAGE, FP8_PAGE], (lens, items)

    @check
    def store_two_level_decode_plan():
        case = decode_case()
        case.kv[4] *= 1e-6  # below SGLang's fp8 scale floor
        hi = store_through_binding(case)
        assert_two_level_pages(hi, core.lo_cache_of(hi), case)

    @check
    def store_two_level_prefill_plan():
        case = prefill_case()
        case.kv[1] *= 300.0
        hi = store_through_binding(case)
        assert_two_level_pages(hi, core.lo_cache_of(hi), case)

    @check
    def store_two_level_one_launch_via_sglang_call_site():
        case, (hi, lo) = call_site_case(), rescore_cache()
        stores = store_through_sglang_call_site(case, hi)
        assert len(stores) == 1 and stores[0]["kvcache"] is hi and stores[0]["lo_cache"] is lo, \
            "not one store of both pages"
        assert_two_level_pages(hi, lo, case)

    @check
    def store_rescore_strictness():
        assert_fp8_keyed_store_strictness(MODE, rescore_cache(), ("fp8 index cache", "its residual page in one launch"))
        with mode_env("fp8-cupy"):
            orphan = make_index_pool(size=256).index_k_with_scale_buffer[0]  # fp8 rows without lo pages
        kv, plan, kw = _store_call(orphan)
        assert_hook_refuses(kv, plan, kw, "has no residual (lo) pages", "stored fp8 keys without their residuals")
        assert not orphan.any()

    @check
    def indexer_decode_matches_reference_both_stage1():
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        ns = _setup()
        oracle = _oracle_exact(ns)
        # --dsa-topk-backend sgl-kernel (SGLang's default) with its v2 top-k on: v2 picks stage 1's candidates
        for stage1 in ("cupy", "sglang"):
            with core.env_vars({"SGLANG_OPT_USE_TOPK_V2": "1"}):
                md, spies, _ = _run(ForwardMode.DECODE, 3, stage1, ns=ns, topk_backend="sgl-kernel")
            assert [r for r, _ in spies.calls] == ["rescore_rows"] and spies.calls[0][1] == 4 * 512, spies.calls
            if stage1 == "sglang":
                (args, logits), = spies.stage1  # SGLang's call as its forward makes it: [R, 1, 64, 128] q, [R] lens
                assert tuple(args[0].shape) == (3, 1, 64, 128) and tuple(args[1].shape) == (44, 64, 1, 132)
                assert torch.equal(args[3], torch.tensor(ns.lens, dtype=torch.int32)) and args[7] is False
                # the candidates: SGLang's v2 top-k at k = K', raw positions (no page table)
                assert spies.picks == [("v2", 4 * 512, False)], spies.picks
                ref = _reference(ns, stage1_logits=logits)
            else:
                assert not spies.stage1, "stage1=cupy called SGLang's fp8 logits"
                assert not spies.picks, f"stage1=cupy called SGLang's top-k for its candidates: {spies.picks}"
                ref = _reference(ns)
            _assert_equal_reference(md, ref, f"decode, stage1={stage1}")
            INFO[f"rescore_recall_decode_{stage1}"] = _up_to_ties(md, oracle, ns.lens, 512, TWO_LEVEL_TIE,
                                                                  f"decode, stage1={stage1}")
        # v2 off (sm_120's SGLang): v1 picks K' <= 1024 (with a page table, raw positions beside), and K' = 2048 is
        # past it; the torch backend has no kernel of its own: cupy_dsa's select in both, the same selection
        for backend, kprime, picks in (("sgl-kernel", "2x", [("v1", 1024, True)]), ("sgl-kernel", None, []),
                                       ("torch", None, [])):
            with core.env_vars({"SGLANG_OPT_USE_TOPK_V2": "0"}):
                md, spies, _ = _run(ForwardMode.DECODE, 3, "sglang", ns=ns, kprime=kprime, topk_backend=backend)
            assert spies.picks == picks, (backend, kprime, spies.picks)
            _assert_equal_reference(md, _reference(ns, k_prime=1024 if kprime else None,
                                                   stage1_logits=spies.stage1[0][1]), f"decode, {backend}, {kprime}")
        # against SGLang's own fp8 forward on the same fp8 pages (its top-k of its fp8 logits)
        with mode_env("fp8"), one_attention_cp_rank():
            fp8_md, _ = ns.run(ns.pool)
        fp8_recall = []
        for r, n in enumerate(ns.lens):
            exact = set(oracle[r, :n].topk(512).indices.tolist())
            fp8_recall.append(len(_sets(fp8_md.c4_sparse_raw_indices[r:r + 1])[0] & exact) / 512)
        INFO["fp8_recall_decode"] = fp8_recall
        ours = INFO["rescore_recall_decode_cupy"]
        assert sum(ours) >= sum(fp8_recall), (ours, fp8_recall)

    @check
    def indexer_routes_match_reference():
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        cases = (("extend", ForwardMode.EXTEND, 3, dict(lens=(900, 901, 1300, 600, 601, 602, 2000), groups=(2, 4, 1)),
                  "rescore_extend"),
                 ("prefill, one request", ForwardMode.EXTEND, 1,
                  dict(lens=(700, 701, 702, 703, 2500), one_request=True), "rescore_extend"),
                 ("verify n=2", ForwardMode.TARGET_VERIFY, 3,
                  dict(lens=(1000, 1001, 1300, 1301, 2500, 2501), groups=(2, 2, 2)), "rescore_verify"),
                 ("verify n=4", ForwardMode.TARGET_VERIFY, 2,
                  dict(lens=(1000, 1001, 1001, 1002, 2300, 2301, 2301, 2302), groups=(4, 4)), "rescore_verify"),
                 ("ragged verify", ForwardMode.TARGET_VERIFY, 2, dict(lens=(900, 901, 2400), groups=(2, 1)),
                  "rescore_rows"))
        for what, mode_, batch, setup, route in cases:
            ns = _setup(**setup)
            oracle = _oracle_exact(ns)
            for stage1 in ("cupy", "sglang"):
                md, spies, _ = _run(mode_, batch, stage1, ns=ns, kprime="2x")
                want = route if stage1 == "cupy" else "rescore_rows"  # SGLang's call: one row per token
                assert [r for r, _ in spies.calls] == [want] and spies.calls[0][1] == 1024, (what, stage1, spies.calls)
                logits = spies.stage1[0][1] if stage1 == "sglang" else None
                ref = _reference(ns, k_prime=1024, stage1_logits=logits)
                _assert_equal_reference(md, ref, f"{what}, stage1={stage1}", exact=want == "rescore_rows")
                INFO[f"rescore_recall_{what}_{stage1}"] = _up_to_ties(md, oracle, ns.lens, 512, TWO_LEVEL_TIE,
                                                                      f"{what}, stage1={stage1}")

    @check
    def indexer_bf16_stage2_query_reaches_stage2():
        # SGLANG_CUPY_DSA_INDEX_Q=bf16: one wq_b and one weights_proj feed SGLang's fused fp8 q kernel (stage 1) and
        # the bf16 rotation (stage 2); stage 2 gets exactly the independently computed bf16 q and unscaled weights;
        # the top-k equals the reference called with them, on every route and both stage-1 sources, and differs
        # from stage 2 with the fp8 q on these rows
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        cases = forward_cases("rescore_rows", "rescore_extend", "rescore_verify")
        for what, mode_, batch, setup, route in cases:
            ns = _bf16q_setup(**setup)
            for stage1 in ("cupy", "sglang"):
                fused_calls = []
                ns.projections.clear()
                prepare = ns.Backend._forward_prepare_normal

                def refused(self, **kw):
                    raise AssertionError("SGLang's prepare ran: it would run wq_b a second time")

                ns.Backend._forward_prepare_normal = refused
                try:
                    with sglang_fused_q_on_cpu(fused_calls):
                        md, spies, _ = _run(mode_, batch, stage1, ns=ns, stage2_q=None if stage1 == "cupy" else "bf16")
                finally:
                    ns.Backend._forward_prepare_normal = prepare
                assert [p[0] for p in ns.projections] == ["weights_proj", "wq_b"], ns.projections
                assert ns.projections[0][1] is True, "weights_proj's output must come without weight_scale"
                (q_in, w_in, ws, pos), = fused_calls
                # SGLang's kernel gets wq_b's bf16 output as [T, 64, 128], the raw bf16 weights, the layer's scale
                assert q_in.dtype == torch.bfloat16 and tuple(q_in.shape) == (4, 64, 128), (q_in.dtype, q_in.shape)
                assert w_in.dtype == torch.bfloat16 and ws == 128 ** -0.5 * 64 ** -0.5
                assert torch.equal(pos, torch.arange(4)), pos
                want_route = route if stage1 == "cupy" else "rescore_rows"
                assert [r for r, _ in spies.calls] == [want_route], (what, stage1, spies.calls)
                (q2, w2), = spies.stage2
                assert q2 is not None and q2.dtype == torch.bfloat16 and q2.is_contiguous() and \
                    tuple(q2.shape) == (4, 64, 128), (what, stage1, None if q2 is None else (q2.dtype, q2.shape))
                assert torch.equal(q2, ns.q_bf16), f"{what}, stage1={stage1}: stage 2's q is not the bf16 rotated q"
                assert w2.dtype == torch.float32 and torch.equal(w2, ns.w_bf16), \
                    f"{what}, stage1={stage1}: stage 2's weights are not weights_proj * weight_scale (no q scale)"
                logits = spies.stage1[0][1] if stage1 == "sglang" else None
                ref = _reference_bf16q(ns, stage1_logits=logits)
                _assert_equal_reference(md, ref, f"{what}, stage1={stage1}, bf16 q",
                                        exact=want_route == "rescore_rows")
                fp8_ref = _reference_bf16q(ns, stage1_logits=logits, bf16=False)
                differ = [r for r, (a, b) in enumerate(zip(_sets(ref.raw_indices), _sets(fp8_ref.raw_indices)))
                          if a != b]
                assert differ, f"{what}, stage1={stage1}: the bf16 and fp8 stage-2 queries select the same keys"
                INFO.setdefault("rescore_bf16q_rows_differing_from_fp8q", {})[f"{what}, {stage1}"] = differ
        # with SGLANG_CUPY_DSA_INDEX_Q=fp8 stage 2 gets no q_rescore: stage 1's fp8 q and weights; recall of the exact top-k
        # (fp64 scores of the fp32 keys and the fp32 rotated q) of both stage-2 queries, for the record
        ns = _bf16q_setup(lens=(2560, 2400, 2100, 1800))
        k = ns.keys.double().view(40, 64, 128)[ns.page_table.long()].reshape(4, -1, 128)
        oracle = (torch.relu(torch.einsum("rhd,rnd->rhn", ns.q_exact.double(), k))
                  * ns.w_bf16.double()[:, :, None]).sum(1)
        for name, ref in (("bf16", _reference_bf16q(ns)), ("fp8", _reference_bf16q(ns, bf16=False))):
            got = _sets(ref.raw_indices)
            INFO[f"rescore_recall_exact_stage2_{name}_q"] = [
                len(got[r] & set(oracle[r, :n].topk(512).indices.tolist())) / 512 for r, n in enumerate(ns.lens)]
        md, spies, _ = _run(ForwardMode.DECODE, 4, "cupy", ns=ns)
        assert spies.stage2 == [(None, None)], "SGLANG_CUPY_DSA_INDEX_Q=fp8 passed a stage-2 query"
        _assert_equal_reference(md, _reference_bf16q(ns, bf16=False), "decode, fp8 stage-2 q")

    @check
    def indexer_exact_topk_where_unambiguous():
        # every row sees all 2560 keys (its own page order) with one q: the keys scoring above the 512th are scaled
        # by 1.004 (scores are positively homogeneous in k), a margin of 0.4% at every row's boundary that the
        # two-level keys resolve; the result must be that exact set, in every route and for both stage 1 choices
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        g = torch.Generator().manual_seed(7)
        keys = torch.randn(2560, 128, generator=g)
        q1 = torch.randn(1, 64, 128, generator=g).to(torch.float8_e4m3fn)
        w1 = torch.rand(1, 64, generator=g)
        score = (torch.relu(torch.einsum("hd,nd->hn", q1[0].double(), keys.double())) * w1[0, :, None].double()).sum(0)
        top = score.topk(512).indices
        keys[top] *= 1.004
        exact = set(top.tolist())
        for what, mode_, batch, groups in (("decode", ForwardMode.DECODE, 4, None),
                                           ("verify n=2", ForwardMode.TARGET_VERIFY, 2, (2, 2)),
                                           ("extend", ForwardMode.EXTEND, 2, (3, 1))):
            ns = _setup(lens=(2560,) * 4, keys=keys, q=q1.expand(4, 64, 128).contiguous(), w=w1.expand(4, 64).contiguous(),
                        groups=groups)
            slots = [[int(ns.page_table[r, i // 64]) * 64 + i % 64 for i in range(2560)] for r in range(4)]
            for stage1 in ("cupy", "sglang"):
                md, _, _ = _run(mode_, batch, stage1, ns=ns)
                for r in range(4):
                    got = {slots[r][i] for i in _sets(md.c4_sparse_raw_indices[r:r + 1])[0]}
                    assert got == exact, f"{what}, stage1={stage1}, row {r}: {len(got ^ exact)} keys differ"
            if mode_ == ForwardMode.DECODE:  # the margin is below fp8's resolution: SGLang's fp8 top-k misses keys
                with mode_env("fp8"), one_attention_cp_rank():
                    fp8_md, _ = ns.run(ns.pool, mode_, batch)
                missed = [len(exact - {slots[r][i] for i in _sets(fp8_md.c4_sparse_raw_indices[r:r + 1])[0]})
                          for r in range(4)]
                INFO["fp8_missed_where_unambiguous"] = missed
                assert min(missed) > 0, missed

    @check
    def indexer_small_rows_padding_and_kprime_cap():
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        ns = _setup(lens=(300, 64, 0, 600))
        for stage1 in ("cupy", "sglang"):
            md, _, _ = _run(ForwardMode.DECODE, 4, stage1, ns=ns, kprime="8192")  # K' above the width: capped
            raw = md.c4_sparse_raw_indices
            assert sorted(x for x in raw[0].tolist() if x >= 0) == list(range(300))
            assert sorted(x for x in raw[1].tolist() if x >= 0) == list(range(64))
            assert (raw[2] == -1).all() and (md.c4_sparse_page_indices[2] == -1).all(), "a row of length 0 selected"
            assert len(_sets(raw[3:4])[0]) == 512
            exp = torch.where(raw.long() >= 0, ns.page_table.long().gather(1, raw.long().clamp(min=0) // 64) * 64
                              + raw.long() % 64, -1)
            assert torch.equal(md.c4_sparse_page_indices.long(), exp), "page indices are not SGLang's slot transform"
        with settings_env(kprime="256"):  # a count below index_topk: refused at the first forward
            try:
                _run(ForwardMode.DECODE, 4, "cupy", ns=ns, kprime="256")
            except ValueError as e:
                assert "at least index_topk (512)" in str(e), str(e)
            else:
                raise AssertionError("K' below index_topk was accepted")

    @check
    def indexer_rescore_refuses_pools_without_lo():
        ns = _setup(lens=(700, 900))
        for pool in (ns.fp8_pool,):  # SGLang's fp8 pages without residual pages
            try:
                with one_attention_cp_rank(), settings_env(stage2_q="fp8"):
                    ns.run(pool)
            except RuntimeError as e:
                assert "has no residual (lo) pages" in str(e) and MODE in str(e), str(e)
            else:
                raise AssertionError("fp8-rescore scored a pool without lo pages")

    @check
    def indexer_rescore_refuses_a_tbo_micro_batch():
        # refused at start-up (--enable-two-batch-overlap); a micro-batch that reaches the forward anyway is refused
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        ns = _setup(lens=(700, 900))
        orig = forward.forward_c4_indexer_bf16

        def as_micro_batch(self, **kw):
            kw["forward_batch"].tbo_parent_token_range = (0, 2)
            return orig(self, **kw)

        forward.forward_c4_indexer_bf16 = as_micro_batch
        try:
            assert_refused(lambda: _run(ForwardMode.DECODE, 2, "cupy", ns=ns), ("two-batch-overlap micro-batch",),
                           "fp8-rescore ran a two-batch-overlap micro-batch")
        finally:
            forward.forward_c4_indexer_bf16 = orig

    @check
    def indexer_rescore_hisparse_and_capturer():
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        ns = _setup(lens=(700, 900))
        seen, holder = {}, {}
        with hisparse_decode(seen, holder):
            _run(ForwardMode.DECODE, 2, "cupy", ns=ns)
        md = holder["b"].forward_metadata.core_metadata
        assert torch.equal(md.c4_sparse_page_indices, torch.full((2, 512), 42, dtype=torch.int32))
        raw = seen["swap"]["top_k_result"]
        ref = _reference(ns)
        assert torch.equal(raw, ref.raw_indices), "HiSparse did not get the rescored raw top-k"
        assert seen["capture"][0] == 0 and seen["capture"][1] is raw

    @check
    def pd_layout_pairs_only_with_fp8_rescore():
        from sglang.kernels.ops.attention.dsv4.kv_layout import KVLayout
        from sglang.srt.disaggregation.utils import get_pd_kv_layout
        from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool

        pool = object.__new__(DeepSeekV4TokenToKVPool)
        pool.uniform_fp8 = True
        layouts = {}
        for mode in ("fp8", "fp8-cupy", "bf16", MODE):
            with mode_env(mode):
                layouts[mode] = get_pd_kv_layout(pool)
        assert layouts[MODE] == KVLayout.UNIFORM_FP8.value + ",c4idx:fp8-rescore", layouts

        for other in ("fp8", "fp8-cupy", "bf16"):
            for local, peer in ((layouts[MODE], layouts[other]), (layouts[other], layouts[MODE])):
                try:
                    pd_decode_handshake(local, peer)
                except RuntimeError as e:
                    assert "KV layout mismatch" in str(e) and "c4idx:fp8-rescore" in str(e), str(e)
                else:
                    raise AssertionError(f"a {local} decode peer accepted a {peer} prefill peer")
        assert_pd_layout_accepted(layouts[MODE])

    @check
    def hicache_carries_lo_pages_in_its_namespace():
        from sglang.srt.mem_cache.hicache_storage import PoolName
        from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import _dsv4_indexer_regions

        pool = make_index_pool(layers=2)
        hi_region, lo_region = _dsv4_indexer_regions(types.SimpleNamespace(c4_indexer_kv_pool=pool), 256)
        assert str(hi_region.name) == str(PoolName.DEEPSEEK_V4_C4_INDEXER) and hi_region.item_bytes == FP8_PAGE
        assert hi_region.page_aligned_only is False and hi_region.device_buffers is pool.index_k_with_scale_buffer
        assert str(lo_region.name) == str(PoolName.DEEPSEEK_V4_C4_INDEXER_SCALE)
        assert all(a is b for a, b in zip(lo_region.device_buffers, pool.index_k_lo_buffer))
        assert (lo_region.item_bytes, lo_region.slot_page_size, lo_region.page_aligned_only) == \
            (hi_region.item_bytes, hi_region.slot_page_size, hi_region.page_aligned_only)
        with mode_env("fp8-cupy"):
            other = make_index_pool()
        try:
            _dsv4_indexer_regions(types.SimpleNamespace(c4_indexer_kv_pool=other), 256)
        except RuntimeError as e:
            assert "residual (lo) buffers" in str(e) and "Refusing to build HiCache" in str(e), str(e)
        else:
            raise AssertionError("HiCache was built without the lo pages")
        assert hicache_model_name() == "deepseek-ai/DeepSeek-V4_c4idx-fp8-rescore"

    @check
    def hicache_backup_and_load_carry_lo_pages():
        """SGLang's HiCache host pools back up and load the lo pages with the hi pages (checks_hicache: SGLang's
        retraction backup and restore, its sgl_kernel transfer op stood in on CPU): two C4 layers, two source pages
        of known hi and lo bytes (the reference two-level store) among random ones, backed up to host pages and
        loaded into two other device pages come back byte for byte, both pages of a layer in before SGLang
        signals the layer loaded (the forward waits through the hi page's getter only), the lo pages the plugin
        rescores from are the buffers HiCache restored, and no other page changes."""
        from sglang.srt.mem_cache import memory_pool_host as mph
        from sglang.srt.mem_cache.hicache_storage import PoolName

        from checks_hicache import hicache_round_trip

        pool = make_index_pool(layers=2)  # the plugin's pool hook allocates and registers the lo pages
        pages = {"hi": pool.index_k_with_scale_buffer, "lo": pool.index_k_lo_buffer}
        g = torch.Generator().manual_seed(int(os.environ.get("CUPY_DSA_SEED", "0")))
        for bufs in pages.values():
            for b in bufs:
                b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=g))
        src, dst = [7, 3], [12, 29]
        locs = torch.cat([torch.arange(p * 64, (p + 1) * 64) for p in src])
        for layer in range(2):
            store_two_level_reference(torch.randn(len(locs), 128, generator=g), pages["hi"][layer],
                                      pages["lo"][layer], locs)
        want = {(kind, layer): b.clone() for kind, bufs in pages.items() for layer, b in enumerate(bufs)}
        assert all(not torch.equal(w[d], w[s]) for w in want.values() for s, d in zip(src, dst))
        unbound = mph.__dict__.get("transfer_kv_direct", None)

        in_at_layer_done = {}

        def layer_done(layer):
            in_at_layer_done[layer] = {kind: all(torch.equal(pages[kind][layer][d], want[kind, layer][s])
                                                 for s, d in zip(src, dst)) for kind in pages}

        calls = []
        group, host_page, regions = hicache_round_trip(pool, src, dst, calls, on_layer_done=layer_done)

        assert [str(r.name) for r in regions] == [str(PoolName.DEEPSEEK_V4_C4_INDEXER),
                                                  str(PoolName.DEEPSEEK_V4_C4_INDEXER_SCALE)], regions
        hosts = {"hi": group.get_pool(PoolName.DEEPSEEK_V4_C4_INDEXER),
                 "lo": group.get_pool(PoolName.DEEPSEEK_V4_C4_INDEXER_SCALE)}
        for kind, host in hosts.items():
            assert all(a is b for a, b in zip(host.device_buffers, pages[kind])), f"{kind} host pool's buffers"
            for layer in range(2):
                for s in src:
                    assert torch.equal(host.kv_buffer[layer][host_page[s]], want[kind, layer][s]), \
                        f"{kind} page {s} of layer {layer} not in its host page {host_page[s]}"
        for (kind, layer), w in want.items():
            got = pages[kind][layer]
            for s, d in zip(src, dst):
                assert torch.equal(got[d], w[s]), f"{kind} page {s} of layer {layer} did not come back in page {d}"
            rest = [r for r in range(got.shape[0]) if r not in dst]
            changed = [r for r in rest if not torch.equal(got[r], w[r])]
            assert not changed, f"{kind} pages {changed} of layer {layer} changed"
        assert in_at_layer_done == {l: {"hi": True, "lo": True} for l in range(2)}, in_at_layer_done
        for layer in range(2):
            assert core.lo_cache_of(pages["hi"][layer]) is pages["lo"][layer], "the plugin reads other lo pages"
        # SGLang's own transfer call moved the lo pages: a backup of each region, a load of each region per layer
        lo_calls = [c for c in calls if any(t is pages["lo"][0] or t is pages["lo"][1] for t in c[0] + c[1])]
        assert len(calls) == 6 and len(lo_calls) == 3, [(len(a), len(b)) for a, b, _, _ in calls]
        assert mph.__dict__.get("transfer_kv_direct", None) is unbound, "the stand-in was left in SGLang"

    @check
    def resolution_rescore_refusals():
        assert_resolution_leaves_environment()
        for fields, fragments in ((dict(attn_cp_size=2), ("--attn-cp-size 2", "context parallel")),
                                  (dict(enable_two_batch_overlap=True), ("--enable-two-batch-overlap",)),
                                  (dict(enable_deepseek_v4_fp4_indexer=True), ("--enable-deepseek-v4-fp4-indexer",)),
                                  (dict(enable_nvidia_megakernel=True), ("--enable-nvidia-megakernel",)),
                                  (dict(device="npu"), ("NPU",))):
            msg = resolution_refusal(MODE, **fields)
            assert all(f in msg for f in fragments) and f"{ENV}={MODE}" in msg and "two-level" in msg, msg
            INFO.setdefault("rescore_refusals", []).append(msg)

    @check
    def settings_refused_before_anything_is_patched():
        from cupy_dsa.sglang.core import StartupRefused

        for stage1, kprime, stage2_q, fragment in (("deepgemm", None, None, f"{STAGE1}='deepgemm'"),
                                                   (None, "4y", None, f"{KPRIME}='4y'"),
                                                   (None, "0x", None, f"{KPRIME}='0x'"),
                                                   (None, None, "fp16", f"{STAGE2_Q}='fp16'")):
            with settings_env(stage1, kprime, stage2_q):
                try:
                    hooks._resolve_switch()
                except StartupRefused as e:
                    assert fragment in str(e) and "Refusing to start" in str(e), str(e)
                else:
                    raise AssertionError(f"{stage1}, {kprime}, {stage2_q} accepted")
                try:
                    run_resolution()
                except StartupRefused as e:
                    assert fragment in str(e), str(e)
                else:
                    raise AssertionError(f"{stage1}, {kprime}, {stage2_q} accepted at resolution")
        with settings_env(kprime="2X", stage1=" CUPY ", stage2_q=" BF16 "):
            assert core.rescore_settings() == ("cupy", 2, None) and core.rescore_settings().k_prime(512) == 1024
            assert core.index_query() == "bf16"
        with settings_env(kprime="3000"):
            assert core.rescore_settings().k_prime(1024) == 3000
        # a rescore setting with another mode on: refused, not ignored; the query setting is bf16's too
        for name, kw in ((KPRIME, dict(kprime="2x")), (STAGE1, dict(stage1="cupy"))):
            with mode_env("bf16"), settings_env(**kw):
                try:
                    hooks._resolve_switch()
                except StartupRefused as e:
                    assert f"{name} set with {ENV}=bf16" in str(e) and f"{MODE} only" in str(e), str(e)
                else:
                    raise AssertionError(f"{name} was ignored in bf16 mode")
        with mode_env("bf16"), settings_env(stage2_q="bf16"):
            assert hooks._resolve_switch() == "bf16" and core.index_query() == "bf16"
        # the switch off: register() reads no setting (the CLI flag may still turn the switch on), the launcher's
        # resolution step refuses a stray or invalid one like the other modes do
        for kw, fragment in ((dict(kprime="junk"), f"{KPRIME} set with {ENV}=fp8"),
                             (dict(stage1="cupy"), f"{STAGE1} set with {ENV}=fp8"),
                             (dict(stage2_q="bf16"), f"{STAGE2_Q}='bf16' set with {ENV}=fp8")):
            with mode_env("fp8"), settings_env(**kw):
                assert hooks._resolve_switch() == "fp8"
                try:
                    run_resolution()
                except StartupRefused as e:
                    assert fragment in str(e) and "Refusing to start" in str(e), str(e)
                else:
                    raise AssertionError(f"{kw} accepted with the switch off")
        # K' as a count below the model's index_topk (in the model config SGLang's own step built): refused at the
        # launcher's resolution step, not at the first C4 forward
        for kprime, topk, refused in (("100", 512, True), ("511", 512, True), ("512", 512, False),
                                      ("1024", 2048, True), ("2x", 512, False)):
            with settings_env(kprime=kprime):
                try:
                    run_resolution(index_topk=topk)
                except StartupRefused as e:   # a clean exit, as the settings refusals (it was a ValueError)
                    assert refused and f"{KPRIME}={kprime}: K' must be at least index_topk ({topk})" in str(e), str(e)
                    assert "the model's index_topk is" in str(e), str(e)
                else:
                    assert not refused, f"K'={kprime} accepted with index_topk {topk}"
        with settings_env(kprime="100"):
            run_resolution()  # no model config: nothing to check against (the forward refuses it)

    @check
    def flags_and_yaml_keys_take_rescore():
        from sglang.srt.server_args import prepare_server_args

        from cupy_dsa.sglang.core import StartupRefused

        with mode_env(None), settings_env():
            prepare_server_args(["--model-path", "dummy", "--cupy-dsa-index-k-dtype", "FP8-Rescore",
                                 "--cupy-dsa-rescore-stage1", "cupy", "--cupy-dsa-rescore-kprime", "3x",
                                 "--cupy-dsa-index-q", "BF16"])
            assert os.environ.get(ENV) == MODE and os.environ.get(STAGE1) == "cupy" and os.environ.get(KPRIME) == "3x"
            assert os.environ.get(STAGE2_Q) == "bf16"
            assert core.index_k_mode() == MODE and core.rescore_settings() == ("cupy", 3, None)
            assert core.index_query() == "bf16"
        with mode_env(None), settings_env():
            server_args_from_yaml("model-path: dummy\ncupy-dsa-index-k-dtype: fp8-rescore\ncupy-dsa-rescore-kprime: "
                                  "2048\ncupy-dsa-index-q: fp8\n")
            assert os.environ.get(ENV) == MODE and os.environ.get(KPRIME) == "2048", os.environ.get(KPRIME)
            assert os.environ.get(STAGE2_Q) == "fp8" and core.index_query() == "fp8"
            assert STAGE1 not in os.environ
        with mode_env(None), settings_env():
            for bad in (["--cupy-dsa-rescore-kprime", "4y"], ["--cupy-dsa-rescore-stage1", "deepgemm"],
                        ["--cupy-dsa-index-q", "fp16"], ["--cupy-dsa-rescore-q", "bf16"]):
                assert_argparse_rejects(bad)
        with mode_env(MODE), settings_env(kprime="4x"):
            assert_refused(lambda: prepare_server_args(["--model-path", "dummy", "--cupy-dsa-rescore-kprime", "2x"]),
                           ("--cupy-dsa-rescore-kprime 2x", f"{KPRIME}='4x'"),
                           "the flag silently overrode the variable", error=StartupRefused)
            assert os.environ[KPRIME] == "4x"
            prepare_server_args(["--model-path", "dummy", "--cupy-dsa-rescore-kprime", "4X"])  # the same value

    @check
    def check_command_describes_rescore():
        from cupy_dsa.sglang import check as check_cmd

        assert_check_command_says(MODE, ("int8 residual pages) and a rescored top-k (264 B per entry)",
                                         "stage 1 = SGLang's own fp8 logits call", "K' = 4x index_topk",
                                         ",c4idx:fp8-rescore",
                                         f"stage 2 with the rotated q rounded to bf16 once (the head weights without a "
                                         f"q scale) ({STAGE2_Q} unset: the mode's default)"))
        with settings_env(kprime="4y"):
            mode, lines = check_cmd._mode_lines()
            assert mode is None and lines[0][0] == check_cmd.PROBLEM and f"{KPRIME}='4y'" in lines[0][1], lines
