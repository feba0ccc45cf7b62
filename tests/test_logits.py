"""Indexer logits (paged decode and prefill): references and kernel vs an independent float64 formulation.

The fp64 oracle dequantizes every input (fp8 values times their scale) and does one einsum per request;
it shares no code with cupy_dsa.logits beyond the cache byte layout written here with plain torch.
"""
import math

import pytest
import torch

from cupy_dsa import layouts
from cupy_dsa.logits import (mqa_logits, mqa_logits_reference, paged_mqa_logits, paged_mqa_logits_plan,
                             paged_mqa_logits_plan_reference, paged_mqa_logits_reference)

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
    from cupy_dsa import logits as L
    for next_n, (stages, ctas, split) in L._SM90_CONFIG.items():
        per_cta = L._sm90_smem_bytes(next_n)
        assert per_cta <= 227 * 1024, (next_n, per_cta)
        assert ctas * (per_cta + 1024) <= 228 * 1024, (next_n, per_cta, ctas)   # 1 KiB reserved per CTA
        assert stages >= 2 and next_n % split == 0


def test_product_instantiations_are_declared():
    """What a server warms up is declared (compiled by the CI matrix) and is what the dispatch launches."""
    from cupy_dsa import logits as L
    from cupy_dsa import runtime
    declared = set(runtime.instantiations()["mqa_logits.cu"])
    for arch in ("sm_80", "sm_89", "sm_90", "sm_100", "sm_120"):
        ex = L.product_instantiations(arch, q_fp8=(1, 0), next_ns=(1, 2, 3, 4), layouts=("bf16", "fp8"))
        assert set(ex) <= declared, set(ex) - declared
        assert L._PLAN_EXPR in ex
        assert any("sm90" in e for e in ex) == (arch == "sm_90")
    one = L.product_instantiations("sm_90", q_fp8=(1,), next_ns=(1,), layouts=("bf16",))
    assert one == [L._PLAN_EXPR, L._sm90_expr(1, 1), L._expr(0, 1, 4, 1, 4, 0, 2, 0), L._expr(0, 1, 8, 1, 8, 0, 2, 0)]


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


@pytest.fixture
def tuning(monkeypatch):
    """Set cupy_dsa.logits.TUNING entries for one test (restored afterwards)."""
    from cupy_dsa import logits as L

    def set_(**kw):
        for k, v in kw.items():
            assert k in L.TUNING, k
            monkeypatch.setitem(L.TUNING, k, v)
    return set_


def gpu_paged_case(seed, *, B, next_n, max_pages, P, layout, q_dtype, lens_2d, shape="rows"):
    torch.manual_seed(seed)
    q, cache, deq, w, ctx, bt = random_paged_case(B=B, next_n=next_n, max_pages=max_pages, P=P, layout=layout,
                                                  q_dtype=q_dtype, lens_2d=lens_2d, shape=shape)
    return [t.cuda() for t in (q, cache, deq, w, ctx, bt)]


@gpu
@pytest.mark.parametrize("layout", ["bf16", "fp8"])
@pytest.mark.parametrize("q_dtype", [FP8, torch.bfloat16], ids=["qfp8", "qbf16"])
@pytest.mark.parametrize("next_n", [1, 2, 3, 4])
@pytest.mark.parametrize("lens_2d", [False, True], ids=["lens1d", "lens2d"])
@pytest.mark.parametrize("prefetch", [0, 1], ids=["occ", "prefetch"])
@pytest.mark.parametrize("mma8", [0, 2], ids=["f16mma", "e4m3mma"])
def test_gpu_paged(seed, tuning, layout, q_dtype, next_n, lens_2d, prefetch, mma8):
    if prefetch and layout == "fp8":
        pytest.skip("register double-buffering is a bf16-key variant")
    if mma8 and (layout != "fp8" or q_dtype != FP8 or prefetch):
        pytest.skip("the e4m3 mma is an fp8-key x fp8-q variant")
    # fp8_mma=2: the m16n8k32 e4m3 fragment layout on every sm_89+ GPU (emulated by ptxas on sm_90 / sm_100,
    # which accumulates in fp32: the 1e-5 tolerance applies)
    tuning(decode_prefetch=prefetch, fp8_mma=mma8)
    q, cache, deq, w, ctx, bt = gpu_paged_case(seed, B=5, next_n=next_n, max_pages=37, P=200, layout=layout,
                                               q_dtype=q_dtype, lens_2d=lens_2d,
                                               shape="rows" if next_n % 2 else "typed")
    for width in (37 * PS, 37 * PS - 45, 10 * PS + 3):
        want = oracle_paged(q, deq, w, ctx, bt, width)
        for clean in (True, False):
            buf, out = poisoned(5 * next_n, width, pad=8)
            got = paged_mqa_logits(q, cache, w, ctx, bt, width, clean_logits=clean, out=out)
            assert got.data_ptr() == out.data_ptr()
            what = f"paged {layout} q={q_dtype} next_n={next_n} mma8={mma8} width={width} clean={clean} seed={seed}"
            check_close(got, want, clean=clean, what=what)
            check_untouched(buf, width, what)


@gpu
@pytest.mark.parametrize("layout", ["bf16", "fp8"])
@pytest.mark.parametrize("kernel", ["wgmma", "mma"])
def test_gpu_paged_long(seed, tuning, layout, kernel):
    """Many pages per request, short and full lengths (sm_90: the wgmma and the mma.sync kernel)."""
    tuning(sm90_wgmma=int(kernel == "wgmma"))
    q, cache, deq, w, ctx, bt = gpu_paged_case(seed, B=16, next_n=2, max_pages=211, P=3500, layout=layout,
                                               q_dtype=FP8, lens_2d=False)
    ctx[2] = 211 * PS                                               # a full-length row
    width = 211 * PS
    want = oracle_paged(q, deq, w, ctx, bt, width)
    got = paged_mqa_logits(q, cache, w, ctx, bt, width, clean_logits=True)
    check_close(got, want, clean=True, what=f"paged long {layout} {kernel} seed={seed}")
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
@pytest.mark.parametrize("kind", ["contiguous", "bf16", "fp8"])
@pytest.mark.parametrize("q_dtype", [FP8, torch.bfloat16], ids=["qfp8", "qbf16"])
@pytest.mark.parametrize("variant", ["wgmma", "wgmma-1part", "rows8", "rows8-prefetch", "rows4", "rows8-e4m3mma",
                                     "rows4-e4m3mma"])
def test_gpu_prefill(seed, tuning, kind, q_dtype, variant):
    """Both prefill kernels (on sm_90 the wgmma kernel serves bf16 keys from 8 rows on; the rows* variants are
    the mma.sync kernel everywhere) against the fp64 oracle, on NaN-poisoned outputs."""
    mma8 = 2 if variant.endswith("e4m3mma") else 0
    if mma8 and (kind != "fp8" or q_dtype != FP8):
        pytest.skip("the e4m3 mma is an fp8-key x fp8-q variant")
    if variant.startswith("wgmma"):
        tuning(sm90_wgmma=1, sm90_prefill_parts=1 if variant == "wgmma-1part" else 0)
    else:
        tuning(sm90_wgmma=0, prefill_rows=4 if variant.startswith("rows4") else 8,
               prefill_prefetch=int(variant == "rows8-prefetch"), prefill_keys_per_cta=1024, fp8_mma=mma8)
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
        got = mqa_logits(q, kv, w, ks, ke, block_table=bt, max_seqlen_k=msk, clean_logits=clean, rows=rows,
                         out=out)
        what = f"prefill {kind} q={q_dtype} {variant} rows={rows} max_seqlen_k={msk} clean={clean} seed={seed}"
        check_close(got, want, clean=clean, what=what)
        check_untouched(buf, width, what)


@gpu
def test_gpu_prefill_causal_large(seed, tuning):
    """Causal prefill with the shipped tuning: T=1024 rows, S=8192 contiguous keys."""
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
def test_gpu_variants_bitwise_equal(seed, tuning):
    """Tuning variants change scheduling, never the arithmetic order: results must be bitwise equal."""
    q, cache, _, w, ctx, bt = gpu_paged_case(seed, B=7, next_n=2, max_pages=50, P=400, layout="bf16",
                                             q_dtype=torch.bfloat16, lens_2d=False)
    for wgmma in (1, 0):        # sm_90: the wgmma kernel, then the mma.sync kernel (elsewhere: mma.sync twice)
        outs = []
        for pf, cps in [(0, 0), (1, 0), (0, 1)]:   # sm90_ctas_per_sm=1: a smaller grid, other segment cuts
            tuning(sm90_wgmma=wgmma, decode_prefetch=pf, sm90_ctas_per_sm=cps)
            outs.append(paged_mqa_logits(q, cache, w, ctx, bt, 50 * PS, clean_logits=True))
        for i, o in enumerate(outs[1:], 1):
            assert torch.equal(o, outs[0]), \
                f"paged variant {i} (wgmma={wgmma}) differs: {int((o != outs[0]).sum())} entries"
    tuning(sm90_wgmma=1, sm90_ctas_per_sm=0)
    T = 77
    q2 = make_q((T, H, D), FP8, "cuda")
    w2 = torch.randn(T, H, device="cuda")
    kv = torch.randn(3000, D, device="cuda").to(torch.bfloat16)
    ke = torch.randint(0, 3000, (T,), dtype=torch.int32, device="cuda")
    ks = (ke - 900).clamp_min(0)
    outs = []
    tuning(sm90_wgmma=0)
    for rows, pf, chunk in [(8, 0, 4096), (8, 1, 1024), (4, 0, 64), (4, 0, 2048)]:
        tuning(prefill_rows=rows, prefill_prefetch=pf, prefill_keys_per_cta=chunk)
        outs.append(mqa_logits(q2, kv, w2, ks, ke))
    for i, o in enumerate(outs[1:], 1):
        assert torch.equal(o, outs[0]), f"prefill variant {i} differs: {int((o != outs[0]).sum())} entries"
    outs = []
    tuning(sm90_wgmma=1)
    for parts in (0, 1, 3, 40):  # sm_90 wgmma kernel: other cuts of a tile's key blocks over CTAs
        tuning(sm90_prefill_parts=parts)
        outs.append(mqa_logits(q2, kv, w2, ks, ke))
    for i, o in enumerate(outs[1:], 1):
        assert torch.equal(o, outs[0]), f"wgmma prefill parts variant {i} differs: {int((o != outs[0]).sum())}"


@gpu
@pytest.mark.parametrize("layout", ["bf16", "fp8"])
def test_gpu_l2_hint_variants_bitwise_equal(seed, tuning, layout):
    """The L2 prefetch-size hint of the key loads (declared for decode next_n=1, fp8 q) changes no result;
    a hint asked where no such variant exists falls back to the default loads."""
    q, cache, deq, w, ctx, bt = gpu_paged_case(seed, B=6, next_n=1, max_pages=40, P=300, layout=layout,
                                               q_dtype=FP8, lens_2d=False)
    outs = []
    for hint in (2, 1, 0):
        tuning(decode_l2_hint=hint)
        outs.append(paged_mqa_logits(q, cache, w, ctx, bt, 40 * PS, clean_logits=True))
    check_close(outs[0], oracle_paged(q, deq, w, ctx, bt, 40 * PS), clean=True, what=f"l2 hint {layout}")
    for hint, o in zip((1, 0), outs[1:]):
        assert torch.equal(o, outs[0]), f"{layout} L2 hint {hint} differs: {int((o != outs[0]).sum())} entries"
    q2, cache2, deq2, w2, ctx2, bt2 = gpu_paged_case(seed, B=3, next_n=2, max_pages=10, P=40, layout=layout,
                                                     q_dtype=FP8, lens_2d=False)
    got = paged_mqa_logits(q2, cache2, w2, ctx2, bt2, 10 * PS, clean_logits=True)   # hint 0 undeclared here
    check_close(got, oracle_paged(q2, deq2, w2, ctx2, bt2, 10 * PS), clean=True, what=f"l2 fallback {layout}")


@gpu
def test_gpu_fp8_mma_native(seed, tuning):
    """fp8_mma=1: e4m3 tensor cores where native (sm_89, sm_120+), else exactly the f16-mma path.
    Native Ada-class fp8 mma adds products with ~13-bit precision: checked at rel L2 2e-3 there and the
    measured error is in the message."""
    q, cache, deq, w, ctx, bt = gpu_paged_case(seed, B=5, next_n=2, max_pages=37, P=200, layout="fp8",
                                               q_dtype=FP8, lens_2d=False)
    want = oracle_paged(q, deq, w, ctx, bt, 37 * PS)
    tuning(fp8_mma=0)
    ref = paged_mqa_logits(q, cache, w, ctx, bt, 37 * PS, clean_logits=True)
    tuning(fp8_mma=1)
    got = paged_mqa_logits(q, cache, w, ctx, bt, 37 * PS, clean_logits=True)
    cc = torch.cuda.get_device_capability()
    if cc == (8, 9) or cc[0] >= 12:
        vis = torch.isfinite(want)
        err = float((got.double()[vis] - want[vis]).norm() / want[vis].norm())
        check_close(got, want, clean=True, what=f"native e4m3 mma (rel L2 {err:.3g}) seed={seed}", tol=2e-3)
    else:
        assert torch.equal(got, ref), f"fp8_mma=1 on sm_{cc[0]}{cc[1]} must be the f16 path: " \
                                      f"{int((got != ref).sum())} entries differ"


@gpu
def test_gpu_deterministic(seed, tuning):
    for layout, mma8 in (("bf16", 0), ("fp8", 0), ("fp8", 1), ("fp8", 2)):
        tuning(fp8_mma=mma8)
        q, cache, _, w, ctx, bt = gpu_paged_case(seed, B=9, next_n=3, max_pages=40, P=300, layout=layout,
                                                 q_dtype=FP8, lens_2d=True)
        first = paged_mqa_logits(q, cache, w, ctx, bt, 40 * PS, clean_logits=True)
        for i in range(10):
            again = paged_mqa_logits(q, cache, w, ctx, bt, 40 * PS, clean_logits=True)
            assert torch.equal(again, first), \
                f"{layout} fp8_mma={mma8} rerun {i}: {int((again != first).sum())} entries differ"
    tuning(fp8_mma=0)
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
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            paged_mqa_logits(q, cache, w, ctx, bt, width, clean_logits=True)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = paged_mqa_logits(q, cache, w, ctx, bt, width, clean_logits=True)
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
def test_gpu_paged_mixed(seed, tuning, layout, kernel, next_n, lens_2d):
    """Balanced schedule on mixed lengths: every column vs the fp64 oracle (clean on: exact -inf masks;
    off: visible columns), NaN-poisoned outputs, nothing written past the width, bitwise reruns, plan
    given or built inside."""
    tuning(sm90_wgmma=int(kernel == "wgmma"))
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


@gpu
@pytest.mark.parametrize("layout", ["bf16", "fp8"])
def test_gpu_cuda_graph_mixed(seed, layout):
    """One capture (plan + two layers reusing it), replayed with new mixed lengths: the longest request in
    another slot, then all lengths zero; every column checked (clean logits)."""
    B, next_n, max_pages, P = 12, 2, 200, 260
    q, cache, deq, w, ctx, bt = mixed_case(B, next_n, max_pages, P, layout, FP8, False)
    w2 = torch.randn_like(w)
    width = max_pages * PS
    plan = torch.empty(B + 1, dtype=torch.int64, device="cuda")

    def forward():
        paged_mqa_logits_plan(ctx, next_n, out=plan)
        return [paged_mqa_logits(q, cache, ww, ctx, bt, width, clean_logits=True, plan=plan) for ww in (w, w2)]

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            forward()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = forward()
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
                        what=f"graph replay '{step}' {layout} seed={seed}")


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
# Variant benchmark (not a test): python tests/test_logits.py [--quick]
# Times every tuning variant of cupy_dsa.logits.TUNING on the current GPU and prints one line per run.
# --------------------------------------------------------------------------------------------------

def _bench_variants(quick=False):
    import itertools

    from cupy_dsa import logits as L
    from cupy_dsa.bench.timing import time_calls

    dev = "cuda"
    reps = 10 if quick else 30

    def timed(fn):
        # device time of one call in us: the bench's CUDA-graph timer over a graph of 5 calls
        return time_calls([fn] * 5, torch.device(dev), reps=reps).seconds * 1e6

    base = dict(L.TUNING)
    print("device:", torch.cuda.get_device_name(), "| defaults:", base)
    decode_cases = [(1, 8192, 1), (64, 32768, 1), (128, 16384, 1), (4, 262144, 1), (64, 32768, 2), (64, 32768, 4)]
    if quick:
        decode_cases = decode_cases[:2]
    for layout, (B, ctx_len, next_n) in itertools.product(("bf16", "fp8"), decode_cases):
        pages = ctx_len // PS
        P = B * pages
        cache = layouts.empty_cache(P, layout, device=dev)
        cache.random_(0, 120)
        q = make_q((B, next_n, H, D), FP8, dev)
        w = torch.randn(B * next_n, H, device=dev)
        ctx = torch.full((B,), ctx_len, dtype=torch.int32, device=dev)
        bt = torch.randperm(P, device=dev).to(torch.int32).view(B, pages)
        key_bytes = B * ctx_len * (256 if layout == "bf16" else 132)
        nbytes = key_bytes + q.numel() * q.element_size() + w.numel() * 4 + B * next_n * ctx_len * 4
        variants = [dict(decode_prefetch=pf, sm90_wgmma=wg)
                    for pf, wg in itertools.product((0, 1) if layout == "bf16" else (0,), (1, 0))]
        if layout == "fp8":      # e4m3 mma.sync: 1 = where native (sm_89/sm_120+), 2 = forced (sm_90: emulated)
            variants += [dict(fp8_mma=m) for m in (1, 2)]
        if (B, ctx_len, next_n) == (64, 32768, 1):   # L2 prefetch-size hint of the key loads (default 256 B)
            # (declared for prefetch 0, fp8_mma 0 only; anything else falls back to 256 B)
            variants += [dict(decode_l2_hint=h, sm90_wgmma=0) for h in (1, 0)]
        for var in variants:
            L.TUNING.update(base, **var)
            us = timed(lambda: paged_mqa_logits(q, cache, w, ctx, bt, ctx_len))
            t = L.TUNING
            print(f"decode {layout:4s} B={B:3d} ctx={ctx_len:6d} next_n={next_n} prefetch={t['decode_prefetch']} "
                  f"wgmma={t['sm90_wgmma']} l2hint={t['decode_l2_hint']} fp8_mma={t['fp8_mma']}: "
                  f"{us:8.1f} us {nbytes / us / 1e3:7.0f} GB/s {B * ctx_len * next_n / us / 1e3:6.1f} G pairs/s")
        del cache
    T, S = (2048, 16384) if quick else (4096, 65536)
    kv = torch.randn(S, D, device=dev).to(torch.bfloat16)
    for q_dtype in (FP8, torch.bfloat16):
        q = make_q((T, H, D), q_dtype, dev)
        w = torch.randn(T, H, device=dev)
        ke = (torch.arange(T, device=dev) + S - T + 1).to(torch.int32)   # causal, query i at key S-T+i
        ks = torch.zeros(T, dtype=torch.int32, device=dev)
        pairs = float(ke.double().sum())
        out = torch.empty(T, S, device=dev)
        for rows, pf, kpc in itertools.product((8, 4), (0, 1), (2048, 4096, 8192)):
            if pf and rows == 4:
                continue
            L.TUNING.update(base, prefill_rows=rows, prefill_prefetch=pf, prefill_keys_per_cta=kpc)
            us = timed(lambda: mqa_logits(q, kv, w, ks, ke, clean_logits=False, out=out))
            print(f"prefill q={str(q_dtype)[6:]:13s} T={T} S={S} rows={rows} prefetch={pf} keys/CTA={kpc}: "
                  f"{us:9.1f} us {2 * H * D * pairs / us / 1e6:6.1f} TFLOP/s")
    L.TUNING.update(base)


if __name__ == "__main__":
    import sys

    _bench_variants(quick="--quick" in sys.argv)
