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


@pytest.mark.gpu
def test_gpu_fp4sim_block_with_an_infinity_is_nan():
    """One block of one key holds +inf before the rounding (hadamard off, the norm's inf * 0): the kernel
    stores NaN there (it stored a finite value: fmaxf skipped the NaN) and exact zeros elsewhere."""
    kv, pos, freqs = _store_case("cuda")
    k = _stored_keys(kv, pos, freqs, "fp4sim", hadamard=False)
    assert torch.isnan(k[3, :32]).all() and (k[3, 32:] == 0).all(), k[3]
    assert torch.isfinite(k[0]).all()
