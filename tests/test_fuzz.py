"""Fuzz every op with random valid and invalid calls on poisoned buffers.

Each call either matches the CPU reference (GPU: kernel vs reference; CPU: the reference itself, so there
this mainly checks the validation paths) with the guard regions around its output untouched, or raises a
TypeError / ValueError whose message starts with the argument at fault. Calls per op: CUPY_DSA_FUZZ_N
(default 60 on CPU, 1500 on a GPU; the GPU suite runs 3000).
"""
import os
import random

import pytest
import torch

import cupy_dsa
from cupy_dsa import layouts
from logits_cases import check_close, make_cache, make_q

FP8 = torch.float8_e4m3fn
H, D, PS = 64, 128, 64
DEV = "cuda" if torch.cuda.is_available() else "cpu"
N_CALLS = int(os.environ.get("CUPY_DSA_FUZZ_N", 1500 if DEV == "cuda" else 60))
NAN = float("nan")


def guarded_out(rows, width, device):
    """An fp32 ``out`` [rows, width] (row stride a multiple of 4) inside a NaN buffer with a guard row above
    and below and guard columns on the right; returns (buffer, out)."""
    buf = torch.full((rows + 2, -(-width // 4) * 4 + 8), NAN, device=device)
    return buf, buf[1:rows + 1, :width]


def guards_untouched(buf, width):
    inner = buf[1:-1, width:]
    return bool(torch.isnan(buf[0]).all() and torch.isnan(buf[-1]).all() and torch.isnan(inner).all())


def expect_error(fn, name):
    with pytest.raises((TypeError, ValueError)) as info:
        fn()
    assert str(info.value).startswith(name), f"error should name {name!r}: {info.value}"


def _paged_call(rng):
    """(kwargs on CPU, the argument an invalid mutation breaks or None)."""
    B, next_n = rng.randint(0, 5), rng.randint(1, 4)
    layout, q_dtype = rng.choice(["bf16", "fp8"]), rng.choice([FP8, torch.bfloat16])
    P, max_pages = rng.randint(1, 8), rng.randint(0, 6)
    cache, _ = make_cache(P, layout, shape=rng.choice(["rows", "typed"]))
    lens_shape = (B, next_n) if rng.random() < 0.4 else (B,)
    kw = dict(q=make_q((B, next_n, H, D), q_dtype), kv_cache=cache, weights=torch.randn(B * next_n, H),
              context_lens=torch.randint(-70, max_pages * PS + 100, lens_shape, dtype=torch.int32),
              block_table=torch.randint(-3, P + 3, (B, max_pages), dtype=torch.int32),
              max_context_len=rng.randint(0, max_pages * PS + 70), clean_logits=rng.random() < 0.5)
    bad = None
    if rng.random() < 0.3:
        bad = rng.choice(["q", "weights", "context_lens", "block_table", "max_context_len", "kv_cache"])
        kw[bad] = {
            "q": lambda: kw["q"].to(torch.float16) if rng.random() < 0.5 else kw["q"][..., :64],
            "weights": lambda: kw["weights"][:, :32] if rng.random() < 0.5 else kw["weights"].double(),
            "context_lens": lambda: kw["context_lens"].long(),
            "block_table": lambda: torch.zeros(B + 1, max_pages, dtype=torch.int32),
            "max_context_len": lambda: rng.choice([-1, 1.5, True]),
            "kv_cache": lambda: torch.zeros(P, 1000, dtype=torch.uint8),
        }[bad]()
    return kw, bad


def _prefill_call(rng):
    T = rng.randint(0, 40)
    kind = rng.choice(["contiguous", "bf16", "fp8"])
    q_dtype = rng.choice([FP8, torch.bfloat16])
    if kind == "contiguous":
        S = rng.randint(0, 300)
        kv, bt = torch.randn(S, D).to(torch.bfloat16), None
    else:
        P, n_pages = rng.randint(1, 6), rng.randint(0, 5)
        kv, _ = make_cache(P, kind)
        bt = torch.randint(-2, P + 2, (n_pages,), dtype=torch.int32)
        S = n_pages * PS
    ke = torch.randint(-5, S + 30, (T,), dtype=torch.int32)
    ks = ke - torch.randint(0, S + 10, (T,), dtype=torch.int32)
    start = rng.randint(0, T)
    kw = dict(q=make_q((T, H, D), q_dtype), kv=kv, weights=torch.randn(T, H), ks=ks, ke=ke, block_table=bt,
              max_seqlen_k=rng.choice([0, 0, rng.randint(1, 200)]), clean_logits=rng.random() < 0.5,
              rows=(start, rng.randint(start, T)))
    bad = None
    if rng.random() < 0.3:
        bad = rng.choice(["q", "weights", "ks", "ke", "rows", "max_seqlen_k"])
        kw[bad] = {
            "q": lambda: kw["q"].view(T, H * D) if T else torch.zeros(1, H, D),
            "weights": lambda: torch.randn(T + 1, H),
            "ks": lambda: ks.long(),
            "ke": lambda: torch.zeros(T + 2, dtype=torch.int32),
            "rows": lambda: rng.choice([(1, 0), (0, T + 1), 7]),
            "max_seqlen_k": lambda: rng.choice([-3, 2.0]),
        }[bad]()
    return kw, bad


def _to(kw, device):
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}


@pytest.mark.parametrize("op", ["paged_mqa_logits", "mqa_logits"])
def test_fuzz_logits(op):
    rng = random.Random(int(os.environ.get("CUPY_DSA_SEED", 0)) + len(op))
    make = _paged_call if op == "paged_mqa_logits" else _prefill_call
    fn = getattr(cupy_dsa, op)
    checked = failed = 0
    for i in range(N_CALLS):
        torch.manual_seed(i)
        kw, bad = make(rng)
        dev_kw = _to(kw, DEV)
        if bad is not None:
            expect_error(lambda: fn(**dev_kw), bad)
            failed += 1
            continue
        want = fn(**kw)                                     # CPU: the reference
        buf, out = guarded_out(want.shape[0], want.shape[1], DEV)
        got = fn(**dev_kw, out=out)
        assert got.data_ptr() == out.data_ptr()
        assert guards_untouched(buf, want.shape[1]), f"call {i}: {op} wrote outside out"
        if want.numel():
            check_close(got, want.double(), clean=kw["clean_logits"], what=f"fuzz {op} call {i}", tol=1e-5)
        checked += 1
    assert checked and failed


def test_fuzz_plan():
    rng = random.Random(3)
    for i in range(N_CALLS):
        B, next_n = rng.randint(0, 2000 if i % 10 == 0 else 9), rng.randint(1, 4)
        ctx = torch.randint(-100, 300000, (B, next_n) if rng.random() < 0.5 else (B,), dtype=torch.int32)
        want = cupy_dsa.paged_mqa_logits_plan(ctx, next_n)
        buf = torch.full((B + 3,), -7, dtype=torch.int64, device=DEV)
        got = cupy_dsa.paged_mqa_logits_plan(ctx.to(DEV), next_n, out=buf[1:B + 2])
        assert torch.equal(got.cpu(), want) and int(buf[0]) == -7 and int(buf[-1]) == -7
        if rng.random() < 0.3:
            expect_error(lambda: cupy_dsa.paged_mqa_logits_plan(ctx.to(DEV), rng.choice([0, 5, 1.0])), "next_n")


def test_fuzz_store():
    rng = random.Random(4)
    for i in range(max(1, N_CALLS // 3)):
        torch.manual_seed(i)
        layout = rng.choice(["bf16", "fp8"])
        numerics = rng.choice(["exact", "fp4sim"]) if layout == "bf16" else "exact"
        style = rng.choice(["v4", "v32"])
        N, P, max_pos = rng.randint(0, 40), rng.randint(1, 4), rng.randint(1, 300)
        kv = torch.randn(N, D).to(rng.choice([torch.float32, torch.bfloat16]))
        kw = dict(positions=torch.randint(-3, max_pos + 5, (N,), dtype=rng.choice([torch.int32, torch.int64])),
                  # distinct slots (two tokens of one call never share a slot), some < 0, some past the end
                  out_loc=(torch.randperm(P * PS + 140)[:N] - 70).to(rng.choice([torch.int32, torch.int64])),
                  norm_weight=torch.rand(D),
                  freqs_cis=torch.randn(max_pos, 64), norm_bias=torch.randn(D) if style == "v32" else None,
                  numerics=numerics, key_style=style, hadamard=rng.random() < 0.8)
        poison = torch.randint(0, 256, (P + 2, layouts.page_bytes(layout)), dtype=torch.uint8)
        want = poison.clone()
        cupy_dsa.store_index_k(kv, want[1:P + 1], **kw)
        got = poison.to(DEV)
        if rng.random() < 0.2:
            bad = rng.choice(["positions", "out_loc", "norm_weight", "numerics"])
            bad_kw = dict(kw, **{bad: {"positions": kw["positions"][:-1] if N else torch.zeros(1, dtype=torch.int32),
                                       "out_loc": kw["out_loc"].short(), "norm_weight": torch.rand(D + 1),
                                       "numerics": "fp5"}[bad]})
            expect_error(lambda: cupy_dsa.store_index_k(kv.to(DEV), got[1:P + 1], **_to(bad_kw, DEV)), bad)
            assert torch.equal(got.cpu(), poison), "a rejected call wrote the cache"
            continue
        cupy_dsa.store_index_k(kv.to(DEV), got[1:P + 1], **_to(kw, DEV))
        got = got.cpu()
        assert torch.equal(got[0], poison[0]) and torch.equal(got[-1], poison[-1]), f"call {i}: guard page written"
        changed = (want != poison) | (got != poison)
        same = torch.equal(got[~changed], want[~changed])
        assert same, f"call {i}: bytes outside the stored slots differ"
        if layout == "bf16":   # kernel vs reference: at most one bf16 ulp apart (rsqrtf)
            g = got[1:P + 1].view(torch.bfloat16).float()
            w = want[1:P + 1].view(torch.bfloat16).float()
            fin = torch.isfinite(w) & torch.isfinite(g)
            assert torch.allclose(g[fin], w[fin], rtol=1e-2, atol=1e-2) or not fin.any(), f"call {i}: values differ"
