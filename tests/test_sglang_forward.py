"""The plugin's forward on CPU (cupy_dsa.sglang.core with the CPU backends): the per-forward plans and their
reuse across layers, the decode / verify / extend and rescoring routes, row chunks, rope table and top-k page
indices."""
from __future__ import annotations

import types

import pytest
import torch

from cupy_dsa import layouts
from cupy_dsa.sglang import core


def test_rescore_routes_share_the_forward_plans(monkeypatch):
    """The rescoring routes on CPU (the references): decode rows, grouped verify and varlen extend give the
    reference's selection; the schedules and a chunk's request offsets are built by the first layer only."""
    import cupy_dsa
    from cupy_dsa.rescore import rescore_topk_reference, store_two_level_reference

    g = torch.Generator().manual_seed(3)
    P, n = 24, 2
    hi = torch.zeros(P, layouts.FP8_PAGE_BYTES, dtype=torch.uint8)
    lo = torch.zeros_like(hi)
    store_two_level_reference(torch.randn(P * 64, 128, generator=g), hi, lo, torch.arange(P * 64))
    lens = torch.tensor([300, 301, 700, 701, 1200, 1201], dtype=torch.int32)
    R = lens.shape[0]
    q = torch.randn(R, 64, 128, generator=g).to(torch.float8_e4m3fn)
    w = torch.rand(R, 64, generator=g)
    pt = torch.stack([torch.randperm(P, generator=g)[:20] for _ in range(R // n)]).to(torch.int32).repeat_interleave(n, 0)
    ref = rescore_topk_reference(q.unsqueeze(1), w, hi, lo, lens, pt, 256, 512)
    built = []
    for name in ("paged_mqa_logits_plan", "mqa_logits_plan"):
        real = getattr(cupy_dsa, name)
        monkeypatch.setattr(cupy_dsa, name, lambda *a, _real=real, _name=name, **k: built.append(_name) or _real(*a, **k))
    md = types.SimpleNamespace(compressed_seq_lens=lens)
    cu_rows, bt = core.extend_requests(torch.tensor([2, 2, 2], dtype=torch.int32), pt, R)
    for layer in (1, 3):
        plans = core.ForwardPlans.for_layer(md, lens, layer)
        rows = [core.rescore_rows(q, w, lens, pt, hi, lo, r, 256, 512, plans) for r in core.row_chunks(R, 4, 1280, False)]
        verify = core.rescore_verify(q, w, lens, pt, hi, lo, n, slice(0, R), 256, 512, plans)
        ext = [core.rescore_extend(q, w, lens, cu_rows, bt, hi, lo, r, 256, 512, plans)
               for r in core.row_chunks(R, 3, 1280, False)]  # chunks split request 1 (rows 2-3)
        for what, outs in (("rows", rows), ("verify", [verify]), ("extend", ext)):
            raw = torch.cat([o.raw_indices for o in outs])
            page = torch.cat([o.page_indices for o in outs])
            for r in range(R):
                assert set(raw[r].tolist()) == set(ref.raw_indices[r].tolist()), (what, layer, r)
                assert set(page[r].tolist()) == set(ref.page_indices[r].tolist()), (what, layer, r)
    # one forward (two layers): 2 row chunks + 1 verify schedule + 2 varlen chunk plans, each built once
    assert sorted(built) == sorted(["paged_mqa_logits_plan"] * 3 + ["mqa_logits_plan"] * 2), built
    cu, _ = plans.items[("rescore-varlen", 3, 6)]
    assert cu.tolist() == [0, 0, 1, 3], "chunk rows [3, 6): request 1 owns row 3, request 2 rows 4-5"
    with pytest.raises(ValueError, match="whole requests"):
        core.rescore_verify(q, w, lens, pt, hi, lo, n, slice(0, 3), 256, 512)


def test_forward_plans_built_once_per_forward(monkeypatch):
    import cupy_dsa

    calls = []
    real = cupy_dsa.paged_mqa_logits_plan

    def plan(lens, next_n):
        calls.append((lens.clone(), next_n))
        return real(lens, next_n)

    monkeypatch.setattr(cupy_dsa, "paged_mqa_logits_plan", plan)
    md = types.SimpleNamespace(compressed_seq_lens=torch.tensor([300, 64, 900], dtype=torch.int32))
    q = torch.randn(3, 64, 128).to(torch.float8_e4m3fn)
    w, pt = torch.rand(3, 64), torch.arange(45, dtype=torch.int32).view(3, 15)
    cache = torch.zeros(48, layouts.BF16_PAGE_BYTES, dtype=torch.uint8)
    seen = []
    real_logits = cupy_dsa.paged_mqa_logits
    monkeypatch.setattr(cupy_dsa, "paged_mqa_logits", lambda *a, **k: seen.append(k.get("plan")) or real_logits(*a, **k))
    for layer in (1, 3, 5):  # one forward: the first C4 layer builds the schedules, the others reuse them
        plans = core.ForwardPlans.for_layer(md, md.compressed_seq_lens, layer)
        for r in core.row_chunks(3, 2, 960, False):
            core.paged_logits(q, w, md.compressed_seq_lens, pt, cache, 960, r, plans)
    assert len(calls) == 2 and [c[0].tolist() for c in calls] == [[300, 64], [900]]
    assert len(seen) == 6 and seen[0] is seen[2] is seen[4] and seen[1] is seen[3] is seen[5]
    assert seen[0].tolist() == [0, 5, 6]  # pages per request, cumulated (int64 [B + 1])
    core.ForwardPlans.for_layer(md, md.compressed_seq_lens, 1)  # layer 1 again: a new pass (forward, capture)
    plans = core.ForwardPlans.for_layer(md, md.compressed_seq_lens, 1)
    core.paged_logits(q, w, md.compressed_seq_lens, pt, cache, 960, slice(0, 3), plans)
    assert len(calls) == 3
    md.compressed_seq_lens.add_(1)  # written in place (graph replay buffers): rebuilt
    plans = core.ForwardPlans.for_layer(md, md.compressed_seq_lens, 2)
    core.paged_logits(q, w, md.compressed_seq_lens, pt, cache, 960, slice(0, 3), plans)
    assert len(calls) == 4 and calls[-1][0].tolist() == [301, 65, 901]
    assert core.ForwardPlans.for_layer(types.SimpleNamespace(), md.compressed_seq_lens, 1) is not None
    assert core.ForwardPlans.for_layer(object(), md.compressed_seq_lens, 1) is None  # nowhere to keep them


def test_verify_and_extend_plans(monkeypatch):
    """The grouped verify plan is next_n-wide 2-D lengths (one per request); the varlen plan one per chunk."""
    import cupy_dsa

    n, B = 2, 3
    lens = torch.tensor([300, 301, 64, 64, 899, 900], dtype=torch.int32)
    md = types.SimpleNamespace(compressed_seq_lens=lens)
    q = torch.randn(B * n, 64, 128).to(torch.float8_e4m3fn)
    w = torch.rand(B * n, 64)
    pt = torch.arange(45, dtype=torch.int32).view(3, 15).repeat_interleave(n, 0)
    cache = torch.zeros(48, layouts.BF16_PAGE_BYTES, dtype=torch.uint8)
    seen = []
    real_logits = cupy_dsa.paged_mqa_logits

    def spy(q_, kv, w_, lens_, bt, width, **k):
        seen.append((tuple(q_.shape), lens_.tolist(), bt.tolist(), k["plan"].tolist()))
        return real_logits(q_, kv, w_, lens_, bt, width, **k)

    monkeypatch.setattr(cupy_dsa, "paged_mqa_logits", spy)
    plans = core.ForwardPlans.for_layer(md, lens, 1)
    out = core.verify_logits(q, w, lens, pt, cache, 960, n, slice(0, B * n), plans)
    assert out.shape == (B * n, 960)
    assert seen == [((B, n, 64, 128), [[300, 301], [64, 64], [899, 900]], pt[::n].tolist(), [0, 5, 6, 21])]
    with pytest.raises(ValueError, match="whole requests"):
        core.verify_logits(q, w, lens, pt, cache, 960, n, slice(0, 3), plans)
    # extend: requests from extend_seq_lens, each its first row's page-table row; the plan once per chunk
    cu_rows, bt = core.extend_requests(torch.tensor([2, 3, 1], dtype=torch.int32), pt, 6)
    assert cu_rows.tolist() == [0, 2, 5, 6] and bt.tolist() == [pt[0].tolist(), pt[2].tolist(), pt[5].tolist()]
    built = []
    real_plan = cupy_dsa.mqa_logits_plan
    monkeypatch.setattr(cupy_dsa, "mqa_logits_plan", lambda c, rows: built.append(rows) or real_plan(c, rows=rows))
    ks, ke = torch.zeros(6, dtype=torch.int32), lens
    for _ in range(2):
        for r in core.row_chunks(6, 4, 960, False):
            core.extend_logits(q, w, ks, ke, cu_rows, bt, cache, r, plans)
    assert built == [(0, 4), (4, 6)]


def test_rope_table_is_a_view():
    ang = torch.rand(16, 32)
    fc = torch.polar(torch.ones_like(ang), ang)
    t = core.rope_table(fc)
    assert t.shape == (16, 64) and t.dtype == torch.float32 and t.data_ptr() == fc.data_ptr()
    assert torch.allclose(t[:, 0::2], torch.cos(ang))
    assert torch.allclose(t[:, 1::2], torch.sin(ang))


def test_row_chunks():
    assert core.row_chunks(10, None, 64, False) == [slice(0, 10)]
    assert core.row_chunks(10, 4, 64, False) == [slice(0, 4), slice(4, 8), slice(8, 10)]
    width = 1 << 20
    rows = core.MAX_EAGER_LOGITS_BYTES // (width * 4)
    chunks = core.row_chunks(3 * rows, None, width, False)
    assert len(chunks) == 3 and all(c.stop - c.start == rows for c in chunks)
    assert core.row_chunks(3 * rows, None, width, True) == [slice(0, 3 * rows)]  # never split a capture
    chunks = core.row_chunks(3 * rows, None, width, False, multiple=3)  # whole verify requests of 3 rows
    assert all((c.stop - c.start) % 3 == 0 for c in chunks) and chunks[-1].stop == 3 * rows


def test_topk_page_indices(seed):
    R, pages, k = 4, 6, 64
    logits = torch.randn(R, pages * 64)
    lens = torch.tensor([10, 64, 65, 384], dtype=torch.int32)
    pt = torch.stack([torch.randperm(50)[:pages] for _ in range(R)]).to(torch.int32)
    page_idx, raw = core.topk_page_indices(logits, lens, pt, k)
    for r in range(R):
        n = int(lens[r])
        got = sorted(x for x in raw[r].tolist() if x >= 0)
        exp = sorted(range(n)) if n <= k else sorted(logits[r, :n].double().topk(k).indices.tolist())
        assert got == exp, f"row {r} (seed {seed})"
        for i, g in zip(raw[r].tolist(), page_idx[r].tolist()):
            assert g == (-1 if i < 0 else int(pt[r, i // 64]) * 64 + i % 64)


def test_rescore_candidate_select_follows_sglangs_top_k():
    """fp8-rescore's candidates (cupy_dsa.sglang.candidates): SGLang's v2 at K' <= 2048, v1 at K' <= 1024 where v2
    is off (sm_120), cupy_dsa's select past either limit, with stage 1 by cupy_dsa, or another top-k backend; v2's plan
    is the forward's own where SGLang built one, else one over the rows' lengths."""
    from cupy_dsa.sglang import candidates as cand
    from cupy_dsa.sglang.modes import parse_rescore_settings

    pick = lambda kp, **kw: cand.candidate_select(kp, **{"stage1": "sglang", "topk_backend": "sgl-kernel",  # noqa: E731
                                                         "use_topk_v2": True, **kw}).kernel
    assert pick(2048) == cand.SGLANG_V2 and pick(2049) == cand.CUPY_DSA
    assert pick(1024, use_topk_v2=False) == cand.SGLANG_V1 and pick(2048, use_topk_v2=False) == cand.CUPY_DSA
    assert pick(512, stage1="cupy") == cand.CUPY_DSA and pick(512, topk_backend="flashinfer") == cand.CUPY_DSA
    assert "past the 2048" in cand.candidate_select(4096, stage1="sglang", topk_backend="sgl-kernel",
                                                    use_topk_v2=True).why
    assert cand.sglang_topk_v2_enabled("sm_90") and not cand.sglang_topk_v2_enabled("sm_120")
    text = cand.check_text(parse_rescore_settings("sglang", "4x"), "sm_90")
    assert "V4-Flash (index_topk 512, K' 2048): SGLang's v2 top-k" in text
    assert "V4-Pro (index_topk 1024, K' 4096): cupy_dsa's own select" in text
    text = cand.check_text(parse_rescore_settings("sglang", "2x"), "sm_120")
    assert "V4-Flash (index_topk 512, K' 1024): SGLang's v1 top-k" in text and "SGLANG_OPT_USE_TOPK_V2 off" in text
    own, per_chunk = torch.zeros(5, 2, dtype=torch.int32), [torch.ones(3, 2, dtype=torch.int32), None]
    md = types.SimpleNamespace(topk_metadata=own, topk_metadata_chunks=per_chunk)
    v2 = cand.CandidateSelect(cand.SGLANG_V2, "test")
    lens = torch.arange(4, dtype=torch.int32)
    assert cand.v2_plan(v2, md, lens, slice(0, 4), True, None) is own
    assert cand.v2_plan(v2, md, lens, slice(0, 2), False, 0) is per_chunk[0]
    assert cand.v2_plan(cand.CandidateSelect(cand.SGLANG_V1, "test"), md, lens, slice(0, 4), True, None) is None
    with pytest.raises(ValueError, match="^choice: expected one of SGLang's kernels"):
        cand.select_candidates(cand.CandidateSelect(cand.CUPY_DSA, "test"), torch.zeros(4, 8), lens, lens[:, None],
                               2, 4, None, topk=types.SimpleNamespace())


# --------------------------------------------------------------------------------------------------
# Long prefill: the logits budget setting, and the memory model the README's table renders
# --------------------------------------------------------------------------------------------------

def test_row_chunks_follow_the_logits_budget_setting(monkeypatch):
    width = 1 << 16   # 256 KiB of fp32 logits per row
    monkeypatch.setenv(core.LOGITS_BUDGET_ENV, "1")
    assert core.row_chunks(10, None, width, False) == [slice(0, 4), slice(4, 8), slice(8, 10)]
    assert core.row_chunks(10, 6, width, False) == [slice(0, 6), slice(6, 10)]   # SGLang's chunks win
    assert core.row_chunks(10, None, width, True) == [slice(0, 10)]               # never split a capture
    monkeypatch.delenv(core.LOGITS_BUDGET_ENV)
    assert core.row_chunks(10, None, width, False) == [slice(0, 10)]
    assert core.logits_budget_bytes() == core.MAX_EAGER_LOGITS_BYTES == 2048 << 20


def test_prefill_memory_model_800k_tokens():
    """One 8192-row chunk after 800K tokens (200K index entries): stock SGLang's unchunked logits are 8192 x 200000
    fp32; every hooked mode holds its logits block to the budget and stays below the stock step."""
    from cupy_dsa.sglang import memory

    stock = memory.prefill_step("fp8", rows=8192, entries=200_000)
    assert stock["logits"] == 8192 * 200_000 * 4 and stock["gathered keys"] == 200_000 * 132
    assert memory.prefill_step("fp8", sglang_rows_per_chunk=1024)["logits"] == 1024 * 200_000 * 4
    for mode in core.MODES:
        if mode == "fp8":
            continue
        step = memory.prefill_step(mode, rows=8192, entries=200_000)
        assert step["logits"] <= 2048 << 20 and step["logits rows per chunk"] == (2048 << 20) // (200_000 * 4)
        assert step["total"] < stock["total"] / 2, (mode, step)
        small = memory.prefill_step(mode, rows=8192, entries=200_000, budget_mib=256)
        assert small["logits"] <= 256 << 20 < step["logits"]
    rescore = memory.prefill_step("fp8-rescore", rows=8192, entries=200_000)
    assert rescore["candidates"] == rescore["logits rows per chunk"] * 2048 * 16
    assert memory.index_key_bytes("bf16", 1 << 20, 21) == 21 * (1 << 18) * 256


def test_readme_memory_table_is_the_models():
    from pathlib import Path

    from cupy_dsa.sglang import memory

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert memory.memory_table() in readme
