"""The plugin on a GPU (``@pytest.mark.gpu``, no SGLang on the machine): the plugin's SGLang-free glue
(cupy_dsa.sglang.core) with tensors shaped as SGLang builds them: plan-native store from DecodePlan / CompressPlan
rows, paged and prefill logits, a torch top-k; eager and inside ``torch.cuda.graph``, against the CPU path.
"""
from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from cupy_dsa import layouts
from cupy_dsa.bench.timing import capture_graph
from cupy_dsa.sglang import core
from sglang_plugin_env import ENV


def _decode_plan(seq_lens):
    """DecodePlan rows (uint8 [B, 16]): u32 seq_len, i32 write_loc, i32 read_page_0, i32 read_page_1."""
    a = np.zeros((len(seq_lens), 4), dtype="<i4")
    a[:, 0] = np.asarray(seq_lens, dtype=np.uint32).view(np.int32)
    return torch.from_numpy(a.view(np.uint8).reshape(len(seq_lens), 16).copy())


def _compress_plan(seq_lens, ragged_ids):
    """CompressPlan rows (uint8 [N, 16]): u32 seq_len (0xFFFFFFFF invalid), u16 ragged_id, u16 buffer_len, 2 x i32."""
    n = len(seq_lens)
    a = np.zeros(n, dtype=[("seq", "<u4"), ("rid", "<u2"), ("blen", "<u2"), ("p0", "<i4"), ("p1", "<i4")])
    a["seq"], a["rid"], a["blen"] = seq_lens, ragged_ids, 4
    return torch.from_numpy(a.view(np.uint8).reshape(n, 16).copy())


def _ulp_diff(a, b):
    """bf16 distance in units of the larger value's ulp (2^-7 relative); values within 1e-6 of each other
    count as equal (an fp32 rounding difference may flip the sign of a value next to zero)."""
    a, b = a.float(), b.float()
    ulp = torch.maximum(a.abs(), b.abs()) * 2.0 ** -7
    d = (a - b).abs()
    return torch.where(d <= 1e-6, torch.zeros_like(d), d / ulp.clamp_min(1e-30)).ceil()


def _cmp_logits(name, got, ref, lens, tol=2e-3):
    bad, worst = 0, 0.0
    for r in range(ref.shape[0]):
        n = int(lens[r])
        g, e = got[r, :n].double().cpu(), ref[r, :n].double()
        err = (g - e).abs()
        lim = tol * (e.abs().max().item() + 1e-6)
        bad += int((err > lim).sum())
        worst = max(worst, err.max().item() / max(lim, 1e-30) if n else 0.0)
    assert bad == 0, f"{name}: {bad} logits outside tolerance (worst {worst:.2f}x the limit)"


def _recall(a, b):
    sa, sb = set(a.tolist()) - {-1}, set(b.tolist()) - {-1}
    return len(sa & sb) / max(len(sb), 1)


@pytest.mark.gpu
def test_gpu_plugin_path_eager_and_graph(seed):
    dev = torch.device("cuda")
    n_pages, topk, max_pos = 48, 512, 16384
    n_slots = n_pages * 64
    # SGLang's buffers: page rows uint8 [P, 16384] (zeros), complex64 rope table, fp32 norm weight
    cache_cpu = torch.zeros(n_pages, layouts.BF16_PAGE_BYTES, dtype=torch.uint8)
    ang = torch.rand(max_pos, 32) * 6.2831853
    freq_cis = torch.polar(torch.ones_like(ang), ang)
    norm_w = torch.rand(128) + 0.5

    # 1. prefill store of every slot 64..n_slots-1 through a CompressPlan (position = seq_len - 4)
    n_tok = n_slots - 64
    kv = torch.randn(n_tok, 128)
    seq = (torch.arange(n_tok) + 1) * 4
    seq_np = seq.numpy().astype(np.uint32)
    seq_np[7] = 0xFFFFFFFF  # an invalid entry must be skipped
    ragged = torch.randperm(n_tok).numpy().astype(np.uint16)
    out_loc = torch.empty(n_tok, dtype=torch.int64)
    out_loc[torch.from_numpy(ragged.astype(np.int64))] = torch.arange(64, n_slots)
    plan_c = _compress_plan(seq_np, ragged)
    store_kw = dict(is_decode=False, compress_ratio=4, norm_eps=1e-6, mode="bf16")
    core.store_index_k_bf16(kv, plan_c, norm_weight=norm_w, freq_cis=freq_cis, out_loc=out_loc, kvcache=cache_cpu,
                            **store_kw)
    cache_gpu = torch.zeros_like(cache_cpu, device=dev)
    core.store_index_k_bf16(kv.to(dev), plan_c.to(dev), norm_weight=norm_w.to(dev), freq_cis=freq_cis.to(dev),
                            out_loc=out_loc.to(dev), kvcache=cache_gpu, **store_kw)
    torch.cuda.synchronize()
    d = _ulp_diff(cache_gpu.cpu().view(torch.bfloat16), cache_cpu.view(torch.bfloat16))
    assert int(d.max()) <= 1, f"prefill store: max {int(d.max())} bf16 ulp from the CPU path, {int((d > 0).sum())} differ"
    skipped = int(out_loc[int(ragged[7])])
    assert not cache_gpu.view(-1, 256)[skipped].any(), "the invalid plan entry was written"

    # 2. decode rows (SGLang's shapes): q fp8 [R,64,128], weights fp32 [R,64], lens int32 [R], page_table [R,max_pages]
    R, max_pages = 6, 40
    # SGLang slices the page table out of a wider per-request buffer: row stride > max_pages, stride(1) == 1
    pt_full = torch.stack([torch.randperm(n_pages) for _ in range(R)]).to(torch.int32)
    pt = pt_full[:, :max_pages]
    lens = torch.tensor([1, 300, 512, 513, 1800, max_pages * 64], dtype=torch.int32)
    q = torch.randn(R, 64, 128).to(torch.float8_e4m3fn)
    w = torch.rand(R, 64)
    width = max_pages * 64
    ref = torch.cat([core.paged_logits(q, w, lens, pt, cache_cpu, width, r) for r in core.row_chunks(R, 4, width, False)])
    gq, gw, gl, gpt = q.to(dev), w.to(dev), lens.to(dev), pt_full.to(dev)[:, :max_pages]
    assert gpt.stride() == (n_pages, 1)
    got = torch.cat([core.paged_logits(gq, gw, gl, gpt, cache_gpu, width, r) for r in core.row_chunks(R, 4, width, False)])
    assert got.shape == (R, width) and got.dtype == torch.float32
    _cmp_logits("paged (eager)", got, ref, lens)
    ref_idx, ref_raw = core.topk_page_indices(ref, lens, pt, topk)
    got_idx, got_raw = core.topk_page_indices(got, gl, gpt, topk)
    rec = [_recall(got_raw[r].cpu(), ref_raw[r]) for r in range(R)]
    assert min(rec) >= 0.99, f"paged top-{topk} overlap with the CPU path per row: {rec}"

    # 3. a multi-request extend (ks = 0, ke = causal compressed length), the plugin's varlen route: 3 requests
    # of 30 / 1 / 33 rows with their page-table rows, in row chunks of 24 (one straddles two requests)
    T = 64
    ke = torch.linspace(600, max_pages * 64, T).to(torch.int32)
    ks = torch.zeros(T, dtype=torch.int32)
    qp = torch.randn(T, 64, 128).to(torch.float8_e4m3fn)
    wp = torch.rand(T, 64)
    row_pt = pt[torch.tensor([0] * 30 + [1] + [2] * 33)]
    cu, bt = core.extend_requests(torch.tensor([30, 1, 33], dtype=torch.int32), row_pt, T)
    gcu, gbt = core.extend_requests(torch.tensor([30, 1, 33], dtype=torch.int32, device=dev), row_pt.to(dev), T)
    refp = torch.cat([core.extend_logits(qp, wp, ks, ke, cu, bt, cache_cpu, r) for r in core.row_chunks(T, 24, width, False)])
    gotp = torch.cat([core.extend_logits(qp.to(dev), wp.to(dev), ks.to(dev), ke.to(dev), gcu, gbt, cache_gpu, r)
                      for r in core.row_chunks(T, 24, width, False)])
    _cmp_logits("extend (varlen)", gotp, refp, ke)
    # 3b. target verify, 3 requests x 2 draft rows grouped as next_n 2 (one page-table row per request)
    vl = torch.tensor([900, 901, 64, 64, 2500, 2501], dtype=torch.int32)
    vpt = pt[torch.tensor([0, 0, 1, 1, 2, 2])]
    qv, wv = torch.randn(6, 64, 128).to(torch.float8_e4m3fn), torch.rand(6, 64)
    refv = core.verify_logits(qv, wv, vl, vpt, cache_cpu, width, 2, slice(0, 6))
    gotv = core.verify_logits(qv.to(dev), wv.to(dev), vl.to(dev), vpt.to(dev), cache_gpu, width, 2, slice(0, 6))
    _cmp_logits("verify (grouped)", gotv, refv, vl)

    # 4. CUDA graph: decode store + paged logits + top-k captured, replayed on new inputs
    B = R
    dec_kv = torch.randn(B, 128, device=dev)
    dec_seq = torch.tensor([8, 9, 12, 400, 4000, 8001], dtype=torch.int64)  # 9 and 8001 are not boundaries
    dec_plan = _decode_plan(dec_seq.numpy()).to(dev)
    dec_loc = torch.tensor([3, 4, 5, 6, 7, 8], dtype=torch.int64, device=dev)  # page 0 slots, unused above
    out_idx = torch.full((R, topk), -1, dtype=torch.int32, device=dev)
    out_raw = torch.full((R, topk), -1, dtype=torch.int32, device=dev)
    g_norm, g_fc = norm_w.to(dev), freq_cis.to(dev)

    def step():
        core.store_index_k_bf16(dec_kv, dec_plan, is_decode=True, compress_ratio=4, norm_weight=g_norm, norm_eps=1e-6,
                                freq_cis=g_fc, out_loc=dec_loc, kvcache=cache_gpu, mode="bf16")
        logits = core.paged_logits(gq, gw, gl, gpt, cache_gpu, width, slice(0, R))
        i, r = core.topk_page_indices(logits, gl, gpt, topk)
        out_idx.copy_(i)
        out_raw.copy_(r)

    core.ensure_warm(dev)
    graph, _ = capture_graph(step, warmups=1)   # one warm-up run on a side stream, then the capture
    # new inputs in place, then replay
    new_kv = torch.randn(B, 128)
    new_q = torch.randn(R, 64, 128).to(torch.float8_e4m3fn)
    dec_kv.copy_(new_kv.to(dev))
    gq.copy_(new_q.to(dev))
    graph.replay()
    torch.cuda.synchronize()
    # CPU path on the same new inputs
    dec_cpu = cache_gpu.cpu().clone()
    dec_cpu.view(-1, 256)[:9] = 0
    core.store_index_k_bf16(new_kv, dec_plan.cpu(), is_decode=True, compress_ratio=4, norm_weight=norm_w, norm_eps=1e-6,
                            freq_cis=freq_cis, out_loc=dec_loc.cpu(), kvcache=dec_cpu, mode="bf16")
    d = _ulp_diff(cache_gpu.cpu().view(torch.bfloat16), dec_cpu.view(torch.bfloat16))
    assert int(d.max()) <= 1, f"decode store (graph): max {int(d.max())} bf16 ulp from the CPU path"
    written = sorted(int(i) for i in (cache_gpu.view(-1, 256)[:9] != 0).any(1).nonzero().flatten().cpu())
    assert written == [3, 5, 6, 7], f"decode store (graph) wrote slots {written}, expected [3, 5, 6, 7]"
    ref2 = core.paged_logits(new_q, w, lens, pt, dec_cpu, width, slice(0, R))
    _, ref2_raw = core.topk_page_indices(ref2, lens, pt, topk)
    rec = [_recall(out_raw[r].cpu(), ref2_raw[r]) for r in range(R)]
    assert min(rec) >= 0.99, f"graph replay top-{topk} overlap with the CPU path per row: {rec}"
    exp_idx = torch.where(out_raw.long() >= 0, gpt.long().gather(1, out_raw.long().clamp(min=0) // 64) * 64
                          + out_raw.long() % 64, -1)
    assert torch.equal(out_idx.long(), exp_idx), "page indices are not the slot transform of the raw indices"


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["bf16", "fp8-cupy", "fp8-rescore"])
def test_gpu_bf16_query_path_graph(seed, monkeypatch, mode):
    """SGLANG_CUPY_DSA_INDEX_Q=bf16 on the plugin's path: warm-up compiles the bf16 query's instantiations, then one
    decode step and one grouped verify step (next_n 2) of two C4 layers, each preparing its query from the layer's
    projections (core.project_query + core.prepare_query, one launch) and scoring with it (the logits, or fp8-rescore's
    stage 2 beside SGLang's fp8 q), are captured in one CUDA graph and replayed on new projections; query, logits and
    top-k against the CPU path."""
    import cupy_dsa
    from cupy_dsa import runtime
    from cupy_dsa.query import prepare_index_q_reference

    dev = torch.device("cuda")
    monkeypatch.setenv(ENV, mode)
    monkeypatch.setenv(core.QUERY_ENV, "bf16")
    for name in core.RESCORE_ENVS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(core.RESCORE_STAGE1_ENV, "cupy")
    core.reset_mode()
    rec = core.record(mode)
    # max_pos covers every stored token's position (4 * n_tok): a position past the rope table is not stored, and
    # pages of zero keys would tie a row's logits at its top-k boundary (the CPU and GPU top-k may then pick
    # different sets, seen with 8 of the 40 pages unstored)
    n_pages, topk, max_pos, R, max_pages = 40, 512, 16384, 6, 40
    width = max_pages * 64
    ang = torch.rand(max_pos, 32) * 6.2831853
    freq_cis = torch.polar(torch.ones_like(ang), ang)
    norm_w = torch.rand(128) + 0.5
    n_tok = n_pages * 64 - 64
    kv = torch.randn(n_tok, 128)
    seq = ((torch.arange(n_tok) + 1) * 4).numpy().astype(np.uint32)
    plan = _compress_plan(seq, np.arange(n_tok).astype(np.uint16))
    out_loc = torch.arange(64, n_pages * 64, dtype=torch.int64)
    caches = {}
    for d in (torch.device("cpu"), dev):
        cache = torch.zeros(n_pages, layouts.page_bytes(rec.cache_layout), dtype=torch.uint8, device=d)
        lo = torch.zeros_like(cache) if rec.two_level else None
        core.store_index_k_bf16(kv.to(d), plan.to(d), is_decode=False, compress_ratio=4, norm_weight=norm_w.to(d),
                                norm_eps=1e-6, freq_cis=freq_cis.to(d), out_loc=out_loc.to(d), kvcache=cache, mode=mode,
                                lo_cache=lo)
        caches[d.type] = (cache, lo)
    unstored = [p for p in range(n_pages) if not caches["cpu"][0][p].any()]
    assert unstored == [0], f"pages without keys: {unstored} (only page 0 is left out)"
    pt = torch.stack([torch.randperm(n_pages) for _ in range(R)]).to(torch.int32)[:, :max_pages]
    lens = torch.tensor([1, 700, 1500, 1501, 2300, 2301], dtype=torch.int32)   # rows 2-3 and 4-5: a verify request each
    vpt = pt[torch.tensor([0, 1, 2, 2, 4, 4])]
    positions = torch.arange(R)
    ws = 128 ** -0.5 * 64 ** -0.5
    on = {d.type: (freq_cis.to(d), positions.to(d), torch.zeros(R, 16, device=d)) for d in (torch.device("cpu"), dev)}

    def step(d, q_raw, w_raw, lens_d, pt_d, vpt_d, out):
        """Everything on ``d`` already: no host-to-device copy while a graph is captured."""
        cache, lo = caches[d.type]
        fc, pos, x = on[d.type]
        layer = types.SimpleNamespace(n_local_heads=64, head_dim=128, freqs_cis=fc, weight_scale=ws,
                                      compute_weights=lambda x, skip_scale=False: w_raw,
                                      wq_b=lambda a: (q_raw.view(q_raw.shape[0], -1), None))
        for i in range(2):  # two C4 layers
            q_proj, w_proj = core.project_query(layer, x, x)
            q_b, w_b = core.prepare_query(q_proj, w_proj, layer, pos, "bf16")
            w_b = w_b.squeeze(2)
            if rec.two_level:
                q8, w8 = cupy_dsa.prepare_index_q(q_proj, w_proj, freqs_cis=core.rope_table(fc), positions=pos,
                                                  weight_scale=ws, numerics="fp8")
                res = core.rescore_rows(q8, w8, lens_d, pt_d, cache, lo, slice(0, R), topk, 4 * topk,
                                        q_rescore=q_b, weights_rescore=w_b)
                raw = res.raw_indices
                vraw = core.rescore_verify(q8, w8, lens_d, vpt_d, cache, lo, 2, slice(2, 6), topk, 4 * topk,
                                           q_rescore=q_b, weights_rescore=w_b).raw_indices
            else:
                logits = core.paged_logits(q_b, w_b, lens_d, pt_d, cache, width, slice(0, R))
                _, raw = core.topk_page_indices(logits, lens_d, pt_d, topk)
                vlog = core.verify_logits(q_b, w_b, lens_d, vpt_d, cache, width, 2, slice(2, 6))
                _, vraw = core.topk_page_indices(vlog, lens_d[2:6], vpt_d[2:6], topk)
                out["logits"].copy_(logits)
            out["q"].copy_(q_b)
            out["raw"].copy_(raw)
            out["vraw"].copy_(vraw)

    def buffers(d):
        return {"q": torch.zeros(R, 64, 128, dtype=torch.bfloat16, device=d),
                "logits": torch.zeros(R, width, device=d), "raw": torch.zeros(R, topk, dtype=torch.int32, device=d),
                "vraw": torch.zeros(4, topk, dtype=torch.int32, device=d)}

    core.configure_warm(next_ns=(1, 2))
    core.ensure_warm(dev)
    warmed = core.warm_expressions(runtime.device_arch(dev.index or 0), mode=mode, query="bf16", next_ns=(1, 2),
                                   stage1="cupy")
    assert core.QUERY_SOURCE in warmed and any("prepare_index_q<2," in e for e in warmed[core.QUERY_SOURCE])
    q_raw = torch.zeros(R, 64, 128, dtype=torch.bfloat16, device=dev)
    w_raw = torch.zeros(R, 64, dtype=torch.bfloat16, device=dev)
    g_lens, g_pt, g_vpt = lens.to(dev), pt.to(dev), vpt.to(dev)
    out = buffers(dev)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step(dev, q_raw, w_raw, g_lens, g_pt, g_vpt, out)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(dev, q_raw, w_raw, g_lens, g_pt, g_vpt, out)
    for replay in range(2):
        new_q = (2 * torch.randn(R, 64, 128)).bfloat16()
        new_w = torch.rand(R, 64).bfloat16()
        q_raw.copy_(new_q.to(dev))
        w_raw.copy_(new_w.to(dev))
        graph.replay()
        torch.cuda.synchronize()
        ref = buffers(torch.device("cpu"))
        step(torch.device("cpu"), new_q, new_w, lens, pt, vpt, ref)
        want_q, _ = prepare_index_q_reference(new_q, new_w, freqs_cis=core.rope_table(freq_cis), positions=positions,
                                              weight_scale=ws, numerics="bf16")
        assert torch.equal(ref["q"], want_q)
        assert torch.equal(out["q"].cpu(), want_q), f"replay {replay}: the bf16 query differs from its reference"
        if not rec.two_level:
            _cmp_logits(f"{mode}, bf16 q, replay {replay}", out["logits"], ref["logits"], lens)
        for name, got, want in (("decode", out["raw"], ref["raw"]), ("verify", out["vraw"], ref["vraw"])):
            overlap = [_recall(got[r].cpu(), want[r]) for r in range(got.shape[0])]
            assert min(overlap) >= 0.99, f"{mode}, bf16 q, replay {replay}, {name}: top-k overlap {overlap}"
    core.reset_mode()


@pytest.mark.gpu
def test_gpu_rescore_path_eager_and_graph(seed):
    """fp8-rescore's glue on the device with SGLang-shaped tensors: the two-page store from a CompressPlan, the three
    rescoring routes (decode rows, grouped verify, varlen extend in two chunks) with the forward's plans and with
    caller logits standing in for SGLang's call, against the CPU path; then a decode step (store + rescored top-k of
    two layers sharing the plans) captured in a CUDA graph and replayed with new lengths."""
    from cupy_dsa.rescore import lo_views, two_level_dequant_reference

    dev = torch.device("cuda")
    n_pages, topk, kprime, max_pos = 48, 512, 1024, 16384
    n_slots = n_pages * 64
    ang = torch.rand(max_pos, 32) * 6.2831853
    freq_cis = torch.polar(torch.ones_like(ang), ang)
    norm_w = torch.rand(128) + 0.5
    caches = {}
    for d in (torch.device("cpu"), dev):
        caches[d.type] = (torch.zeros(n_pages, layouts.FP8_PAGE_BYTES, dtype=torch.uint8, device=d),
                          torch.zeros(n_pages, layouts.FP8_PAGE_BYTES, dtype=torch.uint8, device=d))
    n_tok = n_slots - 64
    kv = torch.randn(n_tok, 128)
    seq_np = ((np.arange(n_tok) + 1) * 4).astype(np.uint32)
    ragged = torch.randperm(n_tok).numpy().astype(np.uint16)
    out_loc = torch.empty(n_tok, dtype=torch.int64)
    out_loc[torch.from_numpy(ragged.astype(np.int64))] = torch.arange(64, n_slots)
    plan_c = _compress_plan(seq_np, ragged)
    for d, (hi, lo) in caches.items():
        core.store_index_k_bf16(kv.to(hi.device), plan_c.to(hi.device), is_decode=False, compress_ratio=4,
                                norm_weight=norm_w.to(hi.device), norm_eps=1e-6, freq_cis=freq_cis.to(hi.device),
                                out_loc=out_loc.to(hi.device), kvcache=hi, mode="fp8-rescore", lo_cache=lo)
    torch.cuda.synchronize()

    def keys(hi, lo):
        codes, scales = lo_views(lo.cpu())
        h = hi.cpu()
        return two_level_dequant_reference(h[:, :8192].reshape(-1, 128), h[:, 8192:].contiguous().view(torch.float32)
                                           .reshape(-1), codes.reshape(-1, 128), scales.reshape(-1))

    k_dev, k_cpu = keys(*caches["cuda"])[64:], keys(*caches["cpu"])[64:]
    err = ((k_dev - k_cpu).abs().amax(1) / k_cpu.abs().amax(1)).max().item()
    assert err <= 1e-3, f"two-page store: keys {err:.2e} from the CPU path"
    hi_c, lo_c = caches["cpu"]
    hi_g, lo_g = caches["cuda"]

    R, n, max_pages = 6, 2, 40
    pt = torch.stack([torch.randperm(n_pages)[:max_pages] for _ in range(R // n)]).to(torch.int32).repeat_interleave(n, 0)
    lens = torch.tensor([1, 2, 1500, 1501, max_pages * 64 - 1, max_pages * 64], dtype=torch.int32)
    q = torch.randn(R, 64, 128).to(torch.float8_e4m3fn)
    w = torch.rand(R, 64)
    width = max_pages * 64

    def overlap(name, got, ref):
        rec = [_recall(got.raw_indices[r].cpu(), ref.raw_indices[r]) for r in range(R)]
        assert min(rec) >= 0.99, f"{name}: top-{topk} overlap with the CPU path per row: {rec}"
        raw = got.raw_indices.long().cpu()
        exp = torch.where(raw >= 0, pt.long().gather(1, raw.clamp(min=0) // 64) * 64 + raw % 64, -1)
        assert torch.equal(got.page_indices.long().cpu(), exp), f"{name}: not SGLang's slot transform"

    gq, gw, gl, gpt = q.to(dev), w.to(dev), lens.to(dev), pt.to(dev)
    md_c, md_g = types.SimpleNamespace(compressed_seq_lens=lens), types.SimpleNamespace(compressed_seq_lens=gl)
    plans_c, plans_g = core.ForwardPlans.for_layer(md_c, lens, 1), core.ForwardPlans.for_layer(md_g, gl, 1)
    full = slice(0, R)
    ref = core.rescore_rows(q, w, lens, pt, hi_c, lo_c, full, topk, kprime, plans_c)
    overlap("rows", core.rescore_rows(gq, gw, gl, gpt, hi_g, lo_g, full, topk, kprime, plans_g), ref)
    overlap("verify", core.rescore_verify(gq, gw, gl, gpt, hi_g, lo_g, n, full, topk, kprime, plans_g), ref)
    cu, bt = core.extend_requests(torch.tensor([n] * (R // n), dtype=torch.int32, device=dev), gpt, R)
    parts = [core.rescore_extend(gq, gw, gl, cu, bt, hi_g, lo_g, r, topk, kprime, plans_g)
             for r in core.row_chunks(R, 3, width, False)]
    overlap("extend", types.SimpleNamespace(raw_indices=torch.cat([p.raw_indices for p in parts]),
                                            page_indices=torch.cat([p.page_indices for p in parts])), ref)
    logits = core.paged_logits(gq, gw, gl, gpt, hi_g, width, full)  # unmasked fp8 logits, as SGLang's call returns
    overlap("caller logits", core.rescore_rows(gq, gw, gl, gpt, hi_g, lo_g, full, topk, kprime, stage1_logits=logits),
            ref)

    # a decode step captured once: store (decode plan) + two C4 layers of rescored top-k, replayed on new lengths
    dec_kv = torch.zeros(R, 128, device=dev)
    dec_plan = torch.zeros(R, 16, dtype=torch.uint8, device=dev)
    dec_loc = torch.zeros(R, dtype=torch.int64, device=dev)
    out_idx = torch.full((R, topk), -1, dtype=torch.int32, device=dev)
    out_raw = torch.full_like(out_idx, -1)
    g_norm, g_fc = norm_w.to(dev), freq_cis.to(dev)
    holder = types.SimpleNamespace(compressed_seq_lens=gl)

    def step():
        core.store_index_k_bf16(dec_kv, dec_plan, is_decode=True, compress_ratio=4, norm_weight=g_norm, norm_eps=1e-6,
                                freq_cis=g_fc, out_loc=dec_loc, kvcache=hi_g, mode="fp8-rescore", lo_cache=lo_g)
        for layer in (0, 1):
            plans = core.ForwardPlans.for_layer(holder, gl, layer)
            res = core.rescore_rows(gq, gw, gl, gpt, hi_g, lo_g, full, topk, kprime, plans)
            out_idx.copy_(res.page_indices)
            out_raw.copy_(res.raw_indices)

    core.ensure_warm(dev)
    graph, _ = capture_graph(step, warmups=1)   # one warm-up run on a side stream, then the capture
    for replay in range(2):
        new_lens = torch.randint(1, width + 1, (R,), dtype=torch.int32)
        new_q = torch.randn(R, 64, 128).to(torch.float8_e4m3fn)
        new_kv = torch.randn(R, 128)
        seq = [int(x) * 4 for x in new_lens]  # compression boundaries; the even rows write (one row per request)
        loc = torch.tensor([int(pt[r, (int(new_lens[r]) - 1) // 64]) * 64 + (int(new_lens[r]) - 1) % 64
                            if r % 2 == 0 else -1 for r in range(R)], dtype=torch.int64)
        for t, v in ((gl, new_lens), (gq, new_q), (dec_kv, new_kv), (dec_plan, _decode_plan(seq)), (dec_loc, loc)):
            t.copy_(v.to(dev))
        graph.replay()
        torch.cuda.synchronize()
        core.store_index_k_bf16(new_kv, _decode_plan(seq), is_decode=True, compress_ratio=4, norm_weight=norm_w,
                                norm_eps=1e-6, freq_cis=freq_cis, out_loc=loc, kvcache=hi_c, mode="fp8-rescore",
                                lo_cache=lo_c)
        ref = core.rescore_rows(new_q, w, new_lens, pt, hi_c, lo_c, full, topk, kprime)
        overlap(f"graph replay {replay + 1}", types.SimpleNamespace(raw_indices=out_raw, page_indices=out_idx), ref)
