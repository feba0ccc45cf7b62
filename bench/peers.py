"""Peers measured live next to our kernels, never imported by the product: DeepGEMM's fp8 paged decode
logits and fp8 prefill logits (what stock SGLang calls on Hopper), and SGLang's gather of a request's fp8 keys
out of the paged cache (its non-paged prefill route). ``import deep_gemm`` may fail; the bench then says why."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from cupy_dsa.layouts import FP8_SCALE_OFFSET, HEAD_DIM, PAGE_SLOTS


def deepgemm():
    """(module, None) when DeepGEMM imports and runs here, else (None, reason)."""
    try:
        import deep_gemm
    except Exception as exc:  # not installed, or built for another torch
        return None, f"deep_gemm not importable ({type(exc).__name__}: {str(exc)[:120]})"
    for name in ("get_paged_mqa_logits_metadata", "fp8_paged_mqa_logits"):
        if not hasattr(deep_gemm, name):
            return None, f"deep_gemm has no {name}"
    return deep_gemm, None


def deepgemm_decode(dg, q_fp8, fp8_cache, weights, lens, block_table, width):
    """DeepGEMM's schedule and logits as SGLang calls them: lens as int32 [B, next_n] (row lengths), the
    fp8 pages viewed [P, 64, 1, 132], clean_logits off. Returns (schedule builder, logits call)."""
    B, next_n = q_fp8.shape[:2]
    lens_2d = lens if lens.dim() == 2 else (lens[:, None] - (next_n - 1)
                                            + torch.arange(next_n, device=lens.device, dtype=lens.dtype)[None, :])
    lens_2d = lens_2d.clamp_min(0).to(torch.int32).contiguous()
    n_sms = _num_sms(dg, q_fp8.device)
    pages = fp8_cache.view(fp8_cache.shape[0], 64, 1, 132)
    meta = dg.get_paged_mqa_logits_metadata(lens_2d, 64, n_sms)

    def schedule():
        return dg.get_paged_mqa_logits_metadata(lens_2d, 64, n_sms)

    def logits(bt=block_table):
        return dg.fp8_paged_mqa_logits(q_fp8, pages, weights, lens_2d, bt, meta, width, False)

    return schedule, logits


def _num_sms(dg, device) -> int:
    """The SM count DeepGEMM schedules for (SGLang passes ``deep_gemm.get_num_sms()``)."""
    if hasattr(dg, "get_num_sms"):
        return dg.get_num_sms()
    return torch.cuda.get_device_properties(device).multi_processor_count


def deepgemm_prefill(dg, q_fp8, keys, weights, ks, ke, *, clean_logits=True, max_seqlen_k=0):
    """DeepGEMM's fp8 prefill logits (``fp8_mqa_logits``) on the same rows and ranges. ``keys``: bf16 ``[S, 128]``,
    quantized here per token to e4m3 and an fp32 scale, or the ``(fp8 [S, 128], fp32 [S])`` pair SGLang's
    non-paged route gathers. SGLang's non-paged call passes ``clean_logits=False`` and ``max_seqlen_k`` (its
    compressed output). Returns the call (None when this DeepGEMM has no fp8_mqa_logits)."""
    if not hasattr(dg, "fp8_mqa_logits"):
        return None
    if isinstance(keys, tuple):
        k_fp8, scale = keys
    else:
        kf = keys.float()
        scale = (kf.abs().amax(1) / 448.0).clamp_min(1e-12)
        k_fp8 = (kf / scale[:, None]).to(torch.float8_e4m3fn).contiguous()
        scale = scale.contiguous()

    compressed = {"max_seqlen_k": max_seqlen_k} if max_seqlen_k else {}  # older DeepGEMMs lack the argument

    def logits():
        return dg.fp8_mqa_logits(q_fp8, (k_fp8, scale), weights, ks, ke, clean_logits, **compressed)

    return logits


def nonpaged_prefill(dg, q_fp8, weights, ks, ke, page_row, n_keys):
    """SGLang 0.5.23's non-paged prefill logits of one request (``_gather_nonpaged_index_k`` then
    ``_nonpaged_mqa_logits``): per call the request's first ``n_keys`` fp8 keys gathered out of a paged cache
    (pages ``page_row``), then DeepGEMM's ``fp8_mqa_logits`` with SGLang's arguments (clean off, ``max_seqlen_k`` =
    the keys' whole pages; column c of row t holds key ``ks[t] + c``). Returns a namespace: ``logits(fp8_cache)``,
    ``gather(fp8_cache)`` (the gather alone), ``gather_op`` (what gathers, :func:`fp8_gather`) and
    ``check(fp8_cache)``, which raises when SGLang's gather disagrees with the torch gather on those pages."""
    max_seqlen_k = math.ceil(n_keys / PAGE_SLOTS) * PAGE_SLOTS  # what SGLang passes: whole pages
    bind, gather_op = fp8_gather()
    gather = bind(page_row, n_keys)

    def logits(fp8_cache):
        return deepgemm_prefill(dg, q_fp8, gather(fp8_cache), weights, ks, ke, clean_logits=False,
                                max_seqlen_k=max_seqlen_k)()

    def check(fp8_cache):
        if not gather_op.startswith("SGLang"):
            return
        k, sc = gather(fp8_cache)
        k_ref, sc_ref = torch_fp8_gather(fp8_cache, page_row, n_keys)
        if not (torch.equal(k.view(torch.uint8), k_ref.view(torch.uint8)) and torch.equal(sc, sc_ref)):
            raise RuntimeError("SGLang's fp8 gather disagrees with the torch gather on the same pages")

    return SimpleNamespace(logits=logits, gather=gather, gather_op=gather_op, check=check, max_seqlen_k=max_seqlen_k)


def torch_fp8_gather(fp8_cache, page_row, n_entries):
    """A request's first ``n_entries`` fp8 keys out of the paged cache (uint8 ``[P, 8448]``, pages ``page_row``),
    as ``(fp8 [n, 128], fp32 scales [n])``: what SGLang's gather returns, in torch (one page gather, then the
    values and the scales split out)."""
    pages = fp8_cache[page_row[:math.ceil(n_entries / PAGE_SLOTS)].long()]
    values = pages[:, :FP8_SCALE_OFFSET].reshape(-1, HEAD_DIM)[:n_entries]
    scales = pages[:, FP8_SCALE_OFFSET:].contiguous().view(torch.float32).reshape(-1)[:n_entries]
    return values.view(torch.float8_e4m3fn), scales


def fp8_gather():
    """``(bind, what it is)``; ``bind(page_row, n_entries)`` returns ``gather(fp8_cache)`` of one request's keys.
    SGLang's own gather when it imports here (``GetKAndS.triton`` of sglang.kernels.ops.kvcache.dsa_index_k_cache,
    what the pool's ``get_index_k_scale_buffer`` runs on CUDA), else :func:`torch_fp8_gather`, saying why."""
    try:
        from sglang.kernels.ops.kvcache.dsa_index_k_cache import GetKAndS
    except Exception as exc:  # SGLang not installed here, or one of its imports fails
        return ((lambda page_row, n: lambda cache: torch_fp8_gather(cache, page_row, n)),
                f"torch gather (SGLang's GetKAndS not importable: {type(exc).__name__}: {str(exc)[:120]})")
    pool = SimpleNamespace(index_page_size=PAGE_SLOTS, index_head_dim=HEAD_DIM)  # what GetKAndS reads of the pool

    def bind(page_row, n_entries):
        pages = page_row.view(1, -1)  # SGLang passes the request's page-table row, [1, pages]
        seq_len = torch.full((1,), n_entries, dtype=torch.int32, device=page_row.device)

        def gather(fp8_cache):
            k, s = GetKAndS.triton(pool, fp8_cache, page_indices=pages, seq_len_tensor=seq_len,
                                   seq_len_sum=n_entries, max_seq_len=n_entries)
            return k.view(torch.float8_e4m3fn), s.view(torch.float32).squeeze(-1)

        return gather

    return bind, "SGLang's GetKAndS.triton (sglang.kernels.ops.kvcache.dsa_index_k_cache)"
