"""``cupy-dsa bench rescore``: what the exact top-k of two-level keys (``fp8-rescore``, issue 26) costs in decode,
against the top-k of bf16 keys and of SGLang's fp8 keys, on this GPU.

Per case (batch, context, next_n 1), each timed with the bench's CUDA-graph timer on the same synthetic keys
(stored by ``store_index_k``: bf16 keys, and fp8 keys with their int8 residual pages in one launch):

* ``bf16``: ``paged_mqa_logits`` on bf16 keys + ``torch.topk(index_topk)`` (what the plugin's bf16 mode runs,
  with torch's top-k for SGLang's);
* ``fp8``: the same on SGLang's fp8 keys (same query);
* ``fp8-rescore``: ``rescore_topk``: fp8 logits, K' candidates, stage-2 scores from the hi and lo pages, the
  selection (the whole op);
* ``rescore stages``: ``rescore_topk`` given those logits (candidates, stage 2, selection: the cost on top of the
  fp8 logits).

Bytes counted per request: keys read by the logits (256 / 132 B per visible entry) and, for the rescore, K' x
264 B per query row. Public ops only.
"""

from __future__ import annotations

import math

import torch

import cupy_dsa
from cupy_dsa import layouts, rescore

from .sweeps import make_freqs

INDEX_TOPK = 512
K_PRIME = rescore.K_PRIME_MULTIPLE * INDEX_TOPK
CASES = [(1, 65536), (8, 65536), (64, 65536), (8, 262144), (64, 262144), (4, 1048576)]   # (batch, raw tokens)
QUICK_CASES = [(8, 65536)]
COLUMNS = ("bf16", "fp8", "fp8-rescore", "rescore stages")


def _case(device, B, tokens, g):
    """Caches of B requests of tokens / 4 index entries (bf16; fp8 + lo), an fp8 query with its folded weights."""
    n = tokens // 4
    pages = math.ceil(n / layouts.PAGE_SLOTS)
    P = B * pages
    kv = torch.randn(B * pages * layouts.PAGE_SLOTS, layouts.HEAD_DIM, device=device, generator=g)
    freqs = make_freqs(4 * n, device)
    pos = (4 * torch.arange(pages * layouts.PAGE_SLOTS, device=device)).clamp(max=4 * n - 1).repeat(B)
    loc = torch.arange(P * layouts.PAGE_SLOTS, device=device)
    w_norm = torch.ones(layouts.HEAD_DIM, device=device)
    bf16 = layouts.empty_cache(P, "bf16", device)
    hi, lo = layouts.empty_cache(P, "fp8", device), rescore.empty_lo_cache(P, device)
    cupy_dsa.store_index_k(kv, bf16, positions=pos, out_loc=loc, norm_weight=w_norm, freqs_cis=freqs)
    cupy_dsa.store_index_k(kv, hi, positions=pos, out_loc=loc, norm_weight=w_norm, freqs_cis=freqs, lo_cache=lo)
    del kv
    qf = torch.randn(B, 1, layouts.N_HEADS, layouts.HEAD_DIM, device=device, generator=g)
    s = qf.abs().amax(-1).clamp_min(1e-4) / 448.0
    q = (qf / s[..., None]).to(torch.float8_e4m3fn)
    w = (torch.randn(B, layouts.N_HEADS, device=device, generator=g) / 90.5 * s.view(B, -1)).contiguous()
    lens = torch.full((B,), n, dtype=torch.int32, device=device)
    table = torch.randperm(P, device=device, generator=g).to(torch.int32).view(B, pages)
    return n, bf16, hi, lo, q, w, lens, table


def rows(device: torch.device, quick: bool, seed: int) -> list[dict]:
    from .timing import time_calls

    g = torch.Generator(device=device).manual_seed(seed)
    out = []
    for B, tokens in QUICK_CASES if quick else CASES:
        n, bf16, hi, lo, q, w, lens, table = _case(device, B, tokens, g)
        width = table.shape[1] * layouts.PAGE_SLOTS
        plan = cupy_dsa.paged_mqa_logits_plan(lens, 1)
        logits = cupy_dsa.paged_mqa_logits(q, hi, w, lens, table, width, clean_logits=True, plan=plan)

        def topk_of(cache):
            return lambda: torch.topk(cupy_dsa.paged_mqa_logits(q, cache, w, lens, table, width, plan=plan,
                                                                clean_logits=True), INDEX_TOPK, dim=1)

        runs = {
            "bf16": topk_of(bf16),
            "fp8": topk_of(hi),
            "fp8-rescore": lambda: rescore.rescore_topk(q, w, hi, lo, lens, table, INDEX_TOPK, K_PRIME, plan=plan),
            "rescore stages": lambda: rescore.rescore_topk(q, w, hi, lo, lens, table, INDEX_TOPK, K_PRIME,
                                                           stage1_logits=logits),
        }
        us = {name: time_calls([fn] * 3, device, reps=10 if quick else 25).seconds * 1e6 for name, fn in runs.items()}
        bytes_ = {"bf16": B * n * layouts.BF16_BYTES_PER_TOKEN, "fp8": B * n * layouts.FP8_BYTES_PER_TOKEN,
                  "fp8-rescore": B * (n * layouts.FP8_BYTES_PER_TOKEN + K_PRIME * rescore.TWO_LEVEL_BYTES_PER_TOKEN),
                  "rescore stages": B * K_PRIME * rescore.TWO_LEVEL_BYTES_PER_TOKEN}
        out.append(dict(B=B, tokens=tokens, index_entries=n, next_n=1, index_topk=INDEX_TOPK, k_prime=K_PRIME,
                        us=us, bytes=bytes_, vs_bf16={k: v / us["bf16"] for k, v in us.items()}))
        del bf16, hi, lo, logits
        torch.cuda.empty_cache()
    return out
