"""mqa_logits of one request (prefill, contiguous or paged keys): reference and kernels vs the float64 oracle,
bad input.
"""

import pytest
import torch

from cupy_dsa import layouts
from cupy_dsa import launch
from cupy_dsa import logits as L
from cupy_dsa.logits import (mqa_logits)
from logits_cases import (ARCH, check_close, check_rows_close, check_untouched, config_id, configs, D, FP8, gpu,
                          gpu_prefill_case, H, make_q, oracle_prefill, poisoned, prefill_cases, prefill_keys,
                          spread_rows)


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


@gpu
@pytest.mark.parametrize("cfg,problem", prefill_cases(), ids=lambda v: config_id(v)
                         if isinstance(v, launch.Config) else "-".join(map(str, v)))
def test_gpu_prefill(seed, cfg, problem):
    """Every declared prefill config of this GPU vs the fp64 oracle (1024 keys per CTA: several CTAs share a
    row tile; 128 keys per work item of the q-in-registers kernel)."""
    kind, q_fp8, _ = problem
    q_dtype = FP8 if q_fp8 else torch.bfloat16
    native_fp8 = cfg.values.get("Mma8") == 1 and ARCH not in ("sm_90", "sm_100")
    variant = str(cfg)
    if "keys_per_cta" in cfg.values:
        cfg = cfg.replace(keys_per_cta=1024)
    if "keys_per_item" in cfg.values:      # q in registers: several items per CTA, the ring running across them
        cfg = cfg.replace(keys_per_item=128)
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
def test_gpu_prefill_fp8_keys_bf16_q_row_magnitudes(seed):
    """Prefill row tiles (4 or 8 rows) on fp8 keys with a bf16 q whose rows differ in magnitude (spread_rows),
    row by row against the fp64 oracle, in every declared config."""
    T, S_pages = 45, 12
    q, kv, bt, keys, valid, w, ks, ke = gpu_prefill_case(seed, "fp8", torch.bfloat16, T, S_pages)
    q = spread_rows(q)
    want = oracle_prefill(q, keys, valid, w, ks, ke, 0, T, 0)
    for cfg in configs(L.PREFILL, ("fp8", 0, 0)):
        with L.PREFILL.forced(cfg, ARCH):
            got = mqa_logits(q, kv, w, ks, ke, block_table=bt, clean_logits=True)
        check_rows_close(got, want, clean=True, what=f"prefill {cfg} seed={seed}")


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
