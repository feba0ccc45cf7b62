"""Varlen prefill (mqa_logits with cu_rows: several requests' rows in one launch, a multi-request extend) and
mqa_logits_plan: reference and kernels vs the float64 oracle, bad input, CUDA graphs.
"""

import math

import pytest
import torch

from cupy_dsa.bench.timing import capture_graph
from cupy_dsa import logits as L
from cupy_dsa.logits import (mqa_logits, mqa_logits_plan, mqa_logits_plan_reference)
from logits_cases import (ARCH, check_close, check_untouched, config_id, FP8, gpu, NAN, oracle_prefill, poisoned,
                          prefill_cases, PS, varlen_args, varlen_case)


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
    args = varlen_args()
    args.update(change)
    with pytest.raises(exc, match=name):
        mqa_logits(**args)


def test_varlen_plan_is_checked_against_its_rows():
    args = varlen_args()
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
@pytest.mark.parametrize("cfg,problem", prefill_cases(varlen=1), ids=lambda v: config_id(v)
                         if isinstance(v, L.launch.Config) else "-".join(map(str, v)))
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
def test_gpu_varlen_deterministic_and_graph(seed, layout):
    """Bitwise reruns; one CUDA-graph capture (plan + logits) replayed with new lengths and a new number of
    requests (trailing requests emptied by repeating the last offset), each replay against the oracle."""
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
