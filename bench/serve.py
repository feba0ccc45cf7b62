"""``cupy-dsa bench serve``: what bf16 index keys cost one forward of a DeepSeek-V4 server, next to SGLang's fp8.

One forward's indexer work on every C4 layer (one cache per layer, as the server keeps them): the store of the
forward's new index entries, the logits of the layer, and the schedule built once per forward (ForwardPlans).
bf16 runs our ops on the plugin's routes (decode rows, grouped verify next_n = n, varlen extend for a prefill
chunk); fp8-cupy runs the same ops and routes on SGLang's fp8 layout (the plugin's fp8-cupy mode); fp8 runs
DeepGEMM on the route SGLang 0.5.23 takes for the step (:func:`fp8_route`): a long single-request prefill chunk
gathers the request's fp8 keys and runs ``fp8_mqa_logits``, every other step ``fp8_paged_mqa_logits`` on one row
per token; our store op writing the fp8 layout stands in for SGLang's fp8 store kernel. Top-k is the same in
all three and left out.

fp8-rescore (issue 26) replaces the top-k, so it is compared with the steps plus a top-k (issue 31): ``fp8+topk`` is
the fp8 step with the stock top-k of each layer's logits: SGLang 0.5.23's own v2 kernel (``plan_topk_v2`` once per
forward, ``topk_transform_paged_v2`` per layer) where SGLang's kernels run on the GPU, else ``cupy_dsa.paged_topk``
standing in for it (named as such in the results); ``bf16+topk`` the bf16 step with the same top-k (what the
plugin's bf16 mode runs: our logits, SGLang's top-k); ``fp8-rescore`` is the store of the hi and lo pages in one
launch, then per layer
``rescore_topk`` (decode rows, grouped verify) or ``rescore_topk_prefill`` (the chunk's varlen rows), stage 1 by
cupy_dsa's fp8 kernels (the plugin's ``stage1=cupy``); ``fp8-rescore-dg`` the same store, then per layer
DeepGEMM's paged fp8 logits (one row per token) and ``rescore_topk`` given them (the plugin's ``stage1=sglang``).
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from cupy_dsa.layouts import BYTES_PER_TOKEN, HEAD_DIM, N_HEADS, PAGE_SLOTS
from cupy_dsa.rescore import K_PRIME_MULTIPLE, TWO_LEVEL_BYTES_PER_TOKEN

from .bytes import C4_RATIO, C128_RATIO
from . import peers
from .models import BUILTIN, MAX_CONTEXT, ServeModel
from .provenance import commit_label

SCHEMA = "cupy-dsa-serve/1"
GIB = 2**30
CACHE_BUDGET_SHARE = 0.6  # share of free GPU memory the per-layer caches may take (the rest: outputs, graphs)

COUNTED = ("one forward = per C4 layer: store of the forward's new index entries + logits, and the schedule once "
           "per forward; top-k is identical for bf16 and fp8 and excluded. New entries per forward: decode/verify "
           "ceil(batch * next_n / 4) (on average one entry per 4 tokens), prefill chunk / 4. fp8 = DeepGEMM on "
           "SGLang 0.5.23's route for the step (fp8_route): a prefill chunk of >= 8192 tokens of one request "
           "('non-paged gather + fp8_mqa_logits': per layer the request's fp8 keys gathered out of the paged cache, "
           "then fp8_mqa_logits with SGLang's ranges, clean off, max_seqlen_k; SGLang runs it eagerly, timed here "
           "in CUDA-graph replays like every step), every other step ('paged rows': fp8_paged_mqa_logits on one row "
           "per token); the schedule SGLang builds once per forward on both routes; no row chunking (SGLang chunks "
           "rows only when the logits exceed its memory budget); + our store op writing SGLang's fp8 layout "
           "(standing in for SGLang's fp8 store kernel); fp8-cupy = the plugin's fp8-cupy mode, our store and "
           "logits on the bf16 routes over SGLang's fp8 layout (same bytes as fp8, our kernels). A prefill chunk is "
           "one request of --chunk tokens after a prefix of --context tokens; its rows seeing <= index_topk entries "
           "get an empty range on the plugin's route and SGLang's non-paged one, as they pass them with SGLang's "
           "default sgl-kernel top-k (SGLang's paged route passes every row whole).")

# Targets on an H200, bf16 step time over the fp8 step's, by (batch, next_n, context tokens)
TARGETS = {(64, 4, 32768): 1.2, (64, 4, 131072): 1.2, (64, 2, 16384): 1.5}

# SGLang 0.5.23 (srt/layers/attention/dsv4/indexer.py) runs the fp8 indexer of a step on its non-paged route when
# `_get_nonpaged_indexer_plan` returns a plan: the forward has at least
# SGLANG_OPT_DSV4_NONPAGED_INDEXER_MIN_QUERY_TOKENS query rows (8192 by default, per rank: one row per token), one
# request extends by all of them, and `_can_use_nonpaged_indexer` holds: SGLANG_OPT_DSV4_NONPAGED_INDEXER on (the
# default, srt/environ.py), CUDA, forward mode EXTEND (not MIXED, not rewritten, no two-batch-overlap split), batch
# size 1, no prefill CUDA graph (eager, not capturing), no FP4 / TileLang / AITER / torch indexer, attn_cp_size 1,
# no HiSparse. `forward_c4_indexer` then gathers the request's fp8 keys (`_gather_nonpaged_index_k`) and calls
# DeepGEMM's fp8_mqa_logits (`_nonpaged_mqa_logits`); every other step calls fp8_paged_mqa_logits, one row per token.
NONPAGED_MIN_ROWS = 8192
FP8_NONPAGED = "non-paged gather + fp8_mqa_logits"
FP8_PAGED = "paged rows"

# What `measure` times: (layout name, cache layout); "fp8", "fp8+topk" and "fp8-rescore-dg" call DeepGEMM.
TIMED = (("bf16", "bf16"), ("bf16+topk", "bf16"), ("fp8-cupy", "fp8"), ("fp8", "fp8"), ("fp8+topk", "fp8"),
         ("fp8-rescore", "fp8-rescore"), ("fp8-rescore-dg", "fp8-rescore"))
NEEDS_DEEPGEMM = ("fp8", "fp8+topk", "fp8-rescore-dg")
OURS = ("bf16", "bf16+topk", "fp8-cupy", "fp8-rescore")  # our logits (or rescore op) on the plugin's routes
WITH_TOPK = ("bf16+topk", "fp8+topk")  # the step + the stock top-k of each layer's logits
MS_KEY = {"bf16": "bf16_ms", "bf16+topk": "bf16_topk_ms", "fp8-cupy": "fp8_cupy_ms", "fp8": "fp8_ms",
          "fp8+topk": "fp8_topk_ms", "fp8-rescore": "fp8_rescore_ms", "fp8-rescore-dg": "fp8_rescore_dg_ms"}
# bytes per index entry of each cache layout: fp8-rescore keeps SGLang's fp8 page (hi) and an int8 residual page (lo)
ENTRY_BYTES = {**BYTES_PER_TOKEN, "fp8-rescore": TWO_LEVEL_BYTES_PER_TOKEN}

# Issue 26's targets on an H200, fp8-rescore's step over the fp8 step with its top-k (fp8+topk): every decode and
# verify step; a prefill chunk of 4,096 or 16,384 tokens after 32K-128K tokens. Memory per index entry <= 1.05x
# bf16's.
RESCORE_TARGET_DECODE = 1.15
RESCORE_TARGET_PREFILL = 1.2
RESCORE_TARGET_CHUNKS = (4096, 16384)
RESCORE_TARGET_CONTEXTS = (32768, 131072)   # inclusive range of the prefix
RESCORE_MEMORY_TARGET = 1.05

# Issue 31's targets (H200, --batch 48, next_n 1 and 3, chunk 8192, DeepGEMM live): fp8-rescore with DeepGEMM's stage 1
# (fp8-rescore-dg) over the stock step (fp8+topk) and over bf16+topk, both with the stock top-k, by (phase, context)
TARGETS_31 = {("decode", 98304): (("fp8+topk", 1.3), ("bf16+topk", 0.75)),
              ("decode", 24576): (("bf16+topk", 1.0),),
              ("prefill", 98304): (("bf16+topk", 0.9),),
              ("prefill", 24576): (("bf16+topk", 1.0),)}
TARGETS_31_BATCH = 48
TARGETS_31_CHUNK = 8192
BASIS_KEY = {"fp8+topk": "fp8_topk_ms", "bf16+topk": "bf16_topk_ms"}


def targets_31(case) -> tuple:
    """Issue 31's bounds on fp8-rescore-dg's step for a case (a Case or a timing row): ((basis layout, bound), ...)."""
    get = case.get if isinstance(case, dict) else (lambda k: getattr(case, k))
    if get("phase") == "prefill":
        return TARGETS_31.get(("prefill", get("context")), ()) if get("chunk") == TARGETS_31_CHUNK else ()
    return TARGETS_31.get(("decode", get("context")), ()) if get("batch") == TARGETS_31_BATCH else ()


RESCORE_COUNTED = (
    "fp8-rescore rows (top-k included, over every C4 layer): 'fp8 + top-k' = the fp8 step (DeepGEMM on SGLang's "
    "route) + the stock top-k of each layer's logits (the run's 'topk': SGLang 0.5.23's v2 kernel where it runs, its "
    "plan once per forward, else cupy_dsa.paged_topk standing in for it), every row its own length and page-table "
    "row; 'bf16 + top-k' = the bf16 step + the same top-k; 'fp8-rescore' = store of the hi and lo pages in one "
    "launch + rescore_topk (decode rows, "
    "grouped verify) / rescore_topk_prefill (the chunk's varlen rows, every row its whole range) per layer, stage 1 "
    "by cupy_dsa's fp8 kernels, K' = 4 x index_topk, the plan once per forward (the plugin's stage1=cupy); "
    "'fp8-rescore, DeepGEMM stage 1' = the same store + DeepGEMM's paged fp8 logits (one row per token, the schedule "
    "once per forward) + rescore_topk given them unmasked, its K' candidates picked by SGLang's v2 top-k at k = K' "
    "where it is live and takes K' (else cupy_dsa's select; the row's rescore_dg_candidates says which): the plugin's "
    "stage1=sglang. Ratios: to 'fp8 + top-k' "
    "(the stock step), to 'bf16 + top-k' and to the plain fp8 step. 'top-k alone': each top-k implementation over "
    "one layer's stock logits, once per C4 layer (its plan once), ms per forward.")


def rescore_target(case) -> float | None:
    """Issue 26's bound on fp8-rescore's step over fp8 + top-k for a case (a Case or a timing row), or None."""
    get = case.get if isinstance(case, dict) else (lambda k: getattr(case, k))
    if get("phase") in ("decode", "verify"):
        return RESCORE_TARGET_DECODE
    lo, hi = RESCORE_TARGET_CONTEXTS
    if get("phase") == "prefill" and get("chunk") in RESCORE_TARGET_CHUNKS and lo <= get("context") <= hi:
        return RESCORE_TARGET_PREFILL
    return None


RATIOS = (0, C4_RATIO, C128_RATIO)  # what a DeepSeek-V4 layer compresses by (0: window only)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # JSON true / false are not counts


def parse_config(path: str) -> ServeModel:
    """A DeepSeek-V4 HF ``config.json``: ``compress_ratios`` (one entry per layer, each 0, 4 or 128; the ratio-4
    layers carry the indexer), the layer count from ``num_hidden_layers`` (HF) or ``n_layers`` (DeepSeek's
    inference config) when present (ratios past it, e.g. an MTP layer's, are not counted), ``index_topk``, and
    ``index_n_heads`` / ``index_head_dim`` which must be 64 / 128 (the kernels' shape). Raises ValueError naming
    the field. The model is named by ``_name_or_path``, else by the config's path."""
    try:
        cfg = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path!r} as JSON ({type(exc).__name__}: {exc})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path!r}: expected a JSON object, got {type(cfg).__name__}")
    ratios = cfg.get("compress_ratios")
    if not isinstance(ratios, list) or not ratios or not all(_is_int(r) and r in RATIOS for r in ratios):
        bad = [r for r in ratios if not (_is_int(r) and r in RATIOS)] if isinstance(ratios, list) else None
        raise ValueError(f"{path!r}: expected 'compress_ratios', a non-empty list with one of 0, 4, 128 per layer "
                         f"(4 = indexer layer), got {ratios!r}" + (f" ({', '.join(map(repr, bad))} not one of them)"
                                                                   if bad else ""))
    n_layers = cfg.get("num_hidden_layers", cfg.get("n_layers", len(ratios)))
    if not _is_int(n_layers) or not 0 < n_layers <= len(ratios):
        raise ValueError(f"{path!r}: expected 'num_hidden_layers' (or 'n_layers') an int in 1..{len(ratios)} (the "
                         f"length of compress_ratios), got {n_layers!r}")
    n_c4 = ratios[:n_layers].count(C4_RATIO)
    if n_c4 == 0:
        raise ValueError(f"{path!r}: no indexer layer: compress_ratios has no ratio-4 layer in its first {n_layers} "
                         f"(num_hidden_layers), so there is no index cache to measure")
    for field, want in (("index_n_heads", N_HEADS), ("index_head_dim", HEAD_DIM)):
        if field in cfg and not (_is_int(cfg[field]) and cfg[field] == want):
            raise ValueError(f"{path!r}: expected {field} = {want} (the indexer shape the kernels take), "
                             f"got {cfg[field]!r}")
    topk = cfg.get("index_topk")
    if not _is_int(topk) or topk <= 0:
        raise ValueError(f"{path!r}: expected 'index_topk', a positive int, got {topk!r}")
    max_context = cfg.get("max_position_embeddings", MAX_CONTEXT)
    if not _is_int(max_context) or max_context <= 0:
        raise ValueError(f"{path!r}: expected 'max_position_embeddings', a positive int, got {max_context!r}")
    name = cfg.get("_name_or_path")
    return ServeModel(name if isinstance(name, str) and name else str(path), n_layers, n_c4, topk,
                      f"config {path}", None, max_context)


def resolve_model(value: str) -> ServeModel:
    return BUILTIN[value] if value in BUILTIN else parse_config(value)


def memory_rows(model: ServeModel, memory_gib: float) -> list[dict]:
    """Index-cache bytes per raw token of all C4 layers and the tokens that fit in ``memory_gib`` (partial
    pages ignored), per layout."""
    out = []
    for layout in ("bf16", "fp8", "fp8-rescore"):
        entry = ENTRY_BYTES[layout]
        per_token = model.n_c4 * entry / C4_RATIO
        row = {"layout": layout, "bytes_per_entry": entry, "index_layers": model.n_c4,
               "index_bytes_per_token": per_token, "memory_gib": memory_gib,
               "tokens_fit": int(memory_gib * GIB // per_token), "vs_bf16": entry / ENTRY_BYTES["bf16"]}
        if layout == "fp8-rescore":  # issue 26: <= 1.05x bf16's bytes per entry
            row["target_vs_bf16"] = RESCORE_MEMORY_TARGET
            row["verdict"] = "pass" if row["vs_bf16"] <= RESCORE_MEMORY_TARGET else "miss"
        out.append(row)
    return out


def fp8_route(case: "Case") -> str:
    """The DeepGEMM route SGLang 0.5.23 takes for the step on an H200 (see :data:`NONPAGED_MIN_ROWS`): a prefill
    chunk here is one request in an eager EXTEND forward, so its row count decides."""
    if case.phase == "prefill" and case.batch == 1 and case.chunk >= NONPAGED_MIN_ROWS:
        return FP8_NONPAGED
    return FP8_PAGED


@dataclass(frozen=True)
class Case:
    phase: str       # "decode" (next_n 1), "verify" (next_n 2..4) or "prefill" (one chunk)
    batch: int
    context: int     # raw tokens per request before this forward
    next_n: int
    chunk: int       # prefill tokens (0 for decode / verify)

    @property
    def new_entries(self) -> int:
        return self.chunk // C4_RATIO if self.phase == "prefill" else math.ceil(self.batch * self.next_n / C4_RATIO)


def case_label(c: Case) -> str:
    """What a case measures, in raw tokens: 'decode 32 x 8K', 'verify 32 x 8K, next_n 2', 'prefill chunk of
    4,096 after 8K'."""
    if c.phase == "prefill":
        return f"prefill chunk of {c.chunk:,} after {_tokens(c.context)}"
    return f"{c.phase} {c.batch} x {_tokens(c.context)}" + (f", next_n {c.next_n}" if c.phase == "verify" else "")


def cases(batch: int, contexts, next_n, chunk) -> list[Case]:
    """Per next_n (an int or several) a decode (1) or verify step at each context, then per prefill chunk size (an
    int or several) a chunk after each context."""
    next_ns = (next_n,) if isinstance(next_n, int) else tuple(next_n)
    chunks = (chunk,) if isinstance(chunk, int) else tuple(chunk)
    return ([Case("decode" if n == 1 else "verify", batch, c, n, 0) for n in next_ns for c in contexts]
            + [Case("prefill", 1, c, 1, ch) for ch in chunks for c in contexts])


def step_label(r) -> str:
    """What kind of step a case or a timing row is: 'decode', 'verify, next_n 2', 'prefill chunk of 4,096'."""
    get = r.get if isinstance(r, dict) else (lambda k: getattr(r, k))
    if get("phase") == "prefill":
        return f"prefill chunk of {get('chunk'):,}"
    return "decode" if get("phase") == "decode" else f"verify, next_n {get('next_n')}"


# --------------------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------------------

def _cache_pages(case: Case) -> int:
    """Pages one layer's cache needs: every request's pages after this forward, plus one spare."""
    if case.phase == "prefill":
        return math.ceil((case.context + case.chunk) / C4_RATIO / PAGE_SLOTS) + 1
    per_req = math.ceil((case.context + case.next_n) / C4_RATIO / PAGE_SLOTS)
    return case.batch * per_req + 1


def _layer_caches(case: Case, layout: str, n_c4: int, device, g):
    """Distinct caches, one per C4 layer, or as many as fit in CACHE_BUDGET_SHARE of free memory (cycled)."""
    from .sweeps import _random_cache

    pages = _cache_pages(case)
    one = pages * PAGE_SLOTS * ENTRY_BYTES[layout]
    if device.type == "cuda":
        fit = max(1, min(n_c4, int(torch.cuda.mem_get_info(device)[0] * CACHE_BUDGET_SHARE // one)))
    else:  # the torch reference at test sizes
        fit = n_c4
    if layout == "fp8-rescore":  # (hi, lo): the lo page has the fp8 page's geometry (int8 codes, fp32 scales)
        return [(_random_cache(pages, "fp8", device, g), _random_cache(pages, "fp8", device, g))
                for _ in range(fit)], pages
    return [_random_cache(pages, layout, device, g) for _ in range(fit)], pages


def _tables(case: Case, device, g):
    """Block table [B, pages per request] over the layer cache's pages, shuffled (an allocator's free list is
    not in order); the last page stays spare."""
    if case.phase == "prefill":
        w = _cache_pages(case) - 1
    else:
        w = math.ceil((case.context + case.next_n) / C4_RATIO / PAGE_SLOTS)
    perm = torch.randperm(case.batch * w, device=device, generator=g).to(torch.int32)
    return perm.view(case.batch, w)


@dataclass
class Forward:
    """One layout's forward of a case: ``run()`` is the timed step; the fp8 non-paged route also gives
    ``gathers()``, its key gathers alone over every C4 layer, and what did them."""
    run: Callable[[], None]
    layer_caches: int
    gathers: Callable[[], None] | None = None
    gather_op: str | None = None
    logits: Callable[[], torch.Tensor] | None = None   # one layer's logits (the layouts with a top-k)
    topk_rows: tuple | None = None                     # (lens, page table), one row per logits row, for the top-k


def _forward(case: Case, layout: str, model: ServeModel, device, g, dg, query: str | None = None,
             topk=None) -> Forward:
    """One layout of :data:`TIMED`: ``bf16`` and ``fp8-cupy`` run our ops on the plugin's routes (bf16 rows, or
    SGLang's fp8 rows), ``fp8`` DeepGEMM on SGLang's route for the step (:func:`fp8_route`); ``bf16+topk`` and
    ``fp8+topk`` add ``topk`` (a :class:`peers.TopKOp`, default cupy_dsa's standing in for SGLang's) per layer.
    ``query`` (a layout of :data:`QUERY_LAYOUTS`): each layer's query is prepared in the step from wq_b-shaped bf16
    rows (:func:`_query_prep`) with that numerics, and the logits take it."""
    import cupy_dsa
    from cupy_dsa import rescore

    from . import peers
    from .sweeps import _sgl_topk_ranges, make_freqs

    cache_layout = dict(TIMED)[layout]
    ours = layout in OURS
    two_level = cache_layout == "fp8-rescore"
    caches, pages = _layer_caches(case, cache_layout, model.n_c4, device, g)
    n_new = case.new_entries
    kv = torch.randn(n_new, HEAD_DIM, device=device, generator=g)
    positions = torch.arange(n_new, dtype=torch.int32, device=device)
    freqs = make_freqs(max(n_new, 1), device)
    norm_w = 1.0 + 0.1 * torch.randn(HEAD_DIM, device=device, generator=g)
    table = _tables(case, device, g)
    # new entry i belongs to request i % B (a decode step spreads them over the batch) and follows its context
    i = torch.arange(n_new, device=device)
    req, entry = i % case.batch, case.context // C4_RATIO + i // case.batch
    out_loc = table[req, entry // PAGE_SLOTS].to(torch.int64) * PAGE_SLOTS + entry % PAGE_SLOTS
    width = table.shape[1] * PAGE_SLOTS
    gathers = gather_op = None

    def store(cache):
        if two_level:  # hi and lo pages in one launch
            cupy_dsa.store_index_k(kv, cache[0], positions=positions, out_loc=out_loc, norm_weight=norm_w,
                                   freqs_cis=freqs, lo_cache=cache[1])
            return
        cupy_dsa.store_index_k(kv, cache, positions=positions, out_loc=out_loc, norm_weight=norm_w, freqs_cis=freqs)

    if case.phase == "prefill":
        T = case.chunk
        prefix = case.context // C4_RATIO
        q = torch.randn(T, N_HEADS, HEAD_DIM, device=device, generator=g).to(torch.float8_e4m3fn)
        weights = torch.rand(T, N_HEADS, device=device, generator=g) / math.sqrt(N_HEADS * HEAD_DIM)
        lens = (prefix + (torch.arange(T, device=device) + 1) // C4_RATIO).to(torch.int32)
        ks, ke = _sgl_topk_ranges(torch.zeros(T, dtype=torch.int32, device=device), lens, model.index_topk)
        topk_rows = (lens, table.expand(T, -1).contiguous())  # SGLang's top-k: every row its whole length
        if ours:
            cu_rows = torch.tensor([0, T], dtype=torch.int32, device=device)

            def layer_logits(cache, plan, q=q, weights=weights):
                if two_level:  # every row keeps its whole range: the rescored top-k replaces SGLang's
                    return rescore.rescore_topk_prefill(q, weights, cache[0], cache[1], torch.zeros_like(lens), lens,
                                                        table, model.index_topk, cu_rows=cu_rows, plan=plan)
                return cupy_dsa.mqa_logits(q, cache, weights, ks, ke, block_table=table, cu_rows=cu_rows,
                                           plan=plan, clean_logits=False)

            def build_plan():
                return cupy_dsa.mqa_logits_plan(cu_rows)
        else:
            q_rows, row_table, lens_rows = q.view(T, 1, N_HEADS, HEAD_DIM), table.expand(T, -1).contiguous(), lens
    else:
        B, n = case.batch, case.next_n
        entries = case.context // C4_RATIO
        lens_2d = (entries + (torch.arange(n, device=device) + 1) // C4_RATIO).to(torch.int32)[None, :].repeat(B, 1)
        q = torch.randn(B, n, N_HEADS, HEAD_DIM, device=device, generator=g).to(torch.float8_e4m3fn)
        weights = torch.rand(B * n, N_HEADS, device=device, generator=g) / math.sqrt(N_HEADS * HEAD_DIM)
        lens = lens_2d.reshape(-1) if n == 1 else lens_2d
        topk_rows = (lens_2d.reshape(-1).contiguous(), table.repeat_interleave(n, 0))
        if ours:
            def layer_logits(cache, plan, q=q, weights=weights):
                if two_level:
                    return rescore.rescore_topk(q, weights, cache[0], cache[1], lens, table, model.index_topk,
                                                plan=plan)
                return cupy_dsa.paged_mqa_logits(q, cache, weights, lens, table, width, plan=plan)

            def build_plan():
                return cupy_dsa.paged_mqa_logits_plan(lens, n)
        else:
            q_rows = q.view(B * n, 1, N_HEADS, HEAD_DIM)
            row_table, lens_rows = table.repeat_interleave(n, 0), lens_2d.reshape(-1).contiguous()

    selection = None
    if layout in WITH_TOPK:
        selection = (topk or peers.cupy_dsa_topk()).bind(*topk_rows, model.index_topk)

    if ours:
        prep = _query_prep(query, q.shape, device, g) if query is not None else None

        def forward():
            plan = build_plan()  # ForwardPlans: the first C4 layer builds it, the others reuse it
            if selection is not None:
                selection.plan()  # SGLang's top-k plan: once per forward, with the forward's metadata
            for i in range(model.n_c4):
                store(caches[i % len(caches)])
                logits = layer_logits(caches[i % len(caches)], plan, *(prep() if prep is not None else ()))
                if selection is not None:
                    selection.select(logits)

        return Forward(forward, len(caches), logits=lambda: layer_logits(caches[0], build_plan()),
                       topk_rows=topk_rows)

    # SGLang builds the paged schedule once per forward on either route (PagedIndexerMetadata.__post_init__,
    # srt/layers/attention/dsv4/metadata.py); DeepGEMM's stands in for it
    hi_caches = [c[0] for c in caches] if two_level else caches
    schedule, _ = peers.deepgemm_decode(dg, q_rows, hi_caches[0], weights, lens_rows[:, None], row_table, width)
    if layout == "fp8-rescore-dg":  # the plugin's stage1=sglang: DeepGEMM's paged rows on every step, then stage 2
        calls = [peers.deepgemm_decode(dg, q_rows, c, weights, lens_rows[:, None], row_table, width)[1]
                 for c in hi_caches]
        pick = rescore_dg_candidates(topk, model)
        plan = candidate_plan(pick, topk, lens_rows)  # SGLang builds v2's plan once per forward

        def layer_logits(i):
            hi, lo = caches[i % len(caches)]
            logits = calls[i % len(calls)]()
            return rescore.rescore_topk(q_rows, weights, hi, lo, lens_rows, row_table, model.index_topk,
                                        stage1_logits=logits,
                                        candidates=select_candidates(pick, topk, logits, lens_rows, row_table, model,
                                                                     plan))
    elif fp8_route(case) == FP8_NONPAGED:
        n_keys = (case.context + case.chunk) // C4_RATIO           # the request's entries after this chunk
        nonpaged = peers.nonpaged_prefill(dg, q, weights, ks, ke, table[0], n_keys)
        nonpaged.check(caches[0])  # SGLang's gather must return what the torch one does on these pages
        gather_op = nonpaged.gather_op

        def layer_logits(i):
            return nonpaged.logits(caches[i % len(caches)])  # per layer, as SGLang gathers each layer's cache

        def gathers():
            for i in range(model.n_c4):
                nonpaged.gather(caches[i % len(caches)])
    else:
        calls = [peers.deepgemm_decode(dg, q_rows, c, weights, lens_rows[:, None], row_table, width)[1]
                 for c in caches]

        def layer_logits(i):
            return calls[i % len(calls)]()

    def forward():
        schedule()
        if selection is not None:
            selection.plan()  # SGLang builds its top-k plan once per forward (PagedIndexerMetadata)
        for i in range(model.n_c4):
            store(caches[i % len(caches)])
            logits = layer_logits(i)
            if selection is not None:
                selection.select(logits)

    return Forward(forward, len(caches), gathers if layout == "fp8" else None, gather_op,
                   logits=lambda: layer_logits(0), topk_rows=topk_rows)


def rescore_dg_candidates(topk, model: ServeModel):
    """What picks fp8-rescore-dg's K' candidates, as the plugin's stage1=sglang does (cupy_dsa.sglang.candidates):
    SGLang's v2 top-k at k = K' where the run has it live (``topk``, the stock :class:`peers.TopKOp`) and K' fits it,
    else cupy_dsa's own select."""
    from cupy_dsa.sglang import candidates

    from . import peers

    if topk is None or topk.key != peers.SGLANG_V2:
        return candidates.CandidateSelect(candidates.CUPY_DSA, "SGLang's v2 top-k is not live in this run")
    return candidates.candidate_select(K_PRIME_MULTIPLE * model.index_topk, stage1="sglang",
                                       topk_backend="sgl-kernel", use_topk_v2=True)


def candidate_plan(pick, topk, lens):
    """SGLang's v2 plan over ``lens`` for ``pick`` (None unless it is v2), from the module ``topk`` (the stock
    :class:`peers.TopKOp`) calls."""
    if pick.kernel != "sglang-v2":
        return None
    return topk.module.plan_topk_v2(lens, out=lens.new_empty(lens.shape[0] + 1, 2))


def select_candidates(pick, topk, logits, lens, table, model: ServeModel, plan):
    """The K' candidates of ``pick`` (None: cupy_dsa's own, inside rescore_topk), by the module ``topk`` calls."""
    if not pick.sglang:
        return None
    from cupy_dsa.sglang import candidates

    return candidates.select_candidates(pick, logits, lens, table, model.index_topk,
                                        K_PRIME_MULTIPLE * model.index_topk, plan, topk=topk.module)


def _add_error(row: dict, case: str, exc: Exception) -> None:
    """Note a case that failed in the row's error (one case failing must not end the run)."""
    failed = f"{case}: {type(exc).__name__}: {str(exc)[:200]}"
    row["error"] = f"{row['error']}; {failed}" if row["error"] else failed


def measure(case: Case, model: ServeModel, device, dg, seed: int, reps: int, layouts=None, topks=None,
            configs_of: str | None = None) -> dict:
    """ms of one forward for each layout of :data:`TIMED` (``layouts``: only those; the DeepGEMM ones only with
    ``dg``), for one case; the fp8 row says its route and, on the non-paged route, what gathered the keys and the
    ms the gathers take of the step; fp8-rescore's ratios to fp8 + top-k, bf16 + top-k and fp8, and its targets'
    verdicts. ``topks`` (:class:`peers.TopKs`; default cupy_dsa's standing in): the stock top-k of the ``+topk``
    layouts, and each of its top-ks alone over one layer's stock logits, once per C4 layer. ``configs_of``: the
    logits launch that arch's product configs (:func:`arch_configs`)."""
    from . import peers
    from .sweeps import _gen, _verdict
    from .timing import time_calls

    topks = topks if topks is not None else peers.topks(device, sglang=False)

    row = {"phase": case.phase, "batch": case.batch, "context": case.context, "next_n": case.next_n,
           "chunk": case.chunk, "new_entries": case.new_entries, "bf16_ms": None, "fp8_ms": None,
           "fp8_cupy_ms": None, "added_ms": None, "ratio": None, "fp8_cupy_ratio": None, "layer_caches": {},
           "fp8_route": fp8_route(case), "fp8_gather": None, "fp8_gather_ms": None,
           "target_ratio": TARGETS.get((case.batch, case.next_n, case.context)) if case.phase == "verify" else None,
           "verdict": None, "timing": None, "error": None,
           "fp8_topk_ms": None, "fp8_rescore_ms": None, "fp8_rescore_dg_ms": None,
           "rescore_vs_fp8_topk": None, "rescore_vs_fp8": None, "rescore_dg_vs_fp8_topk": None,
           "rescore_dg_vs_fp8": None, "rescore_target_ratio": rescore_target(case), "rescore_verdict": None,
           "rescore_dg_verdict": None, "stock_topk": topks.stock.key, "bf16_topk_ms": None,
           "rescore_vs_bf16_topk": None, "rescore_dg_vs_bf16_topk": None, "targets_31": [], "topk_alone_ms": {},
           "topk_alone_on": None, "rescore_dg_candidates": rescore_dg_candidates(topks.stock, model).kernel}
    sample = None  # (logits, (lens, table)) of one layer: the top-k alone runs on it
    for layout, _ in TIMED:
        if (layout in NEEDS_DEEPGEMM and dg is None) or (layouts is not None and layout not in layouts):
            continue
        try:
            with arch_configs(configs_of):
                fwd = _forward(case, layout, model, device, _gen(device, seed), dg, topk=topks.stock)
                t = time_calls([fwd.run], device, reps=reps)
                row[MS_KEY[layout]] = t.seconds * 1e3
                if layout in WITH_TOPK and (sample is None or layout == "fp8+topk"):  # the stock logits first
                    sample = (fwd.logits(), fwd.topk_rows)
                    row["topk_alone_on"] = layout
                row["layer_caches"][layout] = fwd.layer_caches
                row["timing"] = t.method
                if fwd.gathers is not None:
                    row["fp8_gather"] = fwd.gather_op
                    row["fp8_gather_ms"] = time_calls([fwd.gathers], device, reps=reps).seconds * 1e3
                del fwd
        except Exception as exc:  # one case failing must not end the run
            _add_error(row, layout, exc)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if sample is not None:
        _time_topk_alone(row, sample, topks, model, device, reps)
        del sample
    if row["bf16_ms"] is not None and row["fp8_ms"] is not None:
        row["added_ms"] = row["bf16_ms"] - row["fp8_ms"]
        row["ratio"] = row["bf16_ms"] / row["fp8_ms"]
        row["verdict"] = _verdict(row["ratio"], row["target_ratio"], higher_is_better=False)
    if row["fp8_cupy_ms"] is not None and row["fp8_ms"] is not None:
        row["fp8_cupy_ratio"] = row["fp8_cupy_ms"] / row["fp8_ms"]  # our kernels against DeepGEMM, same bytes
    for variant, key in (("rescore", "fp8_rescore_ms"), ("rescore_dg", "fp8_rescore_dg_ms")):
        if row[key] is None:
            continue
        if row["fp8_topk_ms"] is not None:  # the fair comparison: both steps select the top-k
            row[f"{variant}_vs_fp8_topk"] = row[key] / row["fp8_topk_ms"]
            row[f"{variant}_verdict"] = _verdict(row[f"{variant}_vs_fp8_topk"], row["rescore_target_ratio"],
                                                 higher_is_better=False)
        if row["fp8_ms"] is not None:
            row[f"{variant}_vs_fp8"] = row[key] / row["fp8_ms"]
        if row["bf16_topk_ms"] is not None:
            row[f"{variant}_vs_bf16_topk"] = row[key] / row["bf16_topk_ms"]
    for basis, bound in targets_31(case):
        ratio = (row["fp8_rescore_dg_ms"] / row[BASIS_KEY[basis]]
                 if row["fp8_rescore_dg_ms"] is not None and row[BASIS_KEY[basis]] is not None else None)
        row["targets_31"].append({"basis": basis, "target": bound, "ratio": ratio,
                                  "verdict": _verdict(ratio, bound, higher_is_better=False)})
    return row


def _time_topk_alone(row: dict, sample, topks, model: ServeModel, device, reps: int) -> None:
    """ms per forward of each top-k of ``topks`` alone: its plan once, then one selection per C4 layer over the
    sampled layer's logits (L2-warm where they fit, as right after the logits kernel)."""
    from .timing import time_calls

    logits, (lens, table) = sample
    for key, op in topks.ops.items():
        try:
            bound = op.bind(lens, table, model.index_topk)

            def forward(bound=bound):
                bound.plan()
                for _ in range(model.n_c4):
                    bound.select(logits)

            row["topk_alone_ms"][key] = time_calls([forward], device, reps=reps).seconds * 1e3
        except Exception as exc:  # one top-k failing must not end the run
            _add_error(row, f"top-k {key}", exc)


def plot(doc: dict, path: str) -> None:
    """ms per step over context, bf16 vs fp8 (and fp8-cupy), and the added ms: one row of two panels per kind of
    step the run measured (decode, each verify next_n, each prefill chunk size)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [r for r in doc["timings"] if r["bf16_ms"] is not None]
    kinds = list(dict.fromkeys(step_label(r) for r in measured)) or ["decode"]
    with plt.rc_context({"font.size": 9, "xtick.labelsize": 8, "ytick.labelsize": 8, "legend.fontsize": 8}):
        fig, axes = plt.subplots(len(kinds), 2, figsize=(11, 4 * len(kinds)), squeeze=False)
        for kind, (ax, ax2) in zip(kinds, axes):
            rows = [r for r in measured if step_label(r) == kind]
            prefill = kind.startswith("prefill")
            for layout, style, label in (("bf16", "o-", "bf16 index keys"),
                                         ("fp8_cupy", "^:", "fp8 index keys, cupy_dsa kernels (fp8-cupy)"),
                                         ("fp8", "s--", "fp8 index keys, DeepGEMM")):
                pts = [(r["context"], r.get(f"{layout}_ms")) for r in rows if r.get(f"{layout}_ms") is not None]
                if pts:
                    ax.plot(*zip(*pts), style, label=label)
            added = [(r["context"], r["added_ms"]) for r in rows if r["added_ms"] is not None]
            if added:
                ax2.plot(*zip(*added), "o-", color="tab:red")
            for a in (ax, ax2):
                a.set_xscale("log", base=2)
                a.set_xlabel("prefix (raw tokens)" if prefill else "context (raw tokens per request)")
                a.grid(alpha=0.3)
            ax.set_ylabel("indexer ms per forward (all C4 layers)")
            if prefill:
                ax.set_title(f"{kind} tokens")
            else:  # 'decode step, batch 32', 'verify step, batch 64, next_n 4'
                first = rows[0] if rows else {"phase": "decode"}
                ax.set_title(f"{first['phase']} step, batch {first.get('batch', doc['batch'])}"
                             + (f", next_n {first['next_n']}" if first["phase"] == "verify" else ""))
            if rows:
                ax.legend()
            ax2.set_ylabel("added ms (bf16 - fp8)")
            ax2.set_title(f"{kind}: what bf16 keys add")
        from .readme import plot_caption

        fig.suptitle(f"{doc['model']['name']}, {doc['device']}, {doc.get('date', '')[:10]}\n{plot_caption(doc)}")
        fig.tight_layout(rect=(0, 0, 1, 1 - 0.45 / fig.get_figheight()))   # room for the two-line title
    from .output_guard import png_metadata, run_of

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, metadata={"Title": fig.get_suptitle(), "Software": "cupy-dsa bench",
                                         **png_metadata(run_of(doc))})
    plt.close(fig)


def markdown(doc: dict, with_rescore: bool = True) -> str:
    """The run as a markdown table (the README's cost table is this, generated from the results file); with
    fp8-rescore's table when the run timed it and ``with_rescore``."""
    m = doc["model"]
    # columns a run holds data for: runs from before fp8-cupy, the fp8 routes or the targets keep their table
    cupy8 = any(r.get("fp8_cupy_ms") is not None for r in doc["timings"])
    routes = any(r.get("fp8_route") and r.get("fp8_ms") is not None for r in doc["timings"])
    targets = any(r.get("target_ratio") for r in doc["timings"])
    fp8 = ("DeepGEMM on the route SGLang 0.5.23 takes for the step (fp8 route)" if routes
           else "DeepGEMM as SGLang calls it")
    head = (f"{m['name']} ({m['index_layers']} C4 layers), {doc.get('device') or 'no GPU'}{_forced_configs(doc)}, torch "
            f"{doc.get('torch_version') or 'not recorded'}, commit "
            f"`{commit_label(doc)}`: indexer ms per forward over every C4 layer "
            f"(store + logits + the schedule; top-k excluded); fp8 = {fp8}.")
    extra_head = ((" fp8 keys, cupy_dsa (fp8-cupy) | fp8-cupy / DeepGEMM |" if cupy8 else "")
                  + (" fp8 route |" if routes else "") + (" target |" if targets else ""))
    lines = [head, "", f"| step | batch x context (tokens) | bf16 keys | fp8 keys | added | ratio |{extra_head}",
             "|---|---|---|---|---|---|" + "---|" * extra_head.count("|")]
    for r in doc["timings"]:
        ms = [f"{r[k]:.2f} ms" if r.get(k) is not None else "—" for k in ("bf16_ms", "fp8_ms", "added_ms", "fp8_cupy_ms")]
        ratio = f"{r['ratio']:.2f}x" if r["ratio"] is not None else "—"
        extra = ""
        if cupy8:
            r8 = f"{r['fp8_cupy_ratio']:.2f}x" if r.get("fp8_cupy_ratio") is not None else "—"
            extra = f" {ms[3]} | {r8} |"
        if routes:
            gather = f" (its gathers: {r['fp8_gather_ms']:.2f} ms)" if r.get("fp8_gather_ms") is not None else ""
            extra += f" {r['fp8_route'] + gather if r.get('fp8_ms') is not None else '—'} |"
        if targets:
            target = f"<= {r['target_ratio']:.2f}x: {_verdict(r.get('verdict'))}" if r.get("target_ratio") else "—"
            extra += f" {target} |"
        lines.append(f"| {step_label(r)} | {_context(r)} | {ms[0]} | {ms[1]} | {ms[2]} | {ratio} |{extra}")
    gather_ops = sorted({gather_text(r["fp8_gather"]) for r in doc["timings"] if r.get("fp8_gather")})
    if gather_ops:
        lines += ["", f"The non-paged route's key gather: {'; '.join(gather_ops)}."]
    if with_rescore:
        lines += rescore_markdown(doc)
    lines += query_markdown(doc)
    mem = {r["layout"]: r for r in doc["memory"]}
    if {"bf16", "fp8"} <= mem.keys():
        b, f = mem["bf16"], mem["fp8"]
        lines += ["", f"Index cache: {b['index_bytes_per_token']:.0f} B per token with bf16 keys, "
                      f"{f['index_bytes_per_token']:.0f} B with fp8; {b['memory_gib']:g} GiB hold "
                      f"{b['tokens_fit'] / 1e6:.1f}M tokens of index keys (bf16) or {f['tokens_fit'] / 1e6:.1f}M (fp8)."]
        if "fp8-rescore" in mem:  # runs from before fp8-rescore keep their line
            r2 = mem["fp8-rescore"]
            target = (f"; target <= {r2['target_vs_bf16']:.2f}x: {r2['verdict']}" if r2.get("target_vs_bf16") else "")
            lines[-1] += (f" fp8-rescore: {r2['index_bytes_per_token']:.0f} B per token ({r2['bytes_per_entry']} B per "
                          f"entry, {r2['vs_bf16']:.2f}x bf16's{target}), {r2['tokens_fit'] / 1e6:.1f}M tokens.")
    if not doc.get("measured"):
        asked = f" Cases asked for: {'; '.join(doc['cases'])}." if doc.get("cases") else ""
        lines += ["", f"Not measured: {doc.get('not_measured')}.{asked}"]
    return "\n".join(lines) + "\n"


def _context(r) -> str:
    """A step's batch x context, or the context a prefill chunk comes after (the tables' second column)."""
    return f"{r['batch']} x {_tokens(r['context'])}" if r["phase"] != "prefill" else f"after {_tokens(r['context'])}"


def _ms(r, k) -> str:
    return f"{r[k]:.2f} ms" if r.get(k) is not None else "—"


def _times(r, k) -> str:
    return f"{r[k]:.2f}x" if r.get(k) is not None else "—"


def _verdict(v) -> str:
    return {"pass": "pass", "miss": "**miss**"}.get(v, "not evaluated")


def _step_table(head: str, rows: list, cells) -> list[str]:
    """``head``, its separator, then a row a step: its label, :func:`_context` and ``cells(r)``."""
    return [head, "|" + "---|" * (head.count("|") - 1)] + [
        "| " + " | ".join([step_label(r), _context(r)] + cells(r)) + " |" for r in rows]


def rescore_markdown(doc: dict) -> list[str]:
    """fp8-rescore's table (lines to append), for runs that timed it; none for older runs. Runs that record their
    stock top-k (issue 31) get its table (:func:`topk_markdown`); the earlier ones (torch.topk) theirs."""
    rows = [r for r in doc["timings"] if r.get("fp8_rescore_ms") is not None or r.get("fp8_rescore_dg_ms") is not None]
    if not rows:
        return []
    if doc.get("topk"):
        return topk_markdown(doc, rows)
    dg = any(r.get("fp8_rescore_dg_ms") is not None for r in rows)
    lines = ["", f"fp8-rescore, {doc.get('device') or 'no GPU'}, commit "
             f"`{commit_label(doc)}`, top-k included, ms per forward over every C4 layer: **fp8 + top-k** = the fp8 "
             "step above + `torch.topk(index_topk)` of each layer's logits (a stand-in for SGLang's sgl-kernel "
             "top-k, not installed where the bench runs); **fp8-rescore** = the store of the hi and lo pages in one "
             "launch + `rescore_topk` (decode rows, grouped verify) / `rescore_topk_prefill` (the chunk's rows) per "
             "layer, stage 1 by cupy_dsa's fp8 kernels (the plugin's `stage1=cupy`), K' = 4 x index_topk"
             + ("; **DeepGEMM stage 1** = the same store + DeepGEMM's paged fp8 logits, one row per token, + "
                "`rescore_topk` given them (the plugin's `stage1=sglang`)" if dg else "")
             + f". Targets ({targets_gpu(doc)}): decode and verify <= 1.15x, prefill chunks of 4,096 and 16,384 after 32K-128K "
               "<= 1.2x, of fp8 + top-k.", ""]
    head = "| step | batch x context (tokens) | fp8 | fp8 + top-k | fp8-rescore | / (fp8 + top-k) | / fp8 |"
    if dg:
        head += " fp8-rescore, DeepGEMM stage 1 | / (fp8 + top-k) | / fp8 |"
    head += " target |"

    def cells(r):
        got = [_ms(r, "fp8_ms"), _ms(r, "fp8_topk_ms"), _ms(r, "fp8_rescore_ms"), _times(r, "rescore_vs_fp8_topk"),
               _times(r, "rescore_vs_fp8")]
        if dg:
            got += [_ms(r, "fp8_rescore_dg_ms"), _times(r, "rescore_dg_vs_fp8_topk"), _times(r, "rescore_dg_vs_fp8")]
        t = r.get("rescore_target_ratio")
        verdicts = f"ours {_verdict(r.get('rescore_verdict'))}" + (
            f", DeepGEMM stage 1 {_verdict(r.get('rescore_dg_verdict'))}" if dg else "")
        return got + [f"<= {t:.2f}x: {verdicts}" if t else "—"]

    return lines + _step_table(head, rows, cells)


def gather_text(recorded: str) -> str:
    """The key gather a run recorded, for a reader: a run without SGLang installed recorded the raw import error."""
    return re.sub(r" \(SGLang's GetKAndS not importable: ModuleNotFoundError: No module named 'sglang'[^)]*\)",
                  " (SGLang, whose GetKAndS gathers the keys, was not installed where the bench ran)", recorded)


def stock_topk_name(topk: dict) -> str:
    """How a run names its stock top-k (``topk``: :meth:`peers.TopKs.describe`). Runs before issue 50 recorded v2 as
    "the H200's stock top-k" on every sm_90 GPU: named by its arch here, as :data:`peers.TOPK_LABELS` now does."""
    if topk.get("stand_in"):
        return (f"`cupy_dsa.paged_topk`, a STAND-IN for SGLang's v2 top-k: "
                f"{topk.get('stand_in_note') or 'SGLang not run'}")
    return f"{topk.get('stock_label') or topk.get('stock')}".replace("the H200's stock top-k", peers.V2_STOCK_ON)


def targets_gpu(doc: dict) -> str:
    """Where the cost targets were set (an H200) and, for a run on another GPU, that it is not where they apply."""
    device = doc.get("device") or "no GPU"
    return "H200" if "H200" in device else f"set for an H200; this run: {device}"


TOPK_ALONE_COLUMNS = (("sglang-v2", "SGLang v2"), ("sglang-v1", "SGLang v1"), ("cupy_dsa", "cupy_dsa"),
                      ("torch", "torch.topk"))


def topk_markdown(doc: dict, rows: list) -> list[str]:
    """fp8-rescore's table of a run with the stock top-k (issue 31): each step with and without it, fp8-rescore's
    ratios to fp8 + top-k and bf16 + top-k, issue 31's targets; then each top-k alone per forward."""
    dg = any(r.get("fp8_rescore_dg_ms") is not None for r in rows)
    topk = doc["topk"]
    lines = ["", f"fp8-rescore, {doc.get('device') or 'no GPU'}, commit "
             f"`{commit_label(doc)}`, top-k included, ms per forward over every C4 layer. "
             f"**top-k** = the stock top-k, {stock_topk_name(topk)}, per layer (its plan once per forward), every row "
             "its own length and page-table row; **fp8 + top-k** = the fp8 step above + top-k (the stock step); "
             "**bf16 + top-k** = the bf16 step + top-k (the plugin's bf16 mode); **fp8-rescore** = the store of the hi "
             "and lo pages in one launch + `rescore_topk` (decode rows, grouped verify) / `rescore_topk_prefill` (the "
             "chunk's rows) per layer, stage 1 by cupy_dsa's fp8 kernels (the plugin's `stage1=cupy`), K' = 4 x "
             "index_topk" + ("; **DG stage 1** = the same store + DeepGEMM's paged fp8 logits, one row per token, + "
                             "`rescore_topk` given them (the plugin's `stage1=sglang`)" if dg else "")
             + f". Targets ({targets_gpu(doc)}, batch 48, DG stage 1): decode and verify at 96K <= 1.30x fp8 + top-k and "
               "<= 0.75x bf16 + top-k, at 24K <= 1.00x bf16 + top-k; prefill chunk of 8,192 after 96K <= 0.90x, "
               "after 24K <= 1.00x bf16 + top-k.", ""]
    head = ("| step | batch x context (tokens) | fp8 | fp8 + top-k | bf16 + top-k | fp8-rescore | / (fp8 + top-k) "
            "| / (bf16 + top-k) |")
    if dg:
        head += " fp8-rescore, DG stage 1 | / (fp8 + top-k) | / (bf16 + top-k) |"
    head += " targets (DG stage 1) |"

    def cells(r):
        got = [_ms(r, "fp8_ms"), _ms(r, "fp8_topk_ms"), _ms(r, "bf16_topk_ms"), _ms(r, "fp8_rescore_ms"),
               _times(r, "rescore_vs_fp8_topk"), _times(r, "rescore_vs_bf16_topk")]
        if dg:
            got += [_ms(r, "fp8_rescore_dg_ms"), _times(r, "rescore_dg_vs_fp8_topk"),
                    _times(r, "rescore_dg_vs_bf16_topk")]
        targets = [f"<= {t['target']:.2f}x {t['basis'].replace('+topk', ' + top-k')}: {_verdict(t.get('verdict'))}"
                   for t in r.get("targets_31") or []]
        return got + ["; ".join(targets) or "—"]

    lines += _step_table(head, rows, cells)
    alone = [r for r in rows if r.get("topk_alone_ms")]
    have = [(k, name) for k, name in TOPK_ALONE_COLUMNS if any(k in r["topk_alone_ms"] for r in alone)]
    if have:
        n_c4 = doc.get("model", {}).get("index_layers")
        on = {r.get("topk_alone_on") for r in alone}
        whose = "the fp8 step's" if on == {"fp8+topk"} else "the fp8 step's, else the bf16 step's"
        lines += ["", f"Each top-k alone, ms per forward ({n_c4} C4 layers over one layer's logits, {whose}; its "
                      "plan once):", ""]
        lines += _step_table("| step | batch x context (tokens) | " + " | ".join(n for _, n in have) + " |", alone,
                             lambda r: [f"{r['topk_alone_ms'][k]:.3f} ms" if r["topk_alone_ms"].get(k) is not None
                                        else "—" for k, _ in have])
    missing = [f"{name}: {why}" for k, name in TOPK_ALONE_COLUMNS
               if (why := (topk.get("status") or {}).get(k)) not in (None, "live")]
    if missing:
        lines += ["", "Top-k not run: " + "; ".join(missing) + "."]
    return lines


def _tokens(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 and n < 1 << 20 else f"{n:,}"


# --------------------------------------------------------------------------------------------------
# The query axis (--query): the one-pass layouts whose query the plugin's SGLANG_CUPY_DSA_INDEX_Q sets, timed with
# each query, its preparation included
# --------------------------------------------------------------------------------------------------

def _query_layouts() -> tuple[str, ...]:
    """The timed layouts that are plugin modes taking the query setting with one-pass scoring (from the modes'
    records): bf16 and fp8-cupy."""
    from cupy_dsa.sglang.core import MODE_RECORDS

    return tuple(name for name, _ in TIMED if name in MODE_RECORDS and MODE_RECORDS[name].query_settable
                 and MODE_RECORDS[name].scoring == "one-pass")


QUERY_LAYOUTS = _query_layouts()
QUERY_COUNTED = (
    "query rows: the step of each layout with each query, its preparation included: per C4 layer "
    "cupy_dsa.prepare_index_q (RoPE + Hadamard-128 of wq_b's bf16 output, then the query's rounding and the head "
    "weights) on the forward's rows, then the logits with that query. fp8 = numerics 'fp8', the math of SGLang's "
    "fused fp8 q kernel (a stand-in for it: SGLang's JIT kernel is not installed where the bench runs); bf16 = "
    "numerics 'bf16', what the plugin runs with SGLANG_CUPY_DSA_INDEX_Q=bf16. Ratio: bf16 query over fp8 query.")


def arch_configs(target: str | None):
    """Within the block the logits' families (decode, prefill) launch ``target``'s product configs on this GPU, at
    its own residency (``bench serve --arch-configs``; None: this GPU's own configs)."""
    from cupy_dsa import heuristics

    stack = contextlib.ExitStack()
    if target is not None:
        for family in (heuristics.DECODE, heuristics.PREFILL):
            stack.enter_context(family.selecting_for(target))
    return stack


def arch_configs_note(target: str) -> str:
    return (f"--arch-configs {target}: cupy_dsa's logits (decode, verify, prefill) launch {target}'s product "
            f"configs, forced on this GPU at its own CTAs per SM (`bench variants --emulate {target}` also holds "
            f"{target}'s residency); the store, the query preparation and DeepGEMM as on this GPU.")


def _forced_configs(doc: dict) -> str:
    """The tables' mention of --arch-configs ('' for a run with this GPU's own configs)."""
    return f", {doc['arch_configs']}'s product configs forced" if doc.get("arch_configs") else ""


def _query_prep(query: str, q_shape, device, g):
    """A callable giving one layer's ``(q, weights)`` of the query ``query`` in the logits' q shape ``q_shape``:
    prepare_index_q over rows drawn like wq_b's and weights_proj's bf16 outputs, positions 0..rows-1."""
    import cupy_dsa

    from .sweeps import make_freqs

    rows = math.prod(q_shape[:-2])
    raw_q = torch.randn(rows, N_HEADS, HEAD_DIM, device=device, generator=g).to(torch.bfloat16)
    raw_w = torch.rand(rows, N_HEADS, device=device, generator=g).to(torch.bfloat16)
    freqs = make_freqs(rows, device)
    positions = torch.arange(rows, dtype=torch.int32, device=device)
    scale = (N_HEADS * HEAD_DIM) ** -0.5

    def prep():
        q, w = cupy_dsa.prepare_index_q(raw_q, raw_w, freqs_cis=freqs, positions=positions, weight_scale=scale,
                                        numerics=query)
        return q.view(q_shape), w

    return prep


def measure_queries(case: Case, model: ServeModel, device, seed: int, reps: int, queries=("fp8", "bf16"),
                    layouts=QUERY_LAYOUTS, configs_of: str | None = None) -> dict:
    """ms of one forward of each layout of ``layouts`` (of :data:`QUERY_LAYOUTS`) with each query, and each layout's
    bf16-query step over its fp8-query step; ``configs_of``: the logits launch that arch's product configs
    (:func:`arch_configs`)."""
    from .sweeps import _gen
    from .timing import time_calls

    row = {"phase": case.phase, "batch": case.batch, "context": case.context, "next_n": case.next_n,
           "chunk": case.chunk, "ms": {}, "bf16_q_vs_fp8_q": {}, "timing": None, "error": None}
    for layout in layouts:
        for query in queries:
            try:
                with arch_configs(configs_of):
                    fwd = _forward(case, layout, model, device, _gen(device, seed), None, query=query)
                    t = time_calls([fwd.run], device, reps=reps)
                row["ms"].setdefault(layout, {})[query] = t.seconds * 1e3
                row["timing"] = t.method
                del fwd
            except Exception as exc:  # one case failing must not end the run
                _add_error(row, f"{layout} with the {query} query", exc)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        got = row["ms"].get(layout, {})
        if got.get("bf16") is not None and got.get("fp8"):
            row["bf16_q_vs_fp8_q"][layout] = got["bf16"] / got["fp8"]
    return row


def query_markdown(doc: dict) -> list[str]:
    """The query rows' table (lines to append), for runs with ``--query``; none for other runs."""
    rows = doc.get("query_timings") or []
    if not rows:
        return []
    layouts = [name for name in QUERY_LAYOUTS if any(name in r["ms"] for r in rows)]
    queries = list(dict.fromkeys(q for r in rows for per in r["ms"].values() for q in per))
    lines = ["", f"The query ({doc.get('device') or 'no GPU'}{_forced_configs(doc)}, commit "
             f"`{commit_label(doc)}`): "
             "ms per forward over every C4 layer with each query, its preparation included (per layer "
             "`prepare_index_q` of the forward's rows, then the logits; the fp8 query's preparation is the math of "
             "SGLang's fused fp8 q kernel, standing in for it).", ""]
    head = "| step | batch x context (tokens) |" + "".join(
        f" {layout}, {q} q |" for layout in layouts for q in queries) + "".join(
        f" {layout}: bf16 q / fp8 q |" for layout in layouts)

    def cells(r):
        times = [r["ms"].get(layout, {}).get(q) for layout in layouts for q in queries]
        ratios = [r["bf16_q_vs_fp8_q"].get(layout) for layout in layouts]
        return ([f"{v:.2f} ms" if v is not None else "—" for v in times]
                + [f"{v:.3f}x" if v is not None else "—" for v in ratios])

    return lines + _step_table(head, rows, cells) + ["", query_target_line(rows, layouts)]


QUERY_TARGET = 1.05   # issue 32: the bf16 query costs <= 1.05x the fp8 query on every step kind


def query_target_line(rows: list, layouts) -> str:
    """Issue 32's cost target over the query rows: per layout the bf16 q / fp8 q span, its verdict and the steps
    over the target."""
    parts = []
    for layout in layouts:
        got = [(r, r["bf16_q_vs_fp8_q"][layout]) for r in rows if r["bf16_q_vs_fp8_q"].get(layout) is not None]
        if not got:
            continue
        ratios = [v for _, v in got]
        over = [f"{step_label(r)}{' at' if r['phase'] != 'prefill' else ''} {_context(r)}: {v:.3f}x"
                for r, v in got if v > QUERY_TARGET]
        span = f"{min(ratios):.3f}-{max(ratios):.3f}x" if len(ratios) > 1 else f"{ratios[0]:.3f}x"
        parts.append(f"{layout} {span}: " + (f"**miss** ({', '.join(over)})" if over else "pass"))
    what = f"Target (issue 32): bf16 q <= {QUERY_TARGET:.2f}x fp8 q on every step kind"
    return f"{what}: {'; '.join(parts)}." if parts else f"{what}: not evaluated (no step timed with both queries)."
