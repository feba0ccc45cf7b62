"""paged_mqa_logits (decode, MTP verify) and paged_mqa_logits_plan: references and kernels vs the float64
oracle (logits_cases.py), bad input, CUDA graphs and mixed-length batches.
"""

import pytest
import torch

from cupy_dsa.bench.timing import capture_graph
from cupy_dsa.heuristics import EMULATED_ARCHS
from cupy_dsa import launch
from cupy_dsa import logits as L
from cupy_dsa.logits import (mqa_logits, mqa_logits_reference, paged_mqa_logits, paged_mqa_logits_plan,
                             paged_mqa_logits_plan_reference, paged_mqa_logits_reference)
from logits_cases import (ARCH, forced_product_of, check_close, check_rows_close, check_untouched, config_id, configs,
                          D, decode_cases, force, FP8, gpu, gpu_paged_case, H, make_cache, make_q, NAN, oracle_paged,
                          plan_oracle, poisoned, PS, random_paged_case, spread_rows, varlen_args)


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
        mqa_logits(**varlen_args(), clean_logits=value)


def test_paged_plan_is_checked_against_its_next_n(seed):
    q, cache, deq, w, ctx, bt = random_paged_case(B=3, next_n=1, max_pages=4, P=9, layout="bf16", q_dtype=FP8,
                                                  lens_2d=False)
    with pytest.raises(ValueError, match=r"^plan: made by paged_mqa_logits_plan\(context_lens, next_n=2\), this "
                                         r"call has next_n 1"):
        paged_mqa_logits(q, cache, w, ctx, bt, 4 * PS, plan=paged_mqa_logits_plan(ctx, 2))
    reused = paged_mqa_logits_plan(ctx, 2, out=torch.empty(4, dtype=torch.int64))
    paged_mqa_logits_plan(ctx, 1, out=reused)  # a reused buffer records its latest build
    paged_mqa_logits(q, cache, w, ctx, bt, 4 * PS, plan=reused)


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


@gpu
@pytest.mark.parametrize("cfg,problem", decode_cases(), ids=lambda v: config_id(v) if isinstance(v, launch.Config)
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
@pytest.mark.parametrize("next_n", [1, 4])
def test_gpu_paged_fp8_keys_bf16_q_row_magnitudes(seed, next_n):
    """fp8 keys x a bf16 q (staged as f16 times a power of two per head, folded into its weight): rows and heads
    of very different magnitudes (spread_rows; next_n 4: in one CTA) each match the fp64 oracle, in every
    declared config."""
    q, cache, deq, w, ctx, bt = gpu_paged_case(seed, B=8, next_n=next_n, max_pages=20, P=200, layout="fp8",
                                               q_dtype=torch.bfloat16, lens_2d=True)
    q = spread_rows(q)
    width = 20 * PS
    want = oracle_paged(q, deq, w, ctx, bt, width)
    for cfg in configs(L.DECODE, ("fp8", 0, next_n)):
        with L.DECODE.forced(cfg, ARCH):
            got = paged_mqa_logits(q, cache, w, ctx, bt, width, clean_logits=True)
        check_rows_close(got, want, clean=True, what=f"paged {cfg} next_n={next_n} seed={seed}")


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
