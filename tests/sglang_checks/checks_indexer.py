"""Scenario "on", part: forward_c4_indexer, SGLang's own (fp8) vs hooked (bf16); the indexer set-up and the
route spies the fp8cupy scenario uses too."""
from __future__ import annotations

import contextlib
import os
import types

import torch

from cupy_dsa.sglang import core, forward

from harness import check, INFO, make_index_pool, mode_env


def _indexer_setup(lens=(2000, 1500, 2560), topk=512, seed=None, one_request=False, groups=None, reference=False,
                   two_level=False, keys=None, q=None, w=None, layer=None):
    """groups: rows per request (consecutive rows of a request share its page table), as SGLang lays out an
    extend or a verify batch; one_request = one group of every row. reference: the bf16 pool holds FP4-simulated
    keys, the indexer layer has SGLang's projections (bf16 wq_b output and weights_proj output, the RoPE table)
    for bf16-reference to build its query from, and the oracle is DeepSeek-V4's reference numerics in fp64.
    two_level: the keys also go into an fp8-rescore pool (SGLang's fp8 pages and their residual pages, written by
    cupy_dsa.rescore's reference store); returns a namespace (run, pool, keys, q, w, page_table, lens, ...).
    keys / q / w: given instead of drawn (fp32 [2560, 128], [rows, 64, 128] fp8, [rows, 64]); layer: the indexer layer
    the forward gets (one with SGLang's projections) instead of a bare one."""
    if seed is None:
        seed = int(os.environ.get("CUPY_DSA_SEED", "0"))
    from sglang.srt.layers.attention.dsa.dsa_topk_backend import DSATopKBackend
    from sglang.srt.layers.attention.dsv4.indexer import C4IndexerBackendMixin
    from sglang.srt.layers.attention.dsv4.metadata import PagedIndexerMetadata
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    g = torch.Generator().manual_seed(seed)
    n_slots, n_pages = 2560, 40
    drawn = torch.randn(n_slots, 128, generator=g)                     # slot = loc; pages 0..39 used
    keys = drawn if keys is None else keys
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

    two_level_pool = None
    if two_level:
        from cupy_dsa.rescore import store_two_level_reference

        with mode_env("fp8-rescore"):
            two_level_pool = make_index_pool()
        store_two_level_reference(keys, two_level_pool.index_k_with_scale_buffer[0],
                                  two_level_pool.index_k_lo_buffer[0], torch.arange(n_slots))

    rows = len(lens)
    drawn_q = torch.randn(rows, 64, 128, generator=g).to(torch.float8_e4m3fn)
    drawn_w = torch.rand(rows, 64, generator=g)
    q = drawn_q if q is None else q
    w = drawn_w if w is None else w
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
    c4 = layer if layer is not None else types.SimpleNamespace(layer_id=0, use_fp4_indexer=False, index_topk=topk)
    if reference:  # fp64 score bounds over the query's FP4 box: centre +- radius per element, relu monotone
        (q_lo, q_hi), w, c4 = _reference_layer(c4, rows, g)
        q, kr = (q_lo + q_hi) / 2, kr.double()
        radius = torch.einsum("rhd,rnd->rhn", (q_hi - q_lo) / 2, kr.abs())
        centre = torch.einsum("rhd,rnd->rhn", q, kr)
        score_bounds = [(torch.relu(centre + sign * radius) * w[:, :, None]).sum(1) for sign in (-1, 1)]
        INFO["reference_q_elements_at_a_rounding_boundary"] = int((q_hi != q_lo).sum())
    else:
        ref_logits = (torch.relu(torch.einsum("rhd,rnd->rhn", q.to(kr.dtype), kr)) * w[:, :, None].to(kr.dtype)).sum(1)
        ref_sets = [set(ref_logits[r, :lens[r]].topk(min(topk, lens[r])).indices.tolist()) for r in range(rows)]

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

    def run(pool, mode_=ForwardMode.DECODE, batch=rows, topk_backend=None):
        b = Backend(pool, mode_, batch)
        if topk_backend is not None:  # --dsa-topk-backend (the set-up's own: torch, SGLang's CPU-capable one)
            b.dsa_topk_backend = DSATopKBackend(topk_backend)
        x = torch.zeros(rows, 16)
        b.forward_c4_indexer(x, x, c4, b.forward_batch)
        return b.forward_metadata.core_metadata, page_table

    if reference:
        return run, score_bounds, bf16_pool, lens
    if two_level:
        return types.SimpleNamespace(run=run, pool=two_level_pool, fp8_pool=fp8_pool, keys=keys, q=q, w=w,
                                     page_table=page_table, lens=lens, topk=topk, Backend=Backend)
    return run, ref_sets, bf16_pool, fp8_pool, lens


def _reference_layer(c4, rows, g, max_pos=4096):
    """An indexer layer with SGLang's projections for bf16-reference, and the fp64 oracle of DeepSeek-V4's
    reference query: (q_box, w_ref [rows, 64] fp64, layer). q_box = (lo, hi) fp64 [rows, 64, 128]: every FP4 value
    the query may round to, since an element (or a block's amax) within fp32 error of a rounding boundary rounds
    either way (an element at 0.87500002 in fp64 came out 0.875 - ulp in fp32 and rounded down a code)."""
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
    x = z @ had
    lo, hi = _fp4_box(x)
    once = fp4sim_reference(x.float()).double()  # the box holds the fp64 value's own rounding
    assert bool(((lo <= once) & (once <= hi)).all()), "the oracle's FP4 box misses the value's rounding"
    return (lo, hi), w_raw.double() * weight_scale, layer


def _fp4_box(x: torch.Tensor, rel: float = 1e-5):
    """(lo, hi): the bounds of e2m1 rounding (a power-of-two scale per 32 elements, from the block's amax) over
    every x' within rel * (the 128-vector's max |x|) of x, fp64. rel is far above fp32's error in RoPE and the
    Hadamard butterfly (~1e-6) and far below a code's width (>= 1/12 of the block's amax)."""
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
    cuts = (grid[1:] + grid[:-1]) / 2
    blocks = x.reshape(*x.shape[:-1], 4, 32)
    slack = rel * x.abs().amax(-1, keepdim=True)[..., None]
    amax = blocks.abs().amax(-1, keepdim=True)

    def rounded(v, scale):  # monotone in v for a fixed scale, as nearest rounding is
        return torch.sign(v) * grid[torch.bucketize((v.abs() / scale).contiguous(), cuts)] * scale

    def scale_of(a):
        return torch.exp2(torch.ceil(torch.log2(a.clamp_min(1e-30) / 6.0)))

    ends = torch.stack([rounded(blocks + d, scale_of(amax + e)) for d in (-slack, slack) for e in (-slack, slack)])
    return ends.amin(0).reshape(x.shape), ends.amax(0).reshape(x.shape)


@contextlib.contextmanager
def one_attention_cp_rank():
    """SGLang's extend and verify paths ask get_parallel() for the attention context-parallel size, which only a
    server sets up: one rank here."""
    from sglang.srt.layers.attention.dsv4 import indexer as ix

    orig = ix.get_parallel
    ix.get_parallel = lambda: types.SimpleNamespace(attn_cp_size=1)
    try:
        yield
    finally:
        ix.get_parallel = orig


@contextlib.contextmanager
def hisparse_decode(seen: dict, holder: dict):
    """Stand-ins for SGLang's HiSparse coordinator and top-k capturer while the forward inside runs in decode mode
    with a coordinator on the backend (and no prefill raw-index buffer): ``seen["swap"]`` gets the coordinator's
    arguments (it answers page indices of 42), ``seen["capture"]`` the capturer's, ``holder["b"]`` the backend."""
    from sglang.srt.layers.attention.dsv4 import indexer as ix

    class Coordinator:
        raw_indices_buffer = torch.full((8, 512), -7, dtype=torch.int32)

        def swap_in_selected_pages(self, **kw):
            seen["swap"] = kw
            return torch.full((2, 512), 42, dtype=torch.int32)

    class Capturer:
        def capture(self, layer, raw):
            seen["capture"] = (layer, raw)

    orig_cap, orig_fwd = ix.get_global_indexer_capturer, forward.forward_c4_indexer_bf16

    def with_hisparse(self, **kw):
        self.hisparse_coordinator = Coordinator()
        self.forward_metadata.core_metadata.c4_sparse_raw_indices = None
        kw["forward_batch"].req_pool_indices = torch.tensor([3, 4])
        holder["b"] = self
        return orig_fwd(self, **kw)

    ix.get_global_indexer_capturer = lambda: Capturer()
    forward.forward_c4_indexer_bf16 = with_hisparse
    try:
        yield
    finally:
        ix.get_global_indexer_capturer, forward.forward_c4_indexer_bf16 = orig_cap, orig_fwd


@contextlib.contextmanager
def spied_logits_routes(keys):
    """Spies on cupy_dsa's three logits routes, yielding the calls they get [(route, args)], with SGLang's fp8
    non-paged reader refused: the hooked forward must never consult it (``keys``: what its failure names)."""
    from sglang.srt.layers.attention.dsv4 import indexer as ix

    calls = []
    real = {name: getattr(core, name) for name in ("paged_logits", "verify_logits", "extend_logits")}

    def spy(name):
        def f(*a, **k):
            calls.append((name, a))
            return real[name](*a, **k)
        return f

    def nonpaged_reader(*a, **k):
        raise AssertionError(f"SGLang's fp8 non-paged reader was consulted {keys}")

    mixin = ix.C4IndexerBackendMixin
    orig_np = mixin._can_use_nonpaged_indexer, mixin._get_nonpaged_indexer_plan
    for name in real:
        setattr(core, name, spy(name))
    mixin._can_use_nonpaged_indexer = mixin._get_nonpaged_indexer_plan = nonpaged_reader
    try:
        yield calls
    finally:
        for name, f in real.items():
            setattr(core, name, f)
        mixin._can_use_nonpaged_indexer, mixin._get_nonpaged_indexer_plan = orig_np


def _recall(raw, ref_sets):
    out = []
    for r, ref in enumerate(ref_sets):
        got = {int(i) for i in raw[r].tolist() if i >= 0}
        out.append(len(got & ref) / len(ref))
    return out


def indexer_checks():

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
        run, _, bf16_pool, _, _ = _indexer_setup(**setup)
        rows_md, _ = run(bf16_pool)  # DECODE: every row its own request (SGLang's paged path as it calls it)
        with one_attention_cp_rank(), spied_logits_routes("with bf16 keys") as calls:
            md, _ = run(bf16_pool, mode_, batch)
        got = [set(r.tolist()) - {-1} for r in md.c4_sparse_raw_indices]
        exp = [set(r.tolist()) - {-1} for r in rows_md.c4_sparse_raw_indices]
        return got, exp, [route for route, _ in calls]

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
        # keys, on the decode, varlen extend and grouped verify routes; top-k = the fp64 oracle's up to ties and up
        # to query elements within fp32 error of an FP4 rounding boundary (the oracle bounds scores over both codes)
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        cases = ((ForwardMode.DECODE, dict(lens=(2000, 1500, 2560))),
                 (ForwardMode.EXTEND, dict(lens=(900, 901, 1300, 600, 601, 602, 2000), groups=(2, 4, 1))),
                 (ForwardMode.TARGET_VERIFY, dict(lens=(1000, 1001, 1300, 1301), groups=(2, 2))))
        with one_attention_cp_rank():
            with mode_env("bf16-reference"):
                for mode_, setup in cases:
                    run, (lowest, highest), pool, lens = _indexer_setup(reference=True, **setup)
                    md, _ = run(pool, mode_, len(setup.get("groups", lens)))
                    for r, n in enumerate(lens):
                        got = [int(i) for i in md.c4_sparse_raw_indices[r].tolist() if i >= 0]
                        k = min(512, n)
                        assert len(got) == k == len(set(got)), (mode_, r, len(got))
                        # a selected key's highest score reaches the k-th lowest score, up to fp32-accumulation ties
                        # (where no query element is at a boundary, the bounds are one score: the oracle's top-k)
                        kth = lowest[r, :n].topk(k).values[-1]
                        worst = highest[r, got].min()
                        assert worst >= kth - 1e-5 * highest[r, :n].abs().max(), (mode_, r, float(worst), float(kth))

    @check
    def indexer_logits_budget_chunks_equal_unchunked():
        # without SGLang's row chunks (its torch route plans none) a prefill's logits are computed in chunks of the
        # plugin's budget (SGLANG_CUPY_DSA_LOGITS_BUDGET_MIB; here 3 rows' worth): the top-k equals the one-block run's
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        lens = tuple(900 + 97 * i for i in range(7))
        run, _, bf16_pool, _, _ = _indexer_setup(lens=lens, one_request=True)
        with one_attention_cp_rank(), spied_logits_routes("with bf16 keys") as calls:
            whole, _ = run(bf16_pool, ForwardMode.EXTEND, 1)
        assert [c[1][7] for c in calls] == [slice(0, 7)], calls
        row_bytes = 40 * 64 * 4   # the setup's page table: 40 pages of 64 entries, fp32 logits
        real_budget = core.logits_budget_bytes
        core.logits_budget_bytes = lambda: 3 * row_bytes
        try:
            with one_attention_cp_rank(), spied_logits_routes("with bf16 keys") as calls:
                chunked, _ = run(bf16_pool, ForwardMode.EXTEND, 1)
        finally:
            core.logits_budget_bytes = real_budget
        assert [c[1][7] for c in calls] == [slice(0, 3), slice(3, 6), slice(6, 7)], calls
        assert torch.equal(chunked.c4_sparse_raw_indices, whole.c4_sparse_raw_indices)
        assert torch.equal(chunked.c4_sparse_page_indices, whole.c4_sparse_page_indices)
        assert (whole.c4_sparse_raw_indices >= 0).sum() == 7 * 512

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
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        run, _, bf16_pool, _, _ = _indexer_setup(lens=(700, 900))
        seen, holder = {}, {}
        with hisparse_decode(seen, holder):
            run(bf16_pool, ForwardMode.DECODE)
        b = holder["b"]
        md = b.forward_metadata.core_metadata
        assert torch.equal(md.c4_sparse_page_indices, torch.full((2, 512), 42, dtype=torch.int32))
        raw = seen["swap"]["top_k_result"]
        assert raw.shape == (2, 512) and (raw >= 0).all(), "HiSparse did not get the raw top-k buffer"
        assert seen["swap"]["layer_id"] == 0 and torch.equal(seen["swap"]["req_pool_indices"], torch.tensor([3, 4]))
        assert seen["capture"][0] == 0 and seen["capture"][1] is raw
