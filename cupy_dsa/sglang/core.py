"""The parts of the SGLang plugin that do not need SGLang: the store and logits glue, fp8-rescore's routes and the
kernel warm-up. The switch and its settings live in :mod:`.modes`; every name of it is re-exported here, so the
hooks and callers read the whole SGLang-free side as ``core.<name>``.

``hooks.py`` wires these into SGLang's hooks; the GPU test calls them directly with tensors shaped as
SGLang builds them (the H200 has no SGLang). Everything here takes torch tensors and runs the cupy_dsa ops,
which dispatch CPU tensors to the torch reference and CUDA tensors to the kernels.

CUDA-graph rules (SGLang captures decode and target-verify, ``forward_c4_indexer`` included): no host
sync, no allocation outside torch, kernels compiled and loaded before capture (:func:`ensure_warm`).
"""

from __future__ import annotations

import logging
import threading
import weakref

import torch

from cupy_dsa.layouts import BF16_PAGE_BYTES, FP8_PAGE_BYTES, PAGE_SLOTS

# the switch and its settings (re-exported: ``core.<name>`` is the plugin's one SGLang-free namespace)
from .modes import (  # noqa: F401
    ENV_NAME, CLI_FLAG, DEFAULT_MODE, QUERY_ENV, QUERY_FLAG, QUERY_CHOICES, RESCORE_STAGE1_ENV, RESCORE_KPRIME_ENV,
    RESCORE_STAGE1_FLAG, RESCORE_KPRIME_FLAG, STAGE1_CHOICES, DEFAULT_STAGE1, DEFAULT_KPRIME, RESCORE_ENVS,
    IndexMode, MODE_RECORDS, MODES, mode_table, parse_mode, record, StartupRefused, index_k_mode, mode_record,
    set_mode, reset_mode, env_vars, enabled, cache_layout, is_two_level, index_bytes_per_entry, numerics_of,
    describe, QUERY_TEXT, parse_query, query_of, index_query, describe_query, RescoreSettings, parse_stage1,
    parse_k_prime, parse_rescore_settings, rescore_settings_from_env, rescore_settings, settings_problem,
    pd_layout_tag, pd_layout_hint, LOGITS_BUDGET_ENV, DEFAULT_LOGITS_BUDGET_MIB, DEBUG_NONFINITE_ENV,
    HOOKED_SETTING_ENVS, parse_logits_budget_mib, logits_budget_bytes, parse_debug_nonfinite, debug_nonfinite,
    RENAMED_ENVS, MODEL_INDEX_TOPK
)

logger = logging.getLogger(__name__)

# Without SGLang's row-chunk plan (SGLANG_FP8_PAGED_MQA_LOGITS_TORCH=1 builds none) an eager call still
# bounds one fp32 logits block to LOGITS_BUDGET_ENV (default below); graph-captured calls are never split (fixed
# shapes).
MAX_EAGER_LOGITS_BYTES = DEFAULT_LOGITS_BUDGET_MIB << 20


# --------------------------------------------------------------------------------------------------
# Kernel warm-up (compile + module load outside any CUDA-graph capture)
# --------------------------------------------------------------------------------------------------

STORE_SOURCE = "store_index_k.cu"
LOGITS_SOURCE = "mqa_logits.cu"
QUERY_SOURCE = "prepare_index_q.cu"
RESCORE_SOURCE = "rescore_topk.cu"


def logits_q_dtype(mode: str, query: str) -> str:
    """The query dtype of the mode's one pass over every key (cupy_dsa's logits, or stage 1): ``"fp8"`` or
    ``"bf16"`` (the bf16 and fp4sim queries are bf16 tensors). Two-level scoring's first pass takes SGLang's fp8 q
    whatever the setting (the setting is stage 2's)."""
    return "fp8" if (MODE_RECORDS[mode].two_level or query == "fp8") else "bf16"


def warm_expressions(arch: str, *, mode: str, query: str | None = None, next_ns=(1,), kv_dtypes=(torch.bfloat16,),
                     stage1: str = "cupy") -> dict[str, list[str]]:
    """The kernel instantiations one SGLang server launches, ``{source_file: [name expressions]}``, read from the
    mode's record (:class:`IndexMode`) and its query (``query``; None: the mode's default): the store of the key
    format and numerics on SGLang's decode and prefill plan rows for the model's kv dtype (two-level: both pages
    in one launch), the logits of the cache layout for the first pass's q dtype (:func:`logits_q_dtype`) and the
    given ``next_ns`` (1, plus the MTP draft count), the query prep of a query cupy_dsa prepares (bf16, fp4sim; for
    bf16 head weights, ``weights_proj``'s dtype), and for two-level scoring the rescoring kernels of stage 2's query
    (no logits kernel of its own when SGLang's call computes stage 1, ``stage1="sglang"``). Everything else compiles
    on first use. The logits expressions are ``cupy_dsa.logits.product_instantiations``."""
    from cupy_dsa import launch, logits, query as query_prep, rescore, store

    rec = MODE_RECORDS[mode]
    query = rec.query if query is None else query
    if query not in rec.query_choices:
        raise ValueError(f"warm_expressions: {mode} does not take the query {query!r} (it takes "
                         f"{', '.join(rec.query_choices)})")
    product = launch.product_expressions(arch)
    kv_dtypes = tuple(d for d in kv_dtypes if d in (torch.float32, torch.bfloat16)) or (torch.bfloat16,)
    out = {STORE_SOURCE: store.product_instantiations(
        layouts=(rec.key_format,), numerics=(rec.key_numerics,), key_styles=("v4",),
        hadamard=(True,), in_dtypes=kv_dtypes, sources=("decode", "prefill"))}
    if not (rec.two_level and stage1 == "sglang"):
        q_fp8 = int(logits_q_dtype(mode, query) == "fp8")
        out[LOGITS_SOURCE] = logits.product_instantiations(arch, q_fp8=(q_fp8,), next_ns=tuple(sorted(set(next_ns))),
                                                           layouts=(rec.cache_layout,))
    if rec.two_level:  # the stage-2 instantiation of the one q type stage 2 gets (1: fp8, 0: bf16)
        unused = rescore.RESCORE.select(("stage2", 0 if query == "fp8" else 1), arch).expr
        out[RESCORE_SOURCE] = [e for e in rescore.product_instantiations(arch) if e != unused]
    if query != "fp8":
        out[QUERY_SOURCE] = query_prep.product_instantiations(numerics=(query,), weight_dtypes=(torch.bfloat16,))
    for filename, exprs in out.items():
        unknown = [e for e in exprs if e not in product.get(filename, ())]
        if unknown:
            raise RuntimeError(f"cupy_dsa warm-up: {filename} does not declare {unknown} as product configs on {arch}")
    return out


def server_next_ns(server_args) -> tuple[int, ...]:
    """next_n values a server can run: 1, plus the draft token count when speculative decoding (MTP) is on."""
    next_ns = {1}
    draft = getattr(server_args, "speculative_num_draft_tokens", None)
    if getattr(server_args, "speculative_algorithm", None) and draft:
        next_ns.add(int(draft))
    return tuple(sorted(next_ns))


_WARM_CONFIG = {"next_ns": (1,), "kv_dtypes": (torch.bfloat16,)}
_WARMED: set[tuple] = set()
_WARM_LOCK = threading.Lock()


def configure_warm(*, next_ns=None, kv_dtypes=None) -> None:
    """What :func:`ensure_warm` compiles (the plugin sets it from the server's arguments)."""
    if next_ns is not None:
        _WARM_CONFIG["next_ns"] = tuple(sorted(set(int(n) for n in next_ns)))
    if kv_dtypes is not None:
        _WARM_CONFIG["kv_dtypes"] = tuple(kv_dtypes)


def ensure_warm(device: torch.device) -> None:
    """Compile and load the server's kernels (:func:`warm_expressions`) on ``device``, once per process.

    SGLang's ``ModelRunner.init_cuda_graphs`` hook calls this before the first capture; the store and
    logits glue call it too, so an eager first call warms everything. A call that finds the device cold
    while the stream is capturing still compiles (host-only) and loads the modules, and logs a warning:
    a driver may refuse module loads during capture, which then surfaces as a capture error.
    """
    if device.type != "cuda":
        return
    idx = device.index if device.index is not None else torch.cuda.current_device()
    mode = index_k_mode()
    if not MODE_RECORDS[mode].hooked:  # the switch off (check's self-test): bf16's kernels
        mode, query = "bf16", "fp8"
    else:
        query = index_query()
    stage1 = rescore_settings().stage1 if MODE_RECORDS[mode].two_level else "cupy"
    key = (idx, mode, query, stage1, _WARM_CONFIG["next_ns"], _WARM_CONFIG["kv_dtypes"])
    if key in _WARMED:
        return
    with _WARM_LOCK:
        if key in _WARMED:
            return
        if torch.cuda.is_current_stream_capturing():
            logger.warning("cupy_dsa kernels were not warmed up before CUDA-graph capture on cuda:%d; "
                           "compiling now", idx)
        from cupy_dsa import runtime

        exprs = warm_expressions(runtime.device_arch(idx), mode=mode, query=query, next_ns=_WARM_CONFIG["next_ns"],
                                 kv_dtypes=_WARM_CONFIG["kv_dtypes"], stage1=stage1)
        n = runtime.warm_up_expressions(idx, exprs)
        from cupy_dsa import store

        if torch.cuda.is_available():  # made before any capture: graphs keep its pointer
            store.nonfinite_counter(torch.device("cuda", idx))
        logger.info("cupy_dsa: warmed %d kernel instantiations on cuda:%d for %s with the %s query (%s)", n, idx,
                    mode, query, ", ".join(f"{f}: {len(e)}" for f, e in exprs.items()))
        _WARMED.add(key)


# --------------------------------------------------------------------------------------------------
# Store (H2): SGLang's compress_norm_rope_store arguments -> the plan-native store (bf16 or SGLang's fp8 rows)
# --------------------------------------------------------------------------------------------------

def index_cache_layout(kvcache) -> str | None:
    """``"bf16"`` for uint8 ``[P, 16384]`` page rows, ``"fp8"`` for SGLang's uint8 ``[P, 8448]``, else None (the
    main C4 / C128 KV caches, fp4 index caches and anything else)."""
    if isinstance(kvcache, torch.Tensor) and kvcache.dtype == torch.uint8 and kvcache.dim() == 2:
        return {BF16_PAGE_BYTES: "bf16", FP8_PAGE_BYTES: "fp8"}.get(int(kvcache.shape[1]))
    return None


def is_bf16_index_cache(kvcache: torch.Tensor) -> bool:
    return index_cache_layout(kvcache) == "bf16"


# fp8-rescore's lo pages, by the hi buffer they belong to (SGLang's fp8 page rows of one C4 layer). The pool hook
# registers each pair at allocation; the store hook and the forward, which SGLang hands only the hi buffer, look the
# lo buffer up here. An entry holds the hi buffer weakly and answers only while that tensor is alive (a freed
# buffer's address reused by another tensor finds nothing).
_LO_PAGES: dict[tuple[str, int], tuple[weakref.ref, torch.Tensor]] = {}


def register_lo_cache(hi: torch.Tensor, lo: torch.Tensor) -> None:
    if lo.shape != hi.shape or lo.device != hi.device or lo.dtype != torch.uint8:
        raise ValueError(f"lo pages {lo.dtype} {tuple(lo.shape)} on {lo.device} do not match the fp8 page rows "
                         f"{hi.dtype} {tuple(hi.shape)} on {hi.device}")
    _LO_PAGES[(str(hi.device), hi.data_ptr())] = (weakref.ref(hi), lo)


def lo_cache_of(hi: torch.Tensor) -> torch.Tensor | None:
    """The lo pages of an fp8 index cache (its page rows, or a view of them at the same address), or None."""
    entry = _LO_PAGES.get((str(hi.device), hi.data_ptr()))
    if entry is None:
        return None
    owner, lo = entry
    base = owner()
    if base is None or base.data_ptr() != hi.data_ptr() or lo.shape[0] != hi.shape[0]:
        return None
    return lo


def require_lo_cache(hi: torch.Tensor, what: str) -> torch.Tensor:
    lo = lo_cache_of(hi)
    if lo is None:
        raise RuntimeError(
            f"cupy_dsa ({ENV_NAME}={index_k_mode()}): {what}: the fp8 index cache {tuple(hi.shape)} on {hi.device} has "
            f"no residual (lo) pages. They are allocated with SGLang's indexer pool when {ENV_NAME}={index_k_mode()} is set "
            f"before SGLang starts (every scheduler process must see it; SGLANG_PLUGINS, if set, must list cupy_dsa).")
    return lo


def rope_table(freq_cis: torch.Tensor) -> torch.Tensor:
    """SGLang passes complex64 ``[max_pos, 32]``; the store takes float32 ``[max_pos, 64]`` (cos, sin
    interleaved), which is the same memory viewed as real pairs (no copy)."""
    if freq_cis.is_complex():
        return torch.view_as_real(freq_cis).flatten(-2)
    return freq_cis


def store_index_k_bf16(kv: torch.Tensor, plan_rows: torch.Tensor, *, is_decode: bool, compress_ratio: int,
                       norm_weight: torch.Tensor, norm_eps: float, freq_cis: torch.Tensor,
                       out_loc: torch.Tensor, kvcache: torch.Tensor, mode: str,
                       lo_cache: torch.Tensor | None = None) -> None:
    """Write index keys for SGLang's plan rows (uint8 ``[N, 16]``) into ``kvcache``: bf16 rows (uint8
    ``[P, 16384]``) in the mode's numerics, or SGLang's fp8 rows (uint8 ``[P, 8448]``, fp8-cupy), the layout
    taken from the cache as the store does; with ``lo_cache`` (fp8-rescore) the fp8 rows and their residual pages
    in one launch."""
    import cupy_dsa

    if kv.is_cuda:
        ensure_warm(kv.device)
    if norm_weight.dtype != torch.float32:
        norm_weight = norm_weight.to(torch.float32)
    cupy_dsa.store_index_k_from_plan(
        kv, plan_rows, cache=kvcache, out_loc=out_loc, norm_weight=norm_weight, freqs_cis=rope_table(freq_cis),
        is_decode=bool(is_decode), compress_ratio=int(compress_ratio), eps=float(norm_eps),
        numerics=numerics_of(mode), key_style="v4", hadamard=True, lo_cache=lo_cache)
    if debug_nonfinite():
        report_nonfinite_keys(kv.device)


_NONFINITE_SEEN: dict = {}


def report_nonfinite_keys(device: torch.device) -> int:
    """With :data:`DEBUG_NONFINITE_ENV` = 1: log the non-finite index keys stored on ``device`` since the last
    report (a host sync; skipped while a CUDA graph is captured, where a sync is not allowed). Returns the new ones."""
    from cupy_dsa import store

    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return 0
    total = store.nonfinite_keys(device)
    new = total - _NONFINITE_SEEN.get(str(device), 0)
    _NONFINITE_SEEN[str(device)] = total
    if new > 0:
        logger.warning("cupy_dsa: %d non-finite index key(s) (NaN or infinity) stored on %s by this store, %d in this "
                       "process: their rows score NaN. Check the checkpoint and the layers before the indexer "
                       "(%s=1 reports this)", new, device, total, DEBUG_NONFINITE_ENV)
    return new


def project_query(c4_indexer, x: torch.Tensor, q_lora: torch.Tensor,
                  q_lora_quant=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's own projections, as SGLang's ``compute_q`` and ``compute_weights`` run them before its fused fp8 q
    kernel: ``wq_b``'s bf16 output (on ``q_lora`` or its fp8 group quant) ``[T, 64, 128]`` and ``weights_proj``'s
    head weights without any scale ``[T, 64]``."""
    weights = c4_indexer.compute_weights(x, skip_scale=True)
    q, _ = c4_indexer.wq_b(q_lora if q_lora_quant is None else q_lora_quant)
    return q.view(-1, c4_indexer.n_local_heads, c4_indexer.head_dim), weights


def prepare_query(q: torch.Tensor, weights: torch.Tensor, c4_indexer, positions: torch.Tensor,
                  numerics: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A query cupy_dsa prepares from :func:`project_query`'s outputs in one launch of
    ``cupy_dsa.prepare_index_q``, rotated as SGLang's fused q kernel rotates it (RoPE at ``positions`` from the
    layer's table, Hadamard-128, fp32, the same ``weight_scale``): ``numerics="bf16"`` (rounded to bf16 once, the
    weights without a q scale; SGLang never holds this query, its kernel keeps the rotated q in registers on the way
    to fp8) or ``"fp4sim"`` (DeepSeek-V4's reference query). Returns ``(bf16 [T, 64, 128], float32 [T, 64, 1])``."""
    import cupy_dsa

    if q.is_cuda:
        ensure_warm(q.device)
    q_out, w_out = cupy_dsa.prepare_index_q(q.contiguous(), weights, freqs_cis=rope_table(c4_indexer.freqs_cis),
                                            positions=positions, weight_scale=float(c4_indexer.weight_scale),
                                            numerics=numerics)
    return q_out, w_out.unsqueeze(2)


# --------------------------------------------------------------------------------------------------
# Logits (H3): one row chunk at a time, fp32 [rows, width] with a row stride % 4 == 0
# --------------------------------------------------------------------------------------------------

def _as_i32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 else t.to(torch.int32)


def _rows_call(q, weights, lens, page_table, rows: slice, plans, plan: bool = True):
    """The arguments of one ``paged_mqa_logits``-style launch over SGLang's rows as requests of one row each:
    (q ``[R, 1, 64, 128]``, weights, lengths, block table, {"plan": the chunk's schedule} when ``plans`` keeps
    them and ``plan``). Warms the kernels first."""
    import cupy_dsa

    if q.is_cuda:
        ensure_warm(q.device)
    lens_r = _as_i32(lens[rows]).contiguous()
    kw = {}
    if plans is not None and plan:
        kw["plan"] = plans.get(("rows", rows.start, rows.stop), lambda: cupy_dsa.paged_mqa_logits_plan(lens_r, 1))
    return q[rows].unsqueeze(1).contiguous(), weights[rows].contiguous(), lens_r, _as_i32(page_table[rows]), kw


def _verify_call(q, weights, lens, page_table, next_n: int, rows: slice, plans, op: str):
    """The arguments of one grouped launch over SGLang's uniform verify rows (rows ``[b*n, b*n + n)`` of the
    chunk are request b's, one page-table row each): (q ``[B, n, 64, 128]``, weights, 2-D lengths ``[B, n]``,
    block table ``[B, max_pages]`` (a strided view, no copy), {"plan": ...}). ``op`` names the caller in the
    error for a chunk that is not whole requests. Warms the kernels first."""
    import cupy_dsa

    if q.is_cuda:
        ensure_warm(q.device)
    count = rows.stop - rows.start
    if count % next_n:
        raise ValueError(f"{op}: rows {rows} are not whole requests of {next_n} rows")
    B = count // next_n
    lens_2d = _as_i32(lens[rows]).contiguous().view(B, next_n)
    kw = {}
    if plans is not None:
        kw["plan"] = plans.get(("verify", rows.start, rows.stop, next_n),
                               lambda: cupy_dsa.paged_mqa_logits_plan(lens_2d, next_n))
    block_table = _as_i32(page_table[rows])[::next_n]
    return (q[rows].contiguous().view(B, next_n, *q.shape[1:]), weights[rows].contiguous(), lens_2d, block_table,
            kw)


def paged_logits(q: torch.Tensor, weights: torch.Tensor, lens: torch.Tensor, page_table: torch.Tensor,
                 kvcache: torch.Tensor, max_len: int, rows: slice, plans: "ForwardPlans | None" = None) -> torch.Tensor:
    """SGLang's rows as requests of one row each (decode; any batch): ``q`` fp8 ``[R, 64, 128]``, ``weights``
    fp32 ``[R, 64]``, ``lens`` (compressed lengths) ``[R]``, ``page_table`` int32 ``[R, max_pages]``; returns
    fp32 ``[len(rows), max_len]``. ``plans`` keeps the forward's schedules (one per row chunk)."""
    import cupy_dsa

    q1, w, lens_r, block_table, kw = _rows_call(q, weights, lens, page_table, rows, plans)
    return cupy_dsa.paged_mqa_logits(q1, kvcache, w, lens_r, block_table, int(max_len), clean_logits=False, **kw)


def verify_logits(q: torch.Tensor, weights: torch.Tensor, lens: torch.Tensor, page_table: torch.Tensor,
                  kvcache: torch.Tensor, max_len: int, next_n: int, rows: slice,
                  plans: "ForwardPlans | None" = None) -> torch.Tensor:
    """MTP target-verify rows grouped by request: rows ``[b*n, b*n + n)`` of a chunk are request b's ``n`` draft
    rows (SGLang's uniform verify layout: the same page-table row, each row its own causal length), launched as
    one request of next_n = n (2-D lengths), so its pages are read once. Output rows keep SGLang's order."""
    import cupy_dsa

    qb, w, lens_2d, block_table, kw = _verify_call(q, weights, lens, page_table, next_n, rows, plans, "verify_logits")
    return cupy_dsa.paged_mqa_logits(qb, kvcache, w, lens_2d, block_table, int(max_len), clean_logits=False, **kw)


def extend_requests(extend_seq_lens: torch.Tensor, page_table: torch.Tensor, num_rows: int):
    """(cu_rows int32 [B + 1], block_table int32 [B, max_pages]) of an extend whose requests own consecutive rows
    (``extend_seq_lens`` [B], on the rows' device): each request's block-table row is the page-table row of its
    first row. Torch ops only (no host sync, capturable)."""
    lens = _as_i32(extend_seq_lens)
    cu_rows = torch.nn.functional.pad(torch.cumsum(lens, 0, dtype=torch.int32), (1, 0))
    first = cu_rows[:-1].clamp(0, max(num_rows - 1, 0)).long()
    return cu_rows, _as_i32(page_table[first]).contiguous()


def extend_logits(q: torch.Tensor, weights: torch.Tensor, ks: torch.Tensor, ke: torch.Tensor,
                  cu_rows: torch.Tensor, block_table: torch.Tensor, kvcache: torch.Tensor, rows: slice,
                  plans: "ForwardPlans | None" = None) -> torch.Tensor:
    """A multi-request extend in one launch (``cupy_dsa.mqa_logits`` varlen): row ``i`` sees keys
    ``[ks[i], ke[i])`` of its request's pages; returns fp32 ``[len(rows), block_table.shape[1] * 64]``."""
    import cupy_dsa

    if q.is_cuda:
        ensure_warm(q.device)
    span = (rows.start, rows.stop)
    kw = {}
    if plans is not None:
        kw["plan"] = plans.get(("varlen", rows.start, rows.stop), lambda: cupy_dsa.mqa_logits_plan(cu_rows, rows=span))
    return cupy_dsa.mqa_logits(q.contiguous(), kvcache, weights.contiguous(), _as_i32(ks).contiguous(),
                               _as_i32(ke).contiguous(), block_table=block_table, cu_rows=cu_rows,
                               clean_logits=False, rows=span, **kw)


# --------------------------------------------------------------------------------------------------
# fp8-rescore (H3): the two-stage top-k of one row chunk (cupy_dsa.rescore), in SGLang's output form
# --------------------------------------------------------------------------------------------------

def _stage2_rows(q_rescore: torch.Tensor | None, weights_rescore: torch.Tensor | None, rows: slice) -> dict:
    """The rescore ops' stage-2 keywords for a row chunk: the forward's ``q_rescore [rows, 64, 128]`` /
    ``weights_rescore [rows, 64]`` sliced (contiguous: views when the chunk is the whole forward), or none (stage 2
    takes stage 1's q and weights)."""
    if q_rescore is None:
        return {}
    return dict(q_rescore=q_rescore[rows].contiguous(), weights_rescore=weights_rescore[rows].contiguous())


def rescore_rows(q: torch.Tensor, weights: torch.Tensor, lens: torch.Tensor, page_table: torch.Tensor,
                 hi: torch.Tensor, lo: torch.Tensor, rows: slice, index_topk: int, k_prime: int,
                 plans: "ForwardPlans | None" = None, stage1_logits: torch.Tensor | None = None,
                 q_rescore: torch.Tensor | None = None, weights_rescore: torch.Tensor | None = None,
                 candidates: torch.Tensor | None = None):
    """SGLang's rows as requests of one row each (``paged_logits``' contract: row r sees positions ``[0, lens[r])``
    through its page-table row). Stage 1: ``stage1_logits`` (``[len(rows), >= width]``, unmasked: SGLang's own fp8
    logits call) or cupy_dsa's fp8 logits on ``hi``; the candidates those logits' ``candidates`` (int32 ``[len(rows),
    K']``, SGLang's top-k at k = K') when given, else cupy_dsa's select; stage 2 with ``q_rescore`` /
    ``weights_rescore`` (all the forward's rows) when given. Returns ``cupy_dsa.rescore.RescoreTopK``."""
    from cupy_dsa import rescore

    q1, w, lens_r, block_table, kw = _rows_call(q, weights, lens, page_table, rows, plans,
                                                plan=stage1_logits is None)
    return rescore.rescore_topk(q1, w, hi, lo, lens_r, block_table, index_topk, k_prime,
                                stage1_logits=stage1_logits, candidates=candidates,
                                **_stage2_rows(q_rescore, weights_rescore, rows), **kw)


def rescore_verify(q: torch.Tensor, weights: torch.Tensor, lens: torch.Tensor, page_table: torch.Tensor,
                   hi: torch.Tensor, lo: torch.Tensor, next_n: int, rows: slice, index_topk: int, k_prime: int,
                   plans: "ForwardPlans | None" = None, q_rescore: torch.Tensor | None = None,
                   weights_rescore: torch.Tensor | None = None):
    """MTP target-verify rows grouped by request (``verify_logits``' contract: rows ``[b*n, b*n + n)`` of the chunk
    are request b's, one page-table row each); stage 1 from cupy_dsa's fp8 logits at next_n = n. Output rows keep
    SGLang's order."""
    from cupy_dsa import rescore

    qb, w, lens_2d, block_table, kw = _verify_call(q, weights, lens, page_table, next_n, rows, plans, "rescore_verify")
    return rescore.rescore_topk(qb, w, hi, lo, lens_2d, block_table, index_topk, k_prime,
                                **_stage2_rows(q_rescore, weights_rescore, rows), **kw)


def rescore_extend(q: torch.Tensor, weights: torch.Tensor, lens: torch.Tensor, cu_rows: torch.Tensor,
                   block_table: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor, rows: slice, index_topk: int,
                   k_prime: int, plans: "ForwardPlans | None" = None, q_rescore: torch.Tensor | None = None,
                   weights_rescore: torch.Tensor | None = None):
    """A multi-request extend (``extend_logits``' contract): row i of request b sees positions ``[0, lens[i])`` of
    block-table row b; stage 1 from one varlen ``mqa_logits`` launch. A row chunk is a call of its own, with the
    request offsets shifted to the chunk (requests outside it own no row); its offsets and tile plan are built once
    per forward. Every row keeps its whole range: the rescored top-k bypasses SGLang's, so nothing fills short
    rows for it."""
    import cupy_dsa
    from cupy_dsa import rescore

    if q.is_cuda:
        ensure_warm(q.device)

    def build():
        cu = cu_rows if (rows.start == 0 and rows.stop >= q.shape[0]) else \
            (cu_rows - rows.start).clamp_(0, rows.stop - rows.start)
        return cu, cupy_dsa.mqa_logits_plan(cu)

    cu, plan = plans.get(("rescore-varlen", rows.start, rows.stop), build) if plans is not None else build()
    ke = _as_i32(lens[rows]).contiguous()
    return rescore.rescore_topk_prefill(q[rows].contiguous(), weights[rows].contiguous(), hi, lo,
                                        torch.zeros_like(ke), ke, block_table, index_topk, k_prime, cu_rows=cu,
                                        plan=plan, **_stage2_rows(q_rescore, weights_rescore, rows))


class ForwardPlans:
    """What one forward batch's C4 layers share, built by its first C4 layer and reused by the others (every
    layer sees the same rows and lengths): the schedules (``paged_mqa_logits_plan``, ``mqa_logits_plan``, one
    per route and row chunk) and an extend's request table.

    Kept on SGLang's per-forward ``PagedIndexerMetadata``. A pass over the layers starts again at a layer id
    not above the last one seen (a new forward, a warm-up rerun, a CUDA-graph capture of the same batch):
    everything is then rebuilt, so a capture records the plan kernels and each replay reruns them on the
    new lengths. They are rebuilt too when the lengths tensor is another one or was written in place."""

    ATTR = "_cupy_dsa_forward_plans"

    def __init__(self, source: torch.Tensor):
        self.key = (id(source), source._version)
        self.last_layer = None
        self.items: dict[tuple, object] = {}

    @classmethod
    def for_layer(cls, holder, source: torch.Tensor, layer_id: int) -> "ForwardPlans | None":
        state = getattr(holder, cls.ATTR, None)
        if (state is None or state.key != (id(source), source._version)
                or (state.last_layer is not None and layer_id <= state.last_layer)):
            state = cls(source)
            try:
                setattr(holder, cls.ATTR, state)
            except (AttributeError, TypeError):
                return None  # no place to keep them: every call builds its own
        state.last_layer = layer_id
        return state

    def get(self, key: tuple, build):
        item = self.items.get(key)
        if item is None:
            item = self.items[key] = build()
        return item


def row_chunks(num_rows: int, rows_per_chunk: int | None, width: int, capturing: bool, multiple: int = 1,
               budget_bytes: int | None = None):
    """Row slices: SGLang's ``rows_per_chunk`` when it planned one, else at most ``budget_bytes`` (default: the
    :data:`LOGITS_BUDGET_ENV` setting) of logits per chunk, a multiple of ``multiple`` rows (a verify request's draft
    rows stay together); never split while capturing a graph."""
    if rows_per_chunk is None and not capturing and width > 0:
        row_bytes = ((width + 3) // 4 * 4) * 4
        budget = logits_budget_bytes() if budget_bytes is None else budget_bytes
        cap = max(multiple, budget // row_bytes // multiple * multiple)
        if cap < num_rows:
            rows_per_chunk = cap
    if rows_per_chunk is None or rows_per_chunk >= num_rows:
        return [slice(0, num_rows)]
    return [slice(s, min(s + rows_per_chunk, num_rows)) for s in range(0, num_rows, rows_per_chunk)]


def topk_page_indices(logits: torch.Tensor, lens: torch.Tensor, page_table: torch.Tensor, k: int,
                      page_size: int = PAGE_SLOTS) -> tuple[torch.Tensor, torch.Tensor]:
    """A plain torch top-k with SGLang's output convention (for tests and tools; the plugin uses SGLang's
    own top-k): rows with ``len <= k`` select ``0..len-1``; entries are ``page_table[r, i // 64] * 64 +
    i % 64`` (int32), ``-1`` padded. Returns ``(page_indices, raw_indices)``, both int32 ``[R, k]``.
    Capturable: no host sync, fixed shapes."""
    R, width = logits.shape
    dev = logits.device
    cols = torch.arange(width, device=dev)
    lens_l = lens.to(torch.int64).reshape(R, 1)
    masked = logits.masked_fill(cols[None, :] >= lens_l, float("-inf"))
    kk = min(k, width)
    _, raw = torch.topk(masked, kk, dim=1, largest=True, sorted=False)
    if kk < k:
        raw = torch.nn.functional.pad(raw, (0, k - kk), value=0)
    seq = torch.arange(k, device=dev)[None, :].expand(R, k)
    raw = torch.where(lens_l <= k, seq, raw)
    valid = raw < lens_l
    pages = torch.gather(page_table.to(torch.int64), 1, (raw // page_size).clamp(min=0,
                         max=max(page_table.shape[1] - 1, 0)))
    page_idx = torch.where(valid, pages * page_size + raw % page_size, torch.full_like(raw, -1))
    raw = torch.where(valid, raw, torch.full_like(raw, -1))
    return page_idx.to(torch.int32), raw.to(torch.int32)
