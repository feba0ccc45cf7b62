"""Two-level index keys (``fp8-rescore``): an fp8 candidate pass and an exact rescoring, the exact top-k at about
fp8's cost.

Stage 1 scores every key from SGLang's fp8 keys (the "hi" page, in SGLang's fp8 format; its bytes are checked equal to a
CPU emulation of SGLang's fp8 store, not to SGLang's CUDA store kernel itself, whose RoPE may fuse multiply-adds
where cupy_dsa's and the emulation's do not, so a scale word may differ by one ulp) and keeps each
row's top ``k_prime`` candidates; stage 2 rescores only those from ``hi + lo`` (the "lo" page holds the residual
``k - dequant(hi)``) and selects the row's top ``index_topk`` from those scores.

Ops: :func:`rescore_topk` (decode / MTP verify, the contract of ``paged_mqa_logits``) and
:func:`rescore_topk_prefill` (prefill / varlen extend, the paged contract of ``mqa_logits``): stage 1 from
cupy_dsa's fp8 logits (or logits the caller computed), then the candidates (a radix select, one CTA per row or
over column chunks), stage 2 and the selection by ``kernels/rescore_topk.cu``; no host sync, no data-dependent
shape (CUDA-graph safe), bitwise reruns; CPU tensors run the torch references (:func:`rescore_topk_reference`, :func:`rescore_topk_prefill_reference`,
the test oracle and the design's measurement). :func:`rescore_candidate_scores` is stage 2 alone. The fused store
writes both pages in one launch (``store_index_k(..., lo_cache=)``).

Residual encoding (the "lo" page): **int8 with its own per-token fp32 scale**, in the fp8 page geometry
(``uint8 [P, 8448]``: 64 x 128 int8 codes, then 64 little-endian fp32 scales at byte 8192), so one index entry
costs 132 B (hi) + 132 B (lo) = 264 B, 1.03x bf16's 256 B::

    r        = k - float(e4m3(hi_code)) * hi_scale             (fp32: a product, then a difference)
    lo_scale = max_e |r_e| / 127                               (fp32; 1.0 for a row whose residual is all zero)
    lo_code  = clamp(RNE(r / lo_scale), -127, 127)             (int8, true division)
    k_hat    = float(e4m3(hi_code)) * hi_scale + lo_code * lo_scale   (fp32, two products then one sum)

A key holding a NaN or an infinity gets zero lo codes and a NaN lo scale. The fused store
(``store_index_k(..., lo_cache=)``, ``kernels/store_index_k.cu``) writes both pages in one launch with these
operations in this order, so its hi page equals the fp8 store's and its lo page this reference's, bit for bit.

Why int8 and not an e4m3 or a bf16 residual: the fp8 residual ``r_e`` is bounded by half an e4m3 step of the
element's own binade, so residuals of large elements are large and those of small elements small, but every
``|r_e| <= 16 * hi_scale`` (half the step of the top binade, [256, 448)). A uniform (int8) grid over
``[-max|r|, max|r|]`` gives every element the same absolute error (<= max|r| / 254 <= 16 * hi_scale / 254, 1.4e-4
of the row's absolute maximum): finer than bf16's half-ulp (>= 2^-9 |x|) for every element above 1/14 of the row's
maximum, i.e. for most elements of a Hadamard-rotated key and nearly all of its dot products. Measured on the
recall bench's synthetic keys (8,192 Hadamard-rotated keys through ``rotate_index_k_reference``, 4 outlier
channels x20; ``tests/test_rescore.py`` checks these bounds on its own keys), relative L2 error
``|k_hat - k| / |k|``, mean / worst over keys:

==============================  ===================  =====================
key copy                        rel. L2 mean / max   bytes per entry
==============================  ===================  =====================
fp8 (hi alone)                  2.6e-2 / 3.2e-2      132
bf16 copy of k                  1.6e-3 / 2.1e-3      256
fp8 + e4m3 residual + scale     6.3e-4 / 8.7e-4      264
**fp8 + int8 residual + scale** **1.8e-4 / 2.8e-4**  **264**
==============================  ===================  =====================

The dot-product error ``|q . (k_hat - k)| / (|q| |k|)`` for random q follows the same order (mean 1.3e-5 for
int8 vs 1.2e-4 for bf16), so the rescoring is about 9x more precise than a bf16 key at 1.03x its bytes; a bf16
residual would be finer still, at 388 B per entry. Measured and not chosen (yet): an int8 residual
relative to each element's own e4m3 step (``lo * 2^(max(E, 1) - 18)`` in hi-scale units, E the code's exponent
field; no lo scale, 260 B per entry) has 1.7x less error again (rel. L2 1.1e-4 mean); on the recall bench's
near-duplicate stress suite (K' = 4k, k = 512, 8 queries) it missed 8 instead of 12 of the 4,096 exact top-k
entries at 64K tokens, and 19 instead of 18 at 16K. On that suite (near-duplicates at the top-k boundary) neither
residual keeps 99.99% of the exact top-k (99.5-99.9% at K' = 4k); stage 2 from the unrounded fp32 keys keeps
99.988-100% with a bf16 q and 99.85-99.98% with the fp8 q.

Stage 2 scores with one f16 key per candidate, the **combined key** (:func:`combined_key_reference`)::

    ratio8 = (lo_scale / hi_scale) * 2^-8                          (fp32, two roundings; 0 where hi_scale is 0)
    c      = f16_rn(e4m3(hi_code) * 2^-8 + float(lo_code) * ratio8) (fp32 product, fp32 sum, one f16 rounding)
    score  = sum_h fmax(256 * hi_scale * (q_h . c), 0) * w_h

``256 * hi_scale * c`` is ``k_hat`` rounded to 11 significant bits: one tensor-core product per candidate instead
of one for the hi and one for the lo page. On the CPU study of the diverse keys (k 512, K' 2048) it missed 0.02-0.12%
of the exact top-k, against 0.00-0.07% for the exact two-level key and 0.10-0.17% for a bf16 key. ``fmax`` (not a
clamp) takes a NaN dot product (a non-finite key) as 0, as the kernel's ``fmaxf`` does.

Selection (:func:`rescore_topk_reference`): stage 1 ranks a row's visible keys by their fp8 logit
(``paged_mqa_logits_reference`` on the hi cache: ``k_scale * sum_h relu(q_h . k_fp8) * w_h``), ties broken by
the lower position; the first ``k_prime`` are the candidates (or the caller's ``candidates``: e.g. SGLang's own
top-k at k = K', whose tie order may differ). Stage 2 scores them as above in fp32 and keeps the first
``index_topk`` by that score, ties broken by the lower position (two keys with equal hi bytes have equal fp8
logits, so this is their stage-1 order too). A row that sees ``len <=
index_topk`` keys selects ``0..len-1`` without reading scores, as SGLang's top-k does (its fp8 ranks are counted
over the row's visible keys). The kernels select exactly the reference's candidates (the radix select works on
the same keys: logit bits, then position) and sum ``q . c`` with exact products (q scaled per row by a power of
two into f16) and fp32 accumulation on f16 tensor cores: on the same stage-1 logits the device selection is the
reference's except where two candidates' scores lie within fp32 rounding of each other.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import arch as arch_limits
from . import launch, runtime
from .contracts import check_aligned, check_bool, check_contiguous, check_device, check_dtype, check_int
from .launch import I32, I64, PTR
# the two-level page pair lives with the other layouts (cupy_dsa.layouts); re-exported here, its numerics above
from .layouts import (LO_BYTES_PER_TOKEN, LO_MAX, LO_PAGE_BYTES, TWO_LEVEL_BYTES_PER_TOKEN, empty_lo_cache, lo_views,
                      residual_encode_reference, store_two_level_reference, two_level_dequant_reference)
from .layouts import check_two_level_pair as _check_pair
from .layouts import (FP8_PAGE_BYTES, FP8_SCALE_OFFSET, HEAD_DIM, N_HEADS, PAGE_SLOTS, as_page_rows,
                      fp8_quantize_reference, fp8_views, layout_of)
from .logits import (check_paged, check_prefill, device_info, REF_ROW_CHUNK, mqa_logits, mqa_logits_reference,
                     paged_mqa_logits, paged_mqa_logits_reference)
from .topk import (ROW_SELECT_PROBLEMS, SELECT_THREADS, SLICE_CACHE_KEYS, row_cache_keys, row_select_problem,
                   row_select_smem, row_select_values)

class RescoreTopK(NamedTuple):
    """int32 ``[rows, index_topk]`` each, -1 padded: ``page_indices`` (SGLang's form, ``page_table[r, i // 64] *
    64 + i % 64``), ``raw_indices`` (positions ``i``), ``fp8_rank`` (each selected key's 0-based stage-1 rank;
    None unless asked for)."""
    page_indices: torch.Tensor
    raw_indices: torch.Tensor
    fp8_rank: torch.Tensor


def combined_key_reference(hi, hi_scale, lo, lo_scale) -> torch.Tensor:
    """Stage 2's key, float16 ``[N, 128]``: ``f16_rn(e4m3(hi) * 2^-8 + lo * ratio8)``, ratio8 = ``(lo_scale /
    hi_scale) * 2^-8`` (0 where hi_scale is 0: a slot never stored), in units of ``256 * hi_scale`` (see the
    module docstring). Each operation rounds as the kernel's does (fp32 division, products and sums, then one
    conversion to f16)."""
    two_level_dequant_reference(hi, hi_scale, lo, lo_scale)      # the argument checks
    hi8 = hi.view(torch.float8_e4m3fn).float() * (2.0 ** -8)     # exact
    stored = hi_scale != 0
    ratio8 = torch.where(stored, lo_scale / torch.where(stored, hi_scale, torch.ones_like(hi_scale)),
                         torch.zeros_like(lo_scale)) * (2.0 ** -8)
    return (hi8 + lo.float() * ratio8[:, None]).to(torch.float16)


# --------------------------------------------------------------------------------------------------
# Kernels (kernels/rescore_topk.cu) and their family
# --------------------------------------------------------------------------------------------------

K_PRIME_MULTIPLE = 4                 # default K' = 4 x index_topk
INVALID_KEY = -(2 ** 63)             # a stage-2 key that no selection takes before a scored candidate
_TILE_CANDS = 16                     # candidates of a warp's tile (a CTA's chunk is a multiple of its warps' tiles)
STAGE2_MAX_CHUNK = {4: 2048, 8: 1024}   # candidates of one CTA by its warps (kMaxChunk: slots in shared memory)
# Candidates of one CTA at most where the rows alone would not fill a wave: below one wave, smaller chunks give later
# CTAs whose prologue (q staged, slots located) overlaps earlier CTAs' tiles (H100, 144 rows x K' 2048: 384 per CTA
# 44.8 us, 1,024 51.6 us; 48 rows keep 256, one wave: 16.8 us, 384 17.9 us).
STAGE2_SPREAD_CHUNK = 384
STAGE2_STAGES = 2                    # tiles of a warp in its cp.async ring: one in flight while one is scored
_RING_STAGE_BYTES = 8 * 512 + 4 * 128 + 2 * 128   # RingStage: 8 row chunks, 4 scales, 2 slots per lane
RADIX_BINS = 4096                    # their 12-bit digits (kRadixBins)
MAX_DEVICE_TOPK = 2048               # rescore_finish holds a row's selection in shared memory (kMaxTopK)
_BOUNDARY_MIN = 16384                # keys of the K'-th key's 12-bit bin collected per row (at least 8 x K')
_MAX_GRID_Y = 65535
_FP8 = torch.float8_e4m3fn
_Q_DTYPES = (_FP8, torch.bfloat16)
_SRC = "rescore_topk.cu"

# How a kernel finds row r's visible positions [lo, hi) and its block-table row (RowMode in the kernel).
_ROW_ARGS = (("lens0", PTR), ("lens1", PTR), ("cu_rows", PTR), ("mode", I32), ("next_n", I32), ("batch", I32),
             ("width", I32))
_DECODE_LENS_1D, _DECODE_LENS_2D, _PREFILL_KS_KE = 0, 1, 2

_LOGITS_ARGS = (("logits", PTR), ("logits_stride", I64)) + _ROW_ARGS
_select_threads = lambda cfg: SELECT_THREADS   # noqa: E731
HISTOGRAM_KERNEL = launch.Kernel(
    _SRC, "rescore_histogram", args=_LOGITS_ARGS + (("cols_per_cta", I32), ("index_topk", I32), ("work", PTR)),
    threads=_select_threads)
GATHER_KERNEL = launch.Kernel(
    _SRC, "rescore_gather",
    args=_LOGITS_ARGS + (("cols_per_cta", I32), ("index_topk", I32), ("work", PTR), ("k_prime", I32),
                         ("candidates", PTR), ("boundary", PTR), ("cap", I32)),
    threads=_select_threads)
BOUNDARY_KERNEL = launch.Kernel(
    _SRC, "rescore_boundary",
    args=_LOGITS_ARGS + (("index_topk", I32), ("work", PTR), ("k_prime", I32), ("candidates", PTR),
                         ("boundary", PTR), ("cap", I32)),
    threads=_select_threads)
STAGE2_KERNEL = launch.Kernel(
    _SRC, "rescore_topk_kernel", params=("QFp8", "Stages", "Warps"),
    args=(("q", PTR), ("weights", PTR), ("hi_cache", PTR), ("lo_cache", PTR), ("num_pages", I64), ("block_table", PTR),
          ("bt_stride", I64), ("bt_width", I32)) + _ROW_ARGS
    + (("candidates", PTR), ("k_prime", I32), ("cands_per_cta", I32), ("index_topk", I32), ("keys", PTR)),
    threads=lambda cfg: 32 * cfg.Warps, smem=lambda cfg: cfg.Warps * cfg.Stages * _RING_STAGE_BYTES)
CANDIDATES_KERNEL = launch.Kernel(
    _SRC, "rescore_candidates", params=("CacheEntries", "Cluster"),
    args=_LOGITS_ARGS + (("index_topk", I32), ("k_prime", I32), ("candidates", PTR)),
    threads=_select_threads, smem=row_select_smem, smem_check="dsa::radix::kSelectSmemBytes<{CacheEntries}, {Cluster}>")
FINISH_CACHED_KEYS = 4096            # stage-2 keys of a row rescore_finish reads into shared memory (K' <= 4096)
FINISH_KERNEL = launch.Kernel(
    _SRC, "rescore_finish", params=("CachedKeys",),
    args=(("keys", PTR), ("k_prime", I32), ("candidates", PTR), ("logits", PTR), ("logits_stride", I64),
          ("block_table", PTR), ("bt_stride", I64)) + _ROW_ARGS
    + (("index_topk", I32), ("page_indices", PTR), ("raw_indices", PTR), ("fp8_rank", PTR),
       ("in_position_order", I32)),
    threads=_select_threads, smem=lambda cfg: 8 * cfg.CachedKeys)
_PARTS = {"histogram": HISTOGRAM_KERNEL, "gather": GATHER_KERNEL, "boundary": BOUNDARY_KERNEL}


def stage2_warps(arch: str | None) -> int:
    """Warps of a stage-2 CTA: 4 where three CTAs fit an SM, 8 on the 100 KB archs (sm_86 / sm_89 / sm_120 /
    sm_121), where one CTA holds the SM: at least 8 warps resident either way."""
    return 8 if arch is not None and arch_limits.small_smem(arch) else 4


def _select_config(problem, arch):
    if problem[0] == "stage2":
        return STAGE2_KERNEL.config(QFp8=problem[1], Stages=STAGE2_STAGES, Warps=stage2_warps(arch))
    if problem[0] == "candidates":
        return CANDIDATES_KERNEL.config(**row_select_values(problem[1:], arch))
    if problem[0] == "finish":
        return FINISH_KERNEL.config(CachedKeys=FINISH_CACHED_KEYS if problem[1] else 0)
    return _PARTS[problem[0]].config()


def _serves(cfg, problem) -> bool:
    """Any row cache computes any row (a row longer than its cache is read from L2), any ring depth any stage 2;
    otherwise the product config."""
    if problem[0] == "candidates":
        return cfg.kernel is CANDIDATES_KERNEL
    if problem[0] == "stage2":
        return cfg.kernel is STAGE2_KERNEL and cfg.QFp8 == problem[1]
    return cfg == _select_config(problem, None)


# A problem: the op's step (a selection kernel), ("candidates", *topk.row_select_problem), ("stage2",
# 1 for an fp8 stage-2 q / 0 for bf16) or ("finish", whether K' keys fit in shared memory).
RESCORE = launch.register(launch.Family(
    "rescore_topk", problems=[("histogram",), ("gather",), ("boundary",)]
    + [("candidates",) + p for p in ROW_SELECT_PROBLEMS] + [("stage2", 0), ("stage2", 1),
                              ("finish", True),
                              ("finish", False)],
    select=_select_config, serves=_serves))


def product_instantiations(arch: str | None = None) -> list[str]:
    """Name expressions of the rescoring kernels on ``arch`` (all of them: both stage-2 q types)."""
    return list(dict.fromkeys(RESCORE.select(p, arch).expr for p in RESCORE.problems))


# --------------------------------------------------------------------------------------------------
# Contract checks (tensor metadata only: no host sync)
# --------------------------------------------------------------------------------------------------

def _renamed(e: ValueError, old: str, new: str) -> ValueError:
    """The error of a logits-op check with the cache argument named as this op names it."""
    msg = str(e)
    return ValueError(new + msg[len(old):] if msg.startswith(old) else msg)


def _check_topk(index_topk, k_prime):
    index_topk = check_int("index_topk", index_topk, 1)
    if k_prime is None:
        return index_topk, min(K_PRIME_MULTIPLE * index_topk, 2**31 - 1)
    k_prime = check_int("k_prime", k_prime, 1)
    if k_prime < index_topk:
        raise ValueError(f"k_prime: expected an int >= index_topk ({index_topk}), got {k_prime}")
    return index_topk, k_prime


def _check_stage2_q(q_rescore, weights_rescore, q2, weights, shapes, device):
    """The stage-2 query and weights as ``[R, 64, 128]`` and ``[R, 64]`` (default: the stage-1 ones)."""
    R = q2.shape[0]
    if q_rescore is not None:
        check_dtype("q_rescore", q_rescore, _Q_DTYPES)
        if tuple(q_rescore.shape) not in shapes:
            raise ValueError(f"q_rescore: expected shape {' or '.join(str(s) for s in shapes)} (the rows of q), got "
                             f"{tuple(q_rescore.shape)}")
        check_contiguous("q_rescore", q_rescore)
        check_device("q_rescore", q_rescore, device, "q")
        q2 = q_rescore.reshape(R, N_HEADS, HEAD_DIM)
    # stage 2 reads 8 q elements at once: 16 bytes of a bf16 q, 8 of an fp8 one
    check_aligned("q_rescore" if q_rescore is not None else "q", q2, 16 if q2.dtype == torch.bfloat16 else 8)
    w2 = weights
    if weights_rescore is not None:
        check_dtype("weights_rescore", weights_rescore, (torch.float32,))
        if tuple(weights_rescore.shape) != (R, N_HEADS):
            raise ValueError(f"weights_rescore: expected shape {(R, N_HEADS)}, got {tuple(weights_rescore.shape)}")
        check_contiguous("weights_rescore", weights_rescore)
        check_device("weights_rescore", weights_rescore, device, "q")
        w2 = weights_rescore
    return q2, w2


def _check_stage1_logits(stage1_logits, R, device):
    check_dtype("stage1_logits", stage1_logits, (torch.float32,))
    if stage1_logits.dim() != 2 or stage1_logits.shape[0] != R:
        raise ValueError(f"stage1_logits: expected shape [{R}, width] (one row per query row), got "
                         f"{tuple(stage1_logits.shape)}")
    check_device("stage1_logits", stage1_logits, device, "q")
    if R > 0 and stage1_logits.shape[1] > 1 and stage1_logits.stride(1) != 1:
        raise ValueError(f"stage1_logits: expected stride(1) == 1, got strides {stage1_logits.stride()}")


def _check_candidates(candidates, stage1_logits, R, index_topk, k_prime, device):
    """The caller's stage-1 candidates: int32 ``[R, K']`` positions (-1: none), K' >= index_topk; returns K'."""
    if candidates is None:
        return k_prime
    if stage1_logits is None:
        raise ValueError("candidates: expected together with stage1_logits (the logits they were selected from)")
    check_dtype("candidates", candidates, (torch.int32,))
    if candidates.dim() != 2 or candidates.shape[0] != R or candidates.shape[1] < index_topk:
        raise ValueError(f"candidates: expected shape [{R}, K'] with K' >= index_topk ({index_topk}), got "
                         f"{tuple(candidates.shape)}")
    check_contiguous("candidates", candidates)
    check_device("candidates", candidates, device, "q")
    return candidates.shape[1]


def _check_decode(q, weights, hi_cache, lo_cache, context_lens, block_table, index_topk, k_prime, q_rescore,
                  weights_rescore, stage1_logits):
    """Checks of a decode / verify call; returns (B, next_n, index_topk, k_prime, stage-2 q [R, 64, 128], weights)."""
    _check_pair(hi_cache, lo_cache)
    try:
        check_paged(q, hi_cache, weights, context_lens, block_table, 0)
    except ValueError as e:
        raise _renamed(e, "kv_cache:", "hi_cache:") from None
    _check_pair(hi_cache, lo_cache, q.device)
    index_topk, k_prime = _check_topk(index_topk, k_prime)
    B, next_n = q.shape[0], q.shape[1]
    R = B * next_n
    q2, w2 = _check_stage2_q(q_rescore, weights_rescore, q.reshape(R, N_HEADS, HEAD_DIM), weights,
                             ((B, next_n, N_HEADS, HEAD_DIM), (R, N_HEADS, HEAD_DIM)), q.device)
    if stage1_logits is not None:
        _check_stage1_logits(stage1_logits, R, q.device)
    return B, next_n, index_topk, k_prime, q2, w2


def _check_prefill_call(q, weights, hi_cache, lo_cache, ks, ke, block_table, index_topk, k_prime, cu_rows,
                        q_rescore, weights_rescore, stage1_logits):
    """Checks of a prefill call; returns (index_topk, k_prime, stage-2 q, weights, block table (1-D for one
    request), keys per request row of the table, cu_rows on q's device or None)."""
    _check_pair(hi_cache, lo_cache)
    if block_table is None:
        raise ValueError("block_table: two-level keys are paged: expected int32 [num_pages] (one request) or "
                         "[batch, max_pages] with cu_rows")
    try:
        _, bt, num_keys, _, _, _, cu_rows = check_prefill(q, hi_cache, weights, ks, ke, block_table, 0, None, cu_rows)
    except ValueError as e:
        raise _renamed(_renamed(e, "kv (paged cache):", "hi_cache:"), "kv:", "hi_cache:") from None
    _check_pair(hi_cache, lo_cache, q.device)
    index_topk, k_prime = _check_topk(index_topk, k_prime)
    T = q.shape[0]
    q2, w2 = _check_stage2_q(q_rescore, weights_rescore, q, weights, ((T, N_HEADS, HEAD_DIM),), q.device)
    if stage1_logits is not None:
        _check_stage1_logits(stage1_logits, T, q.device)
    return index_topk, k_prime, q2, w2, bt, num_keys, cu_rows


# --------------------------------------------------------------------------------------------------
# Torch references (CPU backend and test oracle)
# --------------------------------------------------------------------------------------------------

def _stage2_reference(q2, w2, hi_cache, lo_cache, cand, lo, hi, bt_rows):
    """fp32 ``sum_h relu(q_h . k_hat) * w_h`` of candidate positions ``cand`` [r, n] (int64) of rows that see
    ``[lo, hi)`` ([r, 1] each) through block-table rows ``bt_rows`` [r, max_pages]; ``-inf`` where the row does
    not see the position or its page is not in the caches (such keys are never read). Also returns that mask."""
    hi_codes, hi_scales = fp8_views(hi_cache)
    lo_codes, lo_scales = lo_views(lo_cache)
    num_pages = hi_codes.shape[0]
    seen = (cand >= lo) & (cand < hi) & (cand // PAGE_SLOTS < bt_rows.shape[1])
    pages = bt_rows.gather(1, (cand // PAGE_SLOTS).clamp(0, max(bt_rows.shape[1] - 1, 0)))
    ok = seen & (pages >= 0) & (pages < num_pages)
    pg = torch.where(ok, pages, torch.zeros_like(pages))
    sl = torch.where(ok, cand % PAGE_SLOTS, torch.zeros_like(cand))
    r, n = cand.shape
    hs = hi_scales[pg, sl].reshape(-1)
    key = combined_key_reference(hi_codes[pg, sl].reshape(-1, HEAD_DIM), hs, lo_codes[pg, sl].reshape(-1, HEAD_DIM),
                                 lo_scales[pg, sl].reshape(-1)).float().reshape(r, n, HEAD_DIM)
    dots = torch.einsum("rhd,rnd->rhn", q2.float(), key) * (256.0 * hs.reshape(r, 1, n))
    s2 = torch.einsum("rhn,rh->rn", torch.fmax(dots, torch.zeros((), device=dots.device)), w2)
    return s2.masked_fill(~ok, float("-inf")), ok


def _select_reference(stage1, lo, hi, bt_rows, q2, w2, hi_cache, lo_cache, index_topk, k_prime,
                      fp8_rank=True, candidates=None) -> RescoreTopK:
    """The two-stage selection of rows that see positions ``[lo, hi)`` (int64 [R] on the CPU, within the logits'
    width), stage-1 logits ``stage1`` [R, >= max hi] (only visible columns are read), block-table rows
    ``bt_rows`` (int64 [R, max_pages] on q's device); ``candidates`` (int [R, K'], any order, a position the row
    does not see names none): the caller's stage-1 candidates instead of the exact stage-1 order's first K'."""
    R = q2.shape[0]
    dev = q2.device
    page_out = torch.full((R, index_topk), -1, dtype=torch.int32, device=dev)
    raw_out = torch.full_like(page_out, -1)
    rank_out = torch.full_like(page_out, -1)
    L = int(hi.max()) if R else 0
    if L == 0:
        return RescoreTopK(page_out, raw_out, rank_out if fp8_rank else None)
    lo_d, hi_d = lo.to(dev), hi.to(dev)
    cols = torch.arange(L, device=dev)
    kp = min(k_prime, L) if candidates is None else candidates.shape[1]
    for r0 in range(0, R, REF_ROW_CHUNK):
        r1 = min(R, r0 + REF_ROW_CHUNK)
        lo_r, hi_r = lo_d[r0:r1, None], hi_d[r0:r1, None]
        seen = (cols[None, :] >= lo_r) & (cols[None, :] < hi_r)
        s1 = stage1[r0:r1, :L].masked_fill(~seen, float("-inf"))
        order = torch.sort(s1, dim=1, descending=True, stable=True).indices          # ties: lower position first
        # positions the row does not see last (a visible key of an invalid page may have a -inf logit too)
        order = order.gather(1, torch.sort(seen.gather(1, order).to(torch.int8), dim=1, descending=True,
                                           stable=True).indices)
        rank = torch.empty_like(order)
        rank.scatter_(1, order, cols[None, :].expand(r1 - r0, L).contiguous())
        cand = order[:, :kp] if candidates is None else candidates[r0:r1].to(dev, torch.int64)   # [r, kp] positions
        # stage 2: the candidates' k_hat from the hi and lo pages
        s2, pages_ok = _stage2_reference(q2[r0:r1], w2[r0:r1], hi_cache, lo_cache, cand, lo_r, hi_r, bt_rows[r0:r1])
        # stage-2 order, ties to the lower position: a stable sort of the candidates in position order
        by_pos = torch.sort(cand, dim=1).indices
        sel = by_pos.gather(1, torch.sort(s2.gather(1, by_pos), dim=1, descending=True,
                                          stable=True).indices[:, :min(index_topk, kp)])
        raw = cand.gather(1, sel)
        ok = pages_ok.gather(1, sel)                                                # keys of invalid pages: never
        # position order (the kernels'), the keys of invalid pages last
        by_position = torch.sort(torch.where(ok, raw, torch.full_like(raw, 2**62)), dim=1, stable=True).indices
        raw, ok = raw.gather(1, by_position), ok.gather(1, by_position)
        n_r = hi_r - lo_r
        trivial = n_r[:, 0] <= index_topk
        if bool(trivial.any()):                                                     # lo .. hi - 1, in order
            seq = torch.arange(raw.shape[1], device=dev)[None, :].expand(r1 - r0, -1)
            raw = torch.where(trivial[:, None], lo_r + seq, raw)
            ok = torch.where(trivial[:, None], seq < n_r, ok)
        pos = raw.clamp(0, L - 1)
        pos_rank = rank.gather(1, pos)
        page = bt_rows[r0:r1].gather(1, (pos // PAGE_SLOTS).clamp(max=bt_rows.shape[1] - 1))
        m = raw.shape[1]
        raw_out[r0:r1, :m] = torch.where(ok, raw, torch.full_like(raw, -1)).to(torch.int32)
        rank_out[r0:r1, :m] = torch.where(ok, pos_rank, torch.full_like(raw, -1)).to(torch.int32)
        page_out[r0:r1, :m] = torch.where(ok, page * PAGE_SLOTS + raw % PAGE_SLOTS,
                                          torch.full_like(raw, -1)).to(torch.int32)
    return RescoreTopK(page_out, raw_out, rank_out if fp8_rank else None)


def _decode_rows_reference(context_lens, B, next_n, width):
    lens = context_lens.long().cpu()
    if lens.dim() == 1:
        lens = lens[:, None] - (next_n - 1 - torch.arange(next_n))[None, :]
    hi = lens.clamp(0, width).reshape(B * next_n)
    return torch.zeros_like(hi), hi


def rescore_topk_reference(q, weights, hi_cache, lo_cache, context_lens, block_table, index_topk, k_prime=None, *,
                           stage1_logits=None, q_rescore=None, weights_rescore=None, fp8_rank=True,
                           candidates=None) -> RescoreTopK:
    """Two-stage top-k of paged index keys (the decode / MTP-verify contract of ``paged_mqa_logits``).

    q float8_e4m3fn/bfloat16 ``[B, next_n, 64, 128]``, weights float32 ``[B * next_n, 64]`` (q's scale folded in
    for an fp8 q), ``hi_cache`` SGLang's fp8 cache, ``lo_cache`` its residual pages (same shape, see
    :func:`store_two_level_reference`), context_lens int32 ``[B]`` (row ``j`` of a request sees ``len - (next_n -
    1 - j)`` keys) or ``[B, next_n]``, block_table int32 ``[B, max_pages]``. ``index_topk >= 1`` keys per row,
    chosen among each row's ``k_prime >= index_topk`` (default ``4 * index_topk``) best stage-1 (fp8) keys.
    ``stage1_logits``: the fp8 logits ``[B * next_n, >= visible width]`` if the caller already has them (columns
    past a row's length are ignored). ``q_rescore`` (bfloat16 or fp8, ``[B, next_n, 64, 128]`` or ``[B * next_n,
    64, 128]``) and ``weights_rescore`` (float32 ``[B * next_n, 64]``): stage 2's query and head weights
    (default: q and weights; a bf16 q_rescore of the unquantized query goes with the weights without q's fp8
    scale). ``candidates`` (int32 ``[B * next_n, K']``, with ``stage1_logits``): each row's stage-1 candidates
    as positions in any order, -1 padded (SGLang's own top-k at k = K'), in place of the exact first K'.
    Returns :class:`RescoreTopK` (each row's selection in position order, trivial rows ``0..len-1``); a
    non-trivial row never selects a key whose block-table entry is not a page of the caches."""
    B, next_n, index_topk, k_prime, q2, w2 = _check_decode(q, weights, hi_cache, lo_cache, context_lens, block_table,
                                                           index_topk, k_prime, q_rescore, weights_rescore,
                                                           stage1_logits)
    _check_candidates(candidates, stage1_logits, B * next_n, index_topk, k_prime, q.device)
    width = block_table.shape[1] * PAGE_SLOTS
    if stage1_logits is None:
        stage1_logits = paged_mqa_logits_reference(q, hi_cache, weights, context_lens, block_table, width)
    lo, hi = _decode_rows_reference(context_lens, B, next_n, min(width, stage1_logits.shape[1]))
    bt_rows = block_table.long().repeat_interleave(next_n, dim=0)                   # [R, max_pages]
    return _select_reference(stage1_logits, lo, hi, bt_rows, q2, w2, hi_cache, lo_cache, index_topk, k_prime,
                             check_bool("fp8_rank", fp8_rank), candidates)


def _prefill_rows_reference(ks, ke, bt, cu_rows, width, T, device):
    """(lo, hi) int64 [T] on the CPU and block-table rows int64 [T, max_pages] of a prefill call."""
    lo = ks.long().cpu().clamp_min(0)
    hi = ke.long().cpu().clamp(max=width)
    if cu_rows is None:
        bt_rows = bt.long()[None, :].expand(T, -1)
    else:
        cu = cu_rows.long().cpu()
        B = cu.shape[0] - 1
        r = torch.arange(T)
        b = torch.searchsorted(cu[1:].contiguous(), r, right=True)                  # first b with cu[b + 1] > r
        owned = (b < B) & (cu[b.clamp(max=max(B - 1, 0))] <= r) if B > 0 else torch.zeros(T, dtype=torch.bool)
        hi = torch.where(owned, hi, lo)                                             # rows of no request: empty
        bt_rows = (bt.long()[b.clamp(max=B - 1).to(bt.device)] if B > 0
                   else torch.zeros(T, 0, dtype=torch.long, device=device))
    empty = hi <= lo
    return torch.where(empty, 0, lo), torch.where(empty, 0, hi), bt_rows


def rescore_topk_prefill_reference(q, weights, hi_cache, lo_cache, ks, ke, block_table, index_topk, k_prime=None, *,
                                   cu_rows=None, stage1_logits=None, q_rescore=None,
                                   weights_rescore=None, fp8_rank=True) -> RescoreTopK:
    """Two-stage top-k of prefill / extend rows (the paged contract of ``mqa_logits``): row ``i`` sees positions
    ``[ks[i], ke[i])`` of its request's keys. q float8_e4m3fn/bfloat16 ``[T, 64, 128]``, weights float32 ``[T,
    64]``, ks / ke int32 ``[T]``; one request: block_table int32 ``[num_pages]`` or ``[1, num_pages]``; several
    (varlen): ``cu_rows`` int32 ``[batch + 1]`` (request ``b`` owns rows ``[cu_rows[b], cu_rows[b + 1])``) and
    block_table ``[batch, max_pages]``; rows of no request select nothing. ``stage1_logits``: ``[T, >= width]``
    with column = position (``mqa_logits`` without ``max_seqlen_k``). A row that sees ``n <= index_topk`` keys
    selects ``ks .. ks + n - 1``; the rest as :func:`rescore_topk_reference` (``q_rescore`` ``[T, 64, 128]``)."""
    index_topk, k_prime, q2, w2, bt, num_keys, cu_rows = _check_prefill_call(
        q, weights, hi_cache, lo_cache, ks, ke, block_table, index_topk, k_prime, cu_rows, q_rescore,
        weights_rescore, stage1_logits)
    if stage1_logits is None:
        stage1_logits = mqa_logits_reference(q, hi_cache, weights, ks, ke, block_table=block_table, cu_rows=cu_rows)
    width = min(num_keys, stage1_logits.shape[1])
    lo, hi, bt_rows = _prefill_rows_reference(ks, ke, bt, cu_rows, width, q.shape[0], q.device)
    return _select_reference(stage1_logits, lo, hi, bt_rows, q2, w2, hi_cache, lo_cache, index_topk, k_prime,
                             check_bool("fp8_rank", fp8_rank))


# --------------------------------------------------------------------------------------------------
# Public ops
# --------------------------------------------------------------------------------------------------

def rescore_topk(q, weights, hi_cache, lo_cache, context_lens, block_table, index_topk, k_prime=None, *,
                 q_rescore=None, weights_rescore=None, stage1_logits=None, plan=None,
                 fp8_rank=False, candidates=None) -> RescoreTopK:
    """The exact top-k at fp8's cost, decode / MTP verify (the contract of :func:`rescore_topk_reference`).

    Stage 1: fp8 logits of every visible key from ``hi_cache`` (:func:`cupy_dsa.paged_mqa_logits`, with ``plan``
    when given), or ``stage1_logits`` the caller computed (e.g. DeepGEMM's; ``[B * next_n, >= width]``, width =
    ``block_table.shape[1] * 64``; only the columns a row sees are read). Each row's ``k_prime`` (default ``4 *
    index_topk``, at most the width) best logits are its candidates (a radix select: one CTA per row, or column
    chunks for few long rows). Stage 2 scores them from the hi and lo pages with ``q_rescore`` /
    ``weights_rescore`` (default q / weights) and selects ``index_topk`` (at most 2048 on the GPU). ``fp8_rank=True`` also returns each selected key's stage-1
    rank (a measurement: it costs index_topk x K' comparisons per row). No host sync and no data-dependent shape:
    capturable in a CUDA graph (after :func:`cupy_dsa.warm_up`), deterministic. ``candidates`` (int32 ``[B *
    next_n, K']`` positions, -1 padded, any order, with ``stage1_logits``): the caller's candidates (SGLang's own
    top-k at k = K'), in place of cupy_dsa's select; K' is their width. Returns :class:`RescoreTopK`.
    CPU tensors run the reference."""
    fp8_rank = check_bool("fp8_rank", fp8_rank)
    if not (isinstance(q, torch.Tensor) and q.is_cuda):
        return rescore_topk_reference(q, weights, hi_cache, lo_cache, context_lens, block_table, index_topk, k_prime,
                                      stage1_logits=stage1_logits, q_rescore=q_rescore,
                                      weights_rescore=weights_rescore, fp8_rank=fp8_rank, candidates=candidates)
    B, next_n, index_topk, k_prime, q2, w2 = _check_decode(q, weights, hi_cache, lo_cache, context_lens, block_table,
                                                           index_topk, k_prime, q_rescore, weights_rescore,
                                                           stage1_logits)
    k_prime = _check_candidates(candidates, stage1_logits, B * next_n, index_topk, k_prime, q.device)
    width = block_table.shape[1] * PAGE_SLOTS
    if stage1_logits is None:
        logits = paged_mqa_logits(q, hi_cache, weights, context_lens, block_table, width, clean_logits=False,
                                  plan=plan)
    else:
        width = min(width, stage1_logits.shape[1])
        logits = stage1_logits[:, :width]
    rows = dict(lens0=context_lens, lens1=None, cu_rows=None, next_n=next_n, batch=B, width=width,
                mode=_DECODE_LENS_2D if context_lens.dim() == 2 else _DECODE_LENS_1D)
    bt_stride = block_table.stride(0) if block_table.shape[1] > 0 else 0
    return _select(logits, rows, q2, w2, hi_cache, lo_cache, block_table, bt_stride, block_table.shape[1],
                   index_topk, k_prime, fp8_rank, candidates)


def rescore_topk_prefill(q, weights, hi_cache, lo_cache, ks, ke, block_table, index_topk, k_prime=None, *,
                         cu_rows=None, q_rescore=None, weights_rescore=None, stage1_logits=None, plan=None,
                         fp8_rank=False) -> RescoreTopK:
    """:func:`rescore_topk` for prefill / extend rows (the contract of :func:`rescore_topk_prefill_reference`):
    stage 1 from :func:`cupy_dsa.mqa_logits` on the hi cache (``plan``: its :func:`cupy_dsa.mqa_logits_plan` for
    ``cu_rows``), or ``stage1_logits`` ``[T, >= width]`` (column = position; width = the block table's pages *
    64). No host sync (a CPU ``cu_rows`` is checked and copied, outside graph capture, as by ``mqa_logits``)."""
    fp8_rank = check_bool("fp8_rank", fp8_rank)
    if not (isinstance(q, torch.Tensor) and q.is_cuda):
        return rescore_topk_prefill_reference(q, weights, hi_cache, lo_cache, ks, ke, block_table, index_topk,
                                              k_prime, cu_rows=cu_rows, stage1_logits=stage1_logits,
                                              q_rescore=q_rescore, weights_rescore=weights_rescore,
                                              fp8_rank=fp8_rank)
    index_topk, k_prime, q2, w2, bt, num_keys, cu_rows = _check_prefill_call(
        q, weights, hi_cache, lo_cache, ks, ke, block_table, index_topk, k_prime, cu_rows, q_rescore,
        weights_rescore, stage1_logits)
    width = num_keys
    if stage1_logits is None:
        logits = mqa_logits(q, hi_cache, weights, ks, ke, block_table=block_table, cu_rows=cu_rows, plan=plan,
                            clean_logits=False)
    else:
        width = min(width, stage1_logits.shape[1])
        logits = stage1_logits[:, :width]
    varlen = cu_rows is not None
    rows = dict(lens0=ks, lens1=ke, cu_rows=cu_rows, mode=_PREFILL_KS_KE, next_n=1,
                batch=cu_rows.shape[0] - 1 if varlen else 1, width=width)
    bt_width = bt.shape[1] if varlen else bt.shape[0]
    bt_stride = bt.stride(0) if (varlen and bt_width > 0) else 0
    return _select(logits, rows, q2, w2, hi_cache, lo_cache, bt, bt_stride, bt_width, index_topk, k_prime, fp8_rank)


def rescore_candidate_scores(q, weights, hi_cache, lo_cache, context_lens, block_table, candidates) -> torch.Tensor:
    """Stage 2 alone (the decode contract of :func:`rescore_topk`, q and weights as stage 2 takes them):
    float32 ``[B * next_n, K']`` = ``sum_h relu(q_h . k_hat) * w_h`` of each row's candidate positions
    (``candidates`` int32/int64 ``[B * next_n, K']``), -inf where the row does not see the position (a negative
    one included) or its page is not in the caches (never read). The scores the selection ranks."""
    if not isinstance(candidates, torch.Tensor):
        raise TypeError(f"candidates: expected a torch.Tensor, got {type(candidates).__name__}")
    B, next_n, _, _, q2, w2 = _check_decode(q, weights, hi_cache, lo_cache, context_lens, block_table, 1, None,
                                            None, None, None)
    R = B * next_n
    check_dtype("candidates", candidates, (torch.int32, torch.int64))
    if candidates.dim() != 2 or candidates.shape[0] != R:
        raise ValueError(f"candidates: expected shape [{R}, K'] (one row per query row), got "
                         f"{tuple(candidates.shape)}")
    check_device("candidates", candidates, q.device, "q")
    width = block_table.shape[1] * PAGE_SLOTS
    if not q.is_cuda:
        lo, hi = _decode_rows_reference(context_lens, B, next_n, width)
        bt_rows = block_table.long().repeat_interleave(next_n, dim=0)
        return _stage2_reference(q2, w2, hi_cache, lo_cache, candidates.long(), lo[:, None].to(q.device),
                                 hi[:, None].to(q.device), bt_rows)[0]
    kp = candidates.shape[1]
    keys = torch.empty(R, kp, dtype=torch.int64, device=q.device)
    if R == 0 or kp == 0:
        return keys.float()
    # int32 positions; one outside [0, 2^31) names none
    pos = candidates.long()
    named = torch.where((pos >= 0) & (pos < 2**31), pos, torch.full_like(pos, -1)).to(torch.int32)
    rows = dict(lens0=context_lens, lens1=None, cu_rows=None, next_n=next_n, batch=B, width=width,
                mode=_DECODE_LENS_2D if context_lens.dim() == 2 else _DECODE_LENS_1D)
    _check_aligned_caches(hi_cache, lo_cache)
    _stage2(q2, w2, hi_cache, lo_cache, block_table, block_table.stride(0) if block_table.shape[1] else 0,
            block_table.shape[1], rows, named, kp, -1, keys)
    return scores_of_keys(keys)


def scores_of_keys(keys: torch.Tensor) -> torch.Tensor:
    """The fp32 scores of stage-2 keys (int64, ``order_key`` in ``kernels/rescore_topk.cu``); -inf for an
    unscored candidate."""
    ordered = (keys >> 32).to(torch.int32)
    bits = torch.where(ordered >= 0, ordered, ordered ^ 0x7FFFFFFF)
    return bits.view(torch.float32).masked_fill(keys == INVALID_KEY, float("-inf"))


# --------------------------------------------------------------------------------------------------
# Launches
# --------------------------------------------------------------------------------------------------

def _check_aligned_caches(hi_cache, lo_cache):
    check_aligned("hi_cache", hi_cache, 16)   # stage 2 reads 16-byte chunks of key rows
    check_aligned("lo_cache", lo_cache, 16)


def _launch(problem, device, grid, **args):
    RESCORE.select(problem, runtime.device_arch(device.index)).launch(device, grid, **args)


def _stage2(q2, w2, hi_cache, lo_cache, block_table, bt_stride, bt_width, rows, candidates, kp, index_topk, keys):
    """rescore_topk_kernel over [R, kp] candidates: each row's candidates in as many chunks as make one wave of
    resident CTAs (a CTA stages q once and keeps its ring full over several tiles per warp), chunks a multiple
    of the CTA's step (16 candidates per warp)."""
    R, dev = q2.shape[0], q2.device
    n_sms, _ = device_info(dev.index)
    problem = ("stage2", int(q2.dtype == _FP8))
    cfg = RESCORE.select(problem, runtime.device_arch(dev.index))
    step = _TILE_CANDS * cfg.Warps
    wave = n_sms * cfg.resident_ctas_per_sm(dev.index)
    chunks = max(1, min(-(-kp // step), wave // max(R, 1)))
    chunk = -(-kp // chunks)
    max_chunk = STAGE2_MAX_CHUNK[cfg.Warps]
    if R * chunks < wave:
        max_chunk = min(max_chunk, max(step, STAGE2_SPREAD_CHUNK // step * step))
    chunk = min(-(-chunk // step) * step, max_chunk)
    if -(-kp // chunk) > _MAX_GRID_Y:
        raise ValueError(f"k_prime: expected at most {_MAX_GRID_Y * max_chunk} candidates per row on the GPU, "
                         f"got {kp}")
    _launch(problem, dev, (R, -(-kp // chunk), 1), q=q2, weights=w2, hi_cache=hi_cache,
            lo_cache=lo_cache, num_pages=hi_cache.shape[0], block_table=block_table, bt_stride=bt_stride,
            bt_width=bt_width, **rows, candidates=candidates, k_prime=kp, cands_per_cta=chunk, index_topk=index_topk,
            keys=keys)


def select_per_row(width: int, rows: int, n_sms: int, arch: str | None) -> bool:
    """Whether the candidates take one CTA or one cluster per row (one read of the row, written in position order)
    rather than column chunks (two reads and a merge, for few long rows): the rows fit in the arch's shared-memory
    cache, or their clusters' slices do, or they fill half the GPU."""
    _, cluster = row_select_problem(width, rows, n_sms, arch)
    return width <= max(row_cache_keys(arch), cluster * SLICE_CACHE_KEYS if cluster > 1 else 0) or 2 * rows >= n_sms


def _select(logits, rows, q2, w2, hi_cache, lo_cache, block_table, bt_stride, bt_width, index_topk, k_prime,
            fp8_rank, given=None) -> RescoreTopK:
    """Stage-1 candidates (``given``: the caller's, int32 [R, K']; else one CTA per row, or histogram, gather and
    boundary over column chunks for few long rows), stage 2 and the selection (finish) on the device: two to
    six launches, none of them data-dependent in shape."""
    R, width = logits.shape
    dev = q2.device
    page_out = torch.empty(R, index_topk, dtype=torch.int32, device=dev)
    raw_out = torch.empty_like(page_out)
    rank_out = torch.empty_like(page_out) if fp8_rank else None
    if R == 0:
        return RescoreTopK(page_out, raw_out, rank_out)
    if index_topk > MAX_DEVICE_TOPK:
        raise ValueError(f"index_topk: expected <= {MAX_DEVICE_TOPK} on the GPU (SGLang's index_topk is 512 or "
                         f"2048), got {index_topk}")
    _check_aligned_caches(hi_cache, lo_cache)
    kp = max(1, min(k_prime, width)) if given is None else k_prime
    n_sms, _ = device_info(dev.index)
    logit_args = dict(logits=logits if width > 0 else None, logits_stride=logits.stride(0) if width > 0 else 0,
                      **rows)
    arch = runtime.device_arch(dev.index)
    # the candidates in position order (one CTA or cluster per row), or not (column chunks, the caller's)
    per_row = given is None and select_per_row(width, R, n_sms, arch)
    candidates = given if given is not None else torch.empty(R, kp, dtype=torch.int32, device=dev)
    if given is None and width > index_topk and per_row:
        problem = ("candidates",) + row_select_problem(width, R, n_sms, arch)
        ctas = RESCORE.select(problem, arch).Cluster   # per row: the config's (one where the arch has no clusters)
        _launch(problem, dev, (R * ctas, 1, 1), **logit_args, index_topk=index_topk, k_prime=kp,
                candidates=candidates)
    elif given is None and width > index_topk:
        # few long rows: column chunks, about four CTAs per SM over the rows, at least four tiles of the block each
        cols = max(4 * SELECT_THREADS, -(-width * R // (4 * n_sms)))
        cols = -(-cols // SELECT_THREADS) * SELECT_THREADS
        chunks = -(-width // cols)
        while chunks > _MAX_GRID_Y:
            cols *= 2
            chunks = -(-width // cols)
        cap = max(_BOUNDARY_MIN, 8 * kp)
        work = torch.zeros(R, RADIX_BINS + 2, dtype=torch.int32, device=dev)
        boundary = torch.empty(R, cap, dtype=torch.int64, device=dev)
        chunked = dict(cols_per_cta=cols, index_topk=index_topk, work=work)
        _launch(("histogram",), dev, (R, chunks, 1), **logit_args, **chunked)
        _launch(("gather",), dev, (R, chunks, 1), **logit_args, **chunked, k_prime=kp, candidates=candidates,
                boundary=boundary, cap=cap)
        _launch(("boundary",), dev, (R, 1, 1), **logit_args, index_topk=index_topk, work=work, k_prime=kp,
                candidates=candidates, boundary=boundary, cap=cap)
    keys = torch.empty(R, kp, dtype=torch.int64, device=dev)
    _stage2(q2, w2, hi_cache, lo_cache, block_table, bt_stride, bt_width, rows, candidates, kp, index_topk, keys)
    _launch(("finish", kp <= FINISH_CACHED_KEYS), dev, (R, 1, 1), keys=keys, k_prime=kp, candidates=candidates,
            logits=logit_args["logits"],
            logits_stride=logit_args["logits_stride"], block_table=block_table, bt_stride=bt_stride, **rows,
            index_topk=index_topk, page_indices=page_out, raw_indices=raw_out, fp8_rank=rank_out,
            in_position_order=int(per_row))
    return RescoreTopK(page_out, raw_out, rank_out)


__all__ = ["residual_encode_reference", "two_level_dequant_reference", "store_two_level_reference",
           "rescore_topk_reference", "rescore_topk_prefill_reference", "rescore_topk", "rescore_topk_prefill",
           "rescore_candidate_scores", "scores_of_keys", "combined_key_reference", "empty_lo_cache", "lo_views", "RescoreTopK",
           "TWO_LEVEL_BYTES_PER_TOKEN", "K_PRIME_MULTIPLE"]
