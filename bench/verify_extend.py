"""The MTP verify and multi-request extend rows of ``cupy-dsa bench logits``: the logits of these batches as SGLang
0.5.23 calls them (one row per token, its own page-table row each) against the plugin's routes (grouped next_n
for verify, one varlen launch for extend) and DeepGEMM's rows, next to the issue targets. The inputs, timing and
verdict helpers are :mod:`.sweeps`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import cupy_dsa
from cupy_dsa.layouts import BYTES_PER_TOKEN, PAGE_SLOTS

from . import peers
from .sweeps import (DIM, HEADS, TARGETS, _all_met, _gen, _paged_tables, _pct, _random_cache, _route_rows, _verdict,
                     long_tail, sizes)
from .timing import rotations, time_calls


@dataclass
class VerifyBatch:
    """Target verify: per request, the index entries its last draft row sees; n draft rows each."""
    name: str
    lens: list
    next_n: int

    @property
    def entries(self) -> int:
        return int(sum(self.lens))


@dataclass
class ExtendBatch:
    """A multi-request extend: per request (prefix index entries, new tokens); new token j of a request sees
    prefix + (j + 1) // 4 entries (C4: a compressed entry per 4 raw tokens), one row per token."""
    name: str
    requests: list


VERIFY_NEXT_N = (2, 3, 4)  # MTP draft tokens per request that SGLang verifies grouped


def verify_batches(device, quick, seed) -> list:
    """Every batch at next_n 2, 3 and 4 (index entries per request: equal, or long-tail lognormal)."""
    K = 1024
    if device.type != "cuda":
        return [VerifyBatch("3 x 300", [300, 280, 64], n) for n in VERIFY_NEXT_N]
    shapes = [("64 x 32K", [32 * K] * 64),
              ("48 long-tail", long_tail(48, seed, max_len=256 * K, median=64 * K))]
    if not quick:
        shapes[1:1] = [("128 x 8K", [8 * K] * 128)]
        shapes += [("16 x 128K", [128 * K] * 16), ("256 x 2K", [2 * K] * 256)]
    return [VerifyBatch(name, lens, n) for name, lens in shapes for n in VERIFY_NEXT_N]


def extend_batches(device, quick, seed) -> list:
    K = 1024
    if device.type != "cuda":
        return [ExtendBatch("3 req", [(0, 40), (300, 7), (65, 20)])]
    g = torch.Generator().manual_seed(seed)
    out = [ExtendBatch("4 x 2K new, prefixes 8K-64K", [(8 * K, 2 * K), (24 * K, 2 * K), (40 * K, 2 * K), (64 * K, 2 * K)]),
           ExtendBatch("16 x 512 new, prefixes 2K-32K",
                       [(int(p), 512) for p in torch.randint(2 * K, 32 * K, (16,), generator=g)]),
           ExtendBatch("2 x 8K new, prefixes 16K / 48K", [(16 * K, 8 * K), (48 * K, 8 * K)])]
    if not quick:
        out.append(ExtendBatch("3 req incl. no prefix", [(0, 4 * K), (12 * K, 1 * K), (30 * K, 3 * K)]))
    return out


def _verify_row_lens(lens, n, device):
    """Per-row compressed lengths [B, n]: raw lengths 4*len + r, r random in 0..3, minus the later draft rows,
    over 4 (consecutive rows step by at most one entry, as C4 verify rows do)."""
    g = torch.Generator().manual_seed(len(lens) * 131 + n)
    raw = 4 * torch.tensor(lens, dtype=torch.int64) + torch.randint(0, 4, (len(lens),), generator=g)
    rows = raw[:, None] - (n - 1) + torch.arange(n)[None, :]
    return (rows.clamp_min(0) // 4).to(torch.int32).to(device)


def verify_rows(device, quick, seed, ceilings, progress=None) -> list[dict]:
    batches = verify_batches(device, quick, seed)
    dg, dg_reason = peers.deepgemm() if device.type == "cuda" else (None, "no GPU")
    reps = max(5, sizes(device, quick).reps // 2) if device.type == "cuda" else 2
    return _route_rows(
        "verify", batches,
        lambda vb: {"mode": "verify", "batch_name": vb.name, "requests": len(vb.lens),
                    "rows": len(vb.lens) * vb.next_n, "next_n": vb.next_n, "entries": vb.entries, "error": None},
        lambda vb, base: _verify_case(device, vb, seed, reps, ceilings, dg, dg_reason, base), device, progress)


def _verify_case(device, vb, seed, reps, ceilings, dg, dg_reason, base):
    g = _gen(device, seed)
    B, n = len(vb.lens), vb.next_n
    pages = [math.ceil(x / PAGE_SLOTS) for x in vb.lens]
    table_w = max(pages) + 1
    width = table_w * PAGE_SLOTS
    rot = rotations(device, vb.entries * BYTES_PER_TOKEN["bf16"])
    tables, n_pages = _paged_tables(pages, rot, table_w, device, g)
    cache = _random_cache(n_pages, "bf16", device, g)
    q = torch.randn(B, n, HEADS, DIM, device=device, generator=g).to(torch.float8_e4m3fn)
    weights = torch.rand(B * n, HEADS, device=device, generator=g) / math.sqrt(HEADS * DIM)
    lens_2d = _verify_row_lens(vb.lens, n, device)
    lens_rows = lens_2d.reshape(-1).contiguous()
    q_rows = q.view(B * n, 1, HEADS, DIM)
    row_tables = [bt.repeat_interleave(n, 0) for bt in tables]
    plan_g = cupy_dsa.paged_mqa_logits_plan(lens_2d, n)
    plan_r = cupy_dsa.paged_mqa_logits_plan(lens_rows, 1)

    def grouped(bt):
        return lambda: cupy_dsa.paged_mqa_logits(q, cache, weights, lens_2d, bt, width, plan=plan_g)

    def by_rows(bt):
        return lambda: cupy_dsa.paged_mqa_logits(q_rows, cache, weights, lens_rows, bt, width, plan=plan_r)

    t_g = time_calls([grouped(bt) for bt in tables], device, reps=reps)
    t_r = time_calls([by_rows(bt) for bt in row_tables], device, reps=reps)
    a, b_ = grouped(tables[0])(), by_rows(row_tables[0])()
    vis = torch.arange(width, device=device)[None, :] < lens_rows.to(torch.int64)[:, None]
    routes_rel = float((a[vis].double() - b_[vis].double()).norm() / b_[vis].double().norm().clamp_min(1e-30))
    key_bytes = vb.entries * BYTES_PER_TOKEN["bf16"]
    pairs = int(lens_2d.to(torch.int64).sum())
    read, mm = ceilings.get("read_gbps"), ceilings.get("matmul_tflops")
    floor_s = None
    if read and mm:
        floor_s = max(key_bytes / (read * 1e9), 2 * HEADS * DIM * pairs / (mm * 1e12))
    dg_rows_us = dg_grouped_us = None
    note = dg_reason
    if dg is not None:
        try:
            fp8_cache = _random_cache(n_pages, "fp8", device, g)
            _, call_rows = peers.deepgemm_decode(dg, q_rows, fp8_cache, weights, lens_rows[:, None], row_tables[0], width)
            dg_rows_us = time_calls([(lambda bt=bt: call_rows(bt)) for bt in row_tables], device, reps=reps).seconds * 1e6
            if n <= 2:
                _, call_g = peers.deepgemm_decode(dg, q, fp8_cache, weights, lens_2d, tables[0], width)
                dg_grouped_us = time_calls([(lambda bt=bt: call_g(bt)) for bt in tables], device, reps=reps).seconds * 1e6
            note = None if n <= 2 else "DeepGEMM's sm_90 paged kernel takes next_n 1 or 2: no grouped figure"
        except Exception as exc:
            note = f"{type(exc).__name__}: {str(exc)[:160]}"
    out = []
    for route, t in (("rows", t_r), ("grouped", t_g)):
        row = dict(base)
        row.update({
            "route": route, "time_us": t.seconds * 1e6, "timing": t.method, "rotating_buffers": rot,
            "key_bytes": key_bytes, "visible_pairs": pairs,
            "pct_read": _pct(key_bytes / t.seconds / 1e9, read),
            "pct_roofline": (floor_s / t.seconds) if floor_s else None,
            "deepgemm_rows_us": dg_rows_us, "deepgemm_grouped_us": dg_grouped_us, "deepgemm_note": note,
            "vs_deepgemm_rows": (t.seconds * 1e6 / dg_rows_us) if dg_rows_us else None,
            "routes_rel_l2": routes_rel,
        })
        out.append(_verify_targets(row, device.type == "cuda"))
    return out


def _verify_targets(row: dict, on_gpu: bool) -> dict:
    """``row`` with its targets and verdict: the grouped route of a batch of >= 1M entries on a GPU has them."""
    row.update({"target_pct_read": None, "target_pct_roofline": None, "target_vs_deepgemm_rows": None,
                "verdict": None})
    if row["route"] == "grouped" and row["entries"] >= 2**20 and on_gpu:
        ceiling, share = TARGETS["verify_grouped_pct"][row["next_n"]]
        row[f"target_pct_{ceiling}"] = share
        row["target_vs_deepgemm_rows"] = TARGETS["verify_vs_deepgemm_rows"][row["next_n"]]
        row["verdict"] = _all_met(_verdict(row[f"pct_{ceiling}"], share),
                                  _verdict(row["vs_deepgemm_rows"], row["target_vs_deepgemm_rows"],
                                           higher_is_better=False))
    return row


def extend_rows(device, quick, seed, ceilings, progress=None) -> list[dict]:
    batches = extend_batches(device, quick, seed)
    dg, dg_reason = peers.deepgemm() if device.type == "cuda" else (None, "no GPU")
    reps = 5 if device.type == "cuda" else 2
    return _route_rows(
        "extend", batches,
        lambda eb: {"mode": "extend", "batch_name": eb.name, "requests": len(eb.requests),
                    "rows": sum(n for _, n in eb.requests), "next_n": 1, "error": None},
        lambda eb, base: _extend_case(device, eb, seed, reps, ceilings, dg, dg_reason, base), device, progress)


def _extend_case(device, eb, seed, reps, ceilings, dg, dg_reason, base):
    g = _gen(device, seed)
    B = len(eb.requests)
    seen = [p + (n + 1) // 4 for p, n in eb.requests]                      # entries of each request's last row
    pages = [math.ceil(x / PAGE_SLOTS) for x in seen]
    table_w = max(pages) + 1
    width = table_w * PAGE_SLOTS
    rot = rotations(device, sum(pages) * PAGE_SLOTS * BYTES_PER_TOKEN["bf16"])
    tables, n_pages = _paged_tables(pages, rot, table_w, device, g)
    cache = _random_cache(n_pages, "bf16", device, g)
    T = sum(n for _, n in eb.requests)
    q = torch.randn(T, HEADS, DIM, device=device, generator=g).to(torch.float8_e4m3fn)
    weights = torch.rand(T, HEADS, device=device, generator=g) / math.sqrt(HEADS * DIM)
    lens = torch.cat([p + (torch.arange(n) + 1) // 4 for p, n in eb.requests]).to(torch.int32).to(device)
    counts = torch.tensor([n for _, n in eb.requests], device=device)
    cu_rows = torch.nn.functional.pad(counts.cumsum(0), (1, 0)).to(torch.int32)
    ks = torch.zeros(T, dtype=torch.int32, device=device)
    row_tables = [bt.repeat_interleave(counts, 0) for bt in tables]
    plan_v = cupy_dsa.mqa_logits_plan(cu_rows)
    plan_r = cupy_dsa.paged_mqa_logits_plan(lens, 1)
    q_rows = q.view(T, 1, HEADS, DIM)
    q_bf16 = q.to(torch.bfloat16)  # bf16-reference's query: the same values in bf16, the same work

    def varlen(bt, q=q):
        return lambda: cupy_dsa.mqa_logits(q, cache, weights, ks, lens, block_table=bt, cu_rows=cu_rows, plan=plan_v,
                                           clean_logits=False)

    def by_rows(bt):
        return lambda: cupy_dsa.paged_mqa_logits(q_rows, cache, weights, lens, bt, width, plan=plan_r)

    t_v = time_calls([varlen(bt) for bt in tables], device, reps=reps)
    t_vb = time_calls([varlen(bt, q_bf16) for bt in tables], device, reps=reps)
    t_r = time_calls([by_rows(bt) for bt in row_tables], device, reps=reps)
    pairs = int(lens.to(torch.int64).sum())
    mm = ceilings.get("matmul_tflops")
    dg_rows_us, note = None, dg_reason
    if dg is not None:
        try:
            fp8_cache = _random_cache(n_pages, "fp8", device, g)
            _, call_rows = peers.deepgemm_decode(dg, q_rows, fp8_cache, weights, lens[:, None], row_tables[0], width)
            dg_rows_us = time_calls([(lambda bt=bt: call_rows(bt)) for bt in row_tables], device, reps=reps).seconds * 1e6
            note = None
        except Exception as exc:
            note = f"{type(exc).__name__}: {str(exc)[:160]}"
    out = []
    for route, t in (("rows", t_r), ("varlen", t_v), ("varlen, q bf16", t_vb)):
        tflops = 2 * HEADS * DIM * pairs / t.seconds / 1e12
        row = dict(base)
        row.update({
            "route": route, "time_us": t.seconds * 1e6, "timing": t.method, "rotating_buffers": rot,
            "visible_pairs": pairs, "tflops": tflops, "pct_matmul": _pct(tflops, mm),
            "deepgemm_rows_us": dg_rows_us, "deepgemm_note": note,
            "vs_deepgemm_rows": (t.seconds * 1e6 / dg_rows_us) if dg_rows_us else None,
        })
        target = None
        if route == "varlen" and device.type == "cuda":
            if eb.name.startswith("16 x 512"):
                target = TARGETS["extend_small_vs_deepgemm_rows"]
            elif pairs >= 64 * 2**20:
                target = TARGETS["extend_vs_deepgemm_rows"]
        row["target_vs_deepgemm_rows"] = target
        row["target_pct_matmul"] = TARGETS["extend_pct_matmul"] if (target and pairs >= 64 * 2**20) else None
        verdicts = [_verdict(row["vs_deepgemm_rows"], target, higher_is_better=False),
                    _verdict(row["pct_matmul"], row["target_pct_matmul"])]
        if route == "varlen, q bf16":
            row["vs_fp8_query"] = t.seconds / t_v.seconds
            if device.type == "cuda":
                row["target_vs_fp8_query"] = TARGETS["bf16_query_vs_fp8_query"]
                verdicts = [_verdict(row["vs_fp8_query"], row["target_vs_fp8_query"], higher_is_better=False)]
        row["verdict"] = _all_met(*verdicts)
        out.append(row)
    return out


VERIFY_EXTEND_COUNTED = (
    "verify: B requests x n draft rows, per-row compressed lengths stepping by at most one (C4); rows = SGLang's "
    "call (every row a next_n-1 request with its own page-table row), grouped = next_n n per request (2-D lengths, "
    "one block-table row); % read = bf16 key bytes of each request read once over the read-only stream; "
    "% roofline = max(read time, bf16-matmul time of the visible pairs) / time, both ceilings measured in this "
    "run; targets (grouped, >= 1M entries): n 2 the read stream, n 3-4 the roofline, and the time over DeepGEMM "
    "rows. extend: one row per new token, "
    "row j of a request sees prefix + (j + 1) // 4 entries; rows = SGLang's paged call, varlen = one mqa_logits "
    "launch over all requests (4-row tiles per request); % matmul = 2*64*128 per visible pair over the bf16 matmul. "
    "DeepGEMM rows = fp8_paged_mqa_logits on the same rows as stock SGLang calls it (fp8 cache, next_n 1, "
    "lens per row); DeepGEMM grouped = next_n n (n <= 2). All timed the same way with rotating buffers.")
