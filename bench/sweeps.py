"""``cupy-dsa bench store``, ``query`` and ``logits``: throughput sweeps of the public ops against the ceilings
measured in the same process, next to the issue targets, plus the torch gather+bmm baseline; the inputs, timing and
verdict helpers every sweep shares. The MTP verify and multi-request extend rows of ``bench logits`` are
:mod:`.verify_extend`'s."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

import cupy_dsa
from cupy_dsa.layouts import BYTES_PER_TOKEN, PAGE_SLOTS, bf16_view, empty_cache, fp8_views

from . import peers
from .models import BUILTIN as SERVE_MODELS
from .timing import peak_extra_bytes, rotations, time_calls

HEADS, DIM = 64, 128
ROPE_THETA = 160000.0  # V4's compress_rope_theta (plain RoPE table; YaRN does not change the cost)

# Issue targets, as fractions of the ceilings measured in the same run.
TARGETS = {
    "store_bf16_pct_copy": 0.80,
    # decode, bf16 keys, fp8 q: key bytes over the read-only stream, by next_n: (>= 1M visible entries,
    # 256K..1M entries); every batch, equal and mixed lengths alike
    "decode_bf16_pct_read": {1: (0.90, 0.80), 2: (0.85, 0.75), 3: (0.80, 0.70), 4: (0.80, 0.70)},
    "decode_small_us": 5.0,
    # prefill, contiguous keys: TFLOP/s useful over the bf16 matmul, by (rows, keys); paged within 5% of it
    "prefill_pct_matmul": {"4096x65536": 0.70, "8192x131072": 0.70, "1024x16384": 0.60},
    "prefill_paged_vs_contiguous": 1.05,
    # a fresh prompt of 16K rows (no prefix), bf16 keys: TFLOP/s over the bf16 matmul, time over DeepGEMM's
    # fp8_mqa_logits on the same rows (SGLang's non-paged route)
    "fresh_prompt_pct_matmul": 0.70,
    "fresh_prompt_vs_deepgemm": 1.6,
    # MTP verify, grouped route, batches of >= 1M entries, by next_n: the share of the ceiling that binds (n 2:
    # the read stream; n 3-4: the roofline max(read, matmul)) and the time over DeepGEMM's as stock SGLang calls
    # it (one row per token)
    "verify_grouped_pct": {2: ("read", 0.85), 3: ("roofline", 0.80), 4: ("roofline", 0.80)},
    "verify_vs_deepgemm_rows": {2: 1.4, 3: 0.9, 4: 1.1},
    # multi-request extend varlen: time over DeepGEMM's rows; with >= 64M visible pairs also of the bf16 matmul
    "extend_vs_deepgemm_rows": 1.6,
    "extend_small_vs_deepgemm_rows": 1.7,
    "extend_pct_matmul": 0.65,
    # bf16-reference's bf16 query on bf16 keys: time over the fp8 query's (decode 64 x 32K, the extend cases)
    "bf16_query_vs_fp8_query": 1.05,
}

# A ragged multi-request extend (one mqa_logits call over the requests' concatenated keys): (prefix, new)
# index entries per request; row r of a request sees its own keys [0, prefix + r].
RAGGED_EXTEND = [(12288, 2048), (0, 4096), (30720, 1024), (2048, 512), (8192, 3072), (57344, 256)]
@dataclass
class DecodeBatch:
    """One decode batch as serving sees it: per-request index entries (the last row's length) and the
    max_context_len SGLang passes (block-table width x 64, wider than the longest request)."""
    name: str
    lens: list
    width: int
    next_n: tuple = (1, 2)
    torch_baseline: bool = False   # the gather+bmm baseline (equal lengths, next_n 1 only: it is slow)

    @property
    def entries(self) -> int:
        return int(sum(self.lens))


def long_tail(B: int, seed: int, max_len: int = 120 * 1024, median: int = 8192) -> list:
    """Lognormal lengths (median 8K entries, sigma 1.2) clipped to [128, max_len], with a few requests
    (B / 16, at least one) near max_len: a serving batch of mostly short and some very long contexts."""
    g = torch.Generator().manual_seed(seed + B)
    lens = torch.exp(math.log(median) + 1.2 * torch.randn(B, generator=g)).clamp(128, max_len)
    near = torch.randperm(B, generator=g)[:max(1, B // 16)]
    lens[near] = max_len - torch.randint(0, 4096, (len(near),), generator=g).to(lens.dtype)
    return [int(x) for x in lens.round()]


def decode_batches(device: torch.device, quick: bool, seed: int) -> list:
    K = 1024
    if device.type != "cuda":  # CPU reference: tiny
        return [DecodeBatch("1 x 256", [256], 256, (1, 2), True),
                DecodeBatch("3 mixed", [700, 0, 65], 1024, (1, 2))]
    eq = [DecodeBatch("1 x 8K", [8 * K], 8 * K, (1,)),
          DecodeBatch("64 x 32K", [32 * K] * 64, 32 * K, (1, 2, 3, 4), True)]
    mixed = [DecodeBatch("long-tail B=64", long_tail(64, seed), 128 * K),
             DecodeBatch("1 x 256K + 63 x 2K", [256 * K] + [2 * K] * 63, 320 * K)]
    if quick:
        return eq + mixed
    eq += [DecodeBatch("128 x 16K", [16 * K] * 128, 16 * K, (1, 2), True),
           DecodeBatch("32 x 64K", [64 * K] * 32, 64 * K, (1, 2), True),
           DecodeBatch("4 x 256K", [256 * K] * 4, 256 * K, (1, 2))]
    mixed = [DecodeBatch("long-tail B=32", long_tail(32, seed), 128 * K),
             mixed[0],
             DecodeBatch("long-tail B=128", long_tail(128, seed), 128 * K),
             mixed[1]]
    return eq + mixed


@dataclass
class Sizes:
    store_n: list
    prefill: list         # (T, S)
    fresh: list           # (T, index_topk): a fresh prompt, T rows over T keys, rows seeing <= index_topk keys empty
    reps: int


# V4-Flash's index_topk: the rows of a fresh prompt whose range is no longer than it get an empty range
FRESH_PROMPT_TOPK = SERVE_MODELS["v4-flash"].index_topk


def sizes(device: torch.device, quick: bool) -> Sizes:
    if device.type != "cuda":  # CPU reference: tiny (index_topk shrunk with the prompt: rows on both sides of it)
        return Sizes([256], [(64, 512)], [(128, 32)], 2)
    if quick:
        return Sizes([2**18], [(1024, 16384)], [(16384, FRESH_PROMPT_TOPK)], 20)
    return Sizes([2**20], [(4096, 65536), (8192, 131072), (1024, 16384)],
                 [(8192, FRESH_PROMPT_TOPK), (16384, FRESH_PROMPT_TOPK)], 30)


def make_freqs(max_pos: int, device) -> torch.Tensor:
    """RoPE table ``float32 [max_pos, 64]`` with (cos, sin) interleaved per frequency."""
    inv = ROPE_THETA ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.stack([ang.cos(), ang.sin()], dim=-1).reshape(max_pos, 64).to(torch.float32).to(device)


def _gen(device, seed):
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def _pct(x, ceiling):
    return None if (x is None or not ceiling) else x / ceiling


def _verdict(value, target, higher_is_better=True):
    if value is None or target is None:
        return None
    return "pass" if ((value >= target) if higher_is_better else (value <= target)) else "miss"


def _all_met(*verdicts):
    """One verdict of a row with several targets: a miss if any was missed, a pass if every one evaluated
    passed, None when none was evaluated."""
    seen = [v for v in verdicts if v]
    return ("miss" if "miss" in seen else "pass") if seen else None


def _error_row(base: dict, exc: Exception) -> dict:
    row = dict(base)
    row["error"] = f"{type(exc).__name__}: {exc}"[:300]
    return row


def _run_case(base: dict, case: Callable[[], dict], device: torch.device, progress, task) -> dict:
    """One sweep row: ``case()``, or ``base`` with the error when the op raises (the sweep goes on); then
    give cached memory back and advance the progress bar."""
    try:
        row = case()
    except Exception as exc:
        row = _error_row(base, exc)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if progress:
        progress.advance(task)
    return row


def _route_rows(mode: str, batches, base_of, case, device: torch.device, progress) -> list[dict]:
    """The verify / extend sweeps: one :func:`_run_case` per batch, whose case returns a row per route (or
    the error row)."""
    task = progress.add_task(f"logits ({mode})", total=len(batches)) if progress else None
    rows = []
    for b in batches:
        base = base_of(b)
        r = _run_case(base, lambda: case(b, base), device, progress, task)
        rows.extend(r if isinstance(r, list) else [r])
    return rows


# --------------------------------------------------------------------------------------------------
# store
# --------------------------------------------------------------------------------------------------

STORE_VARIANTS = (("bf16", "exact"), ("bf16", "fp4sim"), ("fp8", "exact"))


def store_rows(device: torch.device, quick: bool, seed: int, ceilings: dict, progress=None) -> list[dict]:
    sz = sizes(device, quick)
    cases = [(n, lay, num, kd) for n in sz.store_n for lay, num in STORE_VARIANTS
             for kd in (torch.float32, torch.bfloat16)]
    task = progress.add_task("store", total=len(cases)) if progress else None
    rows = []
    copy = ceilings.get("copy_gbps")
    for n, layout, numerics, kv_dtype in cases:
        base = {"n_tokens": n, "layout": layout, "numerics": numerics,
                "kv_dtype": str(kv_dtype).replace("torch.", ""), "error": None}
        rows.append(_run_case(base, lambda: _store_case(device, n, layout, numerics, kv_dtype, seed, sz.reps,
                                                        copy, base), device, progress, task))
    return rows


def _store_case(device, n, layout, numerics, kv_dtype, seed, reps, copy_gbps, base):
    g = _gen(device, seed)
    kv = torch.randn(n, DIM, device=device, generator=g).to(kv_dtype)
    positions = torch.arange(n, dtype=torch.int32, device=device)
    pages = math.ceil(n / PAGE_SLOTS)
    perm = torch.randperm(pages, device=device, generator=g)
    ar = torch.arange(n, device=device)
    out_loc = (perm[ar // PAGE_SLOTS] * PAGE_SLOTS + ar % PAGE_SLOTS).to(torch.int64)  # shuffled pages
    freqs = make_freqs(n, device)
    w = 1.0 + 0.1 * torch.randn(DIM, device=device, generator=g)
    cache = empty_cache(pages, layout, device)

    def call():
        cupy_dsa.store_index_k(kv, cache, positions=positions, out_loc=out_loc, norm_weight=w, freqs_cis=freqs,
                               numerics=numerics)

    t = time_calls([call], device, reps=reps)
    bpt = BYTES_PER_TOKEN[layout]
    per_token = DIM * kv.element_size() + 4 + 8 + 64 * 4 + bpt
    moved = n * per_token
    gbps = moved / t.seconds / 1e9
    pct = _pct(gbps, copy_gbps)
    target = TARGETS["store_bf16_pct_copy"] if (layout == "bf16" and n >= 2**20) else None
    row = dict(base)
    row.update({
        "time_us": t.seconds * 1e6, "tokens_per_s": n / t.seconds, "bytes_per_token_counted": per_token,
        "gbps": gbps, "pct_copy": pct, "target_pct_copy": target, "verdict": _verdict(pct, target),
        "timing": t.method,
    })
    return row


STORE_COUNTED = ("store GB/s counts per token: kv read (128 x 4 B fp32 or 2 B bf16) + position (int32, 4 B) + "
                 "out_loc (int64, 8 B) + one freqs_cis row (64 x fp32 = 256 B; positions 0..N-1 are distinct, "
                 "so each row is read once) + cache bytes written (256 B bf16, 132 B fp8 incl. its scale). "
                 "out_loc scatters tokens over shuffled pages.")


# --------------------------------------------------------------------------------------------------
# query prep
# --------------------------------------------------------------------------------------------------

QUERY_T = (1, 64, 4096, 16384)
QUERY_OUT_BYTES = {"fp4sim": 2, "fp8": 1}  # per q element written


def query_rows(device: torch.device, quick: bool, seed: int, ceilings: dict, progress=None) -> list[dict]:
    ts = QUERY_T if device.type == "cuda" else QUERY_T[:2]  # the CPU reference: tiny sizes only
    cases = [(t, num) for t in ts for num in QUERY_OUT_BYTES]
    task = progress.add_task("query", total=len(cases)) if progress else None
    reps = sizes(device, quick).reps
    rows = []
    for t, numerics in cases:
        base = {"n_tokens": t, "numerics": numerics, "error": None}
        rows.append(_run_case(base, lambda: _query_case(device, t, numerics, seed, reps, ceilings.get("read_gbps"),
                                                        base), device, progress, task))
    return rows


def _query_case(device, t, numerics, seed, reps, read_gbps, base):
    g = _gen(device, seed)
    q = torch.randn(t, 64, DIM, device=device, generator=g).to(torch.bfloat16)
    w = torch.randn(t, 64, device=device, generator=g).to(torch.bfloat16)
    positions = torch.arange(t, dtype=torch.int32, device=device)
    freqs = make_freqs(t, device)
    out = cupy_dsa.prepare_index_q(q, w, freqs_cis=freqs, positions=positions, weight_scale=DIM ** -0.5 * 64 ** -0.5,
                                   numerics=numerics)

    def call():
        cupy_dsa.prepare_index_q(q, w, freqs_cis=freqs, positions=positions, weight_scale=DIM ** -0.5 * 64 ** -0.5,
                                 numerics=numerics, out=out)

    tm = time_calls([call], device, reps=reps)
    per_token = 64 * DIM * (2 + QUERY_OUT_BYTES[numerics]) + 64 * (2 + 4) + 4 + 64 * 4
    gbps = t * per_token / tm.seconds / 1e9
    row = dict(base)
    row.update({"time_us": tm.seconds * 1e6, "bytes_per_token_counted": per_token, "gbps": gbps,
                "pct_read": _pct(gbps, read_gbps), "timing": tm.method})
    return row


QUERY_COUNTED = ("query GB/s counts per token: q read (64 x 128 bf16 = 16 KiB) + q written (16 KiB bf16 fp4sim, "
                 "8 KiB fp8) + weights read (64 x bf16) and written (64 x fp32) + position (int32) + one "
                 "freqs_cis row (256 B), against the read-only stream ceiling of the same run.")


# --------------------------------------------------------------------------------------------------
# logits: decode (paged) and prefill
# --------------------------------------------------------------------------------------------------

def _random_cache(num_pages, layout, device, g):
    cache = empty_cache(num_pages, layout, device)
    if layout == "bf16":
        bf16_view(cache).copy_(0.3 * torch.randn(num_pages, PAGE_SLOTS, DIM, device=device, generator=g))
    else:
        values, _ = fp8_views(cache)
        values.copy_(torch.randn(num_pages, PAGE_SLOTS, DIM, device=device, generator=g)
                     .clamp(-400, 400).to(torch.float8_e4m3fn).view(torch.uint8))
        scales = 0.01 + 0.01 * torch.rand(num_pages, PAGE_SLOTS, device=device, generator=g)
        cache.view(num_pages, -1)[:, PAGE_SLOTS * DIM:].view(torch.float32).copy_(scales)
    return cache


def _paged_tables(pages, rot, table_w, device, g):
    """`rot` disjoint page sets (shuffled) for requests of `pages` pages: block tables [B, table_w]."""
    per_rot = sum(pages)
    perm = torch.randperm(max(1, rot * per_rot), device=device, generator=g).to(torch.int32)
    tables = []
    for i in range(rot):
        bt = torch.zeros(len(pages), table_w, dtype=torch.int32, device=device)
        off = i * per_rot
        for b, n in enumerate(pages):
            bt[b, :n] = perm[off:off + n]
            off += n
        tables.append(bt)
    return tables, max(1, rot * per_rot)


def torch_gather_bmm(q, cache, weights, lens, block_table, max_len, layout):
    """What SGLang's torch fallback does (our own formulation): gather the request's pages to bf16, bmm
    with q in bf16 (scores rounded to bf16), relu, times the weights, sum over heads (fp32), times the fp8
    key scale; columns past a row's length set to 0."""
    B, nn = q.shape[0], q.shape[1]
    bt = block_table.clamp(min=0).long()
    if layout == "bf16":
        k = bf16_view(cache)[bt]                                    # [B, pages, 64, 128] bf16
        kscale = None
    else:
        values, scales = fp8_views(cache)
        k = values[bt].view(torch.float8_e4m3fn).to(torch.bfloat16)
        kscale = scales[bt].reshape(B, -1)[:, :max_len]
    k = k.reshape(B, -1, DIM)[:, :max_len]
    s = torch.bmm(q.reshape(B, nn * HEADS, DIM).to(torch.bfloat16), k.transpose(1, 2))  # [B, nn*64, S] bf16
    s = s.relu_().view(B, nn, HEADS, -1)
    logits = (s * weights.view(B, nn, HEADS, 1)).sum(2)             # fp32 [B, nn, S]
    if kscale is not None:
        logits = logits * kscale[:, None, :]
    col = torch.arange(logits.shape[-1], device=q.device)
    ln = lens.view(B, -1).to(torch.int64)[..., None]
    logits = logits.masked_fill_(col >= ln, 0.0)
    return logits.reshape(B * nn, -1)


def _decode_inputs(device, batch, next_n, layout, q_dtype, rot, g):
    """Cache with `rot` disjoint page sets for the batch (shuffled pages), block tables [B, width / 64] (the
    entries past a request's pages point at page 0, as in a padded SGLang table), q, weights, lens."""
    B = len(batch.lens)
    pages = [math.ceil(n / PAGE_SLOTS) for n in batch.lens]
    per_rot = sum(pages)
    cache = _random_cache(max(1, rot * per_rot), layout, device, g)
    perm = torch.randperm(max(1, rot * per_rot), device=device, generator=g).to(torch.int32)
    table_w = math.ceil(batch.width / PAGE_SLOTS)
    tables = []
    for i in range(rot):
        bt = torch.zeros(B, table_w, dtype=torch.int32, device=device)
        off = i * per_rot
        for b, n in enumerate(pages):
            bt[b, :n] = perm[off:off + n]
            off += n
        tables.append(bt)
    q = torch.randn(B, next_n, HEADS, DIM, device=device, generator=g)
    q = q.to(torch.float8_e4m3fn) if q_dtype == "fp8" else q.to(torch.bfloat16)
    weights = torch.rand(B * next_n, HEADS, device=device, generator=g) / math.sqrt(HEADS * DIM)
    lens = torch.tensor(batch.lens, dtype=torch.int32, device=device)  # row j sees lens - (next_n - 1 - j)
    return cache, tables, q, weights, lens


def decode_rows(device, quick, seed, ceilings, progress=None) -> list[dict]:
    batches = decode_batches(device, quick, seed)
    reps = sizes(device, quick).reps
    cases = [(bt, nn, layout, "fp8") for bt in batches for nn in bt.next_n for layout in ("fp8", "bf16")]
    cases.append((batches[1], 1, "bf16", "bf16"))  # bf16 q on bf16 keys, one batch
    dg, dg_reason = peers.deepgemm() if device.type == "cuda" else (None, "no GPU")
    task = progress.add_task("logits (decode)", total=len(cases)) if progress else None
    rows = []
    for batch, nn, layout, qd in cases:
        base = {"mode": "decode", "batch_name": batch.name, "batch": len(batch.lens), "entries": batch.entries,
                "context": max(batch.lens), "width": batch.width, "next_n": nn, "layout": layout, "q_dtype": qd,
                "error": None}
        rows.append(_run_case(base, lambda: _decode_case(device, batch, nn, layout, qd, seed, reps, ceilings,
                                                         base, dg if layout == "fp8" and qd == "fp8" else None),
                              device, progress, task))
    # our time vs our fp8 layout, and DeepGEMM's fp8 time, on the same batch / next_n / q
    fp8 = {(r["batch_name"], r["next_n"], r["q_dtype"]): r for r in rows
           if r["layout"] == "fp8" and not r.get("error")}
    for r in rows:
        r8 = fp8.get((r["batch_name"], r["next_n"], r["q_dtype"]))
        r["time_vs_fp8"] = (r["time_us"] / r8["time_us"]) if (r8 and r.get("time_us")) else None
        dg_us = r8.get("deepgemm_us") if r8 else None
        r["deepgemm_us"] = dg_us
        r["vs_deepgemm"] = (r["time_us"] / dg_us) if (dg_us and r.get("time_us")) else None
        if r8 and r is not r8:
            r["deepgemm_schedule_us"] = r8.get("deepgemm_schedule_us")
        if dg is None and not r.get("deepgemm_note"):
            r["deepgemm_note"] = dg_reason
    # the bf16 query (bf16-reference) against the fp8 query on the same bf16 keys
    fp8_q = {(r["batch_name"], r["next_n"]): r for r in rows
             if r["layout"] == "bf16" and r["q_dtype"] == "fp8" and not r.get("error")}
    for r in rows:
        ref = fp8_q.get((r["batch_name"], r["next_n"])) if r["q_dtype"] == "bf16" else None
        if ref and r.get("time_us") and device.type == "cuda":
            r["vs_fp8_query"] = r["time_us"] / ref["time_us"]
            r["target_vs_fp8_query"] = TARGETS["bf16_query_vs_fp8_query"]
            r["verdict"] = _verdict(r["vs_fp8_query"], r["target_vs_fp8_query"], higher_is_better=False)
    return rows


def _decode_target(batch, nn, layout, qd, device):
    """(target fraction of the read stream, target us) of a row, or None."""
    if device.type != "cuda" or layout != "bf16" or qd != "fp8":
        return None, None
    if batch.name == "1 x 8K" and nn == 1:
        return None, TARGETS["decode_small_us"]
    big, mid = TARGETS["decode_bf16_pct_read"][nn]
    if batch.entries >= 2**20:
        return big, None
    return (mid, None) if batch.entries >= 2**18 else (None, None)


def _decode_case(device, batch, nn, layout, qd, seed, reps, ceilings, base, dg):
    g = _gen(device, seed)
    bpt = BYTES_PER_TOKEN[layout]
    key_bytes = batch.entries * bpt
    rot = rotations(device, key_bytes)
    cache, tables, q, weights, lens = _decode_inputs(device, batch, nn, layout, qd, rot, g)
    plan = cupy_dsa.paged_mqa_logits_plan(lens, nn)
    width = batch.width

    def ours(bt):
        return lambda: cupy_dsa.paged_mqa_logits(q, cache, weights, lens, bt, width, clean_logits=False, plan=plan)

    t = time_calls([ours(bt) for bt in tables], device, reps=reps)
    # a few-us kernel: 32 back-to-back calls per replay, so the replay's own overhead is spread thin
    t_plan = time_calls([lambda: cupy_dsa.paged_mqa_logits_plan(lens, nn, out=plan)] * 32, device, reps=reps)
    mem = peak_extra_bytes(ours(tables[0]), device)
    visible = int((lens.to(torch.int64)[:, None] - torch.arange(nn, device=lens.device)).clamp_min(0).sum())
    moved = key_bytes + q.numel() * q.element_size() + weights.numel() * 4 + visible * 4
    gbps = moved / t.seconds / 1e9
    key_gbps = key_bytes / t.seconds / 1e9
    read = ceilings.get("read_gbps")
    pct_read = _pct(key_gbps, read)
    target, us_target = _decode_target(batch, nn, layout, qd, device)
    row = dict(base)
    row.update({
        "time_us": t.seconds * 1e6, "plan_us": t_plan.seconds * 1e6, "gbps": gbps, "key_gbps": key_gbps,
        "pct_copy": _pct(gbps, ceilings.get("copy_gbps")), "pct_read": pct_read,
        "gkeys_per_s": batch.entries / t.seconds / 1e9, "bytes_counted": moved, "key_bytes": key_bytes,
        "rotating_buffers": rot, "timing": t.method, "peak_extra_mb": None if mem is None else mem / 1e6,
        "target_pct_read": target, "target_us": us_target,
        "verdict": _verdict(pct_read, target) if target else _verdict(t.seconds * 1e6, us_target, False),
        "torch_time_us": None, "speedup_vs_torch": None, "torch_peak_extra_mb": None,
        "deepgemm_us": None, "deepgemm_schedule_us": None, "deepgemm_rel_l2": None, "deepgemm_note": None,
    })
    if dg is not None:
        try:
            schedule, dg_call = peers.deepgemm_decode(dg, q, cache, weights, lens, tables[0], width)
            td = time_calls([(lambda bt=bt: dg_call(bt)) for bt in tables], device, reps=reps)
            ts = time_calls([schedule] * 32, device, reps=reps)
            theirs = dg_call().double()
            mine = ours(tables[0])().double()
            col = torch.arange(width, device=device)
            row_len = (lens.to(torch.int64)[:, None] - (nn - 1) + torch.arange(nn, device=device)).reshape(-1)
            vis = col[None, :] < row_len[:, None]
            err = float((mine[vis] - theirs[vis]).norm() / mine[vis].norm().clamp_min(1e-30)) if vis.any() else 0.0
            row.update({"deepgemm_us": td.seconds * 1e6, "deepgemm_schedule_us": ts.seconds * 1e6,
                        "deepgemm_rel_l2": err})
        except Exception as exc:  # the peer failed on this batch: say so, keep our row
            row["deepgemm_note"] = f"{type(exc).__name__}: {str(exc)[:160]}"
    if batch.torch_baseline and nn == 1 and qd == "fp8":
        def base_call(bt):
            return lambda: torch_gather_bmm(q, cache, weights, lens, bt, width, layout)
        tb = time_calls([base_call(bt) for bt in tables[: max(1, min(len(tables), 8))]], device,
                        reps=max(5, reps // 2) if device.type == "cuda" else reps)
        bmem = peak_extra_bytes(base_call(tables[0]), device)
        row.update({"torch_time_us": tb.seconds * 1e6, "speedup_vs_torch": tb.seconds / t.seconds,
                    "torch_peak_extra_mb": None if bmem is None else bmem / 1e6})
    return row


def prefill_rows(device, quick, seed, ceilings, progress=None) -> list[dict]:
    sz = sizes(device, quick)
    cases = []  # (rows, keys, kv, layout, index_topk of a fresh prompt or None)
    for i, (T, S) in enumerate(sz.prefill):
        cases.append((T, S, "contiguous", "bf16", None))
        if S >= 65536 or i == 0:
            cases.append((T, S, "paged", "bf16", None))
        if i == 0:
            cases.append((T, S, "paged", "fp8", None))
    cases += [(T, T, kvk, "bf16", topk) for T, topk in sz.fresh for kvk in ("contiguous", "paged")]
    if device.type == "cuda" and not quick:
        cases.append((sum(n for _, n in RAGGED_EXTEND), sum(p + n for p, n in RAGGED_EXTEND), "ragged", "bf16", None))
    task = progress.add_task("logits (prefill)", total=len(cases)) if progress else None
    dg, dg_reason = peers.deepgemm() if device.type == "cuda" else (None, "no GPU")
    rows = []
    for T, S, kvk, layout, topk in cases:
        base = {"mode": "prefill", "rows": T, "keys": S, "kv": kvk, "layout": layout, "q_dtype": "fp8",
                "error": None}
        if topk is not None:
            base.update({"prompt": "fresh", "index_topk": topk})
        reps = max(5, sz.reps // 3) if device.type == "cuda" else sz.reps
        rows.append(_run_case(base, lambda: _prefill_case(device, T, S, kvk, layout, seed, reps, ceilings, base,
                                                          dg, dg_reason, topk), device, progress, task))
    if device.type != "cuda":
        return rows  # the CPU reference's paged / contiguous times differ by noise: no ratio, no verdict
    contiguous = {(r["rows"], r["keys"], r.get("prompt")): r for r in rows
                  if r.get("kv") == "contiguous" and r.get("time_us")}
    for r in rows:
        c = contiguous.get((r["rows"], r["keys"], r.get("prompt")))
        if r.get("kv") == "paged" and r.get("layout") == "bf16" and c and r.get("time_us"):
            r["vs_contiguous"] = r["time_us"] / c["time_us"]
            r["target_vs_contiguous"] = TARGETS["prefill_paged_vs_contiguous"]
            if r.get("prompt") == "fresh":  # DeepGEMM ran once per prompt, on the contiguous row's keys
                r.update({k: c.get(k) for k in ("deepgemm_us", "deepgemm_tflops", "deepgemm_note")})
                r["vs_deepgemm"] = r["time_us"] / c["deepgemm_us"] if c.get("deepgemm_us") else None
                r["verdict"] = _fresh_prompt_verdict(r)
            else:
                r["verdict"] = _verdict(r["vs_contiguous"], r["target_vs_contiguous"], higher_is_better=False)
    return rows


def _fresh_prompt_verdict(row) -> str | None:
    """A fresh prompt's targets (16K rows on a GPU): % of the bf16 matmul, time over DeepGEMM's fp8_mqa_logits,
    and for the paged cache its time over the contiguous keys'."""
    return _all_met(_verdict(row.get("pct_matmul"), row.get("target_pct_matmul")),
                    _verdict(row.get("vs_deepgemm"), row.get("target_vs_deepgemm"), higher_is_better=False),
                    _verdict(row.get("vs_contiguous"), row.get("target_vs_contiguous"), higher_is_better=False))


def _sgl_topk_ranges(ks, ke, index_topk):
    """The ranges SGLang 0.5.23 passes for a single request with its default sgl-kernel top-k: that top-k fills a
    row whose range holds <= index_topk keys without reading its logits, so the row's range is empty
    (``_get_nonpaged_indexer_plan`` in srt/layers/attention/dsv4/indexer.py; the plugin's varlen route does the
    same, cupy_dsa/sglang/forward.py)."""
    return ks, torch.where(ke - ks > index_topk, ke, ks)


def _ragged_ranges(device):
    """ks, ke of RAGGED_EXTEND over the concatenated keys."""
    ks, ke, base = [], [], 0
    for prefix, new in RAGGED_EXTEND:
        ks.append(torch.full((new,), base, dtype=torch.int32))
        ke.append(base + prefix + 1 + torch.arange(new, dtype=torch.int32))
        base += prefix + new
    return torch.cat(ks).to(device), torch.cat(ke).to(device)


def _prefill_case(device, T, S, kvk, layout, seed, reps, ceilings, base, dg=None, dg_reason=None, fresh_topk=None):
    """One prefill row. ``fresh_topk`` set: a fresh prompt (S = T, row i sees keys [0, i + 1)) called as SGLang's
    non-paged route and the plugin call it: the ranges SGLang passes (:func:`_sgl_topk_ranges`), clean_logits
    off, the paged cache through the plugin's one-request varlen call; DeepGEMM with SGLang's arguments."""
    g = _gen(device, seed)
    fresh = fresh_topk is not None
    q = torch.randn(T, HEADS, DIM, device=device, generator=g).to(torch.float8_e4m3fn)
    weights = torch.rand(T, HEADS, device=device, generator=g) / math.sqrt(HEADS * DIM)
    if kvk == "ragged":
        ks, ke = _ragged_ranges(device)
    else:
        ks = torch.zeros(T, dtype=torch.int32, device=device)
        ke = (S - T + 1 + torch.arange(T, device=device)).to(torch.int32)  # causal: row i ends at the diagonal
    if fresh:
        ks, ke = _sgl_topk_ranges(ks, ke, fresh_topk)
    keys = None
    if kvk in ("contiguous", "ragged"):
        kv = keys = (0.3 * torch.randn(S, DIM, device=device, generator=g)).to(torch.bfloat16)
        kwargs = {}
    else:
        pages = math.ceil(S / PAGE_SLOTS)
        kv = _random_cache(pages, layout, device, g)
        kwargs = {"block_table": torch.randperm(pages, device=device, generator=g).to(torch.int32)}
        if fresh:  # the plugin's extend route: one request of the varlen launch
            cu_rows = torch.tensor([0, T], dtype=torch.int32, device=device)
            kwargs = {"block_table": kwargs["block_table"][None, :], "cu_rows": cu_rows,
                      "plan": cupy_dsa.mqa_logits_plan(cu_rows)}

    def call():
        return cupy_dsa.mqa_logits(q, kv, weights, ks, ke, clean_logits=not fresh, **kwargs)

    t = time_calls([call], device, reps=reps)
    mem = peak_extra_bytes(call, device)
    pairs = int((ke.to(torch.int64) - ks.to(torch.int64)).sum())
    tflops = 2 * HEADS * DIM * pairs / t.seconds / 1e12
    mm = ceilings.get("matmul_tflops")
    pct = _pct(tflops, mm)
    on_gpu = device.type == "cuda"
    if fresh:
        target = TARGETS["fresh_prompt_pct_matmul"] if (on_gpu and T >= 16384) else None
    else:
        target = TARGETS["prefill_pct_matmul"].get(f"{T}x{S}") if (on_gpu and kvk == "contiguous") else None
    row = dict(base)
    row.update({"time_us": t.seconds * 1e6, "visible_pairs": pairs, "tflops": tflops, "pct_matmul": pct,
                "gpairs_per_s": pairs / t.seconds / 1e9, "peak_extra_mb": None if mem is None else mem / 1e6,
                "target_pct_matmul": target, "verdict": _verdict(pct, target), "timing": t.method,
                "deepgemm_us": None, "vs_deepgemm": None, "deepgemm_note": dg_reason})
    if fresh:
        empty = int((ke == ks).sum())
        row.update({"empty_rows": empty,
                    "target_vs_deepgemm": TARGETS["fresh_prompt_vs_deepgemm"] if target else None,
                    "note": f"{empty} rows that see <= {fresh_topk} keys (index_topk) get an empty range, as SGLang "
                            "0.5.23 passes them with its sgl-kernel top-k (the default), which fills those rows "
                            "without their logits; clean_logits off, as SGLang and the plugin call it"})
    if keys is not None and dg is not None:
        try:
            # a fresh prompt: SGLang's non-paged call (_nonpaged_mqa_logits), keys rounded up to whole pages
            sglang_args = ({"clean_logits": False, "max_seqlen_k": math.ceil(S / PAGE_SLOTS) * PAGE_SLOTS}
                           if fresh else {})
            dg_call = peers.deepgemm_prefill(dg, q, keys, weights, ks, ke, **sglang_args)
            if dg_call is None:
                row["deepgemm_note"] = "deep_gemm has no fp8_mqa_logits"
            else:
                td = time_calls([dg_call], device, reps=reps)
                row.update({"deepgemm_us": td.seconds * 1e6, "vs_deepgemm": t.seconds / td.seconds,
                            "deepgemm_tflops": 2 * HEADS * DIM * pairs / td.seconds / 1e12, "deepgemm_note": None})
        except Exception as exc:  # DeepGEMM present but failing here: say so, keep our figures
            row["deepgemm_note"] = f"{type(exc).__name__}: {str(exc)[:160]}"
    if fresh:
        row["verdict"] = _fresh_prompt_verdict(row)
    return row


LOGITS_COUNTED = ("decode: key bytes = index entries of each request's longest row x 256 B (bf16) or 132 B (fp8), "
                  "over the time, against the read-only stream measured in this run (% read); GB/s also counts q + "
                  "weights read and the fp32 logits of visible columns written (% copy). Batches: equal lengths; "
                  "long-tail lognormal lengths (median 8K entries, a few near 120K); one long request among many "
                  "short ones; max_context_len = block-table width x 64 as SGLang passes it. Plan = our schedule "
                  "kernel, built once per forward (timed apart, like DeepGEMM's schedule metadata). DeepGEMM = "
                  "fp8_paged_mqa_logits on the same fp8 cache and q, timed the same way (CUDA-graph replays) in "
                  "this process; rel L2 = our fp8-layout logits vs DeepGEMM's on visible columns. time vs fp8 = "
                  "our time / our fp8-layout time; torch = gather pages + bmm (SGLang's fallback formulation). "
                  "Prefill TFLOP/s = 2*64*128 per visible (row, key) pair, causal ks=0, ke=S-T+i+1, clean on; ragged = one "
                  "call over the concatenated keys of several extend requests (prefix + new entries each); "
                  "DeepGEMM = fp8_mqa_logits on the same rows with the keys in fp8 + per-token scales, clean on, "
                  "timed the same way. Fresh prompt = one request with no prefix, row i sees keys [0, i + 1) of S = T, "
                  "called as SGLang 0.5.23's non-paged route calls DeepGEMM (the same rows: rows seeing <= index_topk "
                  "keys get an empty range, which its default sgl-kernel top-k fills without logits; clean off; "
                  "max_seqlen_k = S rounded up to a page) and as the plugin calls ours (the same ranges, clean off; "
                  "paged = the one-request varlen launch); TFLOP/s counts the pairs of the non-empty ranges.")
