"""Indexer logits (paged decode and prefill): references and kernel vs an independent float64 formulation.

The fp64 oracle dequantizes every input (fp8 values times their scale) and does one einsum per request;
it shares no code with cupy_dsa.logits beyond the cache byte layout written here with plain torch.
"""
import contextlib
import math

import pytest
import torch

from cupy_dsa import launch, layouts, runtime
from cupy_dsa.bench.timing import capture_graph
from cupy_dsa.heuristics import EMULATED_ARCHS
from cupy_dsa import logits as L
from cupy_dsa.logits import (mqa_logits, mqa_logits_plan, mqa_logits_plan_reference, mqa_logits_reference,
                             paged_mqa_logits, paged_mqa_logits_plan, paged_mqa_logits_plan_reference,
                             paged_mqa_logits_reference)

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
    """fp64 on q's device, one request at a time."""
    dev = q.device
    B, nn = q.shape[:2]
    P = deq.shape[0]
    deq = deq.to(dev)
    lens = ctx.long().cpu()
    if lens.dim() == 1:
        lens = lens[:, None] - (nn - 1 - torch.arange(nn))[None, :]
    btc = bt.long().cpu()
    pos = torch.arange(width)
    page_idx = pos // PS
    in_table = page_idx < btc.shape[1]
    flat = deq.reshape(P * PS, D)
    out = torch.empty(B * nn, width, dtype=torch.float64, device=dev)
    for b in range(B):
        ent = torch.full((width,), -1, dtype=torch.long)
        if btc.shape[1] > 0:
            ent = torch.where(in_table, btc[b, page_idx.clamp(max=btc.shape[1] - 1)], ent)
        valid = (ent >= 0) & (ent < P)
        keys = flat[(ent.clamp(0, P - 1) * PS + pos % PS).to(dev)]              # [width, D]
        visible = (pos[None, :] < lens[b][:, None]) & valid[None, :]              # [nn, width]
        out[b * nn:(b + 1) * nn] = oracle_logits(q[b].double(), w[b * nn:(b + 1) * nn].double(),
                                                 keys.expand(nn, width, D), visible.to(dev))
    return out


def oracle_prefill(q, keys_flat, key_valid, w, ks, ke, start, end, max_seqlen_k, row_chunk=16):
    """keys_flat [S,128] fp64, key_valid [S] bool; fp64 on q's device, a few rows at a time."""
    dev = q.device
    S = keys_flat.shape[0]
    keys_flat, key_valid = keys_flat.to(dev), key_valid.to(dev)
    ks_l, ke_l = ks.long().to(dev)[start:end], ke.long().to(dev)[start:end]
    R = end - start
    W = max_seqlen_k if max_seqlen_k > 0 else S
    out = torch.empty(R, W, dtype=torch.float64, device=dev)
    for r0 in range(0, R, row_chunk):
        r1 = min(R, r0 + row_chunk)
        if max_seqlen_k > 0:
            j = ks_l[r0:r1, None] + torch.arange(W, device=dev)[None, :]      # key of column c
        else:
            j = torch.arange(S, device=dev)[None, :].expand(r1 - r0, S)
        jc = j.clamp(0, S - 1)
        visible = (j >= 0) & (j < S) & (j >= ks_l[r0:r1, None]) & (j < ke_l[r0:r1, None]) & key_valid[jc]
        qd, wd = q[start + r0:start + r1].double(), w[start + r0:start + r1].double()
        if max_seqlen_k > 0:
            sc = torch.einsum("rhd,rnd->rhn", qd, keys_flat[jc])
        else:
            sc = torch.einsum("rhd,nd->rhn", qd, keys_flat)
        lg = torch.einsum("rhn,rh->rn", sc.clamp_min(0), wd)
        out[r0:r1] = torch.where(visible, lg, torch.full_like(lg, -math.inf))
    return out


def check_close(got, want, *, clean, what, tol=1e-5):
    """Relative L2 error on visible entries; exact -inf masks when clean (visible columns only otherwise)."""
    got = got.detach().double().to(want.device)
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


def test_sm90_config_fits_hopper():
    """The sm_90 wgmma decode configs: shared memory of the asked CTAs per SM fits an H100/H200 SM."""
    sm90 = [c for c in L.DECODE.declared("sm_90") if c.kernel is L.SM90_DECODE_KERNEL]
    assert {c.NextN for c in sm90} == {1, 2, 3, 4}
    for cfg in sm90:
        assert cfg.smem <= 227 * 1024, str(cfg)
        assert cfg.MinBlocks * (cfg.smem + 1024) <= 228 * 1024, str(cfg)   # 1 KiB reserved per CTA
        assert cfg.Stages >= 2 and cfg.NextN % cfg.Split == 0


def test_product_instantiations_are_product_configs():
    """What a server warms up is a product config of the arch (what warm_up and the CI matrix compile)."""
    from cupy_dsa import launch
    for arch in ("sm_80", "sm_89", "sm_90", "sm_100", "sm_120"):
        product = set(launch.product_expressions(arch)["mqa_logits.cu"])
        ex = L.product_instantiations(arch, q_fp8=(1, 0), next_ns=(1, 2, 3, 4), layouts=("bf16", "fp8"))
        contiguous = {L.PREFILL.select(("contiguous", qf, 0), arch).expr for qf in (1, 0)}  # no server launches them
        assert set(ex) == product - contiguous, set(ex) ^ (product - contiguous)
        assert any("sm90" in e for e in ex) == (arch == "sm_90")
    one = L.product_instantiations("sm_90", q_fp8=(1,), next_ns=(1,), layouts=("bf16",))
    assert one == ["paged_mqa_logits_plan_kernel", "mqa_logits_plan_kernel", "mqa_logits_sm90_decode_kernel<1, 1, 3, 3, 1>",
                   "mqa_logits_sm90_prefill_kernel<1, 1, 4, 1, 2, 2>"]


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


def plan_oracle(ctx, next_n):
    """Pages each request computes (ceil(longest row / 64)), as an exclusive prefix over requests."""
    out = [0]
    for row in ctx.long().reshape(ctx.shape[0], -1 if ctx.numel() else 1).tolist():
        m = max(row) if len(row) else 0
        out.append(out[-1] + (max(m, 0) + PS - 1) // PS)
    return torch.tensor(out, dtype=torch.int64)


@pytest.mark.parametrize("lens_2d", [False, True], ids=["lens1d", "lens2d"])
def test_plan_reference(seed, lens_2d):
    for B, next_n in ((0, 1), (1, 1), (7, 2), (1500, 3), (33, 4)):
        shape = (B, next_n) if lens_2d else (B,)
        ctx = torch.randint(-70, 5000, shape, dtype=torch.int32)
        plan = paged_mqa_logits_plan(ctx, next_n)
        assert torch.equal(plan, plan_oracle(ctx, next_n)), (B, next_n)
        buf = torch.full((B + 1,), -5, dtype=torch.int64)
        assert paged_mqa_logits_plan(ctx, next_n, out=buf).data_ptr() == buf.data_ptr()
        assert torch.equal(buf, plan)
        assert torch.equal(paged_mqa_logits_plan_reference(ctx, next_n), plan)


def test_paged_reference_takes_plan(seed):
    q, cache, deq, w, ctx, bt = random_paged_case(B=3, next_n=2, max_pages=4, P=9, layout="fp8", q_dtype=FP8,
                                                  lens_2d=False)
    a = paged_mqa_logits(q, cache, w, ctx, bt, 4 * PS, clean_logits=True, plan=paged_mqa_logits_plan(ctx, 2))
    assert torch.equal(a, paged_mqa_logits(q, cache, w, ctx, bt, 4 * PS, clean_logits=True))


@pytest.mark.parametrize("change,exc,name", [
    (dict(next_n=0), ValueError, "next_n"),
    (dict(next_n=5), ValueError, "next_n"),
    (dict(next_n=1.0), TypeError, "next_n"),
    (dict(context_lens=torch.zeros(3, dtype=torch.int64)), TypeError, "context_lens"),
    (dict(context_lens=torch.zeros(3, 2, dtype=torch.int32)), ValueError, "context_lens"),
    (dict(context_lens=torch.zeros(3, 4, dtype=torch.int32)[:, :1]), ValueError, "context_lens"),
    (dict(out=torch.zeros(3, dtype=torch.int64)), ValueError, "plan"),
    (dict(out=torch.zeros(4, dtype=torch.int32)), ValueError, "plan"),
])
def test_plan_bad_input(change, exc, name):
    kw = dict(context_lens=torch.zeros(3, dtype=torch.int32), next_n=1)
    kw.update(change)
    with pytest.raises(exc, match=name):
        paged_mqa_logits_plan(**kw)


def test_next_n_errors_share_one_wording():
    q, cache, deq, w, ctx, bt = random_paged_case(B=2, next_n=1, max_pages=2, P=4, layout="bf16", q_dtype=FP8,
                                                  lens_2d=False)
    with pytest.raises(ValueError, match=r"^next_n: expected an int in \[1, 4\], got 5$"):
        paged_mqa_logits_plan(ctx, 5)
    q5 = torch.zeros(2, 5, 64, 128, dtype=FP8)
    with pytest.raises(ValueError, match=r"^q: expected shape \[B, next_n, 64, 128\] with next_n an int in \[1, 4\]"):
        paged_mqa_logits(q5, cache, torch.zeros(10, 64), ctx, bt, 2 * PS)


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_clean_logits_must_be_a_bool(value):
    q, cache, deq, w, ctx, bt = random_paged_case(B=2, next_n=1, max_pages=2, P=4, layout="bf16", q_dtype=FP8,
                                                  lens_2d=False)
    with pytest.raises(TypeError, match=f"^clean_logits: expected a bool, got {type(value).__name__}"):
        paged_mqa_logits(q, cache, w, ctx, bt, 2 * PS, clean_logits=value)
    with pytest.raises(TypeError, match="^clean_logits: expected a bool"):
        mqa_logits(**_varlen_args(), clean_logits=value)


def test_paged_plan_is_checked_against_its_next_n(seed):
    q, cache, deq, w, ctx, bt = random_paged_case(B=3, next_n=1, max_pages=4, P=9, layout="bf16", q_dtype=FP8,
                                                  lens_2d=False)
    with pytest.raises(ValueError, match=r"^plan: made by paged_mqa_logits_plan\(context_lens, next_n=2\), this "
                                         r"call has next_n 1"):
        paged_mqa_logits(q, cache, w, ctx, bt, 4 * PS, plan=paged_mqa_logits_plan(ctx, 2))
    reused = paged_mqa_logits_plan(ctx, 2, out=torch.empty(4, dtype=torch.int64))
    paged_mqa_logits_plan(ctx, 1, out=reused)  # a reused buffer records its latest build
    paged_mqa_logits(q, cache, w, ctx, bt, 4 * PS, plan=reused)


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


@pytest.mark.parametrize("plan,exc", [
    ("not a tensor", TypeError), (torch.zeros(3, dtype=torch.int32), ValueError),
    (torch.zeros(2, dtype=torch.int64), ValueError),
])
def test_paged_bad_plan(plan, exc):
    with pytest.raises(exc, match="plan"):
        paged_mqa_logits(**_paged_args(), plan=plan)


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


# --------------------------------------------------------------------------------------------------
# GPU: kernel vs the fp64 oracle (outputs poisoned with NaN first; every visible entry must be written)
# --------------------------------------------------------------------------------------------------

gpu = pytest.mark.gpu
NAN = float("nan")


def poisoned(rows, width, pad=0, device="cuda"):
    """A NaN-filled fp32 buffer [rows, ceil4(width) + pad] and its [:, :width] view (the `out=`)."""
    buf = torch.full((rows, -(-width // 4) * 4 + pad), NAN, device=device)
    return buf, buf[:, :width]


def check_untouched(buf, width, what):
    pad = buf[:, width:]
    assert torch.isnan(pad).all(), f"{what}: {int((~torch.isnan(pad)).sum())} writes past column {width}"


# The arch whose declared configs the GPU tests run (collection time: the GPU of the machine running them).
ARCH = runtime.device_arch(torch.cuda.current_device()) if torch.cuda.is_available() else "sm_90"


def configs(family, problem, kernel=None, **values):
    """Declared configs on this GPU (product first) computing ``problem``, of ``kernel`` when given, with
    these parameter values."""
    return [c for c in family.candidates(problem, ARCH) if (kernel is None or c.kernel is kernel)
            and all(c.values.get(k) == v for k, v in values.items())]


@pytest.fixture
def force():
    """``force(family, config)``: the family launches ``config`` for the rest of the test."""
    with contextlib.ExitStack() as stack:
        yield lambda family, cfg: stack.enter_context(family.forced(cfg, ARCH))


def _config_id(cfg):
    return str(cfg).replace(" ", "")


def _decode_cases():
    return [(cfg, p) for p in L.DECODE.problems for cfg in L.DECODE.candidates(p, ARCH)]


def _prefill_cases(varlen=0):
    return [(cfg, p) for p in L.PREFILL.problems if p[2] == varlen for cfg in L.PREFILL.candidates(p, ARCH)
            if cfg.values.get("keys_per_cta", 4096) == 4096]     # other keys_per_cta: the same instantiation (bitwise test below)


def gpu_paged_case(seed, *, B, next_n, max_pages, P, layout, q_dtype, lens_2d, shape="rows"):
    torch.manual_seed(seed)
    q, cache, deq, w, ctx, bt = random_paged_case(B=B, next_n=next_n, max_pages=max_pages, P=P, layout=layout,
                                                  q_dtype=q_dtype, lens_2d=lens_2d, shape=shape)
    return [t.cuda() for t in (q, cache, deq, w, ctx, bt)]


@gpu
@pytest.mark.parametrize("cfg,problem", _decode_cases(), ids=lambda v: _config_id(v) if isinstance(v, launch.Config)
                         else "-".join(map(str, v)))
@pytest.mark.parametrize("lens_2d", [False, True], ids=["lens1d", "lens2d"])
def test_gpu_paged(seed, cfg, problem, lens_2d):
    """Every declared decode config of this GPU (product and experimental: on sm_90 the wgmma and the
    mma.sync kernel for next_n 1-4) vs the fp64 oracle. The e4m3 mma (Mma8=1) is checked at 1e-5 where ptxas
    emulates it in fp32 (sm_90 / sm_100) and at 2e-3 where fp8 tensor cores add with ~13-bit precision."""
    layout, q_fp8, next_n = problem
    native_fp8 = cfg.values.get("Mma8") == 1 and ARCH not in ("sm_90", "sm_100")
    q, cache, deq, w, ctx, bt = gpu_paged_case(seed, B=5, next_n=next_n, max_pages=37, P=200, layout=layout,
                                               q_dtype=FP8 if q_fp8 else torch.bfloat16, lens_2d=lens_2d,
                                               shape="rows" if next_n % 2 else "typed")
    with L.DECODE.forced(cfg, ARCH):
        for width in (37 * PS, 37 * PS - 45, 10 * PS + 3):
            want = oracle_paged(q, deq, w, ctx, bt, width)
            for clean in (True, False):
                buf, out = poisoned(5 * next_n, width, pad=8)
                got = paged_mqa_logits(q, cache, w, ctx, bt, width, clean_logits=clean, out=out)
                assert got.data_ptr() == out.data_ptr()
                what = f"paged {cfg} {problem} width={width} clean={clean} seed={seed}"
                check_close(got, want, clean=clean, what=what, tol=2e-3 if native_fp8 else 1e-5)
                check_untouched(buf, width, what)


@gpu
@pytest.mark.parametrize("layout", ["bf16", "fp8"])
@pytest.mark.parametrize("kernel", ["wgmma", "mma"])
def test_gpu_paged_long(seed, layout, kernel):
    """Many pages per request, short and full lengths (sm_90: the wgmma and the mma.sync kernel)."""
    cfg = configs(L.DECODE, (layout, 1, 2), L.SM90_DECODE_KERNEL if kernel == "wgmma" else L.DECODE_KERNEL)
    if not cfg:
        pytest.skip(f"no {kernel} decode kernel for {layout} keys on {ARCH}")
    q, cache, deq, w, ctx, bt = gpu_paged_case(seed, B=16, next_n=2, max_pages=211, P=3500, layout=layout,
                                               q_dtype=FP8, lens_2d=False)
    ctx[2] = 211 * PS                                               # a full-length row
    width = 211 * PS
    want = oracle_paged(q, deq, w, ctx, bt, width)
    with L.DECODE.forced(cfg[0], ARCH):
        got = paged_mqa_logits(q, cache, w, ctx, bt, width, clean_logits=True)
    check_close(got, want, clean=True, what=f"paged long {layout} {cfg[0]} seed={seed}")
    assert got.stride(0) % 4 == 0


@gpu
@pytest.mark.parametrize("clean", [False, True])
def test_gpu_paged_wide_table(seed, clean):
    """CUDA-graph style: a block table far wider than the lengths (max_context_len 64K, contexts < 3K)."""
    q, cache, deq, w, ctx, bt = gpu_paged_case(seed, B=3, next_n=1, max_pages=1024, P=1100, layout="bf16",
                                               q_dtype=FP8, lens_2d=False)
    ctx.copy_(torch.tensor([2900, 65, 0], dtype=torch.int32))
    width = 1024 * PS
    want = oracle_paged(q, deq, w, ctx, bt, width)
    buf, out = poisoned(3, width, pad=4)
    got = paged_mqa_logits(q, cache, w, ctx, bt, width, clean_logits=clean, out=out)
    check_close(got, want, clean=clean, what=f"wide table clean={clean} seed={seed}")
    check_untouched(buf, width, "wide table")


def gpu_prefill_case(seed, kind, q_dtype, T, S_pages):
    torch.manual_seed(seed)
    kv, bt, keys, valid = prefill_keys(kind, S_pages, device="cuda")
    S = keys.shape[0]
    q = make_q((T, H, D), q_dtype, "cuda")
    w = torch.randn(T, H, device="cuda")
    ke = torch.randint(0, S + 40, (T,), dtype=torch.int32)
    ks = (ke - torch.randint(0, 3 * S // 4, (T,), dtype=torch.int32)).clamp_min(0)
    ks[3], ke[5], ks[7] = ke[3], 0, S + 5                            # empty rows
    ke[:T // 4] = torch.arange(T // 4, dtype=torch.int32) * S // T   # a causal band
    ks[:T // 4] = 0
    return q, kv, bt, keys, valid, w, ks.cuda(), ke.cuda()


@gpu
@pytest.mark.parametrize("cfg,problem", _prefill_cases(), ids=lambda v: _config_id(v)
                         if isinstance(v, launch.Config) else "-".join(map(str, v)))
def test_gpu_prefill(seed, cfg, problem):
    """Every declared prefill config of this GPU vs the fp64 oracle (1024 keys per CTA: several CTAs share a
    row tile)."""
    kind, q_fp8, _ = problem
    q_dtype = FP8 if q_fp8 else torch.bfloat16
    native_fp8 = cfg.values.get("Mma8") == 1 and ARCH not in ("sm_90", "sm_100")
    variant = str(cfg)
    if "keys_per_cta" in cfg.values:
        cfg = cfg.replace(keys_per_cta=1024)
    T, S_pages = 203, 45
    q, kv, bt, keys, valid, w, ks, ke = gpu_prefill_case(seed, kind, q_dtype, T, S_pages)
    S = keys.shape[0]
    for rows, msk, clean in [(None, 0, True), (None, 0, False), ((9, 170), 0, True), (None, 700, False),
                             ((2, 199), 500, True), ((50, 51), 0, True), ((4, 4), 0, True), ((1, 10), 0, True),
                             ((100, 203), 64, True)]:
        start, end = rows if rows else (0, T)
        width = msk if msk else S
        want = oracle_prefill(q, keys, valid, w, ks, ke, start, end, msk)
        buf, out = poisoned(end - start, width, pad=4)
        with L.PREFILL.forced(cfg, ARCH):
            got = mqa_logits(q, kv, w, ks, ke, block_table=bt, max_seqlen_k=msk, clean_logits=clean, rows=rows,
                             out=out)
        what = f"prefill {kind} q={q_dtype} {variant} rows={rows} max_seqlen_k={msk} clean={clean} seed={seed}"
        check_close(got, want, clean=clean, what=what, tol=2e-3 if native_fp8 else 1e-5)
        check_untouched(buf, width, what)


@gpu
def test_gpu_prefill_causal_large(seed):
    """Causal prefill with the product config: T=1024 rows, S=8192 contiguous keys."""
    torch.manual_seed(seed)
    T, S = 1024, 8192
    kv = torch.randn(S, D, device="cuda").to(torch.bfloat16)
    q = make_q((T, H, D), FP8, "cuda")
    w = torch.randn(T, H, device="cuda")
    ke = (torch.arange(T, device="cuda") * (S // T) + S // T).to(torch.int32)
    ks = torch.zeros(T, dtype=torch.int32, device="cuda")
    want = oracle_prefill(q, kv.double(), torch.ones(S, dtype=torch.bool), w, ks, ke, 0, T, 0, row_chunk=64)
    got = mqa_logits(q, kv, w, ks, ke)
    check_close(got, want, clean=True, what=f"causal T={T} S={S} seed={seed}")


@gpu
def test_gpu_variants_bitwise_equal(seed):
    """Variants of one kernel that change scheduling (Prefetch, L2Hint, MinBlocks, CTAs per SM, keys per CTA),
    never the arithmetic order, give bitwise equal results; Mma8 = 1 changes the arithmetic (left out)."""
    for layout, q_fp8 in (("bf16", 0), ("bf16", 1), ("fp8", 1)):
        q, cache, _, w, ctx, bt = gpu_paged_case(seed, B=7, next_n=1, max_pages=50, P=400, layout=layout,
                                                 q_dtype=FP8 if q_fp8 else torch.bfloat16, lens_2d=False)
        for kernel in (L.SM90_DECODE_KERNEL, L.DECODE_KERNEL):
            outs = []
            for cfg in configs(L.DECODE, (layout, q_fp8, 1), kernel):
                if cfg.values.get("Mma8"):
                    continue
                with L.DECODE.forced(cfg, ARCH):
                    outs.append((cfg, paged_mqa_logits(q, cache, w, ctx, bt, 50 * PS, clean_logits=True)))
            for cfg, o in outs[1:]:
                assert torch.equal(o, outs[0][1]), \
                    f"{cfg} differs from {outs[0][0]}: {int((o != outs[0][1]).sum())} entries"
    T = 77
    q2 = make_q((T, H, D), FP8, "cuda")
    w2 = torch.randn(T, H, device="cuda")
    kv = torch.randn(3000, D, device="cuda").to(torch.bfloat16)
    ke = torch.randint(0, 3000, (T,), dtype=torch.int32, device="cuda")
    ks = (ke - 900).clamp_min(0)
    outs = []
    for cfg in configs(L.PREFILL, ("contiguous", 1, 0), Mma8=0):
        for keys_per_cta in (cfg.keys_per_cta, 64):
            with L.PREFILL.forced(cfg.replace(keys_per_cta=keys_per_cta), ARCH):
                outs.append((f"{cfg} keys_per_cta={keys_per_cta}", mqa_logits(q2, kv, w2, ks, ke)))
    assert len(outs) > 2
    for what, o in outs[1:]:
        assert torch.equal(o, outs[0][1]), f"prefill {what} differs: {int((o != outs[0][1]).sum())} entries"
    outs = []
    for cfg in configs(L.PREFILL, ("contiguous", 1, 0), L.SM90_PREFILL_KERNEL)[:1]:  # sm_90: the product wgmma one
        for parts in (0, 1, 3, 40):       # other cuts of a tile's key blocks over CTAs
            with L.PREFILL.forced(cfg.replace(parts=parts), ARCH):
                outs.append((f"{cfg} parts={parts}", mqa_logits(q2, kv, w2, ks, ke)))
    for what, o in outs[1:]:
        assert torch.equal(o, outs[0][1]), f"prefill {what} differs: {int((o != outs[0][1]).sum())} entries"


def test_forcing_an_undeclared_config_fails():
    """An undeclared combination is an error, never a silent fallback to another instantiation."""
    undeclared = L.DECODE_KERNEL.config(KeyFp8=0, QFp8=1, Rows=2, Warps=8, MT=4, Prefetch=0, L2Hint=0, Mma8=0,
                                        MinBlocks=4)
    with pytest.raises(ValueError, match="not a declared config"):
        with L.DECODE.forced(undeclared, "sm_90"):
            pass


@gpu
def test_gpu_deterministic(seed):
    """Ten reruns of every fp8-key decode config and of the product prefill are bitwise equal."""
    for layout in ("bf16", "fp8"):
        q, cache, _, w, ctx, bt = gpu_paged_case(seed, B=9, next_n=3, max_pages=40, P=300, layout=layout,
                                                 q_dtype=FP8, lens_2d=True)
        for cfg in configs(L.DECODE, (layout, 1, 3)):
            with L.DECODE.forced(cfg, ARCH):
                first = paged_mqa_logits(q, cache, w, ctx, bt, 40 * PS, clean_logits=True)
                for i in range(10):
                    again = paged_mqa_logits(q, cache, w, ctx, bt, 40 * PS, clean_logits=True)
                    assert torch.equal(again, first), f"{cfg} rerun {i}: {int((again != first).sum())} entries differ"
    for kind in ("fp8", "bf16", "contiguous"):  # on sm_90 the bf16 kinds take the wgmma kernel
        q, kv, bt, _, _, w, ks, ke = gpu_prefill_case(seed, kind, FP8, 150, 30)
        first = mqa_logits(q, kv, w, ks, ke, block_table=bt)
        for i in range(10):
            again = mqa_logits(q, kv, w, ks, ke, block_table=bt)
            assert torch.equal(again, first), f"prefill {kind} rerun {i}: {int((again != first).sum())} differ"


@gpu
@pytest.mark.parametrize("layout", ["bf16", "fp8"])
def test_gpu_cuda_graph(seed, layout):
    """Capture once (after warm-up, static buffers), replay with new lengths / block tables copied in."""
    B, next_n, max_pages, P = 6, 2, 30, 250
    q, cache, deq, w, ctx, bt = gpu_paged_case(seed, B=B, next_n=next_n, max_pages=max_pages, P=P,
                                               layout=layout, q_dtype=FP8, lens_2d=False)
    width = max_pages * PS
    g, out = capture_graph(lambda: paged_mqa_logits(q, cache, w, ctx, bt, width, clean_logits=True))
    for step in range(3):
        _, _, _, _, ctx_new, bt_new = random_paged_case(B=B, next_n=next_n, max_pages=max_pages, P=P,
                                                        layout=layout, q_dtype=FP8, lens_2d=False)
        ctx.copy_(ctx_new)
        bt.copy_(bt_new)
        q.copy_(make_q(q.shape, FP8, "cuda"))
        out.fill_(NAN)
        g.replay()
        torch.cuda.synchronize()
        check_close(out, oracle_paged(q, deq, w, ctx, bt, width), clean=True,
                    what=f"graph replay {step} {layout} seed={seed}")


def mixed_lengths(B, next_n, max_len, lens_2d, device="cuda"):
    """Serving-like lengths: zeros, one request ~100x longer than the rest at a random slot, none a
    multiple of 64 by construction (odd offsets)."""
    short = max(2, max_len // 100)
    lens = torch.randint(0, short, (B,), dtype=torch.int32) | 1
    lens[torch.randperm(B)[:max(1, B // 5)]] = 0                           # empty requests
    lens[int(torch.randint(0, B, (1,)))] = max_len - int(torch.randint(1, 63, (1,))) | 1
    if lens_2d:                                                              # per-row, MTP-like
        lens = (lens[:, None] - (next_n - 1) + torch.arange(next_n, dtype=torch.int32)[None, :]).clamp_min(0)
        lens = lens.contiguous()
    return lens.to(device)


def mixed_case(B, next_n, max_pages, P, layout, q_dtype, lens_2d):
    """A batch of mixed lengths whose block table is far wider than most requests (max_context_len as
    SGLang passes it: table width x 64), with invalid page ids inside and past the visible ranges."""
    cache, deq = make_cache(P, layout, "cuda")
    q = make_q((B, next_n, H, D), q_dtype, "cuda")
    w = torch.randn(B * next_n, H, device="cuda")
    ctx = mixed_lengths(B, next_n, max_pages * PS - 200, lens_2d)
    bt = mixed_table(B, max_pages, P, ctx)
    return q, cache, deq, w, ctx, bt


def mixed_table(B, max_pages, P, ctx):
    bt = torch.stack([torch.randperm(P)[:max_pages] for _ in range(B)]).to(torch.int32)
    longest = int(ctx.view(B, -1).max(1).values.argmax())
    bt[longest, 3] = -1                                                      # inside the visible range
    bt[longest, 5] = P + 7
    bt[:, -1] = -3                                                           # past every visible range
    return bt.cuda()


@gpu
def test_gpu_plan(seed):
    """The plan kernel equals the oracle (several 1024-request scan chunks, negative lengths, 2-D lens)."""
    for B, next_n, lens_2d in ((1, 1, False), (5, 3, True), (1024, 1, False), (1500, 2, True), (3001, 4, False)):
        shape = (B, next_n) if lens_2d else (B,)
        ctx = torch.randint(-100, 300000, shape, dtype=torch.int32, device="cuda")
        buf = torch.full((B + 1,), -7, dtype=torch.int64, device="cuda")
        got = paged_mqa_logits_plan(ctx, next_n, out=buf)
        assert got.data_ptr() == buf.data_ptr()
        assert torch.equal(got.cpu(), plan_oracle(ctx.cpu(), next_n)), (B, next_n, lens_2d)


@gpu
@pytest.mark.parametrize("layout,kernel", [("bf16", "wgmma"), ("bf16", "mma"), ("fp8", "mma")])
@pytest.mark.parametrize("next_n", [1, 2, 3, 4])
@pytest.mark.parametrize("lens_2d", [False, True], ids=["lens1d", "lens2d"])
def test_gpu_paged_mixed(seed, force, layout, kernel, next_n, lens_2d):
    """Balanced schedule on mixed lengths: every column vs the fp64 oracle (clean on: exact -inf masks;
    off: visible columns), NaN-poisoned outputs, nothing written past the width, bitwise reruns, plan
    given or built inside."""
    cfg = configs(L.DECODE, (layout, next_n % 2, next_n), L.SM90_DECODE_KERNEL if kernel == "wgmma" else L.DECODE_KERNEL)
    if not cfg:
        pytest.skip(f"no {kernel} decode kernel for {layout} keys on {ARCH}")
    force(L.DECODE, cfg[0])
    B, max_pages, P = 23, 260, 300
    q, cache, deq, w, ctx, bt = mixed_case(B, next_n, max_pages, P, layout, FP8 if next_n % 2 else torch.bfloat16,
                                           lens_2d)
    width = max_pages * PS
    want = oracle_paged(q, deq, w, ctx, bt, width)
    plan = paged_mqa_logits_plan(ctx, next_n)
    for clean in (True, False):
        buf, out = poisoned(B * next_n, width, pad=4)
        got = paged_mqa_logits(q, cache, w, ctx, bt, width, clean_logits=clean, out=out, plan=plan)
        what = f"mixed {layout}/{kernel} next_n={next_n} 2d={lens_2d} clean={clean} seed={seed}"
        check_close(got, want, clean=clean, what=what)
        check_untouched(buf, width, what)
        for _ in range(3):
            again = paged_mqa_logits(q, cache, w, ctx, bt, width, clean_logits=clean, plan=None if _ else plan)
            vis = torch.isfinite(want) if not clean else torch.ones_like(want, dtype=torch.bool)
            assert torch.equal(again[vis], got[vis]), f"{what}: rerun differs"


def forced_product_of(family, problem, arch):
    """A context in which ``family`` launches ``arch``'s product config for ``problem`` (another arch's config
    instantiated for this GPU: every arch declares the emulated archs' product configs); a no-op for this GPU."""
    if arch == ARCH:
        return contextlib.nullcontext()
    return family.forced(family.select(problem, arch), ARCH)


@gpu
@pytest.mark.parametrize("layout", ["bf16", "fp8"])
@pytest.mark.parametrize("arch,next_n", [(ARCH, 2)] + [(a, n) for a in EMULATED_ARCHS for n in (2, 4)],
                         ids=lambda v: str(v))
def test_gpu_cuda_graph_mixed(seed, layout, arch, next_n):
    """One capture (plan + two layers reusing it), replayed with new mixed lengths: the longest request in
    another slot, then all lengths zero; every column checked (clean logits). Also with the product configs of
    the emulated archs forced (sm_120: next_n 4 on 8 warps sharing a request's q)."""
    with forced_product_of(L.DECODE, (layout, 1, next_n), arch):
        _graph_mixed(seed, layout, arch, next_n)


def _graph_mixed(seed, layout, arch, next_n):
    B, max_pages, P = 12, 200, 260
    q, cache, deq, w, ctx, bt = mixed_case(B, next_n, max_pages, P, layout, FP8, False)
    w2 = torch.randn_like(w)
    width = max_pages * PS
    plan = torch.empty(B + 1, dtype=torch.int64, device="cuda")

    def forward():
        paged_mqa_logits_plan(ctx, next_n, out=plan)
        return [paged_mqa_logits(q, cache, ww, ctx, bt, width, clean_logits=True, plan=plan) for ww in (w, w2)]

    g, outs = capture_graph(forward)
    for step in ("new lengths", "longest moves", "all zero"):
        new = mixed_lengths(B, next_n, max_pages * PS - 200, False)
        if step == "longest moves":
            new = torch.roll(ctx, 5)
        if step == "all zero":
            new.zero_()
        ctx.copy_(new)
        bt.copy_(mixed_table(B, max_pages, P, ctx))
        q.copy_(make_q(q.shape, FP8, "cuda"))
        for o in outs:
            o.fill_(NAN)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(plan.cpu(), plan_oracle(ctx.cpu(), next_n)), step
        for o, ww in zip(outs, (w, w2)):
            check_close(o, oracle_paged(q, deq, ww, ctx, bt, width), clean=True,
                        what=f"graph replay '{step}' {layout} {arch} next_n={next_n} seed={seed}")


@gpu
def test_gpu_bad_input():
    q, cache, _, w, ctx, bt = gpu_paged_case(0, B=2, next_n=1, max_pages=2, P=4, layout="bf16", q_dtype=FP8,
                                             lens_2d=False)
    with pytest.raises(ValueError, match="block_table"):
        paged_mqa_logits(q, cache, w, ctx, bt.cpu(), 128)
    with pytest.raises(ValueError, match="weights"):
        paged_mqa_logits(q, cache, w.cpu(), ctx, bt, 128)
    with pytest.raises(ValueError, match="out"):
        paged_mqa_logits(q, cache, w, ctx, bt, 128, out=torch.empty(2, 128))


# --------------------------------------------------------------------------------------------------
# Varlen prefill: several requests' rows in one launch (a multi-request extend)
# --------------------------------------------------------------------------------------------------

def varlen_case(layout, q_dtype, rows_per_request, prefix_pages, device="cpu", max_pages=None):
    """Requests with their own pages (invalid entries inside and past the visible range), causal rows:
    row j of request b sees [0, prefix_b + j + 1) of its keys (ks = 0). Returns the tensors and, per
    request, (first row, rows, fp64 keys [S, 128], key validity [S])."""
    B = len(rows_per_request)
    max_pages = max_pages or max(p + -(-r // PS) for p, r in zip(prefix_pages, rows_per_request)) + 2
    P = B * max_pages + 5
    cache, deq = make_cache(P, layout)
    perm = torch.randperm(P)
    bt = perm[:B * max_pages].view(B, max_pages).to(torch.int32).clone()
    bt[0, 1] = -1                                                    # inside request 0's visible range
    bt[B - 1, 0] = P + 9                                             # out of [0, P)
    bt[:, -1] = -2                                                   # past every visible range
    cu = [0]
    for r in rows_per_request:
        cu.append(cu[-1] + r)
    T = cu[-1] + 3                                                   # 3 trailing rows of no request
    ke = torch.zeros(T, dtype=torch.int32)
    for b, r in enumerate(rows_per_request):
        ke[cu[b]:cu[b + 1]] = prefix_pages[b] * PS + 1 + torch.arange(r, dtype=torch.int32)
    ks = torch.zeros(T, dtype=torch.int32)
    q = make_q((T, H, D), q_dtype)
    w = torch.randn(T, H)
    per_request = []
    for b in range(B):
        btl = bt[b].long()
        valid = ((btl >= 0) & (btl < P)).repeat_interleave(PS)
        keys = deq[btl.clamp(0, P - 1)].reshape(-1, D)
        per_request.append((cu[b], rows_per_request[b], keys, valid))
    tensors = dict(q=q, kv=cache, weights=w, ks=ks, ke=ke, block_table=bt,
                   cu_rows=torch.tensor(cu, dtype=torch.int32))
    if device != "cpu":
        tensors = {k: v.to(device) for k, v in tensors.items()}
    return tensors, per_request


def oracle_varlen(t, per_request, start, end, width):
    """fp64 [end - start, width]: each request's rows against its own keys; rows of no request -inf."""
    q, w, ks, ke = t["q"], t["weights"], t["ks"], t["ke"]
    out = torch.full((end - start, width), -math.inf, dtype=torch.float64, device=q.device)
    for first, n, keys, valid in per_request:
        lo, hi = max(first, start), min(first + n, end)
        if hi > lo:
            out[lo - start:hi - start] = oracle_prefill(q, keys, valid, w, ks, ke, lo, hi, 0)[:, :width]
    return out


VARLEN_REQUESTS = [((5, 0, 1, 9, 4), (2, 0, 3, 1, 0)),              # an empty request, one row, 9 rows
                   ((1,), (0,)), ((13, 2), (4, 1))]


@pytest.mark.parametrize("layout", ["bf16", "fp8"])
@pytest.mark.parametrize("q_dtype", [FP8, torch.bfloat16], ids=["qfp8", "qbf16"])
def test_varlen_reference(seed, layout, q_dtype):
    for rows_per_request, prefix in VARLEN_REQUESTS:
        t, per_request = varlen_case(layout, q_dtype, rows_per_request, prefix)
        T, width = t["q"].shape[0], t["block_table"].shape[1] * PS
        for rows in (None, (1, T - 2), (0, 1)):
            start, end = rows if rows else (0, T)
            got = mqa_logits(**t, rows=rows)
            want = oracle_varlen(t, per_request, start, end, width)
            check_close(got, want, clean=True, what=f"varlen ref {rows_per_request} rows={rows} seed={seed}")


def test_varlen_plan_reference():
    cu = torch.tensor([0, 5, 5, 6, 15, 19], dtype=torch.int32)
    assert mqa_logits_plan(cu).tolist() == [0, 2, 2, 3, 6, 7]
    assert mqa_logits_plan(cu, rows=(3, 16)).tolist() == [0, 1, 1, 2, 5, 6]   # rows 3..4, 5, 6..14, 15
    assert mqa_logits_plan_reference(torch.tensor([0], dtype=torch.int32)).tolist() == [0]
    assert mqa_logits_plan_reference(torch.tensor([4, 2, 9], dtype=torch.int32)).tolist() == [0, 0, 2]


def _varlen_args():
    t, _ = varlen_case("bf16", FP8, (3, 2), (1, 0))
    return t


@pytest.mark.parametrize("change,exc,name", [
    (dict(cu_rows=torch.tensor([0, 3, 2], dtype=torch.int32)), ValueError, "cu_rows.*non-decreasing"),
    (dict(cu_rows=torch.tensor([0, 3, 99], dtype=torch.int32)), ValueError, "cu_rows.*within"),
    (dict(cu_rows=torch.tensor([-1, 3, 5], dtype=torch.int32)), ValueError, "cu_rows.*within"),
    (dict(cu_rows=torch.tensor([0, 3, 5])), TypeError, "cu_rows"),
    (dict(cu_rows=torch.zeros(0, dtype=torch.int32)), ValueError, "cu_rows"),
    (dict(cu_rows=[0, 3, 5]), TypeError, "cu_rows"),
    (dict(block_table=torch.zeros(1, 4, dtype=torch.int32)), ValueError, "block_table.*one row per request"),
    (dict(block_table=torch.zeros(2, 8, dtype=torch.int32)[:, ::2]), ValueError, "block_table"),
    (dict(block_table=None), ValueError, "cu_rows"),
    (dict(plan=torch.zeros(2, dtype=torch.int64)), ValueError, "plan"),
    (dict(plan=torch.zeros(3, dtype=torch.int32)), ValueError, "plan"),
    (dict(rows=(0, 99)), ValueError, "rows"),
])
def test_varlen_bad_input(change, exc, name):
    args = _varlen_args()
    args.update(change)
    with pytest.raises(exc, match=name):
        mqa_logits(**args)


def test_varlen_plan_is_checked_against_its_rows():
    args = _varlen_args()
    cu = args["cu_rows"]
    n = args["q"].shape[0]
    with pytest.raises(ValueError, match=r"^plan: made by mqa_logits_plan\(cu_rows, rows=None\), this call has "
                                         r"rows=\(1, 3\)"):
        mqa_logits(**args, plan=mqa_logits_plan(cu), rows=(1, 3))
    with pytest.raises(ValueError, match=r"rows=\(0, 2\)\), this call has rows=None"):
        mqa_logits(**args, plan=mqa_logits_plan(cu, rows=(0, 2)))
    assert torch.equal(mqa_logits(**args, plan=mqa_logits_plan(cu, rows=(1, n)), rows=(1, n)),
                       mqa_logits(**args, rows=(1, n)))


def test_varlen_plan_bad_input():
    with pytest.raises(TypeError, match="cu_rows"):
        mqa_logits_plan(torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="cu_rows"):
        mqa_logits_plan(torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="rows"):
        mqa_logits_plan(torch.zeros(3, dtype=torch.int32), rows=(4, 2))
    with pytest.raises(ValueError, match="plan"):
        mqa_logits_plan(torch.zeros(3, dtype=torch.int32), out=torch.zeros(5, dtype=torch.int64))


@gpu
@pytest.mark.parametrize("cfg,problem", _prefill_cases(varlen=1), ids=lambda v: _config_id(v)
                         if isinstance(v, launch.Config) else "-".join(map(str, v)))
def test_gpu_varlen(seed, cfg, problem):
    """Every varlen prefill config of this GPU vs the fp64 oracle: empty requests, one-row requests, rows not
    a multiple of the 4-row tile, zero prefixes, invalid page ids inside and past the visible range, row
    chunks; NaN-poisoned outputs (rows of no request and columns past the width must stay NaN)."""
    layout, q_fp8, _ = problem
    q_dtype = FP8 if q_fp8 else torch.bfloat16
    native_fp8 = cfg.values.get("Mma8") == 1 and ARCH not in ("sm_90", "sm_100")
    if "keys_per_cta" in cfg.values:
        cfg = cfg.replace(keys_per_cta=1024)
    torch.manual_seed(seed)
    cases = VARLEN_REQUESTS + [((37, 1, 0, 70, 6, 3), (0, 30, 9, 2, 0, 1))]
    for rows_per_request, prefix in cases:
        t, per_request = varlen_case(layout, q_dtype, rows_per_request, prefix, device="cuda")
        T, width = t["q"].shape[0], t["block_table"].shape[1] * PS
        for rows, clean in ((None, True), (None, False), ((2, T - 1), True), ((T // 2, T), False)):
            start, end = rows if rows else (0, T)
            want = oracle_varlen(t, per_request, start, end, width)
            buf, out = poisoned(end - start, width, pad=4)
            with L.PREFILL.forced(cfg, ARCH):
                got = mqa_logits(**t, clean_logits=clean, rows=rows, out=out)
            what = f"varlen {cfg} {problem} {rows_per_request} rows={rows} clean={clean} seed={seed}"
            covered = torch.zeros(end - start, dtype=torch.bool)
            for first, n, _, _ in per_request:
                covered[max(first, start) - start:max(min(first + n, end) - start, 0)] = True
            check_close(got[covered.cuda()], want[covered.cuda()], clean=clean, what=what,
                        tol=2e-3 if native_fp8 else 1e-5)
            assert torch.isnan(got[~covered.cuda()]).all(), f"{what}: a row of no request was written"
            check_untouched(buf, width, what)


@gpu
def test_gpu_varlen_plan(seed):
    torch.manual_seed(seed)
    for B in (1, 7, 1024, 2500):
        cu = torch.cat([torch.zeros(1, dtype=torch.int32),
                        torch.randint(0, 40, (B,), dtype=torch.int32).cumsum(0).to(torch.int32)])
        for rows in (None, (3, int(cu[-1]) // 2 + 1)):
            got = mqa_logits_plan(cu.cuda(), rows=rows)
            assert torch.equal(got.cpu(), mqa_logits_plan_reference(cu, rows=rows)), (B, rows)


@gpu
@pytest.mark.parametrize("layout", ["bf16", "fp8"])
@pytest.mark.parametrize("arch", (ARCH,) + EMULATED_ARCHS)
def test_gpu_varlen_deterministic_and_graph(seed, layout, arch):
    """Bitwise reruns; one CUDA-graph capture (plan + logits) replayed with new lengths and a new number of
    requests (trailing requests emptied by repeating the last offset), each replay against the oracle; with
    this GPU's product config and with each emulated arch's (forced)."""
    with forced_product_of(L.PREFILL, (layout, 1, 1), arch):
        _varlen_deterministic_and_graph(seed, layout)


def _varlen_deterministic_and_graph(seed, layout):
    torch.manual_seed(seed)
    t, per_request = varlen_case(layout, FP8, (9, 4, 17, 2), (3, 0, 5, 1), device="cuda", max_pages=12)
    T, width = t["q"].shape[0], t["block_table"].shape[1] * PS
    covered = sum((9, 4, 17, 2))                                    # the rows after them belong to no request
    first = mqa_logits(**t, clean_logits=True)[:covered]
    for _ in range(5):
        assert torch.equal(mqa_logits(**t, clean_logits=True)[:covered], first)
    out = torch.empty(T, width, device="cuda")
    plan = torch.empty(t["cu_rows"].shape[0], dtype=torch.int64, device="cuda")
    def forward():
        mqa_logits_plan(t["cu_rows"], out=plan)
        mqa_logits(**t, plan=plan, clean_logits=True, out=out)

    g, _ = capture_graph(forward, warmups=1)
    for step, (rows_per_request, prefix) in enumerate((((5, 11, 2, 14), (2, 2, 9, 0)), ((20, 12, 0, 0), (0, 7, 0, 0)),
                                                      ((32, 0, 0, 0), (10, 0, 0, 0)))):
        t2, per2 = varlen_case(layout, FP8, rows_per_request, prefix, max_pages=12)
        for k in ("ks", "ke", "cu_rows", "block_table"):
            t[k].copy_(t2[k])
        t["kv"].copy_(t2["kv"])
        out.fill_(NAN)
        g.replay()
        torch.cuda.synchronize()
        want = oracle_varlen(t, per2, 0, T, width)
        rows = sum(rows_per_request)
        check_close(out[:rows], want[:rows], clean=True, what=f"varlen graph replay {step} {layout} seed={seed}")
