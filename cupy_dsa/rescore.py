"""Two-level index keys (``fp8-rescore``): the CPU reference of an fp8 candidate pass and an exact rescoring.

Stage 1 scores every key from SGLang's fp8 keys (the "hi" page, byte-identical to the fp8 store) and keeps each
row's top ``k_prime`` candidates; stage 2 rescores only those from ``hi + lo`` (the "lo" page holds the residual
``k - dequant(hi)``) and selects the row's top ``index_topk`` from those scores. Torch references only (the test
oracle and the design's measurement); the kernels come later.

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

Selection (:func:`rescore_topk_reference`): stage 1 ranks a row's visible keys by their fp8 logit
(``paged_mqa_logits_reference`` on the hi cache: ``k_scale * sum_h relu(q_h . k_fp8) * w_h``), ties broken by
the lower position; the first ``k_prime`` are the candidates. Stage 2 scores them ``sum_h relu(q_h . k_hat) *
w_h`` in fp32 and keeps the first ``index_topk`` by that score, ties broken by the better stage-1 rank. A row that
sees ``len <= index_topk`` keys selects ``0..len-1`` without reading scores, as SGLang's top-k does.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .contracts import check_device, check_dtype, check_int
from .layouts import FP8_PAGE_BYTES, FP8_SCALE_OFFSET, HEAD_DIM, PAGE_SLOTS, as_page_rows, fp8_views, layout_of
from .logits import _check_paged, _REF_ROW_CHUNK, paged_mqa_logits_reference
from .store import fp8_quantize_reference

LO_MAX = 127
LO_BYTES_PER_TOKEN = HEAD_DIM + 4                    # 132: int8 codes + fp32 scale
TWO_LEVEL_BYTES_PER_TOKEN = 2 * LO_BYTES_PER_TOKEN   # 264: hi (SGLang's fp8) + lo
LO_PAGE_BYTES = FP8_PAGE_BYTES                       # 8448, the fp8 page geometry


class RescoreTopK(NamedTuple):
    """int32 ``[rows, index_topk]`` each, -1 padded: ``page_indices`` (SGLang's form, ``page_table[r, i // 64] *
    64 + i % 64``), ``raw_indices`` (positions ``i``), ``fp8_rank`` (each selected key's 0-based stage-1 rank)."""
    page_indices: torch.Tensor
    raw_indices: torch.Tensor
    fp8_rank: torch.Tensor


def _check_keys(k):
    check_dtype("k", k, (torch.float32, torch.bfloat16))
    if k.dim() != 2 or k.shape[1] != HEAD_DIM:
        raise ValueError(f"k: expected shape [N, {HEAD_DIM}], got {tuple(k.shape)}")


def residual_encode_reference(k: torch.Tensor):
    """Two-level encoding of rotated keys ``k`` (float32/bfloat16 ``[N, 128]``: what the store quantizes).

    Returns ``(hi uint8 [N, 128] e4m3 codes, hi_scale float32 [N], lo int8 [N, 128], lo_scale float32 [N])``; the
    hi codes and scales are :func:`cupy_dsa.store.fp8_quantize_reference`'s (SGLang's fp8 bytes)."""
    _check_keys(k)
    kf = k.to(torch.float32)
    hi, hi_scale = fp8_quantize_reference(kf)
    r = kf - hi.view(torch.float8_e4m3fn).float() * hi_scale[:, None]
    # a key holding a NaN or an infinity has no residual scale: zero codes, NaN scale (the store kernel's rule;
    # otherwise the int8 conversion of a NaN code would be undefined)
    finite = torch.isfinite(r).all(dim=-1)
    amax = r.abs().amax(dim=-1)
    # true divisions (a full tensor: torch on CUDA turns division by a Python scalar into a reciprocal multiply)
    lo_scale = torch.where(amax > 0, amax / torch.full_like(amax, LO_MAX), torch.ones_like(amax))
    lo_scale = torch.where(finite, lo_scale, torch.full_like(lo_scale, float("nan")))
    codes = torch.round(r / lo_scale[:, None]).clamp_(-LO_MAX, LO_MAX)
    lo = torch.where(finite[:, None], codes, torch.zeros_like(codes)).to(torch.int8)
    return hi, hi_scale, lo, lo_scale


def two_level_dequant_reference(hi, hi_scale, lo, lo_scale) -> torch.Tensor:
    """``k_hat`` float32 ``[N, 128]`` = ``e4m3(hi) * hi_scale + lo * lo_scale`` (see the module docstring)."""
    check_dtype("hi", hi, (torch.uint8, torch.float8_e4m3fn))
    if hi.dim() != 2 or hi.shape[1] != HEAD_DIM:
        raise ValueError(f"hi: expected shape [N, {HEAD_DIM}], got {tuple(hi.shape)}")
    n = hi.shape[0]
    check_dtype("hi_scale", hi_scale, (torch.float32,))
    if tuple(hi_scale.shape) != (n,):
        raise ValueError(f"hi_scale: expected shape ({n},) (N of hi), got {tuple(hi_scale.shape)}")
    check_dtype("lo", lo, (torch.int8,))
    if tuple(lo.shape) != (n, HEAD_DIM):
        raise ValueError(f"lo: expected shape ({n}, {HEAD_DIM}) (as hi), got {tuple(lo.shape)}")
    check_dtype("lo_scale", lo_scale, (torch.float32,))
    if tuple(lo_scale.shape) != (n,):
        raise ValueError(f"lo_scale: expected shape ({n},) (N of hi), got {tuple(lo_scale.shape)}")
    for name, t in (("hi_scale", hi_scale), ("lo", lo), ("lo_scale", lo_scale)):
        check_device(name, t, hi.device, "hi")
    h = hi.view(torch.float8_e4m3fn).float() * hi_scale[:, None]
    return h + lo.float() * lo_scale[:, None]


def empty_lo_cache(num_pages: int, device="cpu") -> torch.Tensor:
    """A zeroed lo cache ``uint8 [num_pages, 8448]`` (the fp8 page geometry, int8 codes)."""
    num_pages = check_int("num_pages", num_pages)
    return torch.zeros(num_pages, LO_PAGE_BYTES, dtype=torch.uint8, device=device)


def lo_views(lo_cache: torch.Tensor):
    """``(codes int8 [P, 64, 128], scales float32 [P, 64])`` views of a lo cache."""
    values, scales = fp8_views(lo_cache)
    return values.view(torch.int8), scales


def _check_pair(hi_cache, lo_cache, device=None):
    if not isinstance(hi_cache, torch.Tensor):
        raise TypeError(f"hi_cache: expected a torch.Tensor, got {type(hi_cache).__name__}")
    if layout_of(hi_cache, "hi_cache") != "fp8":
        raise ValueError(f"hi_cache: expected SGLang's fp8 layout (uint8 [P, 8448] or [P, 64, 1, 132]), got "
                         f"{hi_cache.dtype} {tuple(hi_cache.shape)}")
    if not isinstance(lo_cache, torch.Tensor):
        raise TypeError(f"lo_cache: expected a torch.Tensor, got {type(lo_cache).__name__}")
    check_dtype("lo_cache", lo_cache, (torch.uint8,))
    if lo_cache.shape != hi_cache.shape:
        raise ValueError(f"lo_cache: expected the shape of hi_cache {tuple(hi_cache.shape)}, got "
                         f"{tuple(lo_cache.shape)}")
    for name, t in (("hi_cache", hi_cache), ("lo_cache", lo_cache)):
        if not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")
        if device is not None:
            check_device(name, t, device, "q")
    if device is None:
        check_device("lo_cache", lo_cache, hi_cache.device, "hi_cache")


def store_two_level_reference(k: torch.Tensor, hi_cache: torch.Tensor, lo_cache: torch.Tensor,
                              out_loc: torch.Tensor) -> None:
    """Write rotated keys ``k [N, 128]`` at ``out_loc`` (int32/int64 ``[N]``, ``page * 64 + slot``) into the hi
    (fp8 layout) and lo caches; rows with ``out_loc < 0`` or a page past the caches are skipped."""
    _check_keys(k)
    _check_pair(hi_cache, lo_cache)
    check_device("k", k, hi_cache.device, "hi_cache")
    check_dtype("out_loc", out_loc, (torch.int32, torch.int64))
    if tuple(out_loc.shape) != (k.shape[0],):
        raise ValueError(f"out_loc: expected shape ({k.shape[0]},) (N of k), got {tuple(out_loc.shape)}")
    hi_rows, lo_rows = as_page_rows(hi_cache, "hi_cache"), lo_cache.view(hi_cache.shape[0], LO_PAGE_BYTES)
    num_pages = hi_rows.shape[0]
    loc = out_loc.to(torch.int64).to(k.device)
    ok = ((loc >= 0) & ((loc >> 6) < num_pages)).nonzero().flatten()
    if ok.numel() == 0:
        return
    hi, hi_scale, lo, lo_scale = residual_encode_reference(k[ok])
    page, slot = loc[ok] >> 6, loc[ok] & (PAGE_SLOTS - 1)
    for rows, codes, scales in ((hi_rows, hi, hi_scale), (lo_rows, lo.view(torch.uint8), lo_scale)):
        rows[:, :FP8_SCALE_OFFSET].view(num_pages, PAGE_SLOTS, HEAD_DIM)[page, slot] = codes
        rows[:, FP8_SCALE_OFFSET:].view(torch.float32)[page, slot] = scales


def _row_lens(context_lens, B, next_n, width):
    lens = context_lens.long().cpu()
    if lens.dim() == 1:
        lens = lens[:, None] - (next_n - 1 - torch.arange(next_n))[None, :]
    return lens.clamp(0, width).reshape(B * next_n)


def rescore_topk_reference(q, weights, hi_cache, lo_cache, context_lens, block_table, index_topk, k_prime, *,
                           stage1_logits=None) -> RescoreTopK:
    """Two-stage top-k of paged index keys (the decode / MTP-verify contract of ``paged_mqa_logits``).

    q float8_e4m3fn/bfloat16 ``[B, next_n, 64, 128]``, weights float32 ``[B * next_n, 64]`` (q's scale folded in
    for an fp8 q), ``hi_cache`` SGLang's fp8 cache, ``lo_cache`` its residual pages (same shape, see
    :func:`store_two_level_reference`), context_lens int32 ``[B]`` (row ``j`` of a request sees ``len - (next_n -
    1 - j)`` keys) or ``[B, next_n]``, block_table int32 ``[B, max_pages]``. ``index_topk >= 1`` keys per row,
    chosen among each row's ``k_prime >= index_topk`` best stage-1 (fp8) keys. ``stage1_logits``: the fp8 logits
    ``[B * next_n, >= visible width]`` if the caller already has them (columns past a row's length are ignored).
    Returns :class:`RescoreTopK` (row order = stage-2 score order; trivial rows ``0..len-1``); a non-trivial row
    never selects a key whose block-table entry is not a page of the caches."""
    _check_pair(hi_cache, lo_cache)
    try:
        _check_paged(q, hi_cache, weights, context_lens, block_table, 0)
    except ValueError as e:
        raise ValueError(str(e).replace("kv_cache:", "hi_cache:")) from None
    _check_pair(hi_cache, lo_cache, q.device)
    index_topk = check_int("index_topk", index_topk, 1)
    k_prime = check_int("k_prime", k_prime, 1)
    if k_prime < index_topk:
        raise ValueError(f"k_prime: expected an int >= index_topk ({index_topk}), got {k_prime}")
    B, next_n = q.shape[0], q.shape[1]
    R = B * next_n
    width = block_table.shape[1] * PAGE_SLOTS
    if stage1_logits is None:
        stage1_logits = paged_mqa_logits_reference(q, hi_cache, weights, context_lens, block_table, width)
    else:
        check_dtype("stage1_logits", stage1_logits, (torch.float32,))
        if stage1_logits.dim() != 2 or stage1_logits.shape[0] != R:
            raise ValueError(f"stage1_logits: expected shape [{R}, width] (one row per query row), got "
                             f"{tuple(stage1_logits.shape)}")
        check_device("stage1_logits", stage1_logits, q.device, "q")
    lens = _row_lens(context_lens, B, next_n, min(width, stage1_logits.shape[1]))
    dev = q.device
    page_out = torch.full((R, index_topk), -1, dtype=torch.int32, device=dev)
    raw_out = torch.full_like(page_out, -1)
    rank_out = torch.full_like(page_out, -1)
    L = int(lens.max()) if R else 0
    if L == 0:
        return RescoreTopK(page_out, raw_out, rank_out)
    hi_codes, hi_scales = fp8_views(hi_cache)
    lo_codes, lo_scales = lo_views(lo_cache)
    num_pages = hi_codes.shape[0]
    lens_d = lens.to(dev)
    cols = torch.arange(L, device=dev)
    kp = min(k_prime, L)
    qf_all = q.float().reshape(R, q.shape[2], HEAD_DIM)
    bt_rows = block_table.long().repeat_interleave(next_n, dim=0)                   # [R, max_pages]
    for r0 in range(0, R, _REF_ROW_CHUNK):
        r1 = min(R, r0 + _REF_ROW_CHUNK)
        n_r = lens_d[r0:r1, None]
        s1 = stage1_logits[r0:r1, :L].masked_fill(cols[None, :] >= n_r, float("-inf"))
        order = torch.sort(s1, dim=1, descending=True, stable=True).indices          # ties: lower position first
        rank = torch.empty_like(order)
        rank.scatter_(1, order, cols[None, :].expand(r1 - r0, L).contiguous())
        cand = order[:, :kp]                                                        # [r, kp] positions
        cand_ok = torch.arange(kp, device=dev)[None, :] < n_r
        # stage 2: k_hat of the candidates from the hi and lo pages
        pages = bt_rows[r0:r1].gather(1, (cand // PAGE_SLOTS).clamp(max=bt_rows.shape[1] - 1))
        pages_ok = cand_ok & (pages >= 0) & (pages < num_pages)
        pg = torch.where(pages_ok, pages, torch.zeros_like(pages))
        sl = cand % PAGE_SLOTS
        k_hat = (hi_codes[pg, sl].view(torch.float8_e4m3fn).float() * hi_scales[pg, sl][..., None]
                 + lo_codes[pg, sl].float() * lo_scales[pg, sl][..., None])            # [r, kp, 128]
        s = torch.einsum("rhd,rnd->rhn", qf_all[r0:r1], k_hat).clamp_min_(0)
        s2 = torch.einsum("rhn,rh->rn", s, weights[r0:r1])
        s2 = s2.masked_fill(~pages_ok, float("-inf"))
        # stage-2 order; ties by stage-1 rank (the candidates are in stage-1 order, so a stable sort does it)
        sel = torch.sort(s2, dim=1, descending=True, stable=True).indices[:, :min(index_topk, kp)]
        raw = cand.gather(1, sel)
        ok = pages_ok.gather(1, sel)                                                # keys of invalid pages: never
        trivial = n_r[:, 0] <= index_topk
        if bool(trivial.any()):
            seq = torch.arange(min(index_topk, L), device=dev)[None, :].expand(r1 - r0, -1)
            raw = torch.where(trivial[:, None], seq[:, :raw.shape[1]], raw)
            ok = torch.where(trivial[:, None], seq[:, :raw.shape[1]] < n_r, ok)
        pos_rank = rank.gather(1, raw)
        page = bt_rows[r0:r1].gather(1, (raw // PAGE_SLOTS).clamp(max=bt_rows.shape[1] - 1))
        m = raw.shape[1]
        raw_out[r0:r1, :m] = torch.where(ok, raw, torch.full_like(raw, -1)).to(torch.int32)
        rank_out[r0:r1, :m] = torch.where(ok, pos_rank, torch.full_like(raw, -1)).to(torch.int32)
        page_out[r0:r1, :m] = torch.where(ok, page * PAGE_SLOTS + raw % PAGE_SLOTS,
                                          torch.full_like(raw, -1)).to(torch.int32)
    return RescoreTopK(page_out, raw_out, rank_out)


__all__ = ["residual_encode_reference", "two_level_dequant_reference", "store_two_level_reference",
           "rescore_topk_reference", "empty_lo_cache", "lo_views", "RescoreTopK", "TWO_LEVEL_BYTES_PER_TOKEN"]
