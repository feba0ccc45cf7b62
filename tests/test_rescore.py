"""Two-level keys (``cupy_dsa.rescore``): the hi page is SGLang's fp8 bytes, the int8 residual's precision, and the
two-stage top-k against brute force, a constructed miss, mixed row lengths and bad input (CPU references)."""
import math

import pytest
import torch

import cupy_dsa
from cupy_dsa import layouts, rescore, store, topk
from cupy_dsa.layouts import PAGE_SLOTS


def _keys(n, outlier=20.0, seed=0):
    """Rotated keys as the store makes them, from raw keys with 4 outlier channels (scale ``outlier``)."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(0.75 * torch.randn(128, generator=g))
    scale[torch.randperm(128, generator=g)[:4]] *= outlier
    kv = (torch.randn(128, generator=g) + 0.3 * torch.randn(n, 128, generator=g)) * scale
    ang = (torch.rand(4 * n, 32, generator=g, dtype=torch.float64) * 2 - 1) * math.pi
    freqs = torch.stack((ang.cos(), ang.sin()), -1).reshape(4 * n, 64).float()
    pos = 4 * torch.arange(n)
    w = torch.rand(128, generator=g) + 0.5
    return kv, pos, w, freqs


def _paged(k, seed=0):
    """k [B, n, 128] stored two-level into random pages: (hi, lo, block_table int32 [B, n/64])."""
    B, n = k.shape[:2]
    g = torch.Generator().manual_seed(seed)
    P = B * n // PAGE_SLOTS
    table = torch.randperm(P, generator=g).view(B, n // PAGE_SLOTS).to(torch.int32)
    ar = torch.arange(n)
    out_loc = (table.long()[:, ar // PAGE_SLOTS] * PAGE_SLOTS + ar % PAGE_SLOTS).reshape(-1)
    hi, lo = layouts.empty_cache(P, "fp8"), rescore.empty_lo_cache(P)
    rescore.store_two_level_reference(k.reshape(-1, 128), hi, lo, out_loc)
    return hi, lo, table


def _query(B, next_n, seed=0, q_dtype=torch.float8_e4m3fn):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, next_n, 64, 128, generator=g)
    w = (torch.rand(B * next_n, 64, generator=g) + 0.5) / math.sqrt(8192)
    if q_dtype == torch.float8_e4m3fn:
        s = q.abs().amax(-1).clamp_min(1e-4) / 448.0
        return (q / s[..., None]).to(q_dtype).contiguous(), (w * s.reshape(B * next_n, 64)).contiguous()
    return q.to(q_dtype).contiguous(), w.contiguous()


@pytest.mark.parametrize("outlier", [1.0, 20.0, 80.0])
def test_hi_bytes_equal_the_fp8_store(outlier):
    kv, pos, w, freqs = _keys(256, outlier)
    P = 6
    out_loc = torch.randperm(P * PAGE_SLOTS)[:256]
    ref = layouts.empty_cache(P, "fp8")
    store.store_index_k(kv, ref, positions=pos, out_loc=out_loc, norm_weight=w, freqs_cis=freqs)
    k = store.rotate_index_k_reference(kv, pos, w, freqs)
    hi, lo = layouts.empty_cache(P, "fp8"), rescore.empty_lo_cache(P)
    rescore.store_two_level_reference(k, hi, lo, out_loc)
    assert torch.equal(hi, ref)
    codes, scales, lo_codes, lo_scales = rescore.residual_encode_reference(k)
    c_ref, s_ref = store.fp8_quantize_reference(k)
    assert torch.equal(codes, c_ref) and torch.equal(scales, s_ref)
    # the lo page holds the codes and scales where the hi page holds its own
    v, s = rescore.lo_views(lo)
    page, slot = out_loc >> 6, out_loc & 63
    assert torch.equal(v[page, slot], lo_codes) and torch.equal(s[page, slot], lo_scales)
    untouched = ~torch.isin(torch.arange(P * PAGE_SLOTS), out_loc).view(P, PAGE_SLOTS)
    assert bool((v[untouched] == 0).all()) and bool((s[untouched] == 0).all())


def _rel(kh, k):
    return ((kh.double() - k.double()).norm(dim=-1) / k.double().norm(dim=-1))


@pytest.mark.parametrize("outlier", [1.0, 20.0, 80.0])
def test_residual_precision_beats_bf16(outlier):
    kv, pos, w, freqs = _keys(4096, outlier, seed=3)
    k = store.rotate_index_k_reference(kv, pos, w, freqs)
    hi, hs, lo, ls = rescore.residual_encode_reference(k)
    k_hat = rescore.two_level_dequant_reference(hi, hs, lo, ls)
    fp8 = hi.view(torch.float8_e4m3fn).float() * hs[:, None]
    e2, e8, eb = _rel(k_hat, k), _rel(fp8, k), _rel(k.to(torch.bfloat16).float(), k)
    # the int8 grid: every element within half a step (plus fp32 rounding of the sum)
    assert bool(((k_hat - k).abs() <= ls[:, None] * (0.5 + 1e-3) + 1e-6 * k.abs()).all())
    # the residual never exceeds half an e4m3 step of the top binade: 16 hi scales
    assert bool((ls * 127 <= hs * 16 * (1 + 1e-5)).all())
    # the docstring's claim: ~100x below fp8 alone, several times below a bf16 copy, key by key and on average
    assert bool((e2 < e8 / 50).all()), float((e2 / e8).max())
    assert float(e2.mean()) < float(eb.mean()) / 5, (float(e2.mean()), float(eb.mean()))
    assert float(e2.max()) < float(eb.median()) / 2
    assert float(e2.mean()) < 4e-4 and float(eb.mean()) > 1e-3     # the magnitudes the docstring quotes
    # the indexer score: sum_h relu(q_h . k) w_h, error relative to sum_h |q_h . k| w_h
    g = torch.Generator().manual_seed(1)
    q = torch.randn(8, 64, 128, generator=g, dtype=torch.float64)
    wt = torch.rand(8, 64, generator=g, dtype=torch.float64)

    def score(kk):
        return torch.einsum("rhn,rh->rn", torch.einsum("rhd,nd->rhn", q, kk.double()).clamp_min(0), wt)

    exact = score(k)
    scale = torch.einsum("rhn,rh->rn", torch.einsum("rhd,nd->rhn", q, k.double()).abs(), wt)
    err2 = ((score(k_hat) - exact).abs() / scale).max()
    errb = ((score(k.to(torch.bfloat16).float()) - exact).abs() / scale).max()
    assert float(err2) < float(errb) / 3, (float(err2), float(errb))


def test_zero_and_exactly_representable_keys():
    k = torch.zeros(3, 128)
    k[1, :] = 448.0                      # hi exact: no residual
    k[2, 5] = -3.0
    hi, hs, lo, ls = rescore.residual_encode_reference(k)
    assert bool((lo == 0).all()) and bool((ls == 1.0).all())
    assert torch.equal(rescore.two_level_dequant_reference(hi, hs, lo, ls), k)


def _fp8_scores(q, w, k_fp8):
    """fp64 stage-1 score of one row: k_fp8 [n, 128] dequantized hi keys (scale inside)."""
    return (torch.einsum("hd,nd->hn", q.double(), k_fp8.double()).clamp_min(0) * w.double()[:, None]).sum(0)


def _stage2_keys(hv, hs, lv, ls):
    """fp64 values of the keys stage 2 scores ([N, 128]): the combined f16 key in units of 256 hi_scale."""
    return rescore.combined_key_reference(hv, hs, lv, ls).double() * (256.0 * hs.double()[:, None])


def test_combined_key_is_k_hat_rounded_to_f16():
    """The combined key is k_hat to f16's 11 significant bits (relative error <= 2^-11 per element, plus the fp32
    steps), finer than a bf16 copy of k_hat (2^-9), exactly k_hat where the lo codes are 0, and 0 for a slot never
    stored (both scales 0)."""
    kv, pos, w, freqs = _keys(2048, 20.0, seed=3)
    k = store.rotate_index_k_reference(kv, pos, w, freqs)
    hi, hs, lo, ls = rescore.residual_encode_reference(k)
    k_hat = rescore.two_level_dequant_reference(hi, hs, lo, ls).double()
    c = _stage2_keys(hi, hs, lo, ls)
    rel = ((c - k_hat).abs() / k_hat.abs().clamp_min(1e-30))[k_hat.abs() > 1e-3 * k_hat.abs().amax(1, keepdim=True)]
    assert float(rel.max()) <= 2 ** -11 * (1 + 1e-3)
    assert float(rel.max()) > 2 ** -14                                      # it is rounded: the test can tell
    bf16 = (k_hat.to(torch.bfloat16).double() - k_hat).abs()
    assert float((c - k_hat).abs().sum()) < 0.5 * float(bf16.sum())
    zero_lo = torch.zeros_like(lo)
    assert torch.equal(_stage2_keys(hi, hs, zero_lo, ls), hi.view(torch.float8_e4m3fn).double() * hs.double()[:, None])
    unstored = torch.zeros(1, 128, dtype=torch.uint8)
    assert torch.equal(rescore.combined_key_reference(unstored, torch.zeros(1), zero_lo[:1], torch.zeros(1)),
                       torch.zeros(1, 128, dtype=torch.float16))


def _brute(q, w, hi_keys, k_hat, n, index_topk, k_prime):
    """One row, fp64, no tie care: candidates = fp8 top k_prime of the first n keys; then top index_topk of the
    exact scores. Returns the selected positions as a set."""
    if n <= index_topk:
        return set(range(n))
    s1 = _fp8_scores(q, w, hi_keys[:n])
    cand = torch.argsort(s1, descending=True)[:k_prime]
    s2 = _fp8_scores(q, w, k_hat[cand])
    return set(cand[torch.argsort(s2, descending=True)[:index_topk]].tolist())


@pytest.mark.parametrize("next_n,q_dtype", [(1, torch.float8_e4m3fn), (2, torch.bfloat16)])
def test_mixed_row_lengths_against_brute_force(next_n, q_dtype):
    B, n, K, KP = 5, 256, 16, 40
    kv, pos, w, freqs = _keys(B * n, 20.0, seed=5)
    k = store.rotate_index_k_reference(kv, pos, w, freqs).view(B, n, 128)
    hi, lo, table = _paged(k, seed=6)
    q, wt = _query(B, next_n, seed=7, q_dtype=q_dtype)
    lens = torch.tensor([256, 0, 10, 17, 100], dtype=torch.int32)   # rows shorter than K, empty, K' > len > K
    res = rescore.rescore_topk_reference(q, wt, hi, lo, lens, table, K, KP)
    assert all(t.dtype == torch.int32 and tuple(t.shape) == (B * next_n, K) for t in res)
    dq = layouts.dequantize(hi).view(-1, 128)
    hv, hs = layouts.fp8_views(hi)
    lv, ls = rescore.lo_views(lo)
    k_hat = _stage2_keys(hv.reshape(-1, 128), hs.reshape(-1), lv.reshape(-1, 128), ls.reshape(-1))
    for b in range(B):
        slots = (table[b].long()[:, None] * PAGE_SLOTS + torch.arange(PAGE_SLOTS)).reshape(-1)
        for j in range(next_n):
            r = b * next_n + j
            L = max(0, int(lens[b]) - (next_n - 1 - j))
            want = _brute(q[b, j].float(), wt[r], dq[slots], k_hat[slots], L, K, KP)
            raw = res.raw_indices[r]
            got = set(raw[raw >= 0].tolist())
            assert got == want, (b, j, L)
            assert int((raw >= 0).sum()) == min(L, K)
            assert bool((raw[min(L, K):] == -1).all()) and bool((res.page_indices[r][min(L, K):] == -1).all())
            sel = raw[raw >= 0].long()
            assert torch.equal(res.page_indices[r][:len(sel)].long(), slots[sel])
            if 0 < L <= K:                                   # trivial rows: 0..L-1 in order, as SGLang
                assert raw[:L].tolist() == list(range(L))
            # the reported stage-1 ranks are the keys' ranks among the row's fp8 scores
            s1 = _fp8_scores(q[b, j].float(), wt[r], dq[slots][:L])
            order = torch.argsort(s1, descending=True).tolist()
            rank = {p: i for i, p in enumerate(order)}
            assert res.fp8_rank[r][:len(sel)].tolist() == [rank[p] for p in sel.tolist()]


def test_all_keys_as_candidates_give_the_exact_top_k():
    """K' = every key: the selection is the top-k of the exact scores of the stage-2 keys (fp64 oracle, up to
    near-ties), and of the unrounded keys within the stage-2 keys' error,
    which differs from fp8's own top-k here (so the test would see an fp8 selection)."""
    B, n, K = 3, 1024, 64
    kv, pos, w, freqs = _keys(B * n, 80.0, seed=11)
    k = store.rotate_index_k_reference(kv, pos, w, freqs).view(B, n, 128)
    hi, lo, table = _paged(k, seed=12)
    q, wt = _query(B, 1, seed=13)
    lens = torch.full((B,), n, dtype=torch.int32)
    res = rescore.rescore_topk_reference(q, wt, hi, lo, lens, table, K, n)
    fp8_only = rescore.rescore_topk_reference(q, wt, hi, lo, lens, table, K, K)
    hv, hs = layouts.fp8_views(hi)
    lv, ls = rescore.lo_views(lo)
    differs = 0
    for b in range(B):
        slots = (table[b].long()[:, None] * PAGE_SLOTS + torch.arange(PAGE_SLOTS)).reshape(-1)
        k_hat = _stage2_keys(hv.reshape(-1, 128)[slots], hs.reshape(-1)[slots], lv.reshape(-1, 128)[slots],
                             ls.reshape(-1)[slots])
        qb = q[b, 0].float()
        sel = res.raw_indices[b].long()
        # oracle 1: fp64 scores of k_hat (the stage-2 keys); fp32 accumulation only
        # oracle 2: fp64 scores of the unrounded keys k, within the bound of |k_hat - k| on each key's score
        bound = (qb.double().abs() @ (k_hat - k[b]).double().abs().T * wt[b].double()[:, None]).sum(0)
        for keys, tol in ((k_hat, None), (k[b], 2 * float(bound.max()))):
            exact = _fp8_scores(qb, wt[b], keys)
            tol = 4e-6 * float(exact.abs().max()) if tol is None else tol
            kth = exact.topk(K).values[-1]
            assert bool((exact[sel] >= kth - tol).all())                 # nothing below the k-th exact score
            assert set(torch.nonzero(exact > kth + tol).flatten().tolist()) <= set(sel.tolist())   # all above
        assert bool((res.fp8_rank[b] >= 0).all())
        differs += len(set(fp8_only.raw_indices[b].tolist()) ^ set(sel.tolist()))
    assert differs > 0, "fp8 alone already gives the exact top-k: the case cannot tell the stages apart"


def _miss_case(n_b=20):
    """Key A (position n_b + 5) has the best exact score, but fp8 rounds it below n_b keys B (positions 0..n_b-1)
    whose exact scores are lower: A's stage-1 rank is n_b."""
    n = 64
    k = torch.zeros(1, n, 128)
    k[0, :, 0] = torch.linspace(10.0, 50.0, n)             # fillers
    k[0, :, 1] = 448.0                                     # hi scale 1
    k[0, :n_b, 0] = 99.0 - 0.01 * torch.arange(n_b)        # B: exact 99.0.., scale 0.97: code 104 -> 100.9
    k[0, :n_b, 1] = 448.0 * 0.97
    a = n_b + 5
    k[0, a, 0], k[0, a, 1] = 99.9, 448.0 * 1.1             # A: scale 1.1, 99.9 / 1.1 -> code 88 -> 96.8
    hi, lo, table = _paged(k, seed=1)
    q = torch.zeros(1, 1, 64, 128)
    q[0, 0, 0, 0] = 1.0
    w = torch.zeros(1, 64)
    w[0, 0] = 1.0
    return q.to(torch.float8_e4m3fn), w, hi, lo, table, a


def test_small_k_prime_misses_a_constructed_key():
    n_b, K = 20, 8
    q, w, hi, lo, table, a = _miss_case(n_b)
    lens = torch.tensor([64], dtype=torch.int32)
    exact_top = {a} | set(range(K - 1))                    # A and B0..B6
    hit = rescore.rescore_topk_reference(q, w, hi, lo, lens, table, K, n_b + 1)
    assert set(hit.raw_indices[0].tolist()) == exact_top
    assert hit.fp8_rank[0][hit.raw_indices[0] == a].tolist() == [n_b]
    sel = hit.raw_indices[0].tolist()
    assert sel == sorted(sel)                              # position order
    miss = rescore.rescore_topk_reference(q, w, hi, lo, lens, table, K, n_b)
    assert set(miss.raw_indices[0].tolist()) == set(range(K)), "K' = fp8 rank of A must lose A"
    assert bool((miss.fp8_rank[0] < n_b).all())


def test_keys_of_invalid_pages_are_never_selected():
    kv, pos, w, freqs = _keys(128, 20.0, seed=9)
    k = store.rotate_index_k_reference(kv, pos, w, freqs).view(1, 128, 128)
    hi, lo, table = _paged(k, seed=2)
    table = torch.tensor([[int(table[0, 0]), -1]], dtype=torch.int32)   # the second page is not in the caches
    q, wt = _query(1, 1, seed=4)
    res = rescore.rescore_topk_reference(q, wt, hi, lo, torch.tensor([128], dtype=torch.int32), table, 80, 128)
    raw = res.raw_indices[0]
    assert sorted(raw[raw >= 0].tolist()) == list(range(64)) and bool((raw[64:] == -1).all())
    assert bool((res.page_indices[0][64:] == -1).all()) and bool((res.fp8_rank[0][64:] == -1).all())


def test_stage1_logits_given_or_computed_agree():
    q, w, hi, lo, table, a = _miss_case()
    lens = torch.tensor([64], dtype=torch.int32)
    from cupy_dsa.logits import paged_mqa_logits_reference
    s1 = paged_mqa_logits_reference(q, hi, w, lens, table, 64)
    r1 = rescore.rescore_topk_reference(q, w, hi, lo, lens, table, 8, 21)
    r2 = rescore.rescore_topk_reference(q, w, hi, lo, lens, table, 8, 21, stage1_logits=s1)
    assert all(torch.equal(x, y) for x, y in zip(r1, r2))


def _shuffled_candidates(s1, lens, KP, extra, seed):
    """Each row's exact stage-1 top-KP positions (SGLang's top-k at k = KP), in a random order, then `extra` -1s:
    int32 [R, KP + extra]; a row that sees fewer keys lists them all."""
    g = torch.Generator().manual_seed(seed)
    R, width = s1.shape
    out = torch.full((R, KP + extra), -1, dtype=torch.int32)
    for r in range(R):
        n = min(int(lens[r]), width)
        top = torch.sort(s1[r, :n], descending=True, stable=True).indices[:KP]
        out[r, :len(top)] = top[torch.randperm(len(top), generator=g)].to(torch.int32)
    return out[:, torch.randperm(KP + extra, generator=g)].contiguous()


def test_given_candidates_select_as_the_own_select():
    """SGLang's top-k hands the same K' positions in arrival order (and -1 padding): the selection is the one of
    cupy_dsa's own candidates; a subset of them is selected from as such (its best by stage-2 score)."""
    B, n, K, KP = 4, 512, 16, 64
    _, hi, lo, table = _case(B, n, seed=40)
    q, w = _query(B, 1, seed=41)
    lens = torch.tensor([512, 300, 30, 10], dtype=torch.int32)
    from cupy_dsa.logits import paged_mqa_logits_reference
    s1 = paged_mqa_logits_reference(q, hi, w, lens, table, n)
    want = rescore.rescore_topk_reference(q, w, hi, lo, lens, table, K, KP, stage1_logits=s1)
    given = _shuffled_candidates(s1, lens, KP, 5, seed=42)
    got = rescore.rescore_topk(q, w, hi, lo, lens, table, K, stage1_logits=s1, candidates=given, fp8_rank=True)
    assert all(torch.equal(x, y) for x, y in zip(got, want))
    half = given.clone()
    half[:, ::2] = -1                                                     # drop every other candidate
    sub = rescore.rescore_topk(q, w, hi, lo, lens, table, K, stage1_logits=s1, candidates=half)
    kh = _k_hat(hi, lo)
    for r in range(2):                                                    # the two rows with more than K' keys
        cand = half[r][half[r] >= 0].long()
        slots = table[r].long()[cand // PAGE_SLOTS] * PAGE_SLOTS + cand % PAGE_SLOTS
        best = cand[_scores64(q[r].float(), w[r:r + 1], kh, slots[None])[0].topk(K).indices]
        assert set(sub.raw_indices[r].tolist()) == set(best.tolist())
    with pytest.raises(ValueError, match="^candidates: expected together with stage1_logits"):
        rescore.rescore_topk(q, w, hi, lo, lens, table, K, candidates=given)
    with pytest.raises(TypeError, match="^candidates: expected dtype"):
        rescore.rescore_topk(q, w, hi, lo, lens, table, K, stage1_logits=s1, candidates=given.long())
    with pytest.raises(ValueError, match=r"^candidates: expected shape \[4, K'\] with K' >= index_topk \(16\)"):
        rescore.rescore_topk(q, w, hi, lo, lens, table, K, stage1_logits=s1, candidates=given[:, :8].contiguous())


def test_bad_input_names_the_argument():
    q, w, hi, lo, table, a = _miss_case()
    lens = torch.tensor([64], dtype=torch.int32)
    call = rescore.rescore_topk_reference
    with pytest.raises(ValueError, match="k_prime"):
        call(q, w, hi, lo, lens, table, 8, 4)
    with pytest.raises(ValueError, match="index_topk"):
        call(q, w, hi, lo, lens, table, 0, 4)
    with pytest.raises(TypeError, match="k_prime"):
        call(q, w, hi, lo, lens, table, 8, 16.0)
    with pytest.raises(ValueError, match="hi_cache"):
        call(q, w, layouts.empty_cache(1, "bf16"), lo, lens, table, 8, 16)
    with pytest.raises(ValueError, match="lo_cache"):
        call(q, w, hi, rescore.empty_lo_cache(2), lens, table, 8, 16)
    with pytest.raises(TypeError, match="lo_cache"):
        call(q, w, hi, lo.view(torch.int8), lens, table, 8, 16)
    with pytest.raises(ValueError, match="weights"):
        call(q, w[:, :32].contiguous(), hi, lo, lens, table, 8, 16)
    with pytest.raises(TypeError, match="context_lens"):
        call(q, w, hi, lo, lens.long(), table, 8, 16)
    with pytest.raises(ValueError, match="stage1_logits"):
        call(q, w, hi, lo, lens, table, 8, 16, stage1_logits=torch.zeros(2, 64))
    with pytest.raises(TypeError, match="q"):
        call(q.float(), w, hi, lo, lens, table, 8, 16)
    with pytest.raises(TypeError, match="k"):
        rescore.residual_encode_reference(torch.zeros(2, 128, dtype=torch.float16))
    with pytest.raises(ValueError, match="k"):
        rescore.residual_encode_reference(torch.zeros(2, 64))
    hi_c, hs, lo_c, ls = rescore.residual_encode_reference(torch.randn(4, 128))
    with pytest.raises(ValueError, match="lo_scale"):
        rescore.two_level_dequant_reference(hi_c, hs, lo_c, ls[:2])
    with pytest.raises(TypeError, match="lo"):
        rescore.two_level_dequant_reference(hi_c, hs, lo_c.view(torch.uint8), ls)
    with pytest.raises(ValueError, match="out_loc"):
        rescore.store_two_level_reference(torch.randn(4, 128), hi, lo, torch.zeros(3, dtype=torch.int64))


def test_two_level_bytes_per_entry():
    assert rescore.TWO_LEVEL_BYTES_PER_TOKEN == 264
    assert rescore.TWO_LEVEL_BYTES_PER_TOKEN <= 1.05 * layouts.BF16_BYTES_PER_TOKEN


# --------------------------------------------------------------------------------------------------
# The ops' contracts on CPU (the references): prefill and varlen rows, the stage-2 query, stage-2 scores
# --------------------------------------------------------------------------------------------------

def _case(B=3, n=256, seed=20, outlier=20.0):
    """Two-level caches of B requests of n keys each, their keys k [B, n, 128] and block table [B, n / 64]."""
    kv, pos, w, freqs = _keys(B * n, outlier, seed=seed)
    k = store.rotate_index_k_reference(kv, pos, w, freqs).view(B, n, 128)
    hi, lo, table = _paged(k, seed=seed + 1)
    return k, hi, lo, table


def _k_hat(hi, lo):
    """fp64 stage-2 key of every slot [P * 64, 128]: the combined f16 key times 256 hi_scale."""
    hv, hs = layouts.fp8_views(hi)
    lv, ls = rescore.lo_views(lo)
    return _stage2_keys(hv.reshape(-1, 128), hs.reshape(-1), lv.reshape(-1, 128), ls.reshape(-1))


def _scores64(q2, w2, k_hat, slots):
    """fp64 stage-2 scores [R, n] of slots [R, n] (page * 64 + slot) for q2 [R, 64, 128], w2 [R, 64]."""
    kh = k_hat[slots]                                                      # [R, n, 128]
    s = torch.einsum("rhd,rnd->rhn", q2.double(), kh).clamp_min(0)
    return torch.einsum("rhn,rh->rn", s, w2.double())


def test_default_k_prime_is_four_times_index_topk():
    _, hi, lo, table = _case()
    q, w = _query(3, 1, seed=21)
    lens = torch.tensor([256, 100, 30], dtype=torch.int32)
    a = rescore.rescore_topk_reference(q, w, hi, lo, lens, table, 16)
    b = rescore.rescore_topk_reference(q, w, hi, lo, lens, table, 16, 64)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    c = cupy_dsa.rescore_topk(q, w, hi, lo, lens, table, 16, fp8_rank=True)   # CPU tensors: the reference
    assert all(torch.equal(x, y) for x, y in zip(a, c))
    plain = cupy_dsa.rescore_topk(q, w, hi, lo, lens, table, 16)          # ranks only when asked for
    assert plain.fp8_rank is None and torch.equal(plain.raw_indices, a.raw_indices)


def test_prefill_rows_equal_decode_rows_of_the_same_keys():
    """A prefill row that sees [0, ke) of one request selects what a decode row of length ke does."""
    _, hi, lo, table = _case(B=1, n=512, seed=22)
    T = 6
    q, w = _query(T, 1, seed=23)
    ke = torch.tensor([512, 500, 31, 0, 200, 64], dtype=torch.int32)
    pre = rescore.rescore_topk_prefill_reference(q[:, 0].contiguous(), w, hi, lo, torch.zeros_like(ke), ke, table[0],
                                                 32, 96)
    dec = rescore.rescore_topk_reference(q, w, hi, lo, ke[:, None].contiguous(), table.expand(T, -1).contiguous(),
                                         32, 96)
    assert all(torch.equal(x, y) for x, y in zip(pre, dec))


def test_prefill_rows_see_only_ks_to_ke():
    """Rows with ks > 0: the selection lies in [ks, ke), equals brute force there; a trivial row selects
    ks .. ke - 1 in order."""
    k, hi, lo, table = _case(B=1, n=512, seed=24)
    T, K, KP = 4, 16, 40
    q, w = _query(T, 1, seed=25)
    ks = torch.tensor([0, 100, 300, 500], dtype=torch.int32)
    ke = torch.tensor([512, 400, 310, 512], dtype=torch.int32)            # 310 - 300 = 10 and 12 keys: trivial
    res = rescore.rescore_topk_prefill_reference(q[:, 0].contiguous(), w, hi, lo, ks, ke, table, K, KP)
    dq = layouts.dequantize(hi).view(-1, 128)
    kh = _k_hat(hi, lo).float()
    slots = (table[0].long()[:, None] * PAGE_SLOTS + torch.arange(PAGE_SLOTS)).reshape(-1)
    for r in range(T):
        a, b = int(ks[r]), int(ke[r])
        raw = res.raw_indices[r]
        if b - a <= K:
            assert raw[:b - a].tolist() == list(range(a, b)) and bool((raw[b - a:] == -1).all())
            continue
        want = {a + i for i in _brute(q[r, 0].float(), w[r], dq[slots][a:b], kh[slots][a:b], b - a, K, KP)}
        assert set(raw.tolist()) == want
        assert torch.equal(res.page_indices[r].long(), slots[raw.long()])


def test_varlen_prefill_equals_one_call_per_request():
    """cu_rows: request b's rows see its own block-table row; rows of no request select nothing."""
    _, hi, lo, table = _case(B=3, n=256, seed=26)
    cu = torch.tensor([0, 3, 3, 7], dtype=torch.int32)                   # request 1 has no rows; rows 7, 8 none
    T = 9
    q, w = _query(T, 1, seed=27)
    q = q[:, 0].contiguous()
    ks = torch.tensor([0, 10, 0, 0, 0, 50, 0, 0, 0], dtype=torch.int32)
    ke = torch.tensor([256, 200, 20, 256, 128, 256, 60, 256, 256], dtype=torch.int32)
    res = rescore.rescore_topk_prefill_reference(q, w, hi, lo, ks, ke, table, 16, 48, cu_rows=cu)
    for b in range(3):
        r0, r1 = int(cu[b]), int(cu[b + 1])
        if r1 == r0:
            continue
        one = rescore.rescore_topk_prefill_reference(q[r0:r1], w[r0:r1], hi, lo, ks[r0:r1], ke[r0:r1], table[b],
                                                     16, 48)
        assert all(torch.equal(x[r0:r1], y) for x, y in zip(res, one)), b
    assert all(bool((x[7:] == -1).all()) for x in res)


def test_bf16_stage2_query_uses_its_own_weights():
    """q_rescore (bf16 of the unquantized q) with weights_rescore (no fp8 scale): the selection is brute force
    with that query in stage 2, fp8 q in stage 1."""
    k, hi, lo, table = _case(B=2, n=256, seed=28)
    g = torch.Generator().manual_seed(29)
    qf = torch.randn(2, 1, 64, 128, generator=g)
    wf = (torch.rand(2, 64, generator=g) + 0.5) / math.sqrt(8192)
    s = qf.abs().amax(-1).clamp_min(1e-4) / 448.0
    q8, w8 = (qf / s[..., None]).to(torch.float8_e4m3fn), (wf * s.reshape(2, 64)).contiguous()
    qb = qf.to(torch.bfloat16)
    lens = torch.tensor([256, 256], dtype=torch.int32)
    res = rescore.rescore_topk_reference(q8, w8, hi, lo, lens, table, 16, 64, q_rescore=qb, weights_rescore=wf)
    same = rescore.rescore_topk_reference(q8, w8, hi, lo, lens, table, 16, 64, q_rescore=qb.view(2, 64, 128),
                                          weights_rescore=wf)
    assert all(torch.equal(x, y) for x, y in zip(res, same))
    dq = layouts.dequantize(hi).view(-1, 128)
    kh = _k_hat(hi, lo)
    for b in range(2):
        slots = (table[b].long()[:, None] * PAGE_SLOTS + torch.arange(PAGE_SLOTS)).reshape(-1)
        s1 = _fp8_scores(q8[b, 0].float(), w8[b], dq[slots])
        cand = torch.argsort(s1, descending=True)[:64]
        s2 = _scores64(qb[b].float(), wf[b:b + 1], kh, slots[cand][None])[0]
        assert set(res.raw_indices[b].tolist()) == set(cand[torch.argsort(s2, descending=True)[:16]].tolist())


def test_candidate_scores_on_cpu():
    """Stage 2 alone: fp32 scores of given positions as the fp64 formula; -inf for positions a row does not see
    (negative, past its length, past the table), on an invalid page."""
    k, hi, lo, table = _case(B=2, n=256, seed=30)
    table = table.clone()
    table[1, 2] = -1
    q, w = _query(2, 2, seed=31)
    lens = torch.tensor([256, 200], dtype=torch.int32)                    # rows see 255, 256, 199, 200
    cand = torch.tensor([[0, 5, 254, 255, -1, 300],
                         [7, 255, 100, 3, 2**40, 64],
                         [0, 1, 198, 199, 128, 150],                       # 128, 150: page 2 of request 1 is -1
                         [199, 200, 63, 64, 65, 127]])
    got = rescore.rescore_candidate_scores(q, w, hi, lo, lens, table, cand)
    assert got.dtype == torch.float32 and got.shape == (4, 6)
    seen = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 1], [1, 1, 1, 0, 0, 0], [1, 0, 1, 1, 1, 1]],
                        dtype=torch.bool)
    assert torch.equal(torch.isfinite(got), seen)
    kh = _k_hat(hi, lo)
    bt = table.long().repeat_interleave(2, 0)
    safe = cand.clamp(0, 255)
    slots = bt.gather(1, safe // 64).clamp_min(0) * 64 + safe % 64
    exact = _scores64(q.view(4, 64, 128).float(), w, kh, slots)
    scale = _scores64(q.view(4, 64, 128).float().abs(), w.abs(), kh.abs(), slots)
    assert bool(((got.double() - exact).abs() <= 1e-5 * scale + 1e-30)[seen].all())


def test_scores_of_keys_inverts_the_kernel_key():
    """Stage-2 keys (the kernel's order_key: order-preserving int32 of the score, 0xFFFFFFFF - position) sort
    as (score, lower position) and give the scores back."""
    v = torch.tensor([3.5, -2.0, 0.0, -0.0, 3.5, float("inf"), -1e-30, 1e-30, -float("inf")])
    bits = v.view(torch.int32)
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    ordered = torch.where(v == 0, torch.zeros_like(ordered), ordered)     # the kernel counts -0 as +0
    c = torch.arange(len(v))
    keys = (ordered.long() << 32) | (0xFFFFFFFF - c)
    back = rescore.scores_of_keys(keys)
    assert torch.equal(back, v) and not bool(torch.signbit(back[3]))
    order = torch.sort(keys, descending=True).indices.tolist()
    assert order == [5, 0, 4, 7, 2, 3, 6, 1, 8]                            # ties: lower position first
    assert rescore.scores_of_keys(torch.tensor([rescore.INVALID_KEY])).item() == float("-inf")
    assert rescore.INVALID_KEY < int(keys.min())


def test_new_arguments_name_themselves():
    _, hi, lo, table = _case(B=1, n=128, seed=32)
    q, w = _query(1, 2, seed=33)
    lens = torch.tensor([128], dtype=torch.int32)
    call = rescore.rescore_topk
    with pytest.raises(TypeError, match="^q_rescore: expected dtype"):
        call(q, w, hi, lo, lens, table, 8, q_rescore=q.float())
    with pytest.raises(ValueError, match=r"^q_rescore: expected shape \(1, 2, 64, 128\) or \(2, 64, 128\)"):
        call(q, w, hi, lo, lens, table, 8, q_rescore=q[:, :1].contiguous())
    with pytest.raises(ValueError, match="^q_rescore: expected a contiguous tensor"):
        call(q, w, hi, lo, lens, table, 8, q_rescore=torch.zeros(1, 2, 64, 256, dtype=torch.bfloat16)[..., :128])
    with pytest.raises(ValueError, match=r"^weights_rescore: expected shape \(2, 64\)"):
        call(q, w, hi, lo, lens, table, 8, weights_rescore=w[:1].contiguous())
    with pytest.raises(TypeError, match="^weights_rescore: expected dtype torch.float32"):
        call(q, w, hi, lo, lens, table, 8, weights_rescore=w.double())
    with pytest.raises(TypeError, match="^fp8_rank: expected a bool"):
        call(q, w, hi, lo, lens, table, 8, fp8_rank=1)
    with pytest.raises(ValueError, match="^hi_cache: expected a tensor on"):
        call(q, w, hi.to("meta"), lo.to("meta"), lens, table, 8)
    pre = rescore.rescore_topk_prefill
    q1, w1 = q[0], w
    ks = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="^block_table: two-level keys are paged"):
        pre(q1, w1, hi, lo, ks, ks + 5, None, 8)
    with pytest.raises(ValueError, match="^hi_cache: expected SGLang's fp8 layout"):
        pre(q1, w1, layouts.empty_cache(2, "bf16"), lo, ks, ks + 5, table, 8)
    with pytest.raises(ValueError, match=r"^stage1_logits: expected shape \[2, width\]"):
        pre(q1, w1, hi, lo, ks, ks + 5, table, 8, stage1_logits=torch.zeros(3, 128))
    with pytest.raises(ValueError, match=r"^q_rescore: expected shape \(2, 64, 128\)"):
        pre(q1, w1, hi, lo, ks, ks + 5, table, 8, q_rescore=q)
    with pytest.raises(ValueError, match="^cu_rows: expected non-decreasing"):
        pre(q1, w1, hi, lo, ks, ks + 5, table.expand(2, -1).contiguous(), 8,
            cu_rows=torch.tensor([0, 2, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"^candidates: expected shape \[2, K'\]"):
        rescore.rescore_candidate_scores(q, w, hi, lo, lens, table, torch.zeros(3, 4, dtype=torch.long))
    with pytest.raises(TypeError, match="^candidates: expected dtype"):
        rescore.rescore_candidate_scores(q, w, hi, lo, lens, table, torch.zeros(2, 4))


# --------------------------------------------------------------------------------------------------
# GPU: the kernels against the references and an fp64 formulation
# --------------------------------------------------------------------------------------------------

def _query_pair(B, next_n, seed):
    """SGLang's stage-1 query (fp8, its per-(row, head) scale folded into the weights) and the bf16 query and
    weights it came from (weights of both signs, as weights_proj gives)."""
    g = torch.Generator().manual_seed(seed)
    qf = torch.randn(B, next_n, 64, 128, generator=g)
    wf = (torch.randn(B * next_n, 64, generator=g) / math.sqrt(8192)).contiguous()
    s = qf.abs().amax(-1).clamp_min(1e-4) / 448.0
    q8 = (qf / s[..., None]).to(torch.float8_e4m3fn).contiguous()
    return q8, (wf * s.reshape(B * next_n, 64)).contiguous(), qf.to(torch.bfloat16).contiguous(), wf


def _gpu_case(B, n, seed):
    """_case with two block-table entries that are not pages of the caches (-1, and one past them)."""
    k, hi, lo, table = _case(B, n, seed=seed % 100000)
    table = table.clone()
    table[1 % B, min(2, table.shape[1] - 1)] = -1
    table[-1, -1] = hi.shape[0] + 7
    return k, hi, lo, table


def _cuda(*ts):
    return [t.cuda() if isinstance(t, torch.Tensor) else t for t in ts]


def _check_selection(got, ref, s1, q2, w2, hi, lo, table_rows, lo_r, hi_r, K, KP):
    """The device selection against the reference's (same stage-1 logits s1 [R, >= width], CPU tensors):
    rows that see <= K keys equal it exactly; any other row's selection is a top-K of the row's K' stage-1
    candidates by the fp64 stage-2 score up to fp32 rounding (tol), in position order, with the candidates' stage-1
    ranks and SGLang's page indices, and equals the reference's wherever the K-th and K+1-th fp64 scores are
    further apart than the rounding."""
    got = [t.cpu() for t in got]
    kh = _k_hat(hi, lo)
    P = hi.shape[0]
    for r in range(q2.shape[0]):
        a, b = int(lo_r[r]), int(hi_r[r])
        if b - a <= K:
            assert all(torch.equal(x[r], y[r]) for x, y in zip(got, ref)), (r, got[1][r], ref[1][r])
            continue
        row = s1[r, a:b].double()
        order = a + torch.sort(row, descending=True, stable=True).indices[:KP]      # stage-1 order, ties: position
        entries = table_rows[r].long()[order // PAGE_SLOTS]
        ok = (entries >= 0) & (entries < P)
        cand, rank_of = order[ok], {int(p): i for i, p in enumerate(order.tolist())}
        slots = entries[ok] * PAGE_SLOTS + cand % PAGE_SLOTS
        s64 = _scores64(q2[r:r + 1], w2[r:r + 1], kh, slots[None])[0]
        tol = 3e-5 * float(_scores64(q2[r:r + 1].abs(), w2[r:r + 1].abs(), kh.abs(), slots[None])[0].max())
        score = dict(zip(cand.tolist(), s64.tolist()))
        raw = got[1][r]
        sel = raw[raw >= 0].tolist()
        assert len(sel) == min(K, len(score)) and bool((raw[len(sel):] == -1).all()), r
        assert set(sel) <= set(score), f"row {r}: selected a key that is not a valid candidate"
        s_sel = [score[p] for p in sel]
        rest = [v for p, v in score.items() if p not in set(sel)]
        assert not rest or min(s_sel) >= max(rest) - tol, f"row {r}: not a top-{K} of its candidates"
        assert sel == sorted(sel), f"row {r}: not in position order"
        assert got[2][r][:len(sel)].tolist() == [rank_of[p] for p in sel]
        want_pages = [int(table_rows[r, p // PAGE_SLOTS]) * PAGE_SLOTS + p % PAGE_SLOTS for p in sel]
        assert got[0][r][:len(sel)].tolist() == want_pages
        ranked = sorted(score.values(), reverse=True)
        if len(ranked) <= K or ranked[K - 1] - ranked[K] > 2 * tol:
            ref_sel = ref[1][r][ref[1][r] >= 0].tolist()
            assert set(sel) == set(ref_sel), f"row {r}: differs from the reference away from near-ties"


@pytest.mark.gpu
@pytest.mark.parametrize("q_dtype", [torch.float8_e4m3fn, torch.bfloat16])
@pytest.mark.parametrize("next_n", [1, 2, 4])
def test_gpu_candidate_scores_vs_fp64(seed, q_dtype, next_n):
    """Stage 2 alone on random candidates (negative, past a row's length, past the table, on invalid pages):
    -inf exactly where the reference has it, and the fp64 score within fp32 accumulation elsewhere."""
    B, n, KP = 3, 512, 700
    _, hi, lo, table = _gpu_case(B, n, seed)
    q8, w8, qb, wf = _query_pair(B, next_n, seed)
    q, w = (q8, w8) if q_dtype == torch.float8_e4m3fn else (qb, wf)
    lens = torch.tensor([512, 300, 77], dtype=torch.int32)
    R = B * next_n
    cand = torch.randint(-5, 600, (R, KP), generator=torch.Generator().manual_seed(seed))
    got = rescore.rescore_candidate_scores(*_cuda(q, w, hi, lo, lens, table, cand)).cpu()
    ref = rescore.rescore_candidate_scores(q, w, hi, lo, lens, table, cand)
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(got), finite), f"seed {seed}: -inf differs from the reference"
    assert bool(finite.any()) and bool((~finite).any())
    bt = table.long().repeat_interleave(next_n, 0)
    safe = cand.clamp(0, n - 1)
    slots = bt.gather(1, safe // PAGE_SLOTS).clamp(0, hi.shape[0] - 1) * PAGE_SLOTS + safe % PAGE_SLOTS
    kh = _k_hat(hi, lo)
    q2 = q.view(R, 64, 128).float()
    exact = _scores64(q2, w, kh, slots)
    scale = _scores64(q2.abs(), w.abs(), kh.abs(), slots)
    err = ((got.double() - exact).abs() / (scale + 1e-30))[finite]
    assert float(err.max()) < 2e-5, f"seed {seed}: stage-2 score error {float(err.max()):.3g} of the abs scale"
    again = rescore.rescore_candidate_scores(*_cuda(q, w, hi, lo, lens, table, cand)).cpu()
    assert torch.equal(again, got), f"seed {seed}: rerun differs"


def _decode_lens(B, next_n, n, two_d, seed):
    """Mixed lengths: a full request, rows shorter than index_topk (64), empty rows, some between K and K'."""
    if two_d:
        g = torch.Generator().manual_seed(seed)
        lens = torch.randint(0, n + 1, (B, next_n), generator=g, dtype=torch.int32)
        lens[0] = n
        lens[1, 0] = 40
        lens[-1, -1] = 0
        return lens
    return torch.tensor([n, 40, 200, 2][:B], dtype=torch.int32)


@pytest.mark.gpu
@pytest.mark.parametrize("next_n", [1, 2, 3, 4])
@pytest.mark.parametrize("lens_2d", [False, True])
@pytest.mark.parametrize("stage2", ["stage-1 q", "bf16 q"])
def test_gpu_rescore_topk_vs_reference(seed, next_n, lens_2d, stage2, forced_arch):
    """Decode / verify: the op with its own stage 1 equals the op given the same logits; both agree with the
    reference on those logits (exactly for rows that see <= index_topk keys, up to stage-2 near-ties else)."""
    B, n, K, KP = 4, 1024, 64, 256
    _, hi, lo, table = _gpu_case(B, n, seed)
    q8, w8, qb, wf = _query_pair(B, next_n, seed)
    lens = _decode_lens(B, next_n, n, lens_2d, seed)
    kw = dict(q_rescore=qb, weights_rescore=wf) if stage2 == "bf16 q" else {}
    d = _cuda(q8, w8, hi, lo, lens, table)
    dkw = {k_: v.cuda() for k_, v in kw.items()}
    s1 = cupy_dsa.paged_mqa_logits(d[0], d[2], d[1], d[4], d[5], n, clean_logits=True)
    got = rescore.rescore_topk(*d, K, KP, fp8_rank=True, **dkw)
    given = rescore.rescore_topk(*d, K, KP, stage1_logits=s1, fp8_rank=True, **dkw)
    assert all(torch.equal(x, y) for x, y in zip(got, given)), f"seed {seed}: own stage 1 != given logits"
    plain = rescore.rescore_topk(*d, K, KP, **dkw)                          # without the ranks: same selection
    assert plain.fp8_rank is None and torch.equal(plain.raw_indices, got.raw_indices)
    assert torch.equal(plain.page_indices, got.page_indices)
    assert all(t.dtype == torch.int32 and tuple(t.shape) == (B * next_n, K) for t in got)
    s1 = s1.cpu()
    ref = rescore.rescore_topk_reference(q8, w8, hi, lo, lens, table, K, KP, stage1_logits=s1, **kw)
    lo_r, hi_r = rescore._decode_rows_reference(lens, B, next_n, n)
    q2, w2 = (qb, wf) if kw else (q8, w8)
    _check_selection(got, ref, s1, q2.view(-1, 64, 128).float(), w2, hi, lo, table.repeat_interleave(next_n, 0),
                     lo_r, hi_r, K, KP)
    again = rescore.rescore_topk(*d, K, KP, fp8_rank=True, **dkw)
    assert all(torch.equal(x, y) for x, y in zip(got, again)), f"seed {seed}: rerun differs"


@pytest.mark.gpu
def test_gpu_rescore_topk_bf16_stage1_and_small_tables(seed):
    """A bf16 stage-1 q; K' past the table's width (clamped); index_topk past every row (all trivial)."""
    B, n = 2, 128
    _, hi, lo, table = _gpu_case(B, n, seed)
    _, _, qb, wf = _query_pair(B, 1, seed)
    lens = torch.tensor([128, 100], dtype=torch.int32)
    d = _cuda(qb, wf, hi, lo, lens, table)
    for K, KP in ((16, 1000), (200, 300)):
        s1 = cupy_dsa.paged_mqa_logits(d[0], d[2], d[1], d[4], d[5], n, clean_logits=True)
        got = rescore.rescore_topk(*d, K, KP, fp8_rank=True)
        ref = rescore.rescore_topk_reference(qb, wf, hi, lo, lens, table, K, KP, stage1_logits=s1.cpu())
        lo_r, hi_r = rescore._decode_rows_reference(lens, B, 1, n)
        _check_selection(got, ref, s1.cpu(), qb.view(-1, 64, 128).float(), wf, hi, lo, table, lo_r, hi_r, K,
                         min(KP, n))


@pytest.mark.gpu
@pytest.mark.parametrize("next_n", [1, 2])
def test_gpu_given_candidates_select_as_the_own_select(seed, next_n, forced_arch):
    """Candidates handed in by the caller (SGLang's top-k at k = K': arrival order, -1 padded) give the
    selection of cupy_dsa's own candidates, bit for bit, and the reference's up to near-ties."""
    B, n, K, KP = 4, 1536, 64, 256
    _, hi, lo, table = _gpu_case(B, n, seed)
    q8, w8, _, _ = _query_pair(B, next_n, seed)
    lens = torch.tensor([1536, 700, 60, 0], dtype=torch.int32)
    d = _cuda(q8, w8, hi, lo, lens, table)
    s1 = cupy_dsa.paged_mqa_logits(d[0], d[2], d[1], d[4], d[5], n, clean_logits=True)
    lo_r, hi_r = rescore._decode_rows_reference(lens, B, next_n, n)
    given = _shuffled_candidates(s1.cpu(), hi_r, KP, 3, seed=seed % 1000).cuda()
    own = rescore.rescore_topk(*d, K, KP, stage1_logits=s1, fp8_rank=True)
    got = rescore.rescore_topk(*d, K, stage1_logits=s1, candidates=given, fp8_rank=True)
    assert all(torch.equal(x, y) for x, y in zip(got, own)), f"seed {seed}: given candidates select otherwise"
    ref = rescore.rescore_topk_reference(q8, w8, hi, lo, lens, table, K, stage1_logits=s1.cpu(),
                                         candidates=given.cpu())
    _check_selection(got, ref, s1.cpu(), q8.view(-1, 64, 128).float(), w8, hi, lo, table.repeat_interleave(next_n, 0),
                     lo_r, hi_r, K, KP)


@pytest.mark.gpu
def test_gpu_given_logits_with_junk_past_the_lengths(seed):
    """Caller logits (e.g. DeepGEMM's without clean_logits) may hold anything past a row's length and past the
    width: only the columns a row sees are read, so the result is that of clean logits."""
    B, next_n, n, K, KP = 3, 2, 512, 32, 96
    _, hi, lo, table = _gpu_case(B, n, seed)
    q8, w8, _, _ = _query_pair(B, next_n, seed)
    lens = torch.tensor([512, 150, 30], dtype=torch.int32)
    d = _cuda(q8, w8, hi, lo, lens, table)
    clean = cupy_dsa.paged_mqa_logits(d[0], d[2], d[1], d[4], d[5], n, clean_logits=True)
    lo_r, hi_r = rescore._decode_rows_reference(lens, B, next_n, n)
    junk = torch.full((B * next_n, n + 40), float("nan"), device="cuda")
    junk[:, :n] = clean
    cols = torch.arange(n + 40, device="cuda")[None, :]
    past = cols >= hi_r.cuda()[:, None]
    junk[past & (cols % 3 == 0)] = float("inf")
    junk[past & (cols % 3 == 1)] = 1e30
    want = rescore.rescore_topk(*d, K, KP, stage1_logits=clean, fp8_rank=True)
    got = rescore.rescore_topk(*d, K, KP, stage1_logits=junk, fp8_rank=True)
    assert all(torch.equal(x, y) for x, y in zip(got, want)), f"seed {seed}: junk past the lengths was read"


@pytest.mark.gpu
@pytest.mark.parametrize("per_row,ctas", [(False, None), (True, 1), (True, 4), (True, 8)],
                         ids=["column chunks", "one CTA per row", "4-CTA clusters", "8-CTA clusters"])
def test_gpu_long_rows_select_over_column_chunks(seed, forced_arch, per_row, ctas, monkeypatch):
    """Rows of thousands of keys, past the shared-memory cache: by column chunks (the candidates' first digit
    counted by several CTAs per row, the boundary bin collected by atomics), by one CTA per row (every radix
    pass reading the row again) and by a cluster of CTAs per row (sm_90+; one CTA elsewhere: each CTA a slice, the
    digit counts and the bin's keys merged across the cluster): with the op's own logits, with logits of many exact
    ties (rounded to 1/8, so bins and ties straddle the chunks and slices), and with a flat row (every key tied: the
    boundary bin is past what is collected and is read from the row); K' = 2048, index_topk = 512, against the
    reference on the same logits."""
    monkeypatch.setattr(rescore, "select_per_row", lambda width, rows, n_sms, arch: per_row)
    if ctas is not None:
        monkeypatch.setattr(topk, "select_cluster", lambda width, rows, n_sms, arch: ctas)
    B, n, K, KP = 2, 24576, 512, 2048
    _, hi, lo, table = _case(B, n, seed=seed % 100000)
    q8, w8, _, _ = _query_pair(B, 1, seed)
    lens = torch.tensor([n, 9000], dtype=torch.int32)
    d = _cuda(q8, w8, hi, lo, lens, table)
    own = cupy_dsa.paged_mqa_logits(d[0], d[2], d[1], d[4], d[5], n)
    rounded = torch.round(own * 8) / 8
    flat = torch.zeros_like(own)
    lo_r, hi_r = rescore._decode_rows_reference(lens, B, 1, n)
    for name, s1 in (("own", None), ("rounded", rounded), ("flat", flat)):
        got = rescore.rescore_topk(*d, K, KP, stage1_logits=s1, fp8_rank=True)
        s1c = (own if s1 is None else s1).cpu()
        ref = rescore.rescore_topk_reference(q8, w8, hi, lo, lens, table, K, KP, stage1_logits=s1c)
        _check_selection(got, ref, s1c, q8.view(-1, 64, 128).float(), w8, hi, lo, table, lo_r, hi_r, K, KP)
        again = rescore.rescore_topk(*d, K, KP, stage1_logits=s1, fp8_rank=True)
        assert all(torch.equal(x, y) for x, y in zip(got, again)), f"seed {seed} ({name}): rerun differs"


def _prefill_case(seed, varlen):
    """Prefill rows of one request (causal-like ks = 0 and ke growing, plus rows with ks > 0) or, varlen, of
    three requests (one without rows) and two rows of no request."""
    B, n = (3, 512) if varlen else (1, 1024)
    _, hi, lo, table = _gpu_case(B, n, seed)
    T = 12
    q8, w8, _, _ = _query_pair(T, 1, seed)
    ke = torch.tensor([n, n - 3, 600, 40, 64, 65, 300, 512, 0, 200, n, 77], dtype=torch.int32).clamp(max=n)
    ks = torch.tensor([0, 0, 100, 0, 0, 0, 250, 500, 0, 10, 0, 0], dtype=torch.int32)
    cu = torch.tensor([0, 5, 5, 10], dtype=torch.int32) if varlen else None
    return q8[:, 0].contiguous(), w8, hi, lo, ks, ke, (table if varlen else table[0]), cu


@pytest.mark.gpu
@pytest.mark.parametrize("varlen", [False, True])
def test_gpu_rescore_topk_prefill_vs_reference(seed, varlen, forced_arch):
    K, KP = 64, 256
    q, w, hi, lo, ks, ke, bt, cu = _prefill_case(seed, varlen)
    d = _cuda(q, w, hi, lo, ks, ke, bt)
    dcu = None if cu is None else cu.cuda()
    s1 = cupy_dsa.mqa_logits(d[0], d[2], d[1], d[4], d[5], block_table=d[6], cu_rows=dcu, clean_logits=True)
    got = rescore.rescore_topk_prefill(*d, K, KP, cu_rows=dcu, fp8_rank=True)
    given = rescore.rescore_topk_prefill(*d, K, KP, cu_rows=dcu, stage1_logits=s1, fp8_rank=True)
    assert all(torch.equal(x, y) for x, y in zip(got, given)), f"seed {seed}: own stage 1 != given logits"
    s1 = s1.cpu()
    ref = rescore.rescore_topk_prefill_reference(q, w, hi, lo, ks, ke, bt, K, KP, cu_rows=cu, stage1_logits=s1)
    width = (bt.shape[-1]) * PAGE_SLOTS
    lo_r, hi_r, rows = rescore._prefill_rows_reference(ks, ke, bt, cu, width, q.shape[0], q.device)
    _check_selection(got, ref, s1, q.float(), w, hi, lo, rows, lo_r, hi_r, K, KP)
    if varlen:
        assert all(bool((t.cpu()[10:] == -1).all()) for t in got)             # rows of no request
    again = rescore.rescore_topk_prefill(*d, K, KP, cu_rows=dcu, fp8_rank=True)
    assert all(torch.equal(x, y) for x, y in zip(got, again)), f"seed {seed}: rerun differs"


@pytest.mark.gpu
def test_gpu_cuda_graph_capture_and_replay(seed):
    """Captured once (plan, stage 1, candidates, stage 2, selection), replayed on new queries, new keys and new
    lengths: bitwise equal to eager calls on the same inputs."""
    B, next_n, n, K, KP = 4, 2, 1024, 64, 256
    _, hi, lo, table = _gpu_case(B, n, seed)
    q8, w8, _, _ = _query_pair(B, next_n, seed)
    lens = torch.tensor([1024, 40, 700, 65], dtype=torch.int32)
    q_s, w_s, hi_s, lo_s, lens_s, bt_s = _cuda(q8, w8, hi, lo, lens, table)
    plan_s = torch.empty(B + 1, dtype=torch.int64, device="cuda")

    def step():
        plan = cupy_dsa.paged_mqa_logits_plan(lens_s, next_n, out=plan_s)
        return rescore.rescore_topk(q_s, w_s, hi_s, lo_s, lens_s, bt_s, K, KP, plan=plan, fp8_rank=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for trial in range(3):
        _, hi2, lo2, table2 = _gpu_case(B, n, seed + 1 + trial)
        q2, w2, _, _ = _query_pair(B, next_n, seed + 1 + trial)
        lens2 = torch.tensor([[5, 1024, 300, 64], [1024, 1000, 0, 129], [64, 65, 1024, 2]][trial], dtype=torch.int32)
        for s, v in ((q_s, q2), (w_s, w2), (hi_s, hi2), (lo_s, lo2), (lens_s, lens2), (bt_s, table2)):
            s.copy_(v)
        graph.replay()
        eager = step()
        torch.cuda.synchronize()
        assert all(torch.equal(x, y) for x, y in zip(out, eager)), f"seed {seed}: replay {trial} != eager"
        if trial == 0:   # the replay read the new lengths: request 0's rows see 4 and 5 keys (trivial rows)
            assert out.raw_indices[0, :6].tolist() == [0, 1, 2, 3, -1, -1]
            assert out.raw_indices[1, :6].tolist() == [0, 1, 2, 3, 4, -1]
