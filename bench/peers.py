"""Peers measured live next to our kernels, never imported by the product: DeepGEMM's fp8 paged decode
logits and fp8 prefill logits (what stock SGLang calls on Hopper). ``import deep_gemm`` may fail; the bench
then says why."""

from __future__ import annotations

import torch


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
    n_sms = torch.cuda.get_device_properties(q_fp8.device).multi_processor_count
    pages = fp8_cache.view(fp8_cache.shape[0], 64, 1, 132)
    meta = dg.get_paged_mqa_logits_metadata(lens_2d, 64, n_sms)

    def schedule():
        return dg.get_paged_mqa_logits_metadata(lens_2d, 64, n_sms)

    def logits(bt=block_table):
        return dg.fp8_paged_mqa_logits(q_fp8, pages, weights, lens_2d, bt, meta, width, False)

    return schedule, logits


def deepgemm_prefill(dg, q_fp8, keys, weights, ks, ke):
    """DeepGEMM's fp8 prefill logits on the same rows and ranges, with ``keys`` (bf16 ``[S, 128]``) quantized
    per token to e4m3 and an fp32 scale as SGLang's non-paged prefill passes them; clean_logits on. Returns
    the call (None when this DeepGEMM has no fp8_mqa_logits)."""
    if not hasattr(dg, "fp8_mqa_logits"):
        return None
    kf = keys.float()
    scale = (kf.abs().amax(1) / 448.0).clamp_min(1e-12)
    k_fp8 = (kf / scale[:, None]).to(torch.float8_e4m3fn).contiguous()
    scale = scale.contiguous()

    def logits():
        return dg.fp8_mqa_logits(q_fp8, (k_fp8, scale), weights, ks, ke, True)

    return logits
