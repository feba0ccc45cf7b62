"""Shared inputs and the float64 oracle of the indexer-logits tests (test_logits_*.py, test_fuzz.py).

The fp64 oracle dequantizes every input (fp8 values times their scale) and does one einsum per request;
it shares no code with cupy_dsa.logits beyond the cache byte layout written here with plain torch.
GPU helpers: outputs poisoned with NaN first (every visible entry must be written), the declared configs
of this GPU.
"""

import contextlib
import math

import pytest
import torch

from cupy_dsa import layouts, runtime
from cupy_dsa import logits as L

FP8 = torch.float8_e4m3fn
H, D, PS = 64, 128, 64


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


def check_rows_close(got, want, *, clean, what, tol=1e-5):
    """check_close, and its relative L2 error row by row (a small row's error vanishes in the whole output's)."""
    check_close(got, want, clean=clean, what=what, tol=tol)
    g = got.detach().double().to(want.device)
    vis = torch.isfinite(want)
    err = torch.where(vis, g - want, 0).norm(dim=1) / torch.where(vis, want, 0).norm(dim=1).clamp_min(1e-30)
    bad = (err > tol).nonzero()[:, 0].tolist()
    assert not bad, f"{what}: rows {bad[:8]} off, relative L2 error up to {float(err.max()):.3g} > {tol}"


def spread_rows(q):
    """bf16 q [..., 64, 128] whose rows (leading dims flattened) differ in magnitude, in turn: x1e-3, x1e3, every
    third head zero, heads x1e-4 / x1e4 / unchanged in turn; the last row all zero (a per-head power-of-two
    scale must fit each head)."""
    x = q.float().reshape(-1, H, D).clone()
    x[0::4] *= 1e-3
    x[1::4] *= 1e3
    x[2::4, ::3] = 0
    x[3::4, 0::3] *= 1e-4
    x[3::4, 1::3] *= 1e4
    x[-1] = 0
    return x.to(torch.bfloat16).reshape(q.shape)


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


def plan_oracle(ctx, next_n):
    """Pages each request computes (ceil(longest row / 64)), as an exclusive prefix over requests."""
    out = [0]
    for row in ctx.long().reshape(ctx.shape[0], -1 if ctx.numel() else 1).tolist():
        m = max(row) if len(row) else 0
        out.append(out[-1] + (max(m, 0) + PS - 1) // PS)
    return torch.tensor(out, dtype=torch.int64)


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


def varlen_args():
    t, _ = varlen_case("bf16", FP8, (3, 2), (1, 0))
    return t


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


def forced_product_of(family, problem, arch):
    """A context in which ``family`` launches ``arch``'s product config for ``problem`` (another arch's config
    instantiated for this GPU: every arch declares the emulated archs' product configs); a no-op for this GPU."""
    if arch == ARCH:
        return contextlib.nullcontext()
    return family.forced(family.select(problem, arch), ARCH)


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


def config_id(cfg):
    return str(cfg).replace(" ", "")


def decode_cases():
    return [(cfg, p) for p in L.DECODE.problems for cfg in L.DECODE.candidates(p, ARCH)]


def prefill_cases(varlen=0):
    """Every declared prefill instantiation once per problem (keys_per_cta is a host parameter: the bitwise test
    covers its other values; the tests launch 1024 keys per CTA)."""
    out = {}
    for p in L.PREFILL.problems:
        if p[2] == varlen:
            for cfg in L.PREFILL.candidates(p, ARCH):
                out.setdefault((cfg.kernel, cfg.template, p), (cfg, p))
    return list(out.values())


def gpu_paged_case(seed, *, B, next_n, max_pages, P, layout, q_dtype, lens_2d, shape="rows"):
    torch.manual_seed(seed)
    q, cache, deq, w, ctx, bt = random_paged_case(B=B, next_n=next_n, max_pages=max_pages, P=P, layout=layout,
                                                  q_dtype=q_dtype, lens_2d=lens_2d, shape=shape)
    return [t.cuda() for t in (q, cache, deq, w, ctx, bt)]


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
