"""``cupy-dsa bench recall --suite diverse``: a top-k boundary contested by diverse keys, realistic queries, and each
format's error budget (how much of its loss the key's rounding and the query's rounding cause).

The needle suite (``--suite needle``, :mod:`.recall`) puts the boundary among near-duplicates of one key, where the
competing keys share the query's rounding: there the query's precision hardly shows. Here the keys differ as hidden
states do, so the query's per-(token, head) fp8 rounding moves keys across the boundary as much as the key's does.

Keys (SYNTHETIC, one haystack per context, pushed through the real store): raw key = s * (mu + topic[segment] +
U h_t + e): topic segments of geometric length (mean 256 tokens) drawn from 32 recurring topics, an AR(1) drift h_t
(rank 16, rho 0.995) along the sequence, e ~ N(0, 0.3^2), heavy-tailed channel scales s; the store's RMSNorm weight
carries 4 outlier channels (x ``outlier_scale``, default 20), then RoPE at position 4i and Hadamard as
``store_index_k`` applies them. Queries (rotated basis, the position after the last key): per (token, head) a
magnitude exp(N(0, 0.5^2)) (so SGLang's per-(token, head) fp8 scale differs between heads); ``peaked`` rows give half
their heads a preferred token set (one topic's tokens: the head points at their mean key, off the mean-key direction)
and the other half the unpeaked form; ``unpeaked`` rows: every head a random direction plus the mean-key direction and
the recent drift. Head weights N(0.5, 0.5^2) / sqrt(8192) (signed, as weights_proj's are).

Oracles: **exact** (fp64 scores of the fp32 rotated keys the store computes before rounding and the unquantized fp32
query) and **reference** (DeepSeek-V4's numerics: fp4-simulated keys and query, fp32 scores). Formats: the key side
from the real store (fp8, bf16 exact, bf16 fp4sim) scored by the real logits op with the format's query; fp8-rescore
by its CPU reference (stage 1 = the fp8 format's logits, K' = 4k, stage 2 with the fp8 or the bf16 query). Error
budget (one-pass formats): the share of the exact top-k missed with only the key rounded (the stored key, the exact
query), only the query rounded (the exact key, the format's query) and both (fp64 emulation), so it shows which side
to fix.
"""

from __future__ import annotations

import math

import torch

import cupy_dsa
from cupy_dsa.layouts import PAGE_SLOTS, bf16_view, empty_cache, fp8_views
from cupy_dsa.store import fp4sim_reference, rotate_index_k_reference

from .provenance import commit_label
from .recall import _fp8_q, fp4_simulate
from .sweeps import DIM, HEADS, make_freqs

SUITE = "diverse"
TOPKS = (512, 2048)
K_PRIME_MULTIPLE = 4
# format -> (stored key, query): key "fp8" (SGLang's 132 B layout), "bf16" (exact numerics), "fp4sim" (bf16 layout,
# FP4-rounded values); query "fp8" (SGLang's: per (token, head) scale folded into the weights), "bf16" (the rotated
# q rounded once: SGLANG_CUPY_DSA_INDEX_Q=bf16), "fp4" (SGLang's fp4 indexer, simulated), "fp4sim" (bf16-reference)
ONE_PASS = {
    "fp8": ("fp8", "fp8"),
    "fp8+q-bf16": ("fp8", "bf16"),
    "fp4": ("fp4sim", "fp4"),
    "bf16": ("bf16", "fp8"),
    "bf16+q-bf16": ("bf16", "bf16"),
    "bf16-fp4sim": ("fp4sim", "fp8"),
    "bf16-fp4sim+q-bf16": ("fp4sim", "bf16"),
    "bf16-reference": ("fp4sim", "fp4sim"),
}
# two-level keys (fp8 + int8 residual): stage 2's query
RESCORE = {"fp8-rescore-4x": "fp8", "fp8-rescore-4x-bf16q": "bf16"}
FORMATS = tuple(ONE_PASS) + tuple(RESCORE)
ORACLES = ("exact", "reference")
FORMAT_NOTES = {
    "fp8": "SGLang's stock numerics: fp8 keys, fp8 q (cupy_dsa's fp8-key logits: the plugin's fp8-cupy)",
    "fp8+q-bf16": "fp8 keys, bf16 q (fp8-cupy with SGLANG_CUPY_DSA_INDEX_Q=bf16)",
    "fp4": "SGLang's fp4 indexer, simulated: fp4sim keys, q rounded to bf16 then e2m1 (block 32)",
    "bf16": "bf16 keys, SGLang's fp8 q (the plugin's bf16 mode, its default query)",
    "bf16+q-bf16": "bf16 keys, bf16 q (bf16 with SGLANG_CUPY_DSA_INDEX_Q=bf16)",
    "bf16-fp4sim": "fp4sim keys in bf16, fp8 q",
    "bf16-fp4sim+q-bf16": "fp4sim keys in bf16, bf16 q",
    "bf16-reference": "fp4sim keys, fp4sim q (DeepSeek-V4's reference numerics, the plugin's bf16-reference)",
    "fp8-rescore-4x": "two-level keys, K' = 4k fp8 candidates rescored with the fp8 q (CPU reference of rescore_topk)",
    "fp8-rescore-4x-bf16q": "two-level keys, K' = 4k, stage 2 with the bf16 q (fp8-rescore's default)",
}
N_TOPICS = 32
SEGMENT_MEAN = 256
AR_RHO = 0.995
RANK = 16
N_OUTLIERS = 4
OUTLIER_SCALE = 20.0
ROW_CHUNK = 4            # query rows per fp64 scoring pass (bounds its memory)

NOTE = __doc__.split("\n\n", 2)[2].replace("\n", " ").strip()


def contexts(device: torch.device, quick: bool) -> tuple[list[int], int]:
    """(context lengths in raw tokens, query rows per context: half peaked, half unpeaked)."""
    if device.type != "cuda":  # the torch reference store: small sizes
        return ([8192], 4) if quick else ([4096, 16384], 4)
    if quick:
        return [65536], 16
    return [65536, 262144], 32   # 16K and 64K keys


class _World:
    """Fixed 'model' statistics: channel scales, mean, topics, drift factors, the norm weight with its outliers."""

    def __init__(self, device, seed, outlier_scale):
        g = torch.Generator().manual_seed(seed)
        self.scale = torch.exp(0.5 * torch.randn(DIM, generator=g)).to(device)
        self.mu = torch.randn(DIM, generator=g).to(device)
        self.topics = (0.8 * torch.randn(N_TOPICS, DIM, generator=g)).to(device)
        self.U = (torch.randn(DIM, RANK, generator=g) / math.sqrt(RANK)).to(device)
        w = torch.exp(0.2 * torch.randn(DIM, generator=g))
        w[torch.randperm(DIM, generator=g)[:N_OUTLIERS]] *= outlier_scale
        self.norm_weight = w.to(device)


def _ar1(n, device, g, block=1024):
    """AR(1) latent [n, RANK]: h_t = rho h_{t-1} + sqrt(1 - rho^2) eps_t, h_0 ~ N(0, I), by blocks of a
    lower-triangular power matrix."""
    t = torch.arange(block, device=device, dtype=torch.float64)
    power = torch.where(t[:, None] >= t[None, :], AR_RHO ** (t[:, None] - t[None, :]).clamp_min(0), 0.0)
    decay = AR_RHO ** (t + 1)
    h_prev = torch.randn(RANK, device=device, generator=g, dtype=torch.float64)
    out = []
    for start in range(0, n, block):
        m = min(block, n - start)
        eps = math.sqrt(1 - AR_RHO ** 2) * torch.randn(m, RANK, device=device, generator=g, dtype=torch.float64)
        h = power[:m, :m] @ eps + decay[:m, None] * h_prev
        out.append(h)
        h_prev = h[-1]
    return torch.cat(out).float()


def _raw_keys(world, n, device, g):
    """(raw keys [n, 128], topic of each token [n])."""
    lengths = torch.distributions.Geometric(probs=torch.tensor(1.0 / SEGMENT_MEAN)).sample((n // 16 + 16,)) + 1
    seg = torch.repeat_interleave(torch.arange(lengths.numel()), lengths.long())[:n]
    topic_of_seg = torch.randint(0, N_TOPICS, (lengths.numel(),), generator=torch.Generator().manual_seed(
        int(torch.randint(0, 2**31, (1,), device=device, generator=g))))
    topic = topic_of_seg[seg].to(device)
    e = 0.3 * torch.randn(n, DIM, device=device, generator=g)
    raw = (world.mu + world.topics[topic] + _ar1(n, device, g) @ world.U.T + e) * world.scale
    return raw, topic


def _queries(k_exact, topic, rows, device, g):
    """q fp32 [rows, 64, 128] (rotated basis), weights fp32 [rows, 64], and each row's kind (peaked first)."""
    n = k_exact.shape[0]
    mean_dir = k_exact.mean(0)
    mean_dir = mean_dir / mean_dir.norm()
    recent = k_exact[-min(n, 256):].mean(0) - k_exact.mean(0)
    recent = recent / recent.norm().clamp_min(1e-6)
    q = torch.empty(rows, HEADS, DIM, device=device)
    kinds = []
    for r in range(rows):
        peaked = r < rows // 2
        kinds.append("peaked" if peaked else "unpeaked")
        rand = torch.randn(HEADS, DIM, device=device, generator=g)
        rand = rand / rand.norm(dim=-1, keepdim=True)
        c_mean = 0.5 + 0.3 * torch.randn(HEADS, 1, device=device, generator=g)
        c_recent = 0.5 * torch.randn(HEADS, 1, device=device, generator=g)
        heads = rand + c_mean * mean_dir + c_recent * recent
        if peaked:  # half the heads prefer one topic's tokens
            for h in range(HEADS // 2):
                t = topic[int(torch.randint(0, n, (1,), device=device, generator=g))]
                d = k_exact[topic == t].mean(0)
                d = d - (d @ mean_dir) * mean_dir
                d = d / d.norm().clamp_min(1e-6)
                heads[h] = 2.0 * d + 0.3 * rand[h] + c_mean[h] * mean_dir
        mag = torch.exp(0.5 * torch.randn(HEADS, 1, device=device, generator=g))
        q[r] = 4.0 * mag * heads / heads.norm(dim=-1, keepdim=True)
    w = (0.5 + 0.5 * torch.randn(rows, HEADS, device=device, generator=g)) / math.sqrt(HEADS * DIM)
    return q, w, kinds


def _scores64(q, w, k):
    """fp64 sum_h w relu(q . k): q [R, 64, 128], w [R, 64], k [n, 128] -> [R, n], in row chunks."""
    kd = k.double()
    out = []
    for s in range(0, q.shape[0], ROW_CHUNK):
        qq, ww = q[s:s + ROW_CHUNK].double(), w[s:s + ROW_CHUNK].double()
        out.append(torch.einsum("rhd,nd->rhn", qq, kd).clamp_min_(0).mul_(ww[:, :, None]).sum(1))
    return torch.cat(out)


def _topk_sets(scores, k):
    return scores.topk(min(k, scores.shape[1]), dim=-1).indices


def _recall(top, ref, n):
    """|top & ref| / |ref| per row."""
    mask = torch.zeros(top.shape[0], n, dtype=torch.bool, device=top.device)
    mask.scatter_(1, ref, True)
    return (mask.gather(1, top).sum(-1).double() / ref.shape[1])


def _query_of(kind, q, w):
    """(q as the logits op takes it, weights, q dequantized fp32 for the emulation) of a query rounding."""
    if kind == "fp8":
        q8, w8 = _fp8_q(q, w)
        s = w8 / w
        return q8, w8, q8.float() * s[..., None], w
    if kind == "bf16":
        qb = q.to(torch.bfloat16)
        return qb, w, qb.float(), w
    if kind == "fp4":
        qb = fp4_simulate(q.to(torch.bfloat16)).to(torch.bfloat16)
        return qb, w, qb.float(), w
    qb = fp4sim_reference(q).to(torch.bfloat16)  # fp4sim
    return qb, w, qb.float(), w


def _stored_keys(cache, layout, table_row, n):
    """The keys a cache holds, dequantized to fp32 [n, 128], in token order (through the request's page row)."""
    pages = table_row.long()
    if layout == "fp8":
        values, scales = fp8_views(cache)
        k = values[pages].view(torch.float8_e4m3fn).float() * scales[pages][..., None]
    else:
        k = bf16_view(cache)[pages].float()
    return k.reshape(-1, DIM)[:n]


def run(device: torch.device, quick: bool, seed: int, progress=None, outlier_scale: float = OUTLIER_SCALE) -> list[dict]:
    """Rows per (context, format or oracle, k): recall of the exact top-k (mean, min, per query kind), overlap with
    the reference's top-k, and for one-pass formats the error budget."""
    ctxs, rows = contexts(device, quick)
    world = _World(device, seed, outlier_scale)
    freqs = make_freqs(4 * (max(ctxs) // 4), device)
    g = torch.Generator(device=device)
    g.manual_seed(seed + 7)
    torch.manual_seed(seed + 11)  # the segment lengths
    task = progress.add_task("recall (diverse)", total=len(ctxs)) if progress else None
    out = []
    for L in ctxs:
        n = L // 4
        try:
            out += _context(world, freqs, L, n, rows, device, g, outlier_scale)
        except Exception as exc:  # a failing op ends this context; its rows say why
            out += [_row(L, n, fmt, k, rows, error=f"{type(exc).__name__}: {exc}"[:300], outlier_scale=outlier_scale)
                    for fmt in ORACLES + FORMATS for k in TOPKS]
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if progress:
            progress.advance(task)
    return out


def _row(L, n, fmt, k, rows, **fields):
    row = {"suite": SUITE, "context_tokens": L, "index_entries": n, "k": k, "format": fmt, "queries": rows,
           "key": ONE_PASS.get(fmt, ("two-level" if fmt in RESCORE else None, None))[0],
           "query": ONE_PASS[fmt][1] if fmt in ONE_PASS else RESCORE.get(fmt),
           "recall_mean": None, "recall_min": None, "recall_peaked": None, "recall_unpeaked": None,
           "missed_share": None, "ref_overlap_mean": None, "missed_key_only": None, "missed_query_only": None,
           "missed_both": None, "k_prime": K_PRIME_MULTIPLE * k if fmt in RESCORE else None, "trivial": n <= k,
           "outlier_scale": None, "error": None}
    row.update(fields)
    return row


def _context(world, freqs, L, n, rows, device, g, outlier_scale):
    positions = 4 * torch.arange(n, device=device, dtype=torch.int32)
    raw, topic = _raw_keys(world, n, device, g)
    k_exact = rotate_index_k_reference(raw, positions, world.norm_weight, freqs)          # fp32 [n, 128]
    k_ref = rotate_index_k_reference(raw, positions, world.norm_weight, freqs, numerics="fp4sim")
    q, w, kinds = _queries(k_exact, topic, rows, device, g)
    kind_rows = {kd: torch.tensor([i for i, x in enumerate(kinds) if x == kd], device=device)
                 for kd in ("peaked", "unpeaked")}
    # one request of n keys over shuffled pages; every row sees all of them
    pages = n // PAGE_SLOTS
    table = torch.randperm(pages, device=device, generator=g).to(torch.int32)[None]
    ar = torch.arange(n, device=device)
    out_loc = table[0].long()[ar // PAGE_SLOTS] * PAGE_SLOTS + ar % PAGE_SLOTS
    caches = {}
    for name, layout, numerics in (("fp8", "fp8", "exact"), ("bf16", "bf16", "exact"), ("fp4sim", "bf16", "fp4sim")):
        cache = empty_cache(pages, layout, device)
        cupy_dsa.store_index_k(raw, cache, positions=positions, out_loc=out_loc, norm_weight=world.norm_weight,
                               freqs_cis=freqs, numerics=numerics)
        caches[name] = (cache, layout)
    table_rows = table.expand(rows, -1).contiguous()
    lens = torch.full((rows,), n, dtype=torch.int32, device=device)

    exact = _scores64(q, w, k_exact)
    q_ref = fp4sim_reference(q)
    reference = _scores64(q_ref, w, k_ref).float()
    top_exact = {k: _topk_sets(exact, k) for k in TOPKS}
    top_ref = {k: _topk_sets(reference, k) for k in TOPKS}
    scores = {"exact": exact, "reference": reference}
    budget = {}
    stored = {name: _stored_keys(c, layout, table[0], n) for name, (c, layout) in caches.items()}
    for fmt, (key, query) in ONE_PASS.items():
        qq, ww, q_deq, w_deq = _query_of(query, q, w)
        cache, _ = caches[key]
        logits = cupy_dsa.paged_mqa_logits(qq[:, None].contiguous(), cache, ww.float().contiguous(), lens, table_rows,
                                           n, clean_logits=False)[:, :n]
        scores[fmt] = logits.float()
        budget[fmt] = {"missed_key_only": _scores64(q, w, stored[key]),
                       "missed_query_only": _scores64(q_deq, w_deq, k_exact),
                       "missed_both": _scores64(q_deq, w_deq, stored[key])}
    rescored = _rescore(caches["fp8"][0], k_exact, q, w, scores["fp8"], out_loc, pages, lens, table_rows, n, device)

    out = []
    for fmt in ORACLES + FORMATS:
        for k in TOPKS:
            if fmt in RESCORE:
                top = rescored[(fmt, k)]
            else:
                top = _topk_sets(scores[fmt], k)
            rec = _recall(top, top_exact[k], n)
            fields = dict(recall_mean=float(rec.mean()), recall_min=float(rec.min()),
                          missed_share=float(1 - rec.mean()),
                          ref_overlap_mean=float(_recall(top, top_ref[k], n).mean()),
                          **{f"recall_{kd}": float(rec[idx].mean()) for kd, idx in kind_rows.items() if idx.numel()},
                          outlier_scale=float(outlier_scale))
            if fmt in budget:
                for name, s in budget[fmt].items():
                    fields[name] = float(1 - _recall(_topk_sets(s, k), top_exact[k], n).mean())
            out.append(_row(L, n, fmt, k, rows, **fields))
    return out


def _rescore(hi_src, k_exact, q, w, fp8_logits, out_loc, pages, lens, table_rows, n, device):
    """{(format, k): selected positions [rows, k]} of the fp8-rescore formats (CPU reference of rescore_topk): stage 1
    the fp8 format's logits, K' = 4k, stage 2 with the fp8 or the bf16 query over fp8 + int8-residual keys."""
    from cupy_dsa.rescore import empty_lo_cache, rescore_topk_reference, store_two_level_reference

    hi, lo = empty_cache(pages, "fp8", device), empty_lo_cache(pages, device)
    store_two_level_reference(k_exact, hi, lo, out_loc)
    q8, w8 = _fp8_q(q, w)
    stage2 = {"fp8": (q8, w8), "bf16": (q.to(torch.bfloat16), w)}
    out = {}
    for fmt, query in RESCORE.items():
        q2, w2 = stage2[query]
        for k in TOPKS:
            kk = min(k, n)
            sel = rescore_topk_reference(q8[:, None].contiguous(), w8.float().contiguous(), hi, lo, lens, table_rows,
                                         kk, min(K_PRIME_MULTIPLE * kk, n), stage1_logits=fp8_logits.contiguous(),
                                         q_rescore=q2.contiguous(), weights_rescore=w2.float().contiguous())
            out[(fmt, k)] = sel.raw_indices.long()[:, :kk]
    return out


# --------------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------------

def _pct(v, digits=2):
    return "—" if v is None else f"{100 * v:.{digits}f}%"


def markdown(rows: list[dict]) -> str:
    """The suite as markdown: per context and k, each format's share of the exact top-k missed, its overlap with the
    reference's top-k, recall by query kind, and the error budget (missed with only the key rounded, only the query
    rounded, both)."""
    ok = [r for r in rows if not r.get("error") and not r["trivial"]]
    if not ok:
        return "No diverse recall rows."
    lines = []
    for L in sorted({r["context_tokens"] for r in ok}):
        for k in TOPKS:
            sub = [r for r in ok if r["context_tokens"] == L and r["k"] == k and r["format"] not in ORACLES]
            if not sub:
                continue
            n, qn = sub[0]["index_entries"], sub[0]["queries"]
            lines += [f"{L:,} tokens ({n:,} keys), k = {k}, {qn} queries (half with a preferred token set):", "",
                      "| format | keys | query | missed (of the exact top-k) | recall: peaked / unpeaked queries | overlap "
                      "with reference | missed: key rounded only | query rounded only | both |",
                      "|---|---|---|---|---|---|---|---|---|"]
            for r in sub:
                lines.append(f"| {r['format']} | {r['key']} | {r['query']} | {_pct(r['missed_share'])} | "
                             f"{_pct(r['recall_peaked'])} / {_pct(r['recall_unpeaked'])} | "
                             f"{_pct(r['ref_overlap_mean'])} | {_pct(r['missed_key_only'])} | "
                             f"{_pct(r['missed_query_only'])} | {_pct(r['missed_both'])} |")
            lines.append("")
    lines.append(target_line(ok))
    return "\n".join(lines).rstrip("\n")


# issue 32's target: bf16 keys with the bf16 query keep >= 99.5% of the exact top-k at >= 16K keys, k 512 and 2048
TARGET_FORMAT, TARGET_RECALL, TARGET_MIN_KEYS = "bf16+q-bf16", 0.995, 16384
# the formats the query setting switches between: (fp8 query, bf16 query) on the same keys
QUERY_PAIRS = (("fp8", "fp8+q-bf16"), ("bf16", "bf16+q-bf16"), ("bf16-fp4sim", "bf16-fp4sim+q-bf16"),
               ("fp8-rescore-4x", "fp8-rescore-4x-bf16q"))


def _span(values, digits=2):
    lo, hi = min(values), max(values)
    return _pct(lo, digits) if f"{lo:.{digits + 2}f}" == f"{hi:.{digits + 2}f}" else f"{_pct(lo, digits)[:-1]}-{_pct(hi, digits)}"


def readme_markdown(doc: dict) -> str:
    """The README's block: one row a format, the share of the exact top-k it misses in each case (keys x k), its
    error budget over the cases (missed with only the key rounded / only the query rounded), the target's verdict
    and what the bf16 query changes on each key format."""
    ok = [r for r in doc.get("recall_diverse") or [] if not r.get("error") and not r["trivial"]
          and r["format"] not in ORACLES]
    if not ok:
        return "No diverse recall rows."
    cases = sorted({(r["index_entries"], r["k"]) for r in ok})
    by = {(r["format"], r["index_entries"], r["k"]): r for r in ok}
    queries = sorted({r["queries"] for r in ok})
    lines = [f"{doc.get('device') or 'no GPU'}, commit `{commit_label(doc)}`, "
             f"{(doc.get('date') or '')[:10]}: share of the exact top-k missed ({'/'.join(map(str, queries))} queries "
             "per context, half with a preferred token set; synthetic keys), and its error budget over these cases "
             "(missed with only the key rounded, with only the query rounded).", "",
             "| format | keys | query | " + " | ".join(f"{n // 1024}K keys, k {k}" for n, k in cases)
             + " | key rounded only | query rounded only |",
             "|---|---|---|" + "---|" * len(cases) + "---|---|"]
    for fmt in FORMATS:
        rows = [by.get((fmt, n, k)) for n, k in cases]
        have = [r for r in rows if r is not None]
        if not have:
            continue
        budget = [_span([r[f] for r in have]) if all(r[f] is not None for r in have) else "—"
                  for f in ("missed_key_only", "missed_query_only")]
        lines.append(f"| {fmt} | {have[0]['key']} | {have[0]['query']} | "
                     + " | ".join(_pct(r["missed_share"]) if r else "—" for r in rows) + f" | {' | '.join(budget)} |")
    lines += ["", target_line(ok)]
    gains = []
    for fp8_q, bf16_q in QUERY_PAIRS:
        pairs = [(by[(fp8_q, n, k)], by[(bf16_q, n, k)]) for n, k in cases if (fp8_q, n, k) in by and (bf16_q, n, k) in by]
        if pairs:
            gains.append(f"{pairs[0][0]['key']} keys, {fp8_q} {_span([a['missed_share'] for a, _ in pairs])} -> "
                         f"{bf16_q} {_span([b['missed_share'] for _, b in pairs])}")
    if gains:
        lines += ["", "Missed with the fp8 query -> with the bf16 query, by key format: " + "; ".join(gains) + "."]
    return "\n".join(lines)


def target_line(rows: list[dict]) -> str:
    """Issue 32's recall target over ``rows`` (valid, non-trivial): its verdict and the recall it rests on."""
    cases = [r for r in rows if r["format"] == TARGET_FORMAT and r["index_entries"] >= TARGET_MIN_KEYS
             and r["k"] in TOPKS]
    what = (f"Target (issue 32): {TARGET_FORMAT} (bf16 keys, bf16 query) keeps >= {100 * TARGET_RECALL:.1f}% of the "
            f"exact top-k at >= {TARGET_MIN_KEYS // 1024}K keys, k {' and '.join(map(str, TOPKS))}")
    if not cases or {r["k"] for r in cases} != set(TOPKS):
        return f"{what}: not evaluated (no case with >= {TARGET_MIN_KEYS // 1024}K keys at each k in this run)."
    recall = [r["recall_mean"] for r in cases]
    verdict = "pass" if min(recall) >= TARGET_RECALL else "**miss**"
    return f"{what}: recall {_span(recall)} over {len(cases)} cases: {verdict}."
