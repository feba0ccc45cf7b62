"""store_index_k with ``lo_cache`` (fp8-rescore's two-level keys): one launch writes the fp8 page (the plain fp8
store's bytes) and its int8 residual page (the residual reference's), on CPU against the references and on a GPU
bit for bit (device rsqrtf swapped into the reference), skips, plans, non-finite keys and bad input."""

import pytest
import torch

from cupy_dsa import layouts, store
from store_cases import (PLAN_MAX_POS, PLAN_N, PLAN_PAGES, STYLES, _count, _decode_plan, _good,  # noqa: F401
                         _prefill_plan, device_rsqrt, gpu_case, make_inputs, poisoned, slot_bytes, target_bytes,
                         unique_locs)

# --------------------------------------------------------------------------------------------------
# Two-level keys (lo_cache): one launch writes the fp8 page and its int8 residual page
# --------------------------------------------------------------------------------------------------

def _two_level_expected(hi0, lo0, kv, pos, loc, inp, key_style, valid):
    """The poisoned hi / lo caches with the valid rows written, addressed from the layout spec: hi bytes = the
    fp8 store's, lo bytes = residual_encode_reference's int8 codes and fp32 scale, at the same slot."""
    from cupy_dsa import rescore

    hi, lo = hi0.clone().reshape(-1), lo0.clone().reshape(-1)
    idx = valid.nonzero().flatten()
    if idx.numel():
        k = store.rotate_index_k_reference(kv[idx], pos[idx], inp["norm_weight"], inp["freqs_cis"],
                                           inp["norm_bias"], key_style=key_style)
        codes, sc, lo_codes, lo_sc = rescore.residual_encode_reference(k)
        at = slot_bytes(hi0, loc[idx], "fp8")
        hi[at] = torch.cat((codes, sc.view(torch.uint8).view(-1, 4)), 1).reshape(-1)
        lo[at] = torch.cat((lo_codes.view(torch.uint8), lo_sc.view(torch.uint8).view(-1, 4)), 1).reshape(-1)
    return hi.view(hi0.shape), lo.view(lo0.shape)


def _with_skips(n, num_pages, max_pos, inp, device="cpu"):
    """Unique slots with skips (negative / out-of-range out_loc, out-of-range positions) in the first 6 rows."""
    loc = unique_locs(n, num_pages, device)
    pos = inp["positions"].clone()
    loc[0], loc[1], loc[2] = -1, num_pages * 64, 1 << 40
    pos[3], pos[4], pos[5] = -1, max_pos, max_pos + 7
    valid = torch.ones(n, dtype=torch.bool, device=device)
    valid[:6] = False
    return pos, loc, valid


@pytest.mark.parametrize("key_style", STYLES)
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
def test_two_level_store_hi_is_the_fp8_store_lo_the_residual(seed, key_style, in_dtype):
    n, num_pages, max_pos = 200, 5, 300
    inp = make_inputs(n, style=key_style, max_pos=max_pos, in_dtype=in_dtype)
    pos, loc, valid = _with_skips(n, num_pages, max_pos, inp)
    kw = dict(positions=pos, out_loc=loc, norm_weight=inp["norm_weight"], freqs_cis=inp["freqs_cis"],
              norm_bias=inp["norm_bias"], key_style=key_style)
    hi, lo = poisoned(num_pages, "fp8"), poisoned(num_pages, "fp8")
    hi0, lo0 = hi.clone(), lo.clone()
    plain = hi0.clone()
    store.store_index_k(inp["kv"], plain, **kw)
    store.store_index_k(inp["kv"], hi, lo_cache=lo, **kw)
    assert torch.equal(hi, plain), f"seed {seed}: the hi page differs from the plain fp8 store"
    exp_hi, exp_lo = _two_level_expected(hi0, lo0, inp["kv"], pos, loc, inp, key_style, valid)
    assert torch.equal(hi, exp_hi)
    assert int((lo != exp_lo).sum()) == 0, f"seed {seed}: lo bytes differ from the residual reference"
    # the typed view [P, 64, 1, 132] of both caches is accepted and written in place
    hv, lv = poisoned(num_pages, "fp8"), poisoned(num_pages, "fp8")
    hv.copy_(hi0), lv.copy_(lo0)
    store.store_index_k(inp["kv"], hv.view(num_pages, 64, 1, 132), lo_cache=lv.view(num_pages, 64, 1, 132), **kw)
    assert torch.equal(hv, hi) and torch.equal(lv, lo)


@pytest.mark.parametrize("is_decode", [True, False])
def test_two_level_store_from_plan(seed, is_decode):
    n, num_pages, max_pos = PLAN_N, PLAN_PAGES, PLAN_MAX_POS
    inp = make_inputs(n, max_pos=max_pos)
    seq = [int(v) for v in torch.randint(4, max_pos, (n,))]
    loc = unique_locs(n + 10, num_pages)
    if is_decode:
        seq[0], seq[1] = 5, 0
        plan, row_locs = _decode_plan(seq), loc[:n]
        valid = torch.tensor([s % 4 == 0 and s >= 4 for s in seq])
    else:
        seq[0] = 0xFFFFFFFF
        ragged = [int(v) for v in torch.randperm(n + 10)[:n]]
        plan, row_locs = _prefill_plan(seq, ragged), torch.tensor([int(loc[r]) for r in ragged])
        valid = torch.tensor([s != 0xFFFFFFFF for s in seq])
    pos = torch.tensor([s - 4 if s != 0xFFFFFFFF else -1 for s in seq])
    hi, lo = poisoned(num_pages, "fp8"), poisoned(num_pages, "fp8")
    hi0, lo0 = hi.clone(), lo.clone()
    store.store_index_k_from_plan(inp["kv"], plan, cache=hi, lo_cache=lo, out_loc=loc, is_decode=is_decode,
                                  norm_weight=inp["norm_weight"], freqs_cis=inp["freqs_cis"])
    exp_hi, exp_lo = _two_level_expected(hi0, lo0, inp["kv"], pos, row_locs, inp, "v4", valid)
    assert torch.equal(hi, exp_hi) and torch.equal(lo, exp_lo), f"seed {seed}: {int((lo != exp_lo).sum())} lo bytes"


def test_two_level_store_of_non_finite_keys():
    """A key holding a NaN or an infinity: hi as the fp8 store writes it (NaN), lo codes zero and a NaN lo scale;
    clean keys next to it are stored as usual."""
    from cupy_dsa import rescore

    inp = make_inputs(4)
    kv = inp["kv"].clone()
    kv[1, 3], kv[2, 100] = float("nan"), float("inf")
    kw = dict(positions=inp["positions"], out_loc=torch.arange(4), norm_weight=inp["norm_weight"],
              freqs_cis=inp["freqs_cis"])
    hi, lo, plain = (layouts.empty_cache(1, "fp8") for _ in range(3))
    store.store_index_k(kv, plain, **kw)
    store.store_index_k(kv, hi, lo_cache=lo, **kw)
    assert torch.equal(hi, plain)
    codes, scales = rescore.lo_views(lo)
    assert bool((codes[0, 1:3] == 0).all()) and bool(torch.isnan(scales[0, 1:3]).all())
    assert bool(torch.isfinite(scales[0, [0, 3]]).all()) and bool((codes[0, [0, 3]] != 0).any())


def test_two_level_store_bad_input():
    g = _good()
    kv, bf16_cache = g.pop("kv"), g.pop("cache")
    hi = layouts.empty_cache(2, "fp8")
    with pytest.raises(ValueError, match="^lo_cache: two-level keys need an fp8-layout cache"):
        store.store_index_k(kv, bf16_cache, lo_cache=layouts.empty_cache(2, "fp8"), **g)
    with pytest.raises(ValueError, match="^lo_cache: expected the shape of cache"):
        store.store_index_k(kv, hi, lo_cache=layouts.empty_cache(3, "fp8"), **g)
    with pytest.raises(ValueError, match="^lo_cache: expected the shape of cache"):
        store.store_index_k(kv, hi, lo_cache=layouts.empty_cache(2, "fp8").view(2, 64, 1, 132), **g)
    with pytest.raises(TypeError, match="^lo_cache: expected dtype torch.uint8"):
        store.store_index_k(kv, hi, lo_cache=layouts.empty_cache(2, "fp8").view(torch.int8), **g)
    with pytest.raises(TypeError, match="^lo_cache: expected a torch.Tensor"):
        store.store_index_k(kv, hi, lo_cache=[0], **g)
    with pytest.raises(ValueError, match="^lo_cache: expected a contiguous tensor"):
        store.store_index_k(kv, hi, lo_cache=torch.zeros(8448, 2, dtype=torch.uint8).t(), **g)
    with pytest.raises(ValueError, match="^lo_cache: expected its own memory"):
        store.store_index_k(kv, hi, lo_cache=hi, **g)
    with pytest.raises(ValueError, match="^numerics: 'fp4sim' needs a bf16-layout cache"):
        store.store_index_k(kv, hi, lo_cache=layouts.empty_cache(2, "fp8"), numerics="fp4sim", **g)
    plan = _decode_plan([4] * 6)
    with pytest.raises(ValueError, match="^lo_cache: expected the shape of cache"):
        store.store_index_k_from_plan(kv, plan, cache=hi, lo_cache=layouts.empty_cache(1, "fp8"), out_loc=g["out_loc"],
                                      is_decode=True, norm_weight=g["norm_weight"], freqs_cis=g["freqs_cis"])
    with pytest.raises(ValueError, match="^lo_cache: expected the shape of cache"):
        store.store_index_k_reference(kv, hi, lo_cache=layouts.empty_cache(1, "fp8"), **g)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 7, 1000, 65537])
@pytest.mark.parametrize("key_style", STYLES)
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
def test_gpu_two_level_store_vs_reference(seed, device_rsqrt, n, key_style, in_dtype):
    """One launch: hi bytes equal the plain fp8 kernel's and the reference's, lo bytes the residual reference's,
    bit for bit (device rsqrtf in the reference); bytes outside the target slots untouched in both caches; a
    rerun over other poison writes the same target bytes."""
    dev = torch.device("cuda")
    inp, num_pages, kw, valid = gpu_case(n, key_style, in_dtype)
    hi, lo = poisoned(num_pages, "fp8", dev), poisoned(num_pages, "fp8", dev)
    hi0, lo0 = hi.clone(), lo.clone()
    plain = hi0.clone()
    store.store_index_k(inp["kv"], plain, **kw)
    store.store_index_k(inp["kv"], hi, lo_cache=lo, **kw)
    exp_hi, exp_lo = hi0.clone(), lo0.clone()
    store.store_index_k_reference(inp["kv"], exp_hi, lo_cache=exp_lo, **kw)
    torch.cuda.synchronize()
    assert _count(hi, plain) == 0, f"seed {seed}: hi differs from the plain fp8 store in {_count(hi, plain)} bytes"
    assert _count(hi, exp_hi) == 0, f"seed {seed}: hi differs from the reference in {_count(hi, exp_hi)} bytes"
    assert _count(lo, exp_lo) == 0, f"seed {seed}: lo differs from the reference in {_count(lo, exp_lo)} bytes"
    target = target_bytes(hi, kw, valid, "fp8")
    for got, before in ((hi, hi0), (lo, lo0)):
        assert _count(got.reshape(-1)[~target], before.reshape(-1)[~target]) == 0, f"seed {seed}: outside bytes"
    hi2, lo2 = poisoned(num_pages, "fp8", dev), poisoned(num_pages, "fp8", dev)
    store.store_index_k(inp["kv"], hi2, lo_cache=lo2, **kw)
    torch.cuda.synchronize()
    for a, b in ((hi2, hi), (lo2, lo)):
        assert _count(a.reshape(-1)[target], b.reshape(-1)[target]) == 0, f"seed {seed}: rerun differs"


@pytest.mark.gpu
@pytest.mark.parametrize("source", ["direct", "decode", "prefill"])
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_gpu_two_level_store_every_source(seed, device_rsqrt, source, idx_dtype):
    dev = torch.device("cuda")
    n, num_pages, max_pos = 777, 16, 2048
    inp = make_inputs(n, max_pos=max_pos, in_dtype=torch.bfloat16, device=dev)
    common = dict(norm_weight=inp["norm_weight"], freqs_cis=inp["freqs_cis"])
    loc = unique_locs(n, num_pages, dev)
    seq = torch.randint(4, max_pos, (n,), device=dev)
    if source == "direct":
        pos, dloc = inp["positions"], loc
        run = lambda h, lo: store.store_index_k(inp["kv"], h, lo_cache=lo, positions=pos.to(idx_dtype),  # noqa
                                                out_loc=loc.to(idx_dtype), **common)
    elif source == "decode":
        plan = _decode_plan([int(s) for s in seq.cpu()]).to(dev)
        pos, dloc = seq - 4, torch.where(seq % 4 == 0, loc, torch.full_like(loc, -1))
        run = lambda h, lo: store.store_index_k_from_plan(inp["kv"], plan, cache=h, lo_cache=lo,  # noqa: E731
                                                          out_loc=loc.to(idx_dtype), is_decode=True, **common)
    else:
        ragged = torch.randperm(n, device=dev)
        sv = [int(s) if i % 7 else 0xFFFFFFFF for i, s in enumerate(seq.cpu())]
        plan = _prefill_plan(sv, [int(r) for r in ragged.cpu()]).to(dev)
        pos = seq - 4
        dloc = torch.tensor([int(loc[r]) if s != 0xFFFFFFFF else -1 for s, r in zip(sv, ragged.cpu())], device=dev)
        run = lambda h, lo: store.store_index_k_from_plan(inp["kv"], plan, cache=h, lo_cache=lo,  # noqa: E731
                                                          out_loc=loc.to(idx_dtype), is_decode=False, **common)
    hi, lo = poisoned(num_pages, "fp8", dev), poisoned(num_pages, "fp8", dev)
    exp_hi, exp_lo = hi.clone(), lo.clone()
    store.store_index_k_reference(inp["kv"], exp_hi, lo_cache=exp_lo, positions=pos.long(), out_loc=dloc, **common)
    run(hi, lo)
    torch.cuda.synchronize()
    assert _count(hi, exp_hi) == 0 and _count(lo, exp_lo) == 0, \
        f"seed {seed}: {source}/{idx_dtype}: {_count(hi, exp_hi)} hi / {_count(lo, exp_lo)} lo bytes differ"


@pytest.mark.gpu
def test_gpu_two_level_store_of_non_finite_keys(device_rsqrt):
    inp = make_inputs(64, device="cuda")
    kv = inp["kv"].clone()
    kv[1, 3], kv[2, 100], kv[5] = float("nan"), float("inf"), float("-inf")
    kw = dict(positions=inp["positions"], out_loc=torch.arange(64, device="cuda"), norm_weight=inp["norm_weight"],
              freqs_cis=inp["freqs_cis"])
    hi, lo, plain = (poisoned(1, "fp8", "cuda") for _ in range(3))
    exp_lo = lo.clone()
    store.store_index_k(kv, plain, **kw)
    store.store_index_k(kv, hi, lo_cache=lo, **kw)
    store.store_index_k_reference(kv, poisoned(1, "fp8", "cuda"), lo_cache=exp_lo, **kw)
    torch.cuda.synchronize()
    assert torch.equal(hi, plain)
    from cupy_dsa import rescore
    (codes, scales), (ecodes, escales) = rescore.lo_views(lo), rescore.lo_views(exp_lo)
    assert torch.equal(codes, ecodes)
    assert bool((codes[0, [1, 2, 5]] == 0).all()) and bool(torch.isnan(scales[0, [1, 2, 5]]).all())
    same = (scales == escales) | (torch.isnan(scales) & torch.isnan(escales))
    assert bool(same.all())
