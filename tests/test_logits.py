"""Indexer logits (paged decode and prefill): references and kernel vs an independent float64 formulation.

The fp64 oracle dequantizes every input (fp8 values times their scale) and does one einsum per request;
it shares no code with cupy_dsa.logits beyond the cache byte layout written here with plain torch.
"""
import math

import pytest
import torch

from cupy_dsa import layouts
from cupy_dsa.logits import (mqa_logits, mqa_logits_reference, paged_mqa_logits, paged_mqa_logits_reference)

FP8 = torch.float8_e4m3fn
H, D, PS = 64, 128, 64


# --------------------------------------------------------------------------------------------------
# Inputs written directly with torch, and the float64 oracle
# --------------------------------------------------------------------------------------------------

def make_cache(P, layout, device="cpu", shape="rows"):
    """A random cache (uint8 page rows, or the typed / 4-D views SGLang hands around) and its fp64
    dequantized keys [P, 64, 128]."""
    if layout == "bf16":
        k = torch.randn(P, PS, D, device=device).to(torch.bfloat16)
        rows = k.view(torch.uint8).reshape(P, PS * D * 2).clone()
        deq = k.double()
        cache = rows if shape == "rows" else rows.view(torch.bfloat16).view(P, PS, D)
    else:
        vals = (torch.randn(P, PS, D, device=device) * 2).to(FP8)
        scales = torch.rand(P, PS, device=device) * 0.1 + 0.01
        rows = torch.empty(P, layouts.FP8_PAGE_BYTES, dtype=torch.uint8, device=device)
        rows[:, :PS * D] = vals.view(torch.uint8).reshape(P, PS * D)
        rows[:, PS * D:] = scales.view(torch.uint8).reshape(P, PS * 4)
        deq = vals.double() * scales.double()[..., None]
        cache = rows if shape == "rows" else rows.view(P, PS, 1, D + 4)
    return cache, deq


def make_q(shape, q_dtype, device="cpu"):
    q = torch.randn(*shape, device=device)
    return (q * 3).to(FP8) if q_dtype == FP8 else q.to(torch.bfloat16)


def oracle_logits(qd, wd, keys, visible):
    """qd [R,64,128] fp64, wd [R,64] fp64, keys [R,N,128] fp64 (per row), visible [R,N] bool ->
    [R,N] fp64 with -inf where not visible."""
    s = torch.einsum("rhd,rnd->rhn", qd, keys).clamp_min(0)
    lg = torch.einsum("rhn,rh->rn", s, wd)
    return torch.where(visible, lg, torch.full_like(lg, -math.inf))


def oracle_paged(q, deq, w, ctx, bt, width):
    B, nn = q.shape[:2]
    P = deq.shape[0]
    R = B * nn
    pos = torch.arange(width)
    lens = ctx.long().cpu()
    if lens.dim() == 1:
        lens = lens[:, None] - (nn - 1 - torch.arange(nn))[None, :]
    lens = lens.reshape(R)
    page_idx = pos // PS
    btc = bt.long().cpu()
    in_table = page_idx < btc.shape[1]
    ent = torch.where(in_table[None, :], btc[:, page_idx.clamp(max=max(btc.shape[1] - 1, 0))]
                      if btc.shape[1] > 0 else torch.full((B, width), -1), torch.full((B, width), -1))
    valid = (ent >= 0) & (ent < P)                                  # [B, width]
    flat = deq.cpu().reshape(P * PS, D)
    kidx = (ent.clamp(0, P - 1) * PS + pos % PS)                    # [B, width]
    keys = flat[kidx].repeat_interleave(nn, dim=0)                  # [R, width, D]
    visible = (pos[None, :] < lens[:, None]) & valid.repeat_interleave(nn, dim=0)
    return oracle_logits(q.cpu().double().reshape(R, H, D), w.cpu().double(), keys, visible)


def oracle_prefill(q, keys_flat, key_valid, w, ks, ke, start, end, max_seqlen_k):
    """keys_flat [S,128] fp64, key_valid [S] bool."""
    S = keys_flat.shape[0]
    ks_l, ke_l = ks.long().cpu()[start:end], ke.long().cpu()[start:end]
    R = end - start
    if max_seqlen_k > 0:
        j = ks_l[:, None] + torch.arange(max_seqlen_k)[None, :]        # [R, W] key of column c
    else:
        j = torch.arange(S)[None, :].expand(R, S)
    inside = (j >= 0) & (j < S)
    jc = j.clamp(0, max(S - 1, 0))
    keys = keys_flat[jc] if S > 0 else torch.zeros(R, j.shape[1], D, dtype=torch.float64)
    visible = inside & (j >= ks_l[:, None]) & (j < ke_l[:, None]) & (key_valid[jc] if S > 0 else False)
    return oracle_logits(q.cpu().double()[start:end], w.cpu().double()[start:end], keys, visible)


def check_close(got, want, *, clean, what, tol=1e-5):
    """Relative L2 error on visible entries; exact -inf masks when clean (visible columns only otherwise)."""
    got = got.detach().cpu().double()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    vis = torch.isfinite(want)
    g, wv = got[vis], want[vis]
    bad = ~torch.isfinite(g)
    assert not bad.any(), f"{what}: {int(bad.sum())} visible entries not finite (e.g. index " \
                          f"{vis.nonzero()[bad.nonzero()[0, 0]].tolist()})"
    if wv.numel():
        err = float((g - wv).norm() / wv.norm().clamp_min(1e-30))
        worst = float((g - wv).abs().max())
        assert err <= tol, f"{what}: relative L2 error {err:.3g} > {tol} (max abs err {worst:.3g}, " \
                           f"{int(((g - wv).abs() > 1e-3 * wv.abs().max()).sum())} of {wv.numel()} off)"
    if clean:
        wrong = (got[~vis] != -math.inf)
        assert not wrong.any(), f"{what}: {int(wrong.sum())} masked entries are not -inf " \
                                f"(first at {(~vis).nonzero()[wrong.nonzero()[0, 0]].tolist()})"


def random_paged_case(*, B, next_n, max_pages, P, layout, q_dtype, lens_2d, device="cpu", shape="rows",
                      gen=None):
    cache, deq = make_cache(P, layout, device, shape)
    q = make_q((B, next_n, H, D), q_dtype, device)
    w = torch.randn(B * next_n, H, device=device)
    max_len = max_pages * PS
    if lens_2d:
        ctx = torch.randint(0, max_len + 1, (B, next_n), dtype=torch.int32)
    else:
        ctx = torch.randint(0, max_len + 1, (B,), dtype=torch.int32)
        ctx[0] = 0
        if B > 1:
            ctx[1] = min(next_n - 1, max_len)   # some rows of this request see nothing
    bt = torch.stack([torch.randperm(P)[:max_pages] for _ in range(B)]).to(torch.int32)
    bad = torch.rand(B, max_pages) < 0.1
    bt[bad] = torch.where(torch.rand(int(bad.sum())) < 0.5, -1, P + 3).to(torch.int32)
    return q, cache, deq, w, ctx.to(device), bt.to(device)


# --------------------------------------------------------------------------------------------------
# CPU: references vs the fp64 oracle
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["bf16", "fp8"])
@pytest.mark.parametrize("q_dtype", [FP8, torch.bfloat16], ids=["qfp8", "qbf16"])
@pytest.mark.parametrize("next_n", [1, 2, 3, 4])
@pytest.mark.parametrize("lens_2d", [False, True], ids=["lens1d", "lens2d"])
def test_paged_reference(seed, layout, q_dtype, next_n, lens_2d):
    B, max_pages, P = 3, 4, 9
    q, cache, deq, w, ctx, bt = random_paged_case(B=B, next_n=next_n, max_pages=max_pages, P=P, layout=layout,
                                                  q_dtype=q_dtype, lens_2d=lens_2d,
                                                  shape="rows" if next_n % 2 else "typed")
    for width in (max_pages * PS, max_pages * PS - 37, 2 * PS + 5):
        got = paged_mqa_logits(q, cache, w, ctx, bt, width)              # CPU -> reference
        want = oracle_paged(q, deq, w, ctx, bt, width)
        check_close(got, want, clean=True, what=f"paged ref width={width} seed={seed}")
        assert got.stride(0) % 4 == 0


def test_paged_reference_wider_than_table(seed):
    q, cache, deq, w, ctx, bt = random_paged_case(B=2, next_n=1, max_pages=2, P=4, layout="bf16", q_dtype=FP8,
                                                  lens_2d=False)
    ctx[:] = 5 * PS
    got = paged_mqa_logits(q, cache, w, ctx, bt, 3 * PS)               # pages past the table are masked
    check_close(got, oracle_paged(q, deq, w, ctx, bt, 3 * PS), clean=True, what=f"seed={seed}")
    assert torch.isinf(got[:, 2 * PS:]).all()


def test_paged_reference_out_buffer(seed):
    q, cache, deq, w, ctx, bt = random_paged_case(B=2, next_n=2, max_pages=3, P=6, layout="fp8", q_dtype=FP8,
                                                  lens_2d=False)
    width = 3 * PS - 3
    buf = torch.full((4, 3 * PS), 7.0)
    out = buf[:, :width]
    got = paged_mqa_logits(q, cache, w, ctx, bt, width, out=out)
    assert got.data_ptr() == buf.data_ptr()
    check_close(got, oracle_paged(q, deq, w, ctx, bt, width), clean=True, what=f"seed={seed}")
    assert (buf[:, width:] == 7.0).all()


def prefill_keys(kind, S_pages, device="cpu"):
    """(kv, block_table, keys_flat fp64 [S,128], key_valid [S]) for contiguous or paged keys."""
    if kind == "contiguous":
        S = S_pages * PS - 13
        kv = torch.randn(S, D, device=device).to(torch.bfloat16)
        return kv, None, kv.double().cpu(), torch.ones(S, dtype=torch.bool)
    layout = kind
    P = S_pages + 3
    cache, deq = make_cache(P, layout, device)
    bt = torch.randperm(P)[:S_pages].to(torch.int32)
    bt[1] = -1                                                   # an invalid entry: its keys are masked
    btl = bt.long()
    valid = ((btl >= 0) & (btl < P)).repeat_interleave(PS)
    keys = deq.cpu()[btl.clamp(0, P - 1)].reshape(-1, D)
    return cache, bt.to(device), keys, valid


@pytest.mark.parametrize("kind", ["contiguous", "bf16", "fp8"])
@pytest.mark.parametrize("q_dtype", [FP8, torch.bfloat16], ids=["qfp8", "qbf16"])
def test_prefill_reference(seed, kind, q_dtype):
    T, S_pages = 70, 5
    kv, bt, keys, valid = prefill_keys(kind, S_pages)
    S = keys.shape[0]
    q = make_q((T, H, D), q_dtype)
    w = torch.randn(T, H)
    ke = torch.randint(0, S + 20, (T,), dtype=torch.int32)           # some past S
    ks = (ke - torch.randint(0, 150, (T,), dtype=torch.int32)).clamp_min(0)
    ks[3] = ke[3]                                                     # empty row
    bt2 = bt[None] if bt is not None and seed % 2 else bt
    for rows, msk in [(None, 0), ((5, 61), 0), (None, 100), ((2, 40), 90)]:
        start, end = rows if rows else (0, T)
        got = mqa_logits(q, kv, w, ks, ke, block_table=bt2, max_seqlen_k=msk, rows=rows)
        want = oracle_prefill(q, keys, valid, w, ks, ke, start, end, msk)
        check_close(got, want, clean=True, what=f"prefill ref rows={rows} max_seqlen_k={msk} seed={seed}")
        assert got.stride(0) % 4 == 0


def test_references_direct(seed):
    """The *_reference functions are the same as the CPU dispatch (and accept the same arguments)."""
    q, cache, deq, w, ctx, bt = random_paged_case(B=2, next_n=2, max_pages=2, P=4, layout="bf16",
                                                  q_dtype=torch.bfloat16, lens_2d=True)
    a = paged_mqa_logits_reference(q, cache, w, ctx, bt, 2 * PS, clean_logits=True)
    b = paged_mqa_logits(q, cache, w, ctx, bt, 2 * PS, clean_logits=True)
    assert torch.equal(a, b)
    kv = torch.randn(100, D).to(torch.bfloat16)
    q2 = make_q((9, H, D), FP8)
    w2 = torch.randn(9, H)
    ks = torch.zeros(9, dtype=torch.int32)
    ke = torch.arange(9, dtype=torch.int32) * 11
    assert torch.equal(mqa_logits_reference(q2, kv, w2, ks, ke), mqa_logits(q2, kv, w2, ks, ke))


# --------------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------------

def _paged_args():
    q, cache, _, w, ctx, bt = random_paged_case(B=2, next_n=1, max_pages=2, P=4, layout="bf16", q_dtype=FP8,
                                                lens_2d=False)
    return dict(q=q, kv_cache=cache, weights=w, context_lens=ctx, block_table=bt, max_context_len=128)


@pytest.mark.parametrize("change,exc,name", [
    (dict(q=torch.zeros(2, 1, 64, 128)), TypeError, "q"),
    (dict(q=torch.zeros(2, 5, 64, 128, dtype=torch.bfloat16)), ValueError, "q"),
    (dict(q=torch.zeros(2, 1, 32, 128, dtype=torch.bfloat16)), ValueError, "q"),
    (dict(kv_cache=torch.zeros(4, 1000, dtype=torch.uint8)), ValueError, "kv_cache"),
    (dict(weights=torch.zeros(2, 64, dtype=torch.bfloat16)), TypeError, "weights"),
    (dict(weights=torch.zeros(3, 64)), ValueError, "weights"),
    (dict(context_lens=torch.zeros(2, dtype=torch.int64)), TypeError, "context_lens"),
    (dict(context_lens=torch.zeros(3, dtype=torch.int32)), ValueError, "context_lens"),
    (dict(block_table=torch.zeros(2, 4, dtype=torch.int32)[:, ::2]), ValueError, "block_table"),
    (dict(block_table=torch.zeros(3, 2, dtype=torch.int32)), ValueError, "block_table"),
    (dict(block_table=torch.zeros(2, 2, dtype=torch.int64)), TypeError, "block_table"),
    (dict(max_context_len=-1), ValueError, "max_context_len"),
    (dict(max_context_len=1.5), TypeError, "max_context_len"),
])
def test_paged_bad_input(change, exc, name):
    args = _paged_args()
    args.update(change)
    with pytest.raises(exc, match=name):
        paged_mqa_logits(**args)


def test_paged_bad_out():
    args = _paged_args()
    with pytest.raises(ValueError, match="out"):
        paged_mqa_logits(**args, out=torch.empty(2, 130)[:, :128])                      # row stride 130
    with pytest.raises(TypeError, match="out"):
        paged_mqa_logits(**args, out=torch.empty(2, 128, dtype=torch.float64))
    with pytest.raises(ValueError, match="out"):
        paged_mqa_logits(**args, out=torch.empty(3, 128))


def _prefill_args():
    kv = torch.randn(100, D).to(torch.bfloat16)
    return dict(q=make_q((9, H, D), FP8), kv=kv, weights=torch.randn(9, H),
                ks=torch.zeros(9, dtype=torch.int32), ke=torch.full((9,), 50, dtype=torch.int32))


@pytest.mark.parametrize("change,exc,name", [
    (dict(q=torch.zeros(9, 64, 128, dtype=torch.float16)), TypeError, "q"),
    (dict(q=torch.zeros(9, 64, 64, dtype=torch.bfloat16)), ValueError, "q"),
    (dict(kv=torch.zeros(100, 128)), TypeError, "kv"),
    (dict(kv=torch.zeros(100, 64, dtype=torch.bfloat16)), ValueError, "kv"),
    (dict(kv=torch.zeros(128, 100, dtype=torch.bfloat16).t()), ValueError, "kv"),
    (dict(kv=torch.zeros(3, 999, dtype=torch.uint8), block_table=torch.zeros(2, dtype=torch.int32)),
     ValueError, "kv"),
    (dict(kv=layouts.empty_cache(3, "bf16"), block_table=torch.zeros(2, 2, dtype=torch.int32)),
     ValueError, "block_table"),
    (dict(weights=torch.zeros(8, 64)), ValueError, "weights"),
    (dict(ks=torch.zeros(9, dtype=torch.int64)), TypeError, "ks"),
    (dict(ke=torch.zeros(10, dtype=torch.int32)), ValueError, "ke"),
    (dict(rows=(5, 3)), ValueError, "rows"),
    (dict(rows=(0, 10)), ValueError, "rows"),
    (dict(rows=5), TypeError, "rows"),
    (dict(max_seqlen_k=-2), ValueError, "max_seqlen_k"),
])
def test_prefill_bad_input(change, exc, name):
    args = _prefill_args()
    args.update(change)
    with pytest.raises(exc, match=name):
        mqa_logits(**args)
