"""cupy_dsa's forward of SGLang's ``C4IndexerBackendMixin.forward_c4_indexer`` (the H3 hook calls it): SGLang's
steps in SGLang's order, with the logits from cupy_dsa over the mode's index cache (bf16 rows, or SGLang's fp8 rows
in fp8-cupy), or in fp8-rescore the two-stage top-k of two-level keys in place of SGLang's top-k, and the route that
picks how a forward's rows are launched. Imports SGLang only inside functions."""

from __future__ import annotations

import torch

from .. import layouts
from . import core
from .modes import ENV_NAME, index_k_mode


def _match_rows(t: torch.Tensor, rows: int, value) -> torch.Tensor:
    """SGLang's ``match_num_queries``: trim, or pad the row dimension with ``value``."""
    if t.shape[0] == rows:
        return t
    if t.shape[0] > rows:
        return t[:rows]
    pad = (0, 0) * (t.dim() - 1) + (0, rows - t.shape[0])
    return torch.nn.functional.pad(t, pad, value=value)


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


ROUTE_ROWS, ROUTE_GROUPED, ROUTE_VARLEN = "rows", "grouped", "varlen"


def logits_route(ix, self, forward_batch, rows: int) -> tuple[str, int]:
    """How this forward's rows are launched, ``(route, next_n)``:

    * ``grouped`` (MTP target verify with SGLang's uniform layout: every request n consecutive rows built from
      one repeated page-table row, ``make_forward_metadata_from_raw_verify`` / ``expand_extend_with_same_length``):
      one request of next_n = n per request, its pages read once;
    * ``varlen`` (EXTEND / MIXED: requests own consecutive rows, ``forward_batch.extend_seq_lens``): one
      ``mqa_logits`` launch over all requests, 4-row tiles inside each request;
    * ``rows`` otherwise (decode; ragged verify, context parallel, two-batch overlap, late-layer tails, a
      rewritten batch): SGLang's one row per token, as its own paged path runs them."""
    mode = forward_batch.forward_mode
    if not (mode.is_target_verify() or mode == ix.ForwardMode.EXTEND or mode == ix.ForwardMode.MIXED):
        return ROUTE_ROWS, 1
    if (getattr(forward_batch, "tbo_parent_token_range", None) is not None
            or getattr(forward_batch, "_original_forward_mode", None) is not None
            or ix.get_parallel().attn_cp_size != 1):
        return ROUTE_ROWS, 1
    if mode.is_target_verify():
        n = _uniform_verify_rows(self, forward_batch, rows)
        return (ROUTE_GROUPED, n) if n > 1 else (ROUTE_ROWS, 1)
    if mode == ix.ForwardMode.EXTEND or mode == ix.ForwardMode.MIXED:
        if getattr(self.forward_metadata, "late_layer_tail", None) is not None:
            return ROUTE_ROWS, 1
        lens = getattr(forward_batch, "extend_seq_lens", None)
        lens_cpu = getattr(forward_batch, "extend_seq_lens_cpu", None)
        if (isinstance(lens, torch.Tensor) and lens.dim() == 1 and lens.shape[0] > 0 and lens_cpu is not None
                and len(lens_cpu) == lens.shape[0] and 0 < sum(int(n) for n in lens_cpu) <= rows):
            return ROUTE_VARLEN, 1
    return ROUTE_ROWS, 1


def _uniform_verify_rows(self, forward_batch, rows: int) -> int:
    """n when this target-verify batch has SGLang's uniform layout (n = speculative_num_draft_tokens rows per
    request, 2 <= n <= 4, rows = bs * n), else 0 (ragged verify, the DSpark draft runner, other shapes)."""
    from sglang.srt.speculative.ragged_verify import (RaggedVerifyMode, read_ragged_verify_mode,
                                                      resolve_ragged_verify_layout)

    n = getattr(self, "speculative_num_draft_tokens", None)
    if not isinstance(n, int) or not 2 <= n <= 4 or rows % n or getattr(self, "is_dspark_draft", False):
        return 0
    if (resolve_ragged_verify_layout(forward_batch) is not None
            and read_ragged_verify_mode() is RaggedVerifyMode.COMPACT):
        return 0
    return n


def forward_c4_indexer_bf16(self, *, x, q_lora, c4_indexer, forward_batch, alt_streams=None,
                            enable_multi_stream=False, q_lora_ready=None, skip_compressor=False,
                            q_lora_quant=None) -> None:
    """``C4IndexerBackendMixin.forward_c4_indexer`` with cupy_dsa's logits (same steps, same order) over bf16 index
    keys, or over SGLang's fp8 keys in fp8-cupy (the name predates that mode)."""
    from sglang.srt.layers.attention.dsv4 import indexer as ix

    if forward_batch.forward_mode.is_idle():
        return
    pool = self.token_to_kv_pool
    metadata = self.forward_metadata
    indexer_metadata = metadata.indexer_metadata
    core_metadata = metadata.core_metadata

    positions = core_metadata.positions
    n = min(x.shape[0], q_lora.shape[0], positions.shape[0])
    if x.shape[0] != n:
        x = x[:n]
    if q_lora.shape[0] != n:
        q_lora = q_lora[:n]
        q_lora_quant = None
    if positions.shape[0] != n:
        positions = positions[:n]

    q_rescore = weights_rescore = None
    rec, query = core.mode_record(), core.index_query()
    if query != "fp8":
        # a query cupy_dsa prepares (bf16, or bf16-reference's FP4-simulated one) from the layer's own projections;
        # in two-level scoring it is stage 2's, beside SGLang's fp8 q for stage 1. Then the compressor, as
        # _forward_prepare_normal orders them, on one stream (the multi-stream split only overlaps SGLang's own q
        # kernel with the weights projection)
        if q_lora_ready is not None:
            torch.cuda.current_stream(q_lora.device).wait_event(q_lora_ready)
        q_proj, w_proj = core.project_query(c4_indexer, x, q_lora, q_lora_quant)
        if rec.two_level:
            q, weights = ix.fused_q_indexer_rope_hadamard_quant(q_proj, w_proj, c4_indexer.weight_scale,
                                                                c4_indexer.freqs_cis, positions)
            q_rescore, weights_rescore = core.prepare_query(q_proj, w_proj, c4_indexer, positions, query)
            weights_rescore = weights_rescore.squeeze(2)
        else:
            q, weights = core.prepare_query(q_proj, w_proj, c4_indexer, positions, query)
        if not skip_compressor:
            self.forward_indexer_compressor(x=x, forward_batch=forward_batch, layer_id=c4_indexer.layer_id,
                                            compressor=c4_indexer.compressor)
    elif enable_multi_stream:
        q, weights = self._forward_prepare_multi_stream(
            x=x, q_lora=q_lora, c4_indexer=c4_indexer, positions=positions, forward_batch=forward_batch,
            alt_streams=alt_streams, q_lora_ready=q_lora_ready)
    else:
        if q_lora_ready is not None:
            raise ValueError("q_lora_ready: only the multi-stream prepare path takes an event")
        q, weights = self._forward_prepare_normal(
            x=x, q_lora=q_lora, c4_indexer=c4_indexer, positions=positions, forward_batch=forward_batch,
            skip_compressor=skip_compressor, q_lora_quant=q_lora_quant)
    if q.dim() != 3 or weights.dim() != 3:
        raise ValueError(f"cupy_dsa indexer: expected q [rows, 64, 128] and weights [rows, 64, 1], got "
                         f"{tuple(q.shape)} and {tuple(weights.shape)}")
    weights = weights.squeeze(2)
    rows = q.shape[0]

    lens = _match_rows(indexer_metadata.compressed_seq_lens, rows, 1)
    page_table = _match_rows(indexer_metadata.page_table, rows, 0)
    page_indices = _match_rows(core_metadata.c4_sparse_page_indices, rows, -1)
    route, next_n = logits_route(ix, self, forward_batch, rows)
    if self.debug_use_external_c4_sparse_indices:
        return

    capturer = ix.get_global_indexer_capturer()
    hisparse = self.hisparse_coordinator
    hisparse_decode = hisparse is not None and forward_batch.forward_mode.is_decode()
    raw_indices = None
    if core_metadata.c4_sparse_raw_indices is not None:
        raw_indices = core_metadata.c4_sparse_raw_indices
    elif capturer is not None:
        raw_indices = torch.empty_like(page_indices)
    elif hisparse_decode:
        raw_indices = hisparse.raw_indices_buffer[: page_indices.size(0)]

    all_rows = slice(0, rows)
    page_size = indexer_metadata.compressed_page_size
    backend = self.dsa_topk_backend

    def run_topk(r: slice, logits: torch.Tensor, topk_plan=None) -> None:
        raw = raw_indices[r] if raw_indices is not None else None
        if backend.is_torch():
            ix.topk_transform_pytorch_vectorized(logits, lens[r], page_table[r], page_indices[r], page_size, raw)
        elif backend.is_flashinfer():
            self.flashinfer_topk_transform(logits, lens[r], page_table[r], page_indices[r], page_size, raw)
        elif backend.should_use_topk_v2():
            if topk_plan is None:
                topk_plan = indexer_metadata.topk_metadata if r == all_rows else ix.plan_topk_v2(lens[r])
            ix.topk_transform_paged_v2(logits, lens[r], page_table[r], page_indices[r], page_size, topk_plan,
                                       raw)
        else:
            ix.topk_transform_paged(logits, lens[r], page_table[r], page_indices[r], page_size, raw)

    kvcache = pool.get_index_k_with_scale_buffer(layer_id=c4_indexer.layer_id)  # keeps HiCache's layer wait
    expected = rec.cache_layout
    if core.index_cache_layout(kvcache) != expected:
        raise RuntimeError(
            f"cupy_dsa ({ENV_NAME}={index_k_mode()}): the C4 index cache of layer {c4_indexer.layer_id} has "
            f"{tuple(kvcache.shape)} {kvcache.dtype} page rows, expected uint8 [P, {layouts.page_bytes(expected)}] "
            f"({expected} index keys). The pool was sized in another mode (or with the switch off): set {ENV_NAME} "
            f"before SGLang starts (every scheduler process must see it) and check that SGLANG_PLUGINS, if set, "
            f"lists cupy_dsa.")

    width = indexer_metadata.max_compressed_seq_len
    capturing = _capturing(q.device)
    rows_per_chunk = indexer_metadata.rows_per_chunk
    if route == ROUTE_GROUPED and rows_per_chunk is not None and rows_per_chunk < rows and rows_per_chunk % next_n:
        route, next_n = ROUTE_ROWS, 1  # SGLang's chunks would split a request's draft rows
    if rec.two_level:
        _rescored_topk(self, ix, forward_batch, c4_indexer, q=q, weights=weights, lens=lens, page_table=page_table,
                       page_indices=page_indices, raw_indices=raw_indices, kvcache=kvcache, route=route,
                       next_n=next_n, capturing=capturing, q_rescore=q_rescore, weights_rescore=weights_rescore)
        _epilogue(self, forward_batch, c4_indexer, hisparse, hisparse_decode, raw_indices, capturer)
        return
    chunks = core.row_chunks(rows, rows_per_chunk, width, capturing, multiple=next_n)
    topk_plans = indexer_metadata.topk_metadata_chunks
    if (topk_plans is None or rows_per_chunk is None or len(topk_plans) != len(chunks)
            or rows != indexer_metadata.compressed_seq_lens.shape[0]
            or any(c.stop - c.start != min(rows_per_chunk, rows - c.start) for c in chunks)):
        topk_plans = None
    plans = core.ForwardPlans.for_layer(indexer_metadata, indexer_metadata.compressed_seq_lens, c4_indexer.layer_id)
    if route == ROUTE_VARLEN:
        def build_requests():
            return core.extend_requests(forward_batch.extend_seq_lens, page_table, rows)
        cu_rows, block_table = plans.get(("requests",), build_requests) if plans else build_requests()
        ks = torch.zeros_like(lens, dtype=torch.int32)
        ke = lens.to(torch.int32)
        if backend.is_sgl_kernel():
            # sgl-kernel top-k fills rows with len <= topk without reading logits: skip their keys
            ke = torch.where(ke > c4_indexer.index_topk, ke, ks)
    for i, r in enumerate(chunks):
        if route == ROUTE_VARLEN:
            logits = core.extend_logits(q, weights, ks, ke, cu_rows, block_table, kvcache, r, plans)
        elif route == ROUTE_GROUPED:
            logits = core.verify_logits(q, weights, lens, page_table, kvcache, width, next_n, r, plans)
        else:
            logits = core.paged_logits(q, weights, lens, page_table, kvcache, width, r, plans)
        run_topk(r, logits, topk_plans[i] if topk_plans is not None else None)
        del logits
    _epilogue(self, forward_batch, c4_indexer, hisparse, hisparse_decode, raw_indices, capturer)


def _epilogue(self, forward_batch, c4_indexer, hisparse, hisparse_decode, raw_indices, capturer) -> None:
    """SGLang's steps after the top-k: HiSparse's swap-in or translation of the page indices, the top-k capturer."""
    pool = self.token_to_kv_pool
    indexer_metadata = self.forward_metadata.indexer_metadata
    core_metadata = self.forward_metadata.core_metadata
    if hisparse is not None:
        compress_layer_id = pool.layer_mapping[c4_indexer.layer_id].compress_layer_id
        if hisparse_decode:
            core_metadata.c4_sparse_page_indices = hisparse.swap_in_selected_pages(
                req_pool_indices=forward_batch.req_pool_indices,
                compressed_seq_lens=indexer_metadata.compressed_seq_lens,
                top_k_result=raw_indices, layer_id=compress_layer_id)
        else:
            # FlashMLA's C4 attention takes int32 page indices
            core_metadata.c4_sparse_page_indices = pool.c4_kv_pool.translate_loc_to_hisparse_device(
                core_metadata.c4_sparse_page_indices).to(torch.int32)

    if capturer is not None:
        capturer.capture(pool.layer_mapping[c4_indexer.layer_id].compress_layer_id, raw_indices)


# --------------------------------------------------------------------------------------------------
# fp8-rescore: the two-stage top-k in place of SGLang's top-k
# --------------------------------------------------------------------------------------------------

def sglang_fp8_logits_fn(ix):
    """``(fn, lens_2d)``: the fp8 paged logits function SGLang 0.5.23's ``forward_c4_indexer`` picks for fp8 keys (its
    own order: TileLang, aiter, torch (sm120 variant on sm120), XPU's Triton, DeepGEMM), and whether it takes 2-D
    lengths ``[R, 1]`` (DeepGEMM and XPU) rather than ``[R]``; imported as SGLang imports it, on first use."""
    envs = ix.envs
    if envs.SGLANG_OPT_USE_TILELANG_INDEXER.get():
        from sglang.kernels.ops.attention.dsa.tilelang_kernel import tilelang_fp8_paged_mqa_logits as fn
        return fn, False
    if envs.SGLANG_OPT_USE_AITER_INDEXER.get():
        return ix._aiter_fp8_paged_mqa_logits, False
    if envs.SGLANG_FP8_PAGED_MQA_LOGITS_TORCH.get():
        return (ix.fp8_paged_mqa_logits_torch_sm120 if ix.get_platform().is_sm120 else ix.fp8_paged_mqa_logits_torch,
                False)
    if ix.is_xpu():
        from sgl_kernel import fp8_paged_mqa_logits_triton as fn
        return fn, True
    from deep_gemm import fp8_paged_mqa_logits as fn
    return fn, True


_LOGGED_SELECTS: set = set()


def _log_candidate_select(choice) -> None:
    """Says once per process which select picks fp8-rescore's candidates (and again if it changes)."""
    if choice not in _LOGGED_SELECTS:
        _LOGGED_SELECTS.add(choice)
        import logging

        logging.getLogger("cupy_dsa").info("cupy_dsa: fp8-rescore %s", choice.describe())


def _rescored_topk(self, ix, forward_batch, c4_indexer, *, q, weights, lens, page_table, page_indices, raw_indices,
                   kvcache, route, next_n, capturing, q_rescore=None, weights_rescore=None) -> None:
    """fp8-rescore: each row's top ``index_topk`` (the width of SGLang's page-index buffer, as its own top-k fills
    it) chosen among its K' best stage-1 fp8 logits by their scores from the hi and lo pages
    (``cupy_dsa.rescore``), written in SGLang's form: ``c4_sparse_page_indices`` (``page_table[r, i // 64] * 64 + i %
    64``, int32, -1 padded) and the raw positions where SGLang keeps them; SGLang's top-k is not called.

    Stage 1 (``SGLANG_CUPY_DSA_RESCORE_STAGE1``): ``sglang`` calls the fp8 logits function SGLang's own forward
    would call, on its row chunks with its schedules (one row per token, unmasked logits; stage 2 per row), and
    SGLang's own top-k for the step picks the K' candidates where it takes K' (``candidates``: v2 at K' <= 2048, v1
    at K' <= 1024, with SGLang's plans; else cupy_dsa's select); ``cupy`` runs cupy_dsa's fp8-key kernels and
    select on the plugin's routes (decode rows, grouped verify, varlen extend), with the forward's plans built by
    its first C4 layer.

    Stage 2 (the query setting, ``SGLANG_CUPY_DSA_INDEX_Q``) scores the candidates with ``q_rescore`` / ``weights_rescore`` (the bf16
    query and its weights, ``[rows, 64, 128]`` / ``[rows, 64]``) when given, else with stage 1's fp8 q and weights."""
    if getattr(forward_batch, "tbo_parent_token_range", None) is not None:
        raise RuntimeError(f"cupy_dsa ({ENV_NAME}={index_k_mode()}): a two-batch-overlap micro-batch reached the indexer; "
                           f"fp8-rescore refuses --enable-two-batch-overlap at start-up and was not written for it")
    settings = core.rescore_settings()
    lo = core.require_lo_cache(kvcache, f"the indexer of layer {c4_indexer.layer_id}")
    indexer_metadata = self.forward_metadata.indexer_metadata
    rows = q.shape[0]
    index_topk = page_indices.shape[1]
    k_prime = settings.k_prime(index_topk)

    stage2 = dict(q_rescore=q_rescore, weights_rescore=weights_rescore)

    def put(r: slice, res) -> None:
        page_indices[r].copy_(res.page_indices)
        if raw_indices is not None:
            raw_indices[r].copy_(res.raw_indices)

    if settings.stage1 == "sglang":
        from . import candidates

        fn, lens_2d = sglang_fp8_logits_fn(ix)
        kv = kvcache.view(kvcache.shape[0], layouts.PAGE_SLOTS, 1, layouts.FP8_BYTES_PER_TOKEN)
        c4sl = lens.unsqueeze(-1) if lens_2d else lens
        schedule = indexer_metadata.deep_gemm_metadata
        if isinstance(schedule, list):  # SGLang's row chunks, one schedule each
            if rows != indexer_metadata.compressed_seq_lens.shape[0]:
                raise RuntimeError(f"cupy_dsa: chunk schedules were built for "
                                   f"{indexer_metadata.compressed_seq_lens.shape[0]} rows, got {rows}")
            chunks = list(ix.iter_row_chunks(num_rows=rows, rows_per_chunk=indexer_metadata.rows_per_chunk))
            schedules = schedule
        elif schedule is None:  # SGLang's torch route plans no chunks (no schedule): the plugin's budget holds
            chunks = core.row_chunks(rows, None, indexer_metadata.max_compressed_seq_len, capturing)
            schedules = [None] * len(chunks)
        else:
            chunks, schedules = [slice(0, rows)], [schedule]
        choice = candidates.select_of_backend(self, k_prime, settings.stage1)
        _log_candidate_select(choice)
        for i, (r, sched) in enumerate(zip(chunks, schedules)):
            logits = fn(q[r].unsqueeze(1), kv, weights[r], c4sl[r], page_table[r], sched,
                        indexer_metadata.max_compressed_seq_len, False)
            given = None
            if choice.sglang:
                # SGLang's own plan for its row chunks (or all rows); a chunk of the plugin's budget gets its own
                plan = candidates.v2_plan(choice, indexer_metadata, lens, r, len(chunks) == 1,
                                          i if isinstance(schedule, list) else None)
                given = candidates.select_candidates(choice, logits, lens[r], page_table[r], index_topk, k_prime,
                                                      plan)
            put(r, core.rescore_rows(q, weights, lens, page_table, kvcache, lo, r, index_topk, k_prime,
                                     stage1_logits=logits, candidates=given, **stage2))
            del logits, given
        return

    width = indexer_metadata.max_compressed_seq_len
    chunks = core.row_chunks(rows, indexer_metadata.rows_per_chunk, width, capturing, multiple=next_n)
    plans = core.ForwardPlans.for_layer(indexer_metadata, indexer_metadata.compressed_seq_lens, c4_indexer.layer_id)
    if route == ROUTE_VARLEN:
        def build_requests():
            return core.extend_requests(forward_batch.extend_seq_lens, page_table, rows)
        cu_rows, block_table = plans.get(("requests",), build_requests) if plans else build_requests()
    for r in chunks:
        if route == ROUTE_VARLEN:
            res = core.rescore_extend(q, weights, lens, cu_rows, block_table, kvcache, lo, r, index_topk, k_prime,
                                      plans, **stage2)
        elif route == ROUTE_GROUPED:
            res = core.rescore_verify(q, weights, lens, page_table, kvcache, lo, next_n, r, index_topk, k_prime, plans,
                                      **stage2)
        else:
            res = core.rescore_rows(q, weights, lens, page_table, kvcache, lo, r, index_topk, k_prime, plans, **stage2)
        put(r, res)
