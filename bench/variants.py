"""``cupy-dsa bench variants``: every declared config (product and experimental) of the logits families on
this GPU, timed on the same inputs, one row per (case, config); the product config of each case comes first,
so a row's ``vs_product`` says what switching to that variant would gain or lose.

Variants are launched through the public ops with ``Family.forced`` (the only way an experimental config
runs); the timer is the bench's CUDA-graph timer over 5 calls.
"""

from __future__ import annotations

import torch

from cupy_dsa import launch, layouts, logits, runtime

HEADS, DIM = layouts.N_HEADS, layouts.HEAD_DIM
DECODE_CASES = [(1, 8192, 1), (64, 32768, 1), (128, 16384, 1), (4, 262144, 1), (64, 32768, 2), (64, 32768, 4)]


def _time_us(fn, device, reps):
    from .timing import time_calls

    return time_calls([fn] * 5, device, reps=reps).seconds * 1e6


def _rows_for(family: launch.Family, problem, arch, run, device, reps, base: dict) -> list[dict]:
    rows = []
    product_us = None
    for cfg in family.candidates(problem, arch):
        with family.forced(cfg, arch):
            us = _time_us(run, device, reps)
        product_us = us if product_us is None else product_us
        rows.append(dict(base, config=str(cfg), product=not rows, us=us, vs_product=us / product_us))
    return rows


def decode_rows(device, quick: bool, seed: int) -> list[dict]:
    g = torch.Generator(device=device).manual_seed(seed)
    arch = runtime.device_arch(device.index)
    rows = []
    for layout in ("bf16", "fp8"):
        for B, ctx_len, next_n in DECODE_CASES[:2] if quick else DECODE_CASES:
            pages = ctx_len // layouts.PAGE_SLOTS
            cache = layouts.empty_cache(B * pages, layout, device=device)
            cache.random_(0, 120, generator=g)
            q = torch.randn(B, next_n, HEADS, DIM, device=device, generator=g).mul_(3).to(torch.float8_e4m3fn)
            w = torch.randn(B * next_n, HEADS, device=device, generator=g)
            ctx = torch.full((B,), ctx_len, dtype=torch.int32, device=device)
            bt = torch.randperm(B * pages, device=device, generator=g).to(torch.int32).view(B, pages)
            plan = logits.paged_mqa_logits_plan(ctx, next_n)
            rows += _rows_for(logits.DECODE, (layout, 1, next_n), arch,
                              lambda: logits.paged_mqa_logits(q, cache, w, ctx, bt, ctx_len, plan=plan), device,
                              10 if quick else 30, dict(op="decode", layout=layout, B=B, ctx=ctx_len, next_n=next_n))
            del cache
    return rows


def prefill_rows(device, quick: bool, seed: int) -> list[dict]:
    g = torch.Generator(device=device).manual_seed(seed)
    arch = runtime.device_arch(device.index)
    T, S = (2048, 16384) if quick else (4096, 65536)
    kv = torch.randn(S, DIM, device=device, generator=g).to(torch.bfloat16)
    rows = []
    for q_fp8 in (1, 0):
        q = torch.randn(T, HEADS, DIM, device=device, generator=g)
        q = q.mul_(3).to(torch.float8_e4m3fn) if q_fp8 else q.to(torch.bfloat16)
        w = torch.randn(T, HEADS, device=device, generator=g)
        ke = (torch.arange(T, device=device) + S - T + 1).to(torch.int32)   # causal: query i at key S-T+i
        ks = torch.zeros(T, dtype=torch.int32, device=device)
        out = torch.empty(T, S, device=device)
        flops = 2 * HEADS * DIM * float(ke.double().sum())
        for row in _rows_for(logits.PREFILL, ("contiguous", q_fp8, 0), arch,
                             lambda: logits.mqa_logits(q, kv, w, ks, ke, clean_logits=False, out=out), device,
                             10 if quick else 30, dict(op="prefill", layout="contiguous", q="fp8" if q_fp8 else "bf16",
                                                       T=T, S=S)):
            rows.append(dict(row, tflops=flops / row["us"] / 1e6))
    return rows
