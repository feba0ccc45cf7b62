"""NaN and infinity through every numerics: the fp4 simulation (key store and query prep, CPU reference and
kernels) turns a 32-value block holding a NaN or an infinity into NaN, as the exact and fp8 paths carry NaN;
the scalars and offsets a non-finite or out-of-range value would corrupt are refused."""
import pytest
import torch

import cupy_dsa
from cupy_dsa import layouts, query, store

NAN, INF = float("nan"), float("inf")
WEIGHT_SCALE = 128 ** -0.5 * 64 ** -0.5


def _freqs(max_pos=64, device="cpu"):
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * (10000.0 ** (-torch.arange(32) / 32.0))[None]
    return torch.stack((ang.cos(), ang.sin()), dim=-1).reshape(max_pos, 64).to(torch.float32).to(device)


def _same_or_both_nan(a, b):
    a, b = a.float().cpu(), b.float().cpu()
    return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())


# --------------------------------------------------------------------------------------------------
# the fp4 simulation itself (CPU reference)
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_fp4sim_block_with_a_non_finite_value_is_nan(bad):
    torch.manual_seed(0)
    x = torch.randn(3, 128)
    clean = store.fp4sim_reference(x)
    x[1, 40] = bad                               # block 1 (elements 32..63) of row 1
    got = store.fp4sim_reference(x)
    assert torch.isnan(got[1, 32:64]).all(), got[1, 32:64]
    keep = torch.ones_like(got, dtype=torch.bool)
    keep[1, 32:64] = False
    assert torch.equal(got[keep], clean[keep])   # the other blocks are rounded as before, finite


# --------------------------------------------------------------------------------------------------
# the key store (CPU reference; the kernel below)
# --------------------------------------------------------------------------------------------------

def _store_case(device="cpu"):
    """kv rows: clean, one NaN, one +inf, one -inf, all NaN; positions and a freqs table."""
    torch.manual_seed(1)
    kv = torch.randn(5, 128)
    kv[1, 5], kv[2, 70], kv[3, 0], kv[4] = NAN, INF, -INF, NAN
    return kv.to(device), torch.arange(5, device=device) * 3, _freqs(device=device)


def _stored_keys(kv, pos, freqs, numerics, hadamard, layout="bf16"):
    cache = torch.zeros(1, layouts.BF16_PAGE_BYTES if layout == "bf16" else layouts.FP8_PAGE_BYTES,
                        dtype=torch.uint8, device=kv.device)
    cupy_dsa.store_index_k(kv, cache, positions=pos, out_loc=torch.arange(5, device=kv.device),
                           norm_weight=torch.full((128,), 1.25, device=kv.device), freqs_cis=freqs,
                           numerics=numerics, hadamard=hadamard)
    if layout == "bf16":
        return layouts.bf16_view(cache).reshape(-1, 128)[:5].float()
    codes = cache[0, :64 * 128].view(torch.float8_e4m3fn).view(64, 128)[:5].float()
    return codes * cache[0, 64 * 128:].view(torch.float32)[:5, None]


@pytest.mark.parametrize("numerics,layout", [("exact", "bf16"), ("fp4sim", "bf16"), ("exact", "fp8")])
def test_store_carries_nan_in_every_numerics(numerics, layout):
    """A row with a NaN or an infinity is NaN in the cache (the norm spreads it over the row), never a finite
    row (fp4sim stored -0.0 for NaN and -inf for +inf); clean rows stay finite."""
    kv, pos, freqs = _store_case()
    k = _stored_keys(kv, pos, freqs, numerics, hadamard=True, layout=layout)
    assert torch.isfinite(k[0]).all()
    for row in (1, 2, 3, 4):
        assert torch.isnan(k[row]).all(), (row, k[row, :8])


def test_store_fp4sim_without_hadamard_keeps_nan_in_its_block():
    """Without the Hadamard an infinity stays in its element after the RMS norm (inf * 0 = NaN, the others
    0): only that 32-value block is NaN, the others are exact zeros."""
    kv, pos, freqs = _store_case()
    k = _stored_keys(kv, pos, freqs, "fp4sim", hadamard=False)
    assert torch.isnan(k[3, :32]).all() and (k[3, 32:] == 0).all(), k[3]


# --------------------------------------------------------------------------------------------------
# the query prep (CPU reference; the kernel below) and its weight scale
# --------------------------------------------------------------------------------------------------

def _query_case(device="cpu"):
    torch.manual_seed(2)
    q = torch.randn(3, 64, 128).to(torch.bfloat16)
    q[0, 3, 5], q[1, 7, 70], q[2, 0, 0] = NAN, INF, -INF
    return q.to(device), torch.randn(3, 64).to(torch.bfloat16).to(device), _freqs(device=device), \
        torch.tensor([1, 2, 3], device=device)


@pytest.mark.parametrize("numerics", ["fp4sim", "fp8"])
def test_query_carries_nan_in_every_numerics(numerics):
    q, w, freqs, pos = _query_case()
    q_out, w_out = cupy_dsa.prepare_index_q(q, w, freqs_cis=freqs, positions=pos, weight_scale=WEIGHT_SCALE,
                                            numerics=numerics)
    deq = q_out.float() * (1 if numerics == "fp4sim" else w_out[..., None])   # fp8: the scale is in the weight
    for t, h in ((0, 3), (1, 7), (2, 0)):
        assert not torch.isfinite(deq[t, h]).any(), (numerics, t, h, deq[t, h, :8])
        if numerics == "fp4sim":
            assert torch.isnan(q_out[t, h].float()).all()
    assert torch.isfinite(q_out[0, :3].float()).all() and torch.isfinite(w_out[0, :3]).all()


@pytest.mark.parametrize("weight_scale", [NAN, -1.0, 0.0, INF, -INF])
def test_query_refuses_a_weight_scale_that_is_not_finite_and_positive(weight_scale):
    q, w, freqs, pos = _query_case()
    with pytest.raises(ValueError, match=r"^weight_scale: expected a finite float > 0"):
        cupy_dsa.prepare_index_q(q, w, freqs_cis=freqs, positions=pos, weight_scale=weight_scale)


def test_query_accepts_positive_weight_scales():
    q, w, freqs, pos = _query_case()
    for ws in (WEIGHT_SCALE, 1, 3.5e38):
        _, w_out = cupy_dsa.prepare_index_q(q, w, freqs_cis=freqs, positions=pos, weight_scale=ws)
        assert w_out.shape == (3, 64)


# --------------------------------------------------------------------------------------------------
# mqa_logits_plan refuses the host offsets mqa_logits refuses
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cu,match", [([0, 10, 6], "non-decreasing"), ([-4, 6, 16], "within"),
                                      ([3, 2], "non-decreasing")])
def test_varlen_plan_refuses_what_mqa_logits_refuses(cu, match):
    cu_rows = torch.tensor(cu, dtype=torch.int32)
    t = max(max(cu), 1)
    args = dict(q=torch.zeros(t, 64, 128, dtype=torch.bfloat16), kv=layouts.empty_cache(2, "bf16"),
                weights=torch.zeros(t, 64), ks=torch.zeros(t, dtype=torch.int32), ke=torch.ones(t, dtype=torch.int32),
                block_table=torch.zeros(len(cu) - 1, 2, dtype=torch.int32), cu_rows=cu_rows)
    with pytest.raises(ValueError, match=f"cu_rows: expected.*{match}"):
        cupy_dsa.mqa_logits(**args)
    with pytest.raises(ValueError, match=f"cu_rows: expected.*{match}"):
        cupy_dsa.mqa_logits_plan(cu_rows)
    with pytest.raises(ValueError, match=f"cu_rows: expected.*{match}"):
        cupy_dsa.mqa_logits_plan(cu_rows, rows=(0, 1))


# --------------------------------------------------------------------------------------------------
# GPU: the kernels' fp4 simulation does the same (NaN where the reference has NaN, the rest bit for bit)
# --------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("hadamard", [True, False])
@pytest.mark.parametrize("numerics,layout", [("exact", "bf16"), ("fp4sim", "bf16"), ("exact", "fp8")])
def test_gpu_store_kernel_carries_nan_as_the_reference(numerics, layout, hadamard):
    """Every row with a NaN or an infinity in kv stores a non-finite key; fp4sim: those rows are NaN exactly
    where the reference has NaN and zero elsewhere (the clean row's bits depend on rsqrtf: test_store.py)."""
    kv, pos, freqs = _store_case("cuda")
    got = _stored_keys(kv, pos, freqs, numerics, hadamard=hadamard, layout=layout).cpu()
    want = _stored_keys(kv.cpu(), pos.cpu(), freqs.cpu(), numerics, hadamard=hadamard, layout=layout)
    assert torch.isfinite(got[0]).all()
    for row in (1, 2, 3, 4):
        assert not torch.isfinite(got[row]).all(), (row, got[row, :8])
    if numerics == "fp4sim":
        assert torch.equal(torch.isnan(got), torch.isnan(want)), (torch.isnan(got).sum(1), torch.isnan(want).sum(1))
        assert _same_or_both_nan(got[1:], want[1:])


@pytest.mark.gpu
@pytest.mark.parametrize("numerics", ["fp4sim", "fp8"])
def test_gpu_query_kernel_carries_nan_as_the_reference(numerics):
    """The rows with a NaN or an infinity in q come out non-finite (fp4sim: NaN as the reference, to the bit
    elsewhere); the clean rows are the reference's to the bit."""
    q, w, freqs, pos = _query_case("cuda")
    q_out, w_out = cupy_dsa.prepare_index_q(q, w, freqs_cis=freqs, positions=pos, weight_scale=WEIGHT_SCALE,
                                            numerics=numerics)
    ref_q, ref_w = query.prepare_index_q_reference(q.cpu(), w.cpu(), freqs_cis=freqs.cpu(), positions=pos.cpu(),
                                                   weight_scale=WEIGHT_SCALE, numerics=numerics)
    q_out, w_out = q_out.float().cpu(), w_out.cpu()
    bad = torch.zeros(3, 64, dtype=torch.bool)
    for t, h in ((0, 3), (1, 7), (2, 0)):
        bad[t, h] = True
        deq = q_out[t, h] * (1 if numerics == "fp4sim" else w_out[t, h])
        assert not torch.isfinite(deq).any(), (numerics, t, h, deq[:8])
    assert torch.equal(q_out[~bad], ref_q.float()[~bad]) and torch.equal(w_out[~bad], ref_w[~bad])
    if numerics == "fp4sim":
        assert torch.isnan(q_out[bad]).all() and torch.equal(w_out, ref_w)
    else:  # a row's fp8 scale (folded into its weight) is NaN where the row holds a NaN, as the reference's
        assert _same_or_both_nan(w_out, ref_w), (w_out[bad], ref_w[bad])


@pytest.mark.gpu
def test_gpu_fp4sim_block_with_an_infinity_is_nan():
    """One block of one key holds +inf before the rounding (hadamard off, the norm's inf * 0): the kernel
    stores NaN there (it stored a finite value: fmaxf skipped the NaN) and exact zeros elsewhere."""
    kv, pos, freqs = _store_case("cuda")
    k = _stored_keys(kv, pos, freqs, "fp4sim", hadamard=False)
    assert torch.isnan(k[3, :32]).all() and (k[3, 32:] == 0).all(), k[3]
    assert torch.isfinite(k[0]).all()


# --------------------------------------------------------------------------------------------------
# Non-finite keys are counted at the store (never stored silently); check's self-test and the debug setting
# --------------------------------------------------------------------------------------------------

def _count_stored(kv, pos, freqs, layout, out_loc=None, numerics="exact"):
    dev = kv.device
    cache = torch.zeros(1, layouts.page_bytes("bf16" if layout == "bf16" else "fp8"), dtype=torch.uint8, device=dev)
    lo = torch.zeros_like(cache) if layout == "two-level" else None
    before = store.nonfinite_keys(dev)
    cupy_dsa.store_index_k(kv, cache, positions=pos, out_loc=torch.arange(5, device=dev) if out_loc is None else out_loc,
                           norm_weight=torch.full((128,), 1.25, device=dev), freqs_cis=freqs, numerics=numerics,
                           lo_cache=lo)
    return store.nonfinite_keys(dev) - before


@pytest.mark.parametrize("layout,numerics", [("bf16", "exact"), ("bf16", "fp4sim"), ("fp8", "exact"),
                                             ("two-level", "exact")])
def test_store_counts_nonfinite_keys(layout, numerics):
    """_store_case's rows 1-4 hold a NaN, +inf, -inf, all NaN: four keys counted; a clean batch adds none; a row the
    store skips (out_loc -1) is not stored, so not counted."""
    kv, pos, freqs = _store_case()
    assert _count_stored(kv, pos, freqs, layout, numerics=numerics) == 4
    assert _count_stored(kv[:1].repeat(5, 1), pos, freqs, layout, numerics=numerics) == 0
    skip_two = torch.tensor([0, -1, 2, -1, 4])
    assert _count_stored(kv, pos, freqs, layout, out_loc=skip_two, numerics=numerics) == 2


def test_store_from_plan_counts_nonfinite_keys():
    kv, _, freqs = _store_case()
    rows = torch.zeros(5, 16, dtype=torch.uint8)
    seq = torch.tensor([4, 8, 12, 16, 0xFFFFFFFF], dtype=torch.int64)   # the last plan row is invalid: skipped
    for b in range(4):
        rows[:, b] = ((seq >> (8 * b)) & 0xFF).to(torch.uint8)
    rows[:, 4] = torch.arange(5, dtype=torch.uint8)                       # ragged_id
    cache = layouts.empty_cache(1, "bf16")
    before = store.nonfinite_keys("cpu")
    cupy_dsa.store_index_k_from_plan(kv, rows, cache=cache, out_loc=torch.arange(5), norm_weight=torch.ones(128),
                                     freqs_cis=freqs, is_decode=False)
    assert store.nonfinite_keys("cpu") - before == 3   # rows 1, 2, 3; row 4 (all NaN) has an invalid plan row


@pytest.mark.parametrize("mode", ["bf16", "bf16-reference", "fp8-cupy", "fp8-rescore"])
def test_check_self_test_counts_planted_nonfinite_keys(mode):
    from cupy_dsa.sglang import check

    before = store.nonfinite_keys("cpu")
    assert check.nonfinite_self_test(torch.device("cpu"), mode) == (3, 3)
    assert store.nonfinite_keys("cpu") == before   # the process's count is left as it was


def test_check_self_test_fails_when_the_store_does_not_count(monkeypatch):
    from cupy_dsa.sglang import check

    monkeypatch.setattr(store, "nonfinite_counter", lambda device: torch.zeros(1, dtype=torch.int32))
    assert check.nonfinite_self_test(torch.device("cpu"), "bf16") == (0, 3)


def _plugin_store(kv, freqs):
    from cupy_dsa.sglang import core

    rows = torch.zeros(kv.shape[0], 16, dtype=torch.uint8)
    rows[:, 0] = (torch.arange(kv.shape[0]) + 1) * 4
    rows[:, 4] = torch.arange(kv.shape[0], dtype=torch.uint8)
    ang = torch.rand(64, 32) * 6.2831853
    core.store_index_k_bf16(kv, rows, is_decode=False, compress_ratio=4, norm_weight=torch.ones(128), norm_eps=1e-6,
                            freq_cis=torch.polar(torch.ones_like(ang), ang), out_loc=torch.arange(kv.shape[0]),
                            kvcache=layouts.empty_cache(1, "bf16"), mode="bf16")


def test_debug_setting_logs_each_new_nonfinite_key(monkeypatch, caplog):
    from cupy_dsa.sglang import core

    kv, _, freqs = _store_case()
    monkeypatch.delenv(core.DEBUG_NONFINITE_ENV, raising=False)
    with caplog.at_level("WARNING", logger="cupy_dsa"):
        _plugin_store(kv, freqs)
    assert "non-finite" not in caplog.text   # off by default: counted, not read (no host sync)
    monkeypatch.setenv(core.DEBUG_NONFINITE_ENV, "1")
    core.report_nonfinite_keys(torch.device("cpu"))   # what earlier stores left
    caplog.clear()
    with caplog.at_level("WARNING", logger="cupy_dsa"):
        _plugin_store(kv, freqs)
        _plugin_store(kv[:1].repeat(5, 1), freqs)
    records = [r for r in caplog.records if "non-finite" in r.getMessage()]
    assert len(records) == 1 and "4 non-finite index key(s)" in records[0].getMessage(), caplog.text
    assert core.DEBUG_NONFINITE_ENV in records[0].getMessage()


@pytest.mark.parametrize("name,value", [("SGLANG_CUPY_DSA_DEBUG_NONFINITE", "yes"),
                                        ("SGLANG_CUPY_DSA_LOGITS_BUDGET_MIB", "0"),
                                        ("SGLANG_CUPY_DSA_LOGITS_BUDGET_MIB", "2G")])
def test_debug_and_budget_settings_refuse_bad_values(monkeypatch, name, value):
    from cupy_dsa.sglang import core

    monkeypatch.setenv(name, value)
    problem = core.settings_problem("bf16")
    assert problem and problem.startswith(f"{name}={value!r}: expected"), problem


@pytest.mark.parametrize("name,value", [("SGLANG_CUPY_DSA_DEBUG_NONFINITE", "1"),
                                        ("SGLANG_CUPY_DSA_LOGITS_BUDGET_MIB", "512")])
def test_debug_and_budget_settings_are_refused_with_the_switch_off(monkeypatch, name, value):
    from cupy_dsa.sglang import core

    monkeypatch.setenv(name, value)
    assert core.settings_problem("bf16") is None
    problem = core.settings_problem("fp8")
    assert problem and problem.startswith(f"{name} set with SGLANG_CUPY_DSA_INDEX_K=fp8") and "Unset" in problem


# --------------------------------------------------------------------------------------------------
# The selects' contract on non-finite logits (CPU paths): every output index is -1 or inside its row
# --------------------------------------------------------------------------------------------------

def _poisoned_logits(rows, width, seed, device="cpu"):
    """Random logits with about a third NaN (both signs, payloads), +inf and -inf."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g)
    kind = torch.randint(0, 6, (rows, width), generator=g)
    bits = torch.randint(1, 1 << 22, (rows, width), generator=g, dtype=torch.int32)
    nan = (bits | 0x7F800000 | (torch.randint(0, 2, (rows, width), generator=g, dtype=torch.int32) << 31)).view(
        torch.float32)
    x = torch.where(kind == 0, nan, torch.where(kind == 1, torch.full_like(x, INF),
                                                torch.where(kind == 2, torch.full_like(x, -INF), x)))
    x[0] = float("nan")   # a row of NaN only
    x[1] = INF            # a row of +inf only
    return x.to(device)


def assert_inside_rows(page_indices, raw_indices, lo, hi, bt_rows, page_slots=64):
    """Each raw index is -1 or in its row's visible range [lo, hi); each page index is -1 exactly where the raw one
    is, else that position's slot in the row's block table; no row repeats a position."""
    page_indices, raw_indices = page_indices.cpu().long(), raw_indices.cpu().long()
    lo, hi, bt_rows = lo.cpu().long(), hi.cpu().long(), bt_rows.cpu().long()
    valid = raw_indices >= 0
    assert ((raw_indices == -1) | valid).all()
    assert (~valid | ((raw_indices >= lo[:, None]) & (raw_indices < hi[:, None]))).all()
    rel = (raw_indices - lo[:, None]).clamp(min=0)
    page = bt_rows.gather(1, (rel // page_slots).clamp(max=bt_rows.shape[1] - 1))
    want = torch.where(valid, page * page_slots + rel % page_slots, torch.full_like(page, -1))
    assert torch.equal(page_indices, want)
    for r in range(raw_indices.shape[0]):
        sel = raw_indices[r][valid[r]]
        assert sel.unique().numel() == sel.numel(), f"row {r} repeats a position"


def test_the_contract_check_catches_an_index_outside_its_row():
    """assert_inside_rows fails for a position past the row's length, a negative one other than -1, a page index
    that is not the position's slot, and a repeated position."""
    lens, bt = torch.tensor([100, 10]), torch.tensor([[3, 4], [5, 6]])
    raw = torch.tensor([[0, 99, -1], [9, -1, -1]])
    page = torch.tensor([[192, 64 * 4 + 35, -1], [329, -1, -1]])
    assert_inside_rows(page, raw, torch.zeros(2), lens, bt)
    for bad_raw, bad_page in ((raw.clone().index_put_((torch.tensor([1]), torch.tensor([0])), torch.tensor(10)), page),
                              (raw.clone().index_put_((torch.tensor([0]), torch.tensor([2])), torch.tensor(-2)), page),
                              (raw, page.clone().index_put_((torch.tensor([0]), torch.tensor([0])), torch.tensor(193))),
                              (raw.clone().index_put_((torch.tensor([0]), torch.tensor([1])), torch.tensor(0)),
                               page.clone().index_put_((torch.tensor([0]), torch.tensor([1])), torch.tensor(192)))):
        with pytest.raises(AssertionError):
            assert_inside_rows(bad_page, bad_raw, torch.zeros(2), lens, bt)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("op", ["paged_topk_reference", "the plugin's torch top-k"])
def test_cpu_topks_keep_indices_inside_rows(op, seed):
    """cupy_dsa's top-k reference and the plugin's torch top-k (core.topk_page_indices) on poisoned logits."""
    from cupy_dsa import topk
    from cupy_dsa.sglang import core

    rows, width, k = 9, 640, 64
    logits = _poisoned_logits(rows, width, seed)
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, width + 1, (rows,), generator=g, dtype=torch.int32)
    lens[2], lens[3] = 0, k   # an empty row and a trivial one
    page_table = torch.randint(0, 50, (rows, width // 64), generator=g, dtype=torch.int32)
    if op == "paged_topk_reference":
        out = topk.paged_topk_reference(logits, lens, page_table, k, raw_indices=True)
        page_idx, raw = out.page_indices, out.raw_indices
    else:
        page_idx, raw = core.topk_page_indices(logits, lens, page_table, k)
    assert_inside_rows(page_idx, raw, torch.zeros(rows), lens, page_table)
    full = (lens > k).nonzero().flatten()
    assert ((raw[full] >= 0).sum(1) == k).all()   # a full row still selects k keys, NaN or not


def _two_level_case(n_pages, seed, poison_keys=True):
    """Two-level caches of n_pages pages whose kv rows hold some NaN / inf (non-finite keys), plus a clean q."""
    g = torch.Generator().manual_seed(seed)
    n = n_pages * 64
    kv = torch.randn(n, 128, generator=g)
    if poison_keys:
        kv[::17, 3] = NAN
        kv[5::29, 90] = INF
    hi = layouts.empty_cache(n_pages, "fp8")
    lo = torch.zeros_like(hi)
    freqs = _freqs(max_pos=4 * n + 4)
    cupy_dsa.store_index_k(kv, hi, positions=torch.arange(n) * 4, out_loc=torch.arange(n), norm_weight=torch.ones(128),
                           freqs_cis=freqs, lo_cache=lo)
    return hi, lo, g


@pytest.mark.parametrize("seed", range(2))
def test_rescore_reference_keeps_indices_inside_rows(seed):
    """fp8-rescore's CPU selects (decode and prefill) with poisoned stage-1 logits and non-finite keys (NaN stage-2
    scores)."""
    from cupy_dsa import rescore

    n_pages, k, kp = 6, 32, 96
    hi, lo, g = _two_level_case(n_pages, seed)
    B, width = 5, n_pages * 64
    q = torch.randn(B, 1, 64, 128, generator=g).to(torch.float8_e4m3fn)
    w = torch.rand(B, 64, generator=g)
    lens = torch.tensor([width, 200, k, 0, 150], dtype=torch.int32)
    bt = torch.stack([torch.randperm(n_pages, generator=g) for _ in range(B)]).to(torch.int32)
    out = rescore.rescore_topk_reference(q, w, hi, lo, lens, bt, k, kp, stage1_logits=_poisoned_logits(B, width, seed))
    assert_inside_rows(out.page_indices, out.raw_indices, torch.zeros(B), lens, bt)
    T = 6
    ks = torch.zeros(T, dtype=torch.int32)
    ke = torch.tensor([width, 300, 64, 0, k, 130], dtype=torch.int32)
    qp = torch.randn(T, 64, 128, generator=g).to(torch.float8_e4m3fn)
    out = rescore.rescore_topk_prefill_reference(qp, torch.rand(T, 64, generator=g), hi, lo, ks, ke, bt[0], k, kp,
                                                 stage1_logits=_poisoned_logits(T, width, seed + 10))
    assert_inside_rows(out.page_indices, out.raw_indices, ks, ke, bt[:1].expand(T, -1))


# --------------------------------------------------------------------------------------------------
# GPU (the lead runs these): the kernels count as the reference, and the selects keep the contract on
# non-finite logits with this GPU's configs and with sm_120's forced
# --------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("layout,numerics", [("bf16", "exact"), ("bf16", "fp4sim"), ("fp8", "exact"),
                                             ("two-level", "exact")])
def test_gpu_store_kernel_counts_nonfinite_keys(layout, numerics):
    kv, pos, freqs = _store_case("cuda")
    assert _count_stored(kv, pos, freqs, layout, numerics=numerics) == 4
    assert _count_stored(kv[:1].repeat(5, 1), pos, freqs, layout, numerics=numerics) == 0
    skip_two = torch.tensor([0, -1, 2, -1, 4], device="cuda")
    assert _count_stored(kv, pos, freqs, layout, out_loc=skip_two, numerics=numerics) == 2


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["bf16", "fp8-cupy", "fp8-rescore"])
def test_gpu_check_self_test_counts_planted_nonfinite_keys(mode):
    from cupy_dsa.sglang import check

    assert check.nonfinite_self_test(torch.device("cuda"), mode) == (3, 3)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("rows,width,k", [(9, 640, 64), (48, 24576, 512), (3, 65536, 1024), (130, 6144, 512)])
def test_gpu_paged_topk_keeps_indices_inside_rows(forced_arch, rows, width, k, seed):
    from cupy_dsa import topk

    logits = _poisoned_logits(rows, width, seed, "cuda")
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, width + 1, (rows,), generator=g, dtype=torch.int32)
    lens[2] = 0
    page_table = torch.randint(0, 1 << 20, (rows, width // 64), generator=g, dtype=torch.int32)
    out = topk.paged_topk(logits, lens.cuda(), page_table.cuda(), k, raw_indices=True)
    torch.cuda.synchronize()
    assert_inside_rows(out.page_indices, out.raw_indices, torch.zeros(rows), lens, page_table)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(3))
def test_gpu_rescore_keeps_indices_inside_rows(forced_arch, seed):
    from cupy_dsa import rescore

    n_pages, k, kp = 40, 64, 256
    hi, lo, g = _two_level_case(n_pages, seed)
    hi, lo = hi.cuda(), lo.cuda()
    B, width = 6, n_pages * 64
    q = torch.randn(B, 1, 64, 128, generator=g).to(torch.float8_e4m3fn).cuda()
    w = torch.rand(B, 64, generator=g).cuda()
    lens = torch.tensor([width, 1000, k, 0, 700, width - 3], dtype=torch.int32)
    bt = torch.stack([torch.randperm(n_pages, generator=g) for _ in range(B)]).to(torch.int32)
    out = rescore.rescore_topk(q, w, hi, lo, lens.cuda(), bt.cuda(), k, kp,
                               stage1_logits=_poisoned_logits(B, width, seed, "cuda"))
    torch.cuda.synchronize()
    assert_inside_rows(out.page_indices, out.raw_indices, torch.zeros(B), lens, bt)
    T = 6
    ks = torch.zeros(T, dtype=torch.int32)
    ke = torch.tensor([width, 300, 64, 0, k, 1300], dtype=torch.int32)
    qp = torch.randn(T, 64, 128, generator=g).to(torch.float8_e4m3fn).cuda()
    out = rescore.rescore_topk_prefill(qp, torch.rand(T, 64, generator=g).cuda(), hi, lo, ks.cuda(), ke.cuda(),
                                       bt[0].cuda(), k, kp, stage1_logits=_poisoned_logits(T, width, seed + 10, "cuda"))
    torch.cuda.synchronize()
    assert_inside_rows(out.page_indices, out.raw_indices, ks, ke, bt[:1].expand(T, -1))
