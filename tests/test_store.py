"""store_index_k: torch reference vs an independent float64 formulation (CPU), cache addressing and skip
rules, plan entries, bad input; on a GPU the kernel vs the reference, bit for bit.

Bit-exactness bound: the reference follows the kernel's operation order, so with the GPU's own rsqrtf
swapped into the reference (fixture ``device_rsqrt``) kernel and reference must agree on every byte. With
torch.rsqrt instead (<= 2 ulp apart from rsqrtf) at most 1 in 1000 bf16 elements may differ, each by one
bf16 ulp (fp8: one e4m3 code; scales within 4e-7 relative).
"""
import itertools

import pytest
import numpy as np
import torch

from cupy_dsa import layouts, store
from store_cases import (E2M1, PLAN_MAX_POS, PLAN_N, PLAN_PAGES, QUANT, STYLES, _count, _decode_plan,  # noqa: F401
                         _good, _prefill_plan, device_rsqrt, fp4_ideal, gpu_case, ideal_key, make_inputs,
                         poisoned, read_slots, row_rms, slot_bytes, target_bytes, unique_locs)

# --------------------------------------------------------------------------------------------------
# CPU: reference numerics
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("key_style", STYLES)
@pytest.mark.parametrize("hadamard", [True, False])
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
def test_reference_exact_vs_float64(seed, key_style, hadamard, in_dtype):
    n = 384
    inp = make_inputs(n, style=key_style, in_dtype=in_dtype)
    args = dict(norm_weight=inp["norm_weight"], freqs_cis=inp["freqs_cis"], norm_bias=inp["norm_bias"],
                key_style=key_style, hadamard=hadamard)
    ref = store.rotate_index_k_reference(inp["kv"], inp["positions"], **args)
    ideal = ideal_key(inp["kv"], inp["positions"], **args)
    assert ref.dtype == torch.float32 and ref.shape == (n, 128)
    err = (ref.double() - ideal).abs() / row_rms(ideal)
    assert err.max() < 4e-6, f"seed {seed}: fp32 reference vs float64, max error {err.max():.3g} x row rms"

    cache = layouts.empty_cache(8, "bf16")
    loc = unique_locs(n, 8)
    store.store_index_k(inp["kv"], cache, positions=inp["positions"], out_loc=loc, **args)
    got, _ = read_slots(cache, loc, "bf16")
    bound = ideal.abs() * 2.0**-8 + 2e-6 * row_rms(ideal)
    bad = ((got.double() - ideal).abs() > bound).sum().item()
    assert bad == 0, f"seed {seed}: {bad} stored bf16 values further than half a bf16 ulp from float64"
    # and exactly the RNE of the reference
    assert torch.equal(got, ref.to(torch.bfloat16).float())


@pytest.mark.parametrize("key_style", STYLES)
@pytest.mark.parametrize("hadamard", [True, False])
def test_reference_fp4sim(seed, key_style, hadamard):
    n = 512
    inp = make_inputs(n, style=key_style)
    args = dict(norm_weight=inp["norm_weight"], freqs_cis=inp["freqs_cis"], norm_bias=inp["norm_bias"],
                key_style=key_style, hadamard=hadamard)
    k4 = store.rotate_index_k_reference(inp["kv"], inp["positions"], numerics="fp4sim", **args)
    k32 = store.rotate_index_k_reference(inp["kv"], inp["positions"], **args)
    # e2m1 value times the block's power-of-two scale (scale from the fp32 key's block amax, in float64)
    amax = k32.double().reshape(n, 4, 32).abs().amax(-1, keepdim=True)
    scale = torch.exp2(torch.ceil(torch.log2(torch.clamp_min(amax, 1e-4) / 6.0)))
    q = (k4.double().reshape(n, 4, 32) / scale).abs()
    on_grid = (q[..., None] == E2M1).any(-1)
    assert on_grid.all(), f"seed {seed}: {(~on_grid).sum().item()} values are not e2m1 x 2^k"
    # amax / scale lies in (3, 6], so every block's largest value is 3, 4 or 6 times its scale
    assert (q.amax(-1) >= 3).all(), "a block's amax did not round to 3, 4 or 6"
    # against an independent float64 rounding of the float64 key: only boundary cases may differ
    ideal4, _ = fp4_ideal(ideal_key(inp["kv"], inp["positions"], **args))
    diff = (k4.double() != ideal4).sum().item()
    assert diff <= 1e-3 * k4.numel(), f"seed {seed}: {diff} of {k4.numel()} fp4 values differ from float64"
    # stored bf16 holds the fp4 values exactly
    cache = layouts.empty_cache(8, "bf16")
    loc = unique_locs(n, 8)
    store.store_index_k(inp["kv"], cache, positions=inp["positions"], out_loc=loc, numerics="fp4sim", **args)
    got, _ = read_slots(cache, loc, "bf16")
    assert torch.equal(got, k4), f"seed {seed}: stored bf16 differs from the fp4 values"


def test_fp4_rounding_ties():
    # one block with amax 6 -> scale 1; boundaries and ties to the even code
    v = torch.tensor([0.25, 0.26, 0.75, 1.25, 1.26, 1.75, 2.5, 2.6, 3.5, 5.0, 5.01, -0.25, -0.75, -3.4, 6.0])
    x = torch.zeros(1, 128)
    x[0, :15] = v
    want = torch.tensor([0.0, 0.5, 1.0, 1.0, 1.5, 2.0, 2.0, 3.0, 4.0, 4.0, 6.0, -0.0, -1.0, -3.0, 6.0])
    got = store._fp4sim(x)[0, :15]
    assert torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want)), got
    # scale: amax 6.01 -> 2; amax 0 -> 2^ceil(log2(1e-4/6)) and all zero
    x[0, 0] = 6.01
    assert store._fp4sim(x)[0, 0] == 6.0
    z = store._fp4sim(torch.zeros(1, 128))
    assert torch.equal(z, torch.zeros(1, 128))


@pytest.mark.parametrize("key_style", STYLES)
def test_reference_fp8(seed, key_style):
    n = 384
    inp = make_inputs(n, style=key_style)
    args = dict(norm_weight=inp["norm_weight"], freqs_cis=inp["freqs_cis"], norm_bias=inp["norm_bias"],
                key_style=key_style)
    cache = layouts.empty_cache(8, "fp8")
    loc = unique_locs(n, 8)
    store.store_index_k(inp["kv"], cache, positions=inp["positions"], out_loc=loc, **args)
    deq, sc = read_slots(cache, loc, "fp8")
    ideal = ideal_key(inp["kv"], inp["positions"], **args)
    want_sc = torch.clamp_min(ideal.abs().amax(-1), 1e-4) / 448.0
    sc_err = ((sc.double() - want_sc).abs() / want_sc).max().item()
    assert sc_err < 2e-6, f"seed {seed}: fp8 scale vs float64 amax/448, max rel error {sc_err:.3g}"
    # half an e4m3 step, plus the fp32 pipeline's own error (LayerNorm's mean subtraction and the Hadamard
    # sums cost a few fp32 roundings of the row's size), so a value that sits on a rounding boundary in fp64
    # may round the other way in fp32
    fp32_slack = 2.0**-18 * ideal.abs().amax(-1, keepdim=True)
    bound = torch.maximum(ideal.abs() * 2.0**-4, sc.double()[:, None] * 2.0**-10) * (1 + 1e-5) + fp32_slack
    bad = ((deq.double() - ideal).abs() > bound).sum().item()
    assert bad == 0, f"seed {seed}: {bad} fp8 values further than half an e4m3 ulp from float64"
    # the amax element of every token quantizes to +-448
    flat = cache.reshape(-1)
    codes = flat[slot_bytes(cache, loc, "fp8").view(n, 132)[:, :128]]
    assert ((codes & 0x7F) == 0x7E).any(-1).all(), "every token must hold a +-448 code"


# --------------------------------------------------------------------------------------------------
# CPU: addressing, skips, plans
# --------------------------------------------------------------------------------------------------

def _expected_after(cache0, layout, kv, pos, loc, inp, numerics="exact", key_style="v4", valid=None):
    """The poisoned cache with the valid rows written, addressed from the layout spec (not the store)."""
    exp = cache0.clone().reshape(-1)
    idx = valid.nonzero().flatten()
    if idx.numel() == 0:
        return exp.view(cache0.shape)
    k = store.rotate_index_k_reference(kv[idx], pos[idx], inp["norm_weight"], inp["freqs_cis"], inp["norm_bias"],
                                       key_style=key_style, numerics=numerics)
    if layout == "bf16":
        raw = k.to(torch.bfloat16).view(torch.uint8).reshape(len(idx), 256)
    else:
        codes, sc = store.fp8_quantize_reference(k)
        raw = torch.cat((codes, sc.view(torch.uint8).view(-1, 4)), 1)
    exp[slot_bytes(cache0, loc[idx], layout)] = raw.reshape(-1)
    return exp.view(cache0.shape)


@pytest.mark.parametrize("layout,numerics", QUANT)
@pytest.mark.parametrize("key_style", STYLES)
def test_store_writes_only_target_slots(seed, layout, numerics, key_style):
    n, num_pages, max_pos = 200, 5, 300
    inp = make_inputs(n, style=key_style, max_pos=max_pos)
    loc = unique_locs(n, num_pages)
    pos = inp["positions"].clone()
    # skips: negative out_loc, page == num_pages, huge page, position -1 / max_pos
    loc[0], loc[1], loc[2], loc[3] = -1, num_pages * 64, num_pages * 64 + 63, 1 << 40
    loc[4] = -(1 << 40)
    pos[5], pos[6], pos[7] = -1, max_pos, max_pos + 1000
    valid = torch.ones(n, dtype=torch.bool)
    valid[:8] = False
    cache = poisoned(num_pages, layout)
    cache0 = cache.clone()
    store.store_index_k(inp["kv"], cache, positions=pos, out_loc=loc, norm_weight=inp["norm_weight"],
                        freqs_cis=inp["freqs_cis"], norm_bias=inp["norm_bias"], numerics=numerics,
                        key_style=key_style)
    exp = _expected_after(cache0, layout, inp["kv"], pos, loc, inp, numerics, key_style, valid)
    nbad = (cache != exp).sum().item()
    assert nbad == 0, f"seed {seed}: {nbad} cache bytes differ from the expected write"


def test_store_nothing_valid_and_empty():
    inp = make_inputs(4)
    cache = poisoned(2, "bf16")
    c0 = cache.clone()
    loc = torch.tensor([-1, 128, 1000, -7])
    store.store_index_k(inp["kv"], cache, positions=inp["positions"], out_loc=loc,
                        norm_weight=inp["norm_weight"], freqs_cis=inp["freqs_cis"])
    assert torch.equal(cache, c0)
    e = torch.empty(0, 128)
    store.store_index_k(e, cache, positions=torch.empty(0, dtype=torch.int64),
                        out_loc=torch.empty(0, dtype=torch.int64), norm_weight=inp["norm_weight"],
                        freqs_cis=inp["freqs_cis"])
    assert torch.equal(cache, c0)


def _check_plan_store(seed, layout, num_pages, inp, plan, loc, pos, row_locs, valid, **plan_kw):
    """Store through ``plan`` into a poisoned cache: exactly the ``valid`` rows land at ``row_locs``."""
    cache = poisoned(num_pages, layout)
    cache0 = cache.clone()
    store.store_index_k_from_plan(inp["kv"], plan, cache=cache, out_loc=loc, norm_weight=inp["norm_weight"],
                                  freqs_cis=inp["freqs_cis"], **plan_kw)
    exp = _expected_after(cache0, layout, inp["kv"], pos, row_locs, inp, valid=valid)
    nbad = (cache != exp).sum().item()
    assert nbad == 0, f"seed {seed}: {nbad} bytes differ ({valid.sum()} valid rows)"


def _both_layouts_and_loc_dtypes(test):
    return pytest.mark.parametrize("layout", ["bf16", "fp8"])(
        pytest.mark.parametrize("loc_dtype", [torch.int64, torch.int32])(test))




@_both_layouts_and_loc_dtypes
def test_decode_plan(seed, layout, loc_dtype):
    n, num_pages, max_pos = PLAN_N, PLAN_PAGES, PLAN_MAX_POS
    inp = make_inputs(n, max_pos=max_pos)
    seq = [int(v) for v in torch.randint(1, max_pos, (n,))]
    seq[0], seq[1], seq[2], seq[3] = 0, 4, 8, 5  # 0 -> position -4 (skip); 4 -> position 0
    loc = unique_locs(n + 5, num_pages).to(loc_dtype)  # longer than the plan: only the first n are used
    pos = torch.tensor([s - 4 for s in seq])
    valid = torch.tensor([s % 4 == 0 and s >= 4 for s in seq])
    assert valid.sum() > 3
    _check_plan_store(seed, layout, num_pages, inp, _decode_plan(seq), loc, pos, loc[:n].long(), valid,
                      is_decode=True, compress_ratio=4)


@_both_layouts_and_loc_dtypes
def test_prefill_plan(seed, layout, loc_dtype):
    n, num_pages, max_pos = PLAN_N, PLAN_PAGES, PLAN_MAX_POS
    seq = [int(v) for v in torch.randint(4, max_pos, (n,))]
    inp = make_inputs(n, max_pos=max_pos)
    for i in range(0, n, 5):
        seq[i] = 0xFFFFFFFF
    seq[1] = 2  # position -2: skipped although the plan row is valid
    ragged = [int(v) for v in torch.randperm(n + 10)[:n]]
    loc = unique_locs(n + 10, num_pages).to(loc_dtype)
    pos = torch.tensor([(s - 4) if s != 0xFFFFFFFF else -1 for s in seq])
    rloc = torch.tensor([int(loc[r]) for r in ragged])
    valid = torch.tensor([s != 0xFFFFFFFF and s >= 4 for s in seq])
    _check_plan_store(seed, layout, num_pages, inp, _prefill_plan(seq, ragged), loc, pos, rloc, valid,
                      is_decode=False)


def test_typed_cache_views():
    """bf16 [P, 64, 128] and fp8 [P, 64, 1, 132] views are accepted and written in place."""
    inp = make_inputs(10)
    loc = unique_locs(10, 2)
    kw = dict(positions=inp["positions"], out_loc=loc, norm_weight=inp["norm_weight"], freqs_cis=inp["freqs_cis"])
    for layout in ("bf16", "fp8"):
        rows = layouts.empty_cache(2, layout)
        view = rows.view(torch.bfloat16).view(2, 64, 128) if layout == "bf16" else rows.view(2, 64, 1, 132)
        ref = layouts.empty_cache(2, layout)
        store.store_index_k(inp["kv"], view, **kw)
        store.store_index_k(inp["kv"], ref, **kw)
        assert torch.equal(rows, ref) and rows.any()


# --------------------------------------------------------------------------------------------------
# CPU: bad input
# --------------------------------------------------------------------------------------------------

BAD = [
    ("kv", lambda g: g["kv"].double(), TypeError),
    ("kv", lambda g: g["kv"].half(), TypeError),
    ("kv", lambda g: g["kv"][:, :64], ValueError),
    ("kv", lambda g: torch.randn(128, 6).t(), ValueError),
    ("cache", lambda g: torch.zeros(2, 16000, dtype=torch.uint8), ValueError),
    ("cache", lambda g: torch.zeros(16384, 4, dtype=torch.uint8).t(), ValueError),
    ("positions", lambda g: g["positions"].float(), TypeError),
    ("positions", lambda g: g["positions"][:3], ValueError),
    ("out_loc", lambda g: g["out_loc"].short(), TypeError),
    ("out_loc", lambda g: g["out_loc"].float(), TypeError),
    ("out_loc", lambda g: g["out_loc"][:5], ValueError),
    ("out_loc", lambda g: torch.stack((g["out_loc"], g["out_loc"]), 1)[:, 0], ValueError),
    ("norm_weight", lambda g: g["norm_weight"].bfloat16(), TypeError),
    ("norm_weight", lambda g: g["norm_weight"][:64], ValueError),
    ("freqs_cis", lambda g: g["freqs_cis"].double(), TypeError),
    ("freqs_cis", lambda g: g["freqs_cis"][:, :32], ValueError),
    ("freqs_cis", lambda g: torch.randn(64, 300).t(), ValueError),
]


@pytest.mark.parametrize("name,bad,exc", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_input(name, bad, exc):
    g = _good()
    g[name] = bad(g)
    kv, cache = g.pop("kv"), g.pop("cache")
    with pytest.raises(exc, match=name):
        store.store_index_k(kv, cache, **g)


def test_out_loc_int32_and_int64_store_the_same(seed):
    """Both entries take int32 and int64 out_loc (SGLang hands either around)."""
    g = _good()
    kv, wide = g.pop("kv"), g.pop("cache")
    store.store_index_k(kv, wide, **g)
    narrow = layouts.empty_cache(2, "bf16")
    store.store_index_k(kv, narrow, **dict(g, out_loc=g["out_loc"].int()))
    assert torch.equal(narrow, wide) and wide.any()
    ref = layouts.empty_cache(2, "bf16")
    store.store_index_k_reference(kv, ref, **dict(g, out_loc=g["out_loc"].int()))
    assert torch.equal(ref, wide)


@pytest.mark.parametrize("args, kwargs, exc, message", [
    ((4.5, "bf16"), {}, TypeError, "num_pages: expected an int, got float"),
    ((True, "bf16"), {}, TypeError, "num_pages: expected an int, got bool"),
    ((-1, "bf16"), {}, ValueError, "num_pages: expected an int in [0,"),
    ((4, "bf8"), {}, ValueError, "layout: expected one of"),
    ((4, "bf16"), {"device": "gpu"}, ValueError, "device: expected a torch device"),
    ((4, "bf16"), {"device": "cuda:99"}, ValueError, "device: "),
])
def test_empty_cache_errors_name_the_argument(args, kwargs, exc, message):
    with pytest.raises(exc) as e:
        layouts.empty_cache(*args, **kwargs)
    assert str(e.value).startswith(message), str(e.value)


def test_empty_cache_without_a_gpu_names_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device in ("cuda", "cuda:0", torch.device("cuda", 1)):
        with pytest.raises(ValueError, match=r"^device: .* needs a CUDA GPU and none is available"):
            layouts.empty_cache(4, "bf16", device=device)
    assert layouts.empty_cache(0, "fp8").shape == (0, layouts.FP8_PAGE_BYTES)


def test_bad_cache_error_names_the_argument_once():
    g = _good()
    kv = g.pop("kv")
    g.pop("cache")
    with pytest.raises(ValueError, match=r"^cache: expected uint8 \[P, 16384\]") as e:
        store.store_index_k(kv, torch.zeros(2, 100, dtype=torch.uint8), **g)
    assert "kv_cache" not in str(e.value)


def test_bad_options():
    g = _good()
    kv, cache = g.pop("kv"), g.pop("cache")
    with pytest.raises(ValueError, match="numerics"):
        store.store_index_k(kv, layouts.empty_cache(2, "fp8"), numerics="fp4sim", **g)
    with pytest.raises(ValueError, match="numerics"):
        store.store_index_k(kv, cache, numerics="fp8", **g)
    with pytest.raises(ValueError, match="key_style"):
        store.store_index_k(kv, cache, key_style="v3", **g)
    with pytest.raises(ValueError, match="norm_bias"):
        store.store_index_k(kv, cache, key_style="v32", **g)
    with pytest.raises(ValueError, match="norm_bias"):
        store.store_index_k(kv, cache, norm_bias=torch.zeros(128), **g)
    with pytest.raises(TypeError, match="norm_bias"):
        store.store_index_k(kv, cache, key_style="v32", norm_bias=torch.zeros(128, dtype=torch.float64), **g)
    with pytest.raises(ValueError, match="device"):
        store.store_index_k(kv, cache.to("meta"), **g)
    plan = _decode_plan([4] * 6)
    pk = dict(cache=cache, norm_weight=g["norm_weight"], freqs_cis=g["freqs_cis"])
    with pytest.raises(ValueError, match="plan"):
        store.store_index_k_from_plan(kv, plan[:, :8], out_loc=g["out_loc"], is_decode=True, **pk)
    with pytest.raises(TypeError, match="plan"):
        store.store_index_k_from_plan(kv, plan.int(), out_loc=g["out_loc"], is_decode=True, **pk)
    with pytest.raises(ValueError, match="out_loc"):
        store.store_index_k_from_plan(kv, plan, out_loc=g["out_loc"][:3], is_decode=True, **pk)
    with pytest.raises(TypeError, match="out_loc"):
        store.store_index_k_from_plan(kv, plan, out_loc=g["out_loc"].float(), is_decode=True, **pk)
    with pytest.raises(ValueError, match="compress_ratio"):
        store.store_index_k_from_plan(kv, plan, out_loc=g["out_loc"], is_decode=True, compress_ratio=0, **pk)


def test_instantiations_registered():
    from cupy_dsa import launch

    exprs = launch.product_expressions("sm_90")["store_index_k.cu"]
    # 4 (layout, numerics) x 2 styles x 2 hadamard x 2 kv dtypes x 3 sources
    assert len(exprs) == 96 and len(set(exprs)) == 96
    assert not any(e.startswith(("store_index_k<1, 1,", "store_index_k<2, 1,")) for e in exprs)  # no fp8 fp4sim
    assert len([e for e in exprs if e.startswith("store_index_k<2, 0,")]) == 24       # two-level keys


# --------------------------------------------------------------------------------------------------
# GPU: kernel vs reference
# --------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 7, 64, 1000, 65537, 1 << 20])
@pytest.mark.parametrize("layout,numerics", QUANT)
@pytest.mark.parametrize("key_style", STYLES)
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
def test_gpu_kernel_vs_reference(seed, device_rsqrt, n, layout, numerics, key_style, in_dtype):
    dev = torch.device("cuda")
    inp, num_pages, kw, valid = gpu_case(n, key_style, in_dtype, numerics=numerics)
    cache = poisoned(num_pages, layout, dev)
    cache0 = cache.clone()
    expected = cache0.clone()
    store.store_index_k_reference(inp["kv"], expected, **kw)
    store.store_index_k(inp["kv"], cache, **kw)
    torch.cuda.synchronize()
    # non-target bytes untouched, target bytes as the reference
    target = target_bytes(cache, kw, valid, layout)
    flat, flat0, flate = cache.reshape(-1), cache0.reshape(-1), expected.reshape(-1)
    outside = _count(flat[~target], flat0[~target])
    inside = _count(flat[target], flate[target])
    assert outside == 0, f"seed {seed}: kernel changed {outside} bytes outside the {valid.sum()} target slots"
    assert inside == 0, (f"seed {seed}: {inside} of {target.sum().item()} target bytes differ from the reference "
                         f"(with the device rsqrtf)")
    # rerun over a different poison: bitwise identical target bytes, so every target byte was written
    cache2 = poisoned(num_pages, layout, dev)
    poison2 = cache2.clone()
    store.store_index_k(inp["kv"], cache2, **kw)
    torch.cuda.synchronize()
    f2 = cache2.reshape(-1)
    assert _count(f2[target], flat[target]) == 0, f"seed {seed}: rerun differs in target bytes"
    assert _count(f2[~target], poison2.reshape(-1)[~target]) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("layout,numerics", QUANT)
@pytest.mark.parametrize("key_style", STYLES)
def test_gpu_vs_plain_reference_ulp_bound(seed, layout, numerics, key_style):
    """Against the reference with torch.rsqrt on the CPU: rare one-step differences only (the documented
    bound: <= 1e-3 of the elements, each one bf16 ulp / one e4m3 code / one e2m1 step; fp8 scales 1e-6)."""
    dev = torch.device("cuda")
    n, num_pages = 65536, 1025
    inp = make_inputs(n, style=key_style, max_pos=4096, device=dev)
    loc = unique_locs(n, num_pages, dev)
    kw = dict(positions=inp["positions"], out_loc=loc, norm_weight=inp["norm_weight"],
              freqs_cis=inp["freqs_cis"], norm_bias=inp["norm_bias"], numerics=numerics, key_style=key_style)
    cache = layouts.empty_cache(num_pages, layout, dev)
    store.store_index_k(inp["kv"], cache, **kw)
    ref = layouts.empty_cache(num_pages, layout, "cpu")
    store.store_index_k_reference(**{k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in
                                     dict(kv=inp["kv"], cache=ref, **kw).items()})
    lc = loc.cpu()
    graw = cache.cpu().reshape(-1)[slot_bytes(ref, lc, layout)].view(n, -1)
    wraw = ref.reshape(-1)[slot_bytes(ref, lc, layout)].view(n, -1)
    if layout == "bf16":
        g = graw.contiguous().view(torch.int16).int()
        w = wraw.contiguous().view(torch.int16).int()
        ndiff = (g != w).sum().item()
        if numerics == "exact":
            # one bf16 ulp, or (values next to zero after cancellation in the Hadamard sums) a few fp32
            # roundings of the row's scale: rsqrt differing by an ulp moves every sum by ~2^-24 * |row|
            gv = graw.contiguous().view(torch.bfloat16).double()
            wv = wraw.contiguous().view(torch.bfloat16).double()
            ulp = torch.exp2(torch.floor(torch.log2(wv.abs().clamp_min(1e-30))) - 7)
            rms = wv.pow(2).mean(-1, keepdim=True).sqrt()
            far = ((gv - wv).abs() > torch.maximum(ulp, 2.0 ** -18 * rms)).sum().item()
            assert far == 0, f"seed {seed}: {far} bf16 values differ by more than 1 ulp / 2^-18 rms ({ndiff} differ)"
        else:
            gv = graw.contiguous().view(torch.bfloat16).double().view(n, 4, 32)
            wv = wraw.contiguous().view(torch.bfloat16).double().view(n, 4, 32)
            amax = wv.abs().amax(-1, keepdim=True)
            scale = torch.exp2(torch.ceil(torch.log2(torch.clamp_min(amax, 1e-4) / 6.0)))
            far = ((gv - wv).abs() > 2 * scale).sum().item()
            assert far == 0, f"seed {seed}: {far} fp4 values differ by more than one e2m1 step"
        nel = g.numel()
    else:
        gs, ws = graw[:, 128:].contiguous().view(torch.float32), wraw[:, 128:].contiguous().view(torch.float32)
        rel = ((gs.double() - ws.double()).abs() / ws.double()).max().item()
        assert rel <= 1e-6, f"seed {seed}: fp8 scales differ by {rel:.3g} relative"
        gc, wc = graw[:, :128].int(), wraw[:, :128].int()
        ndiff = (gc != wc).sum().item()
        same_sign = ((gc & 0x80) == (wc & 0x80)) | ((gc & 0x7F) == 0) | ((wc & 0x7F) == 0)
        step = ((gc & 0x7F) - (wc & 0x7F)).abs().max().item()
        assert same_sign.all() and step <= 1, f"seed {seed}: e4m3 codes differ by {step} ({ndiff} differ)"
        nel = gc.numel()
    assert ndiff <= 1e-3 * nel, f"seed {seed}: {ndiff} of {nel} elements differ from the torch.rsqrt reference"


@pytest.mark.gpu
@pytest.mark.parametrize("layout,numerics", QUANT)
@pytest.mark.parametrize("key_style", STYLES)
@pytest.mark.parametrize("hadamard", [True, False])
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
def test_gpu_every_variant(seed, device_rsqrt, layout, numerics, key_style, hadamard, in_dtype):
    """Each (layout, numerics, style, hadamard, kv dtype) on one source/index-dtype combination (rotating
    through all six), bitwise against the reference."""
    combos = list(itertools.product(["direct", "decode", "prefill"], [torch.int32, torch.int64]))
    i = (QUANT.index((layout, numerics)) * 8 + STYLES.index(key_style) * 4 + (2 if hadamard else 0)
         + (1 if in_dtype == torch.bfloat16 else 0))
    source, idx_dtype = combos[i % 6]
    dev = torch.device("cuda")
    n, num_pages, max_pos = 777, 16, 2048
    inp = make_inputs(n, style=key_style, max_pos=max_pos, in_dtype=in_dtype, device=dev)
    common = dict(norm_weight=inp["norm_weight"], freqs_cis=inp["freqs_cis"], norm_bias=inp["norm_bias"],
                  numerics=numerics, key_style=key_style, hadamard=hadamard)
    loc = unique_locs(n, num_pages, dev)
    seq = torch.randint(4, max_pos, (n,), device=dev)
    if source == "direct":
        pos, dloc = inp["positions"].to(idx_dtype), loc
        run = lambda c: store.store_index_k(inp["kv"], c, positions=pos, out_loc=dloc.to(idx_dtype),  # noqa: E731
                                            **common)
    elif source == "decode":
        plan = _decode_plan([int(s) for s in seq.cpu()]).to(dev)
        pos = seq - 4
        dloc = torch.where(seq % 4 == 0, loc, torch.full_like(loc, -1))
        run = lambda c: store.store_index_k_from_plan(inp["kv"], plan, cache=c, out_loc=loc.to(idx_dtype),  # noqa
                                                      is_decode=True, **common)
    else:
        ragged = torch.randperm(n, device=dev)
        sv = [int(s) if i % 7 else 0xFFFFFFFF for i, s in enumerate(seq.cpu())]
        plan = _prefill_plan(sv, [int(r) for r in ragged.cpu()]).to(dev)
        pos = seq - 4
        dloc = torch.tensor([int(loc[r]) if s != 0xFFFFFFFF else -1 for s, r in zip(sv, ragged.cpu())],
                            device=dev)
        run = lambda c: store.store_index_k_from_plan(inp["kv"], plan, cache=c, out_loc=loc.to(idx_dtype),  # noqa
                                                      is_decode=False, **common)
    cache = poisoned(num_pages, layout, dev)
    expected = cache.clone()
    store.store_index_k_reference(inp["kv"], expected, positions=pos.long(), out_loc=dloc, **common)
    run(cache)
    torch.cuda.synchronize()
    nbad = _count(cache, expected)
    assert nbad == 0, f"seed {seed}: {source}/{idx_dtype}: {nbad} cache bytes differ from the reference"


@pytest.mark.gpu
def test_gpu_cuda_graph(seed, device_rsqrt):
    dev = torch.device("cuda")
    n, num_pages, max_pos = 4096, 80, 4096
    inp = make_inputs(n, max_pos=max_pos, device=dev)
    s_kv, s_pos, s_loc = inp["kv"].clone(), inp["positions"].clone(), unique_locs(n, num_pages, dev)
    cache = layouts.empty_cache(num_pages, "bf16", dev)
    kw = dict(norm_weight=inp["norm_weight"], freqs_cis=inp["freqs_cis"], numerics="fp4sim")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            store.store_index_k(s_kv, cache, positions=s_pos, out_loc=s_loc, **kw)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        store.store_index_k(s_kv, cache, positions=s_pos, out_loc=s_loc, **kw)
    for step in range(3):
        new = make_inputs(n, max_pos=max_pos, device=dev)
        newloc = unique_locs(n, num_pages, dev)
        newloc[:100] = -1
        s_kv.copy_(new["kv"])
        s_pos.copy_(new["positions"])
        s_loc.copy_(newloc)
        cache.copy_(poisoned(num_pages, "bf16", dev))
        expected = cache.clone()
        g.replay()
        store.store_index_k_reference(new["kv"], expected, positions=new["positions"], out_loc=newloc, **kw)
        torch.cuda.synchronize()
        nbad = _count(cache, expected)
        assert nbad == 0, f"seed {seed}: graph replay {step}: {nbad} cache bytes differ from the reference"


def test_prefill_plan_ragged_id_past_out_loc_is_skipped():
    """A CompressPlan row whose ragged_id points past out_loc writes nothing (the kernel skips it too)."""
    from cupy_dsa.store import plan_to_direct

    plan = torch.zeros(3, 16, dtype=torch.uint8)
    plan[:, 0:4] = torch.tensor([8, 12, 16], dtype=torch.int32).view(torch.uint8).view(3, 4)
    plan[:, 4:6] = torch.tensor([0, 1, 5], dtype=torch.int16).view(torch.uint8).view(3, 2)
    positions, locs = plan_to_direct(plan, torch.tensor([70, 71], dtype=torch.int64), is_decode=False)
    assert positions.tolist() == [4, 8, 12]
    assert locs.tolist() == [70, 71, -1]


# --------------------------------------------------------------------------------------------------
# SGLang's operation order for V4 keys (its nvcc build contracts the sum of squares and the RoPE into FMAs)
# --------------------------------------------------------------------------------------------------

def _exact_fma32(a, b, c):
    """a * b + c of three float32 values, rounded once to float32 (ties to even), in exact rational arithmetic."""
    from fractions import Fraction
    v = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    f = np.float32(float(v))
    near = [np.nextafter(f, np.float32(-np.inf)), f, np.nextafter(f, np.float32(np.inf))]
    return min(near, key=lambda x: (abs(Fraction(float(x)) - v), int(np.array(x).view(np.int32)) & 1))


def test_fma_f32_rounds_once():
    """Random products cancelled by c (where a second rounding shows) and products that land on a float32 tie."""
    g = torch.Generator().manual_seed(7)
    a, b = torch.randn(3000, generator=g), torch.randn(3000, generator=g)
    c = -(a * b) + torch.randn(3000, generator=g) * 1e-6
    got = store.fma_f32(a, b, c)
    want = [_exact_fma32(x, y, z) for x, y, z in zip(a.tolist(), b.tolist(), c.tolist())]
    assert got.numpy().tobytes() == np.array(want, dtype=np.float32).tobytes()
    one_ulp = torch.tensor([1.0 + 2.0 ** -23])
    # (1 + 2^-23)^2 = 1 + 2^-22 + 2^-46: rounding the product first loses the 2^-46 that c = -(1 + 2^-22) leaves
    c = torch.tensor([-(1.0 + 2.0 ** -22)])
    assert store.fma_f32(one_ulp, one_ulp, c).item() == 2.0 ** -46 and (one_ulp * one_ulp + c).item() == 0.0


def test_v4_key_follows_sglangs_fma_order():
    """One V4 key, element by element in exact arithmetic, in SGLang 0.5.23's order: per-lane FMA sum of squares,
    the same butterfly, x * nf * w, RoPE re' = fma(re, c, -(im * s)), im' = fma(re, s, im * c). The unfused order
    gives other bits for some elements, so this test tells the two apart."""
    g = torch.Generator().manual_seed(3)
    n = 64
    kv = torch.randn(n, 128, generator=g) * 3
    w = torch.rand(128, generator=g) + 0.5
    ang = torch.rand(8, 64, generator=g) * 6.28
    freqs = torch.stack((ang[:, 0::2].cos(), ang[:, 1::2].sin()), -1).reshape(8, 64).contiguous()
    pos = torch.arange(n) % 8
    got = store.rotate_index_k_reference(kv, pos, w, freqs, hadamard=False)
    f32 = np.float32
    mism_unfused = 0
    for t in range(n):
        x = kv[t].numpy()
        lane_ss = []
        for lane in range(32):
            s = f32(x[4 * lane] * x[4 * lane])
            for i in (1, 2, 3):
                s = _exact_fma32(x[4 * lane + i], x[4 * lane + i], s)
            lane_ss.append(s)
        v = np.array(lane_ss, dtype=np.float32)
        for m in (16, 8, 4, 2, 1):
            v = (v + v[np.arange(32) ^ m]).astype(np.float32)
        nf = torch.rsqrt(torch.tensor(v[0] / f32(128) + f32(1e-6))).item()
        k = ((x * f32(nf)).astype(np.float32) * w.numpy()).astype(np.float32)
        f = freqs[pos[t]].numpy()
        want = k.copy()
        for j in range(32):
            re, im, c, s = k[64 + 2 * j], k[65 + 2 * j], f[2 * j], f[2 * j + 1]
            want[64 + 2 * j] = _exact_fma32(re, c, -f32(im * s))
            want[65 + 2 * j] = _exact_fma32(re, s, f32(im * c))
            mism_unfused += f32(f32(re * c) - f32(im * s)) != want[64 + 2 * j]
        assert got[t].numpy().tobytes() == want.tobytes(), f"row {t}"
    assert mism_unfused > 0   # the two orders differ on these rows: the comparison above can fail
