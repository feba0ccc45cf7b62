"""``cupy-dsa bench recall``: a needle suite with a controlled margin, and a comparison with DeepSeek-V4's
reference numerics, on synthetic keys pushed through the real store and logits ops.

Two oracles score every haystack:

* **exact**: fp64 scores of the fp32 rotated keys (what ``store_index_k`` computes before rounding) and the
  unquantized fp32 queries. Every query carries one needle whose exact logit beats the best distractor by
  a chosen relative margin, so exact scores rank it first at every margin (asserted); a format that loses
  it loses it through its own rounding error.
* **reference**: DeepSeek-V4's reference numerics: keys and queries fp4-simulated (e2m1, power-of-two
  scale per 32 values) as the fp4sim store rounds keys, fp32 scores. The top-k overlap with it says how
  close a format is to what the model was trained with.

Formats cupy_dsa implements (fp8 and bf16 layouts, exact and fp4sim keys) run through ``store_index_k`` and
``paged_mqa_logits`` (the CUDA kernels on a GPU, their torch references on CPU); the query-side roundings
(fp8, bf16, fp4) are simulated in torch. ``fp8-rescore-Nx`` (two-level keys, issue 26) is scored by its torch
reference (``rescore_topk_reference``; the kernels of ``rescore_topk`` select the same keys up to ties,
tests/test_rescore.py): stage 1 = the fp8 format's logits, K' = N x k candidates,
stage 2 = fp8 q (or, ``-bf16q``, the unquantized q rounded to bf16) against fp8 + int8-residual keys; its rows add
the missed exact top-k entries and their fp8 ranks.
"""

from __future__ import annotations

import math

import torch

import cupy_dsa
from cupy_dsa.layouts import PAGE_SLOTS, empty_cache
from cupy_dsa.store import fp4sim_reference, rotate_index_k_reference

from .sweeps import DIM, HEADS, make_freqs

TOPKS = (512, 1024)
MARGINS = (1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 0.01, 0.02, 0.05, 0.1)
RESOLUTION_RATE = 0.99           # a format "resolves" a margin when it keeps >= 99% of the needles
# fp8-rescore formats: K' = multiple x k; stage 2's query is SGLang's fp8 q (scale folded in the weights) or, for the
# -bf16q rows, the unquantized query rounded to bf16 with the weights without that scale
RESCORE_MULTIPLES = {"fp8-rescore-2x": 2, "fp8-rescore-3x": 3, "fp8-rescore-4x": 4,
                     "fp8-rescore-2x-bf16q": 2, "fp8-rescore-3x-bf16q": 3, "fp8-rescore-4x-bf16q": 4}
RESCORE_STAGE2_Q = {f: ("bf16" if f.endswith("-bf16q") else "fp8") for f in RESCORE_MULTIPLES}
FORMATS = ("fp8", "fp4", "bf16", "bf16-fp4sim", "bf16+q-bf16", "bf16-reference") + tuple(RESCORE_MULTIPLES)
ORACLES = ("exact", "reference")
FORMAT_NOTES = {
    "fp8": "SGLang's default: fp8 keys (132 B layout) and fp8 q, one scale per (row, head) folded into the weights",
    "fp4": "SGLang's fp4 indexer, simulated: fp4sim keys (held in the bf16 layout) and q rounded to bf16 then to "
           "e2m1 (block 32, power-of-two scale, ties away from zero); weights without a q scale",
    "bf16": "cupy_dsa bf16 layout, exact keys, fp8 q (what the SGLang plugin serves with SGLANG_CUPY_DSA_INDEX_K=bf16)",
    "bf16-fp4sim": "cupy_dsa bf16 layout, fp4sim keys (the reference's QAT key rounding), fp8 q",
    "bf16+q-bf16": "cupy_dsa bf16 layout, exact keys, bf16 q (the q-precision floor of bf16 keys)",
    "bf16-reference": "what the plugin serves with SGLANG_CUPY_DSA_INDEX_K=bf16-reference, DeepSeek-V4's own indexer "
                      "numerics: fp4sim keys in the bf16 layout, q fp4-simulated in bf16 as prepare_index_q rounds "
                      "it (its RoPE and Hadamard are the bench's rotated basis), fp32 accumulation in the logits op",
    **{f: f"two-level keys (scored by rescore_topk's CPU reference): fp8 logits pick each row's top {m} x k candidates "
          f"(ties: lower position), which are rescored with "
          + ("fp8 q (scale in the weights)" if RESCORE_STAGE2_Q[f] == "fp8" else
             "a bf16 q (q_rescore: the unquantized query rounded to bf16, as SGLang's fp32 rotated q would be before "
             "its fp8 quantization; weights_rescore without the q scale)")
          + f" against fp8 + int8-residual keys (264 B per entry) in fp32; missed = exact top-k entries outside the "
          f"selection, with their fp8 rank (0-based; the K' that would have kept one is its rank + 1)"
       for f, m in RESCORE_MULTIPLES.items()},
    "exact": "oracle: fp64 scores of the fp32 rotated keys and fp32 q",
    "reference": "oracle: DeepSeek-V4 reference numerics (fp4-simulated q and keys, fp32 scores)",
}
N_OUTLIERS = 4
OUTLIER_SCALE = 20.0             # the outlier channels' factor (run(outlier_scale=...) changes it)
RANK = 16
NEEDLE_HEADS = range(1, 17)      # heads that look for the cluster; head 0 is the needle's own head
CLUSTER_SIGMAS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02)
MAX_CLUSTER = 2048
HALF_SPACE_GAP = 0.05            # non-needle keys end at least this far (times |k|) on the negative side of e,
#                                  beyond what a format's key rounding can move them
CHUNK_KEYS = 2**20               # keys per chunk of queries (bounds the fp64 oracle's memory)

RECALL_NOTE = (
    "Keys are SYNTHETIC. Background raw (pre-norm) key = s * (mu + U z + e): mu a shared mean (N(0,1) per "
    "channel), U z a rank-16 factor, e ~ N(0, 0.3^2), s heavy-tailed per-channel scales exp(N(0, 0.75^2)) with "
    "4 outlier channels x20; norm weight exp(N(0, 0.2^2)); RMSNorm, interleaved RoPE at position 4i (theta "
    "1.6e5) and Hadamard as store_index_k applies them. Queries (rotated basis): heads 1-16 point at a random "
    "background key (its part off the mean key direction; norm ~4, N(0, 0.5^2/128) noise), heads 17-63 at "
    "random directions plus the mean key direction; weights |N(1, 0.25^2)| / sqrt(8192). Per query, a cluster "
    "of min(n/2, 2048) near-duplicates of the background key that scores best on heads 1-63 is built in the "
    "rotated basis (key + sigma * rms(key) * N(0, I), sigma in {0.0005, 0.001, 0.002, 0.005, 0.01, 0.02}) at "
    "random depths; every rotated key is mapped back to a raw key by the inverse Hadamard, RoPE and norm weight, "
    "so that the real store reproduces it. Head 0 is the needle's own head: a direction e of random signs "
    "(+-1/sqrt(128): every q format rounds t e by one common factor), heads 1-63 made orthogonal to it. Every key "
    "but the needle lies on the negative side of e (its e-component reflected, then at most -0.05 |k|), so head 0 "
    "scores only the needle, whose e-component is the mirror image (at least +0.05 |k|); the sign of e is chosen "
    "so that this mirror costs the best keys score on heads 1-63 (RMSNorm rescales every stored key). The needle is the cluster "
    "member that ranks just below the best other key on heads 1-63 (exact fp64); head 0 = t e, with t set per "
    "margin so that the needle's exact logit is (1 + margin) x the best other key's. Exact scores therefore "
    "rank it first at every margin (checked on every row). needle rate = share of needles inside the format's "
    "top-k (a tie counts against the needle); resolution = the smallest margin from which on the rate is "
    ">= 99%. recall@k = |top-k(format) & top-k(exact)| / k and reference overlap = |top-k(format) & "
    "top-k(reference)| / k, on the largest-margin rows. Rows with n <= k are trivial (everything is selected). "
    "A stress test that compares formats: the top-k boundary falls among near-duplicates; it does not predict "
    "a model's accuracy."
)


def contexts(device: torch.device, quick: bool) -> tuple[list[int], int]:
    """(context lengths in raw tokens, queries per context)."""
    if device.type != "cuda":  # the torch reference store is slow: small sizes
        return ([4096, 16384], 4) if quick else ([1024, 4096, 16384, 65536], 8)
    if quick:
        return [4096, 65536, 1048576], 8
    return [1024, 4096, 16384, 65536, 262144, 1048576], 32


class _World:
    """Fixed 'model' statistics shared by every haystack: channel scales, mean, factors, norm weight."""

    def __init__(self, device, seed, outlier_scale=OUTLIER_SCALE):
        g = torch.Generator(device="cpu")
        g.manual_seed(seed)
        s = torch.exp(0.75 * torch.randn(DIM, generator=g))
        s[torch.randperm(DIM, generator=g)[:N_OUTLIERS]] *= outlier_scale
        self.scale = s.to(device)
        self.mu = torch.randn(DIM, generator=g).to(device)
        self.U = (torch.randn(DIM, RANK, generator=g) / math.sqrt(RANK)).to(device)
        self.norm_weight = torch.exp(0.2 * torch.randn(DIM, generator=g)).to(device)


def fp4_simulate(x: torch.Tensor) -> torch.Tensor:
    """e2m1 values with a power-of-two scale per 32 elements (ceil_pow2(max(amax, 1e-4) / 6)), nearest
    code (ties away from zero); float32 out, exactly representable in bf16."""
    shp = x.shape
    xb = x.float().reshape(-1, 32)
    amax = xb.abs().amax(-1, keepdim=True).clamp_min(1e-4)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 6.0)))
    v = (xb / scale).abs()
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], device=x.device)
    mids = (grid[1:] + grid[:-1]) / 2
    code = torch.bucketize(v, mids, right=True)  # ties go up
    return (torch.sign(xb) * grid[code] * scale).reshape(shp)


def _fp8_q(q: torch.Tensor, w: torch.Tensor):
    """Per (row, head) fp8 q with its scale folded into the weights (SGLang's indexer q)."""
    s = q.abs().amax(-1).clamp_min(1e-4) / 448.0
    q8 = (q / s[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q8, w * s


def _hadamard_matrix(device) -> torch.Tensor:
    """The store's Hadamard-128 as an fp64 matrix (natural-order Sylvester / sqrt(128); symmetric, its own
    inverse)."""
    i = torch.arange(DIM, device=device)
    a = i[:, None] & i[None, :]
    parity = torch.zeros_like(a)
    for b in range(7):
        parity ^= (a >> b) & 1
    return (1 - 2 * parity).double() / math.sqrt(DIM)


def _unrotate(k: torch.Tensor, positions: torch.Tensor, norm_weight, freqs, had) -> torch.Tensor:
    """A raw key that the store maps to (a positive multiple of) the rotated key ``k``: inverse Hadamard,
    inverse interleaved RoPE on the trailing 64 dims, divided by the norm weight (RMSNorm only rescales)."""
    z = k.double() @ had
    f = freqs[positions.long()].double()
    cos, sin = f[:, 0::2], f[:, 1::2]
    re, im = z[:, 64::2].clone(), z[:, 65::2].clone()
    z[:, 64::2] = re * cos + im * sin
    z[:, 65::2] = im * cos - re * sin
    return (z / norm_weight.double()).float()


def _rest_scores(q, w, k):
    """fp64 (or the dtype of q) sum over heads 1..63 of w relu(q . k): q [B, 64, 128], k [B, n, 128] -> [B, n]."""
    s = torch.einsum("bhd,bnd->bhn", q[:, 1:], k).clamp_min_(0)
    return torch.einsum("bhn,bh->bn", s, w[:, 1:])


def run(device: torch.device, quick: bool, seed: int, progress=None,
        outlier_scale: float = OUTLIER_SCALE) -> list[dict]:
    """Recall rows per (context, format, k). ``outlier_scale``: the factor of the 4 outlier channels of the raw keys
    (1 = none; RECALL_NOTE describes the default, 20); every row records it."""
    ctxs, n_queries = contexts(device, quick)
    world = _World(device, seed, outlier_scale)
    freqs = make_freqs(4 * (max(ctxs) // 4), device)
    had = _hadamard_matrix(device)
    g = torch.Generator(device=device)
    g.manual_seed(seed + 1)
    task = progress.add_task("recall", total=len(ctxs)) if progress else None
    rows = []
    for L in ctxs:
        n = L // 4
        acc = _Acc()
        error = None
        chunk = max(1, min(n_queries, CHUNK_KEYS // n))
        try:
            done = 0
            while done < n_queries:
                B = min(chunk, n_queries - done)
                _chunk(world, freqs, had, B, n, device, g, acc)
                done += B
        except Exception as exc:  # a failing op (or a broken construction) ends this context; the rows say why
            error = f"{type(exc).__name__}: {exc}"[:300]
        rows += [dict(r, outlier_scale=float(outlier_scale)) for r in acc.rows(L, n, error)]
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if progress:
            progress.advance(task)
    return rows


def resolution(rates):
    """The smallest margin from which on every rate is >= RESOLUTION_RATE (None: not even at the largest)."""
    if not rates:
        return None
    res = None
    for m, r in zip(reversed(MARGINS), reversed(rates)):
        if r < RESOLUTION_RATE:
            break
        res = m
    return res


class _Acc:
    """Per (format, k): needle hits per margin, recall and reference overlap per query."""

    def __init__(self):
        self.hits = {}
        self.recall = {}
        self.overlap = {}
        self.missed = {}             # (rescore format, k): [missed entries, of them beyond K', fp8 ranks of misses]
        self.rank_needed = {}        # k: per query, the fp8 rank + 1 that holds its whole exact top-k
        self.queries = 0
        self.margin_min = math.inf   # smallest achieved / nominal exact margin ratio (>= 1 by construction)

    def add(self, fmt, k, hits, recall, overlap):
        h = self.hits.setdefault((fmt, k), [0] * len(MARGINS))
        for i, v in enumerate(hits):
            h[i] += int(v)
        self.recall.setdefault((fmt, k), []).extend(recall)
        self.overlap.setdefault((fmt, k), []).extend(overlap)

    def add_missed(self, fmt, k, ranks, k_prime):
        m = self.missed.setdefault((fmt, k), [0, 0, []])
        m[0] += len(ranks)
        m[1] += sum(1 for r in ranks if r >= k_prime)
        m[2].extend(ranks)

    def _rescore_fields(self, fmt, k, n):
        kp = RESCORE_MULTIPLES[fmt] * k
        m = self.missed.get((fmt, k))
        need = sorted(self.rank_needed.get(k, []))
        return {"k_prime": kp, "stage2_q": RESCORE_STAGE2_Q[fmt], "missed_entries": m[0] if m else None, "missed_beyond_k_prime": m[1] if m else None,
                "missed_fp8_rank_max": (max(m[2]) if m[2] else None) if m else None,
                "fp8_rank_needed_max": need[-1] if need else None,
                "fp8_rank_needed_median": need[len(need) // 2] if need else None}

    def rows(self, L, n, error):
        out = []
        for fmt in ORACLES + FORMATS:
            for k in TOPKS:
                h = self.hits.get((fmt, k))
                rates = [x / self.queries for x in h] if (h and self.queries) else None
                res = resolution(rates)
                rec, ov = self.recall.get((fmt, k), []), self.overlap.get((fmt, k), [])
                extra = self._rescore_fields(fmt, k, n) if fmt in RESCORE_MULTIPLES else {}
                out.append({
                    "context_tokens": L, "index_entries": n, "k": k, "format": fmt, "queries": self.queries,
                    "margins": list(MARGINS), "needle_rate": rates, "resolution": res,
                    "recall_mean": (sum(rec) / len(rec)) if rec else None, "recall_min": min(rec) if rec else None,
                    "ref_overlap_mean": (sum(ov) / len(ov)) if ov else None, "ref_overlap_min": min(ov) if ov else None,
                    "exact_margin_ratio_min": (self.margin_min if (fmt == "exact" and self.queries) else None),
                    "trivial": n <= k, "error": error, **extra,
                })
        return out


def _background(world, B, n, device, g):
    z = torch.randn(B * n, RANK, device=device, generator=g)
    e = 0.3 * torch.randn(B * n, DIM, device=device, generator=g)
    return (world.mu + z @ world.U.T + e) * world.scale


def _queries(base, mean_dir, B, device, g):
    """q [B, 64, 128] fp32 (rotated basis; head 0 zero for now) and weights [B, 64]."""
    # aim at the part of the base that the mean key direction does not explain, so that the background
    # (which shares the mean) stays below the cluster
    perp = base - (base @ mean_dir)[:, None] * mean_dir
    unit = perp / perp.norm(dim=-1, keepdim=True)
    q = torch.randn(B, HEADS, DIM, device=device, generator=g) / math.sqrt(DIM)
    nh = list(NEEDLE_HEADS)
    q[:, nh] = 4.0 * (unit[:, None, :] + 0.5 * q[:, nh])
    rest = [h for h in range(HEADS) if h not in NEEDLE_HEADS]
    q[:, rest] = q[:, rest] + mean_dir
    q[:, 0] = 0.0
    w = (1.0 + 0.25 * torch.randn(B, HEADS, device=device, generator=g)).abs() / math.sqrt(HEADS * DIM)
    return q, w


def _positive_side(k, e):
    """The mirror image of :func:`_negative_side`: component along e moved to +|c| + HALF_SPACE_GAP |k|."""
    c = torch.einsum("bmd,bd->bm", k, e)
    return _set_e(k, e, c.abs() + HALF_SPACE_GAP * k.norm(dim=-1))


def _negative_side(k, e):
    """k [B, m, 128] with its component c along e [B, 128] moved to -|c| - HALF_SPACE_GAP |k| (fp64)."""
    c = torch.einsum("bmd,bd->bm", k, e)
    return _set_e(k, e, -c.abs() - HALF_SPACE_GAP * k.norm(dim=-1))


def _needle_direction(q, device, g):
    """Head 0's direction e per query: random signs / sqrt(128), so that head 0's query t e has equal
    magnitudes and every q format rounds it by one common factor (no spurious scores on other keys); the
    other heads are made orthogonal to it (in place), so moving a key along e changes only head 0."""
    B = q.shape[0]
    e = (torch.randint(0, 2, (B, DIM), device=device, generator=g) * 2 - 1).double() / math.sqrt(DIM)
    ef = e.float()
    q[:, 1:] -= torch.einsum("bhd,bd->bh", q[:, 1:], ef)[..., None] * ef[:, None, :]
    return e


def _set_e(k, e, value):
    """k [B, m, 128] with its component along e [B, 128] replaced by value [B, m] (fp64)."""
    c = torch.einsum("bmd,bd->bm", k, e)
    return k + (value - c)[..., None] * e[:, None, :]


def _chunk(world, freqs, had, B, n, device, g, acc):
    ar_b = torch.arange(B, device=device)
    positions = (4 * torch.arange(n, device=device, dtype=torch.int32)).repeat(B)
    w_norm = world.norm_weight
    # ---- background keys as the store rotates them, the query, the needle's direction e
    rot = rotate_index_k_reference(_background(world, B, n, device, g), positions, w_norm, freqs).view(B, n, DIM)
    nc = min(n // 2, MAX_CLUSTER) + 1
    slots = torch.rand(B, n, device=device, generator=g).argsort(-1)[:, :nc]          # distinct random depths
    base = rot[ar_b, slots[:, 0]].double()      # a background key, itself replaced by a cluster member
    mean_dir = rot.mean((0, 1)).double()
    mean_dir = (mean_dir / mean_dir.norm()).float()
    q, w = _queries(base.float(), mean_dir, B, device, g)
    e = _needle_direction(q, device, g)                                                # [B, 128] fp64
    qd, wd = q.double(), w.double()
    # RMSNorm rescales a stored key by the RMS of its raw key, which moving it along e changes: orient e so
    # that the positive side costs the best key (and its near-duplicates) score on heads 1..63, so that a
    # needle candidate never outranks every distractor before head 0 lifts it
    best = _rest_scores(qd, wd, rot.double()).argmax(-1)
    top, top_pos = rot.double()[ar_b, best][:, None], positions.view(B, n)[ar_b, best]     # [B, 1, 128], [B]
    sides = torch.cat((_positive_side(top, e), _negative_side(top, e)), 1)               # [B, 2, 128]
    k2 = rotate_index_k_reference(_unrotate(sides.reshape(2 * B, DIM), top_pos.repeat_interleave(2), w_norm,
                                            freqs, had), top_pos.repeat_interleave(2), w_norm, freqs)
    r2 = _rest_scores(qd, wd, k2.view(B, 2, DIM).double())
    e = torch.where((r2[:, 0] > r2[:, 1])[:, None], -e, e)
    # ---- every key but the needle on the negative side of e; raw keys the store maps back to them
    raw = _unrotate(_negative_side(rot.double(), e).reshape(B * n, DIM), positions, w_norm, freqs, had)
    k_all = rotate_index_k_reference(raw, positions, w_norm, freqs).view(B, n, DIM)      # what the store makes
    rest_all = _rest_scores(qd, wd, k_all.double())                                   # exact, heads 1..63
    # ---- the cluster: near-duplicates (rotated basis) of one key
    slot_pos = positions.view(B, n)[ar_b[:, None], slots]                              # [B, nc]
    # its center is the background key that scores best on heads 1..63, so that the best distractor is a
    # cluster member (or that key), never a lone key far above the cluster
    center = k_all[ar_b, rest_all.argmax(-1)].double()
    sig = torch.tensor(CLUSTER_SIGMAS, device=device, dtype=torch.float64)[torch.arange(nc, device=device)
                                                                           % len(CLUSTER_SIGMAS)]
    rms = center.norm(dim=-1) / math.sqrt(DIM)
    cluster = center[:, None, :] + (sig[None, :, None] * rms[:, None, None]
                                    * torch.randn(B, nc, DIM, device=device, generator=g).double())
    flat_pos = slot_pos.reshape(-1)
    raw_neg = _unrotate(_negative_side(cluster, e).reshape(B * nc, DIM), flat_pos, w_norm, freqs, had)
    raw_cand = _unrotate(_positive_side(cluster, e).reshape(B * nc, DIM), flat_pos, w_norm, freqs,
                         had)                                                          # needle versions
    k_neg = rotate_index_k_reference(raw_neg, flat_pos, w_norm, freqs).view(B, nc, DIM)
    k_cand = rotate_index_k_reference(raw_cand, flat_pos, w_norm, freqs).view(B, nc, DIM)
    raw.view(B, n, DIM)[ar_b[:, None], slots] = raw_neg.view(B, nc, DIM)
    k_all[ar_b[:, None], slots] = k_neg
    rest_all[ar_b[:, None], slots] = _rest_scores(qd, wd, k_neg.double())
    rest_cand = _rest_scores(qd, wd, k_cand.double())                                  # [B, nc]
    # ---- the needle: the candidate ranking just below the best other key
    top2 = rest_all.topk(2, dim=-1)
    needles = torch.empty(B, dtype=torch.long, device=device)
    for b in range(B):
        best_other = torch.where(slots[b] == top2.indices[b, 0], top2.values[b, 1], top2.values[b, 0])
        ok = rest_cand[b] < best_other * (1 - 1e-9)
        score = torch.where(ok, rest_cand[b], torch.full_like(rest_cand[b], -math.inf))
        j = int(score.argmax())
        if not bool(ok[j]):
            raise AssertionError("needle construction: no cluster member ranks below the best distractor")
        needles[b] = slots[b, j]
        raw.view(B, n, DIM)[b, slots[b, j]] = raw_cand.view(B, nc, DIM)[b, j]
        k_all[b, slots[b, j]] = k_cand[b, j]
        rest_all[b, slots[b, j]] = rest_cand[b, j]
    # ---- head 0 = t e per margin: exact logit of the needle = (1 + margin) * best other key
    kd = k_all.double()
    proj = torch.einsum("bnd,bd->bn", kd, e)                                           # along e
    is_needle = torch.zeros(B, n, dtype=torch.bool, device=device)
    is_needle[ar_b, needles] = True
    if bool((proj.masked_fill(is_needle, -1.0) >= 0).any()) or bool((proj[ar_b, needles] <= 0).any()):
        raise AssertionError("needle construction: a key is on the wrong side of the needle direction")
    D = rest_all.masked_fill(is_needle, -math.inf).amax(-1)                            # [B]
    margins = torch.tensor(MARGINS, device=device, dtype=torch.float64)
    boost = (1 + margins[None, :]) * D[:, None] - rest_all[ar_b, needles][:, None]     # [B, M] > 0
    t = boost / (wd[:, 0, None] * proj[ar_b, needles][:, None])
    M = len(MARGINS)
    q_rows = q[:, None].repeat(1, M, 1, 1)                                             # [B, M, 64, 128]
    q_rows[:, :, 0] = (t[..., None] * e[:, None, :]).float()
    w_rows = w[:, None].expand(B, M, HEADS).reshape(B * M, HEADS).contiguous()
    q_rows = q_rows.reshape(B * M, HEADS, DIM)
    # exact fp64 logits of every (query, margin) row: heads 1..63 from rest_all, head 0 with the fp32 q
    head0 = torch.einsum("bnd,bmd->bmn", kd, q_rows.view(B, M, HEADS, DIM)[:, :, 0].double()).clamp_min_(0)
    exact = rest_all[:, None, :] + wd[:, 0, None, None] * head0                        # [B, M, n]
    ex_needle = exact[ar_b, :, needles]                                                # [B, M]
    ex_other = exact.masked_fill(is_needle[:, None, :], -math.inf).amax(-1)
    ratio = (ex_needle / ex_other - 1) / margins[None, :]      # 1 up to the fp32 rounding of head 0's q
    if not bool((ex_needle > ex_other).all()) or not bool((ratio > 0.99).all()):
        raise AssertionError(f"needle construction: exact margin off nominal (min ratio {float(ratio.min()):.6f})")
    acc.margin_min = min(acc.margin_min, float(ratio.min()))
    # ---- the reference oracle: fp4-simulated q and keys, fp32 scores
    k_ref = rotate_index_k_reference(raw, positions, w_norm, freqs, numerics="fp4sim").view(B, n, DIM)
    q_ref = fp4sim_reference(q_rows)                                                   # [B*M, 64, 128]
    qr = q_ref.view(B, M, HEADS, DIM)
    ref_rest = _rest_scores(qr[:, 0], w, k_ref)                                        # heads 1..63 are the same per margin
    ref_h0 = torch.einsum("bnd,bmd->bmn", k_ref, qr[:, :, 0]).clamp_min_(0)
    reference = ref_rest[:, None, :] + w[:, 0, None, None] * ref_h0                    # [B, M, n] fp32
    # ---- the formats, through the real store and logits ops
    pages_req = n // PAGE_SLOTS
    num_pages = B * pages_req
    table = torch.randperm(num_pages, device=device, generator=g).view(B, pages_req).to(torch.int32)
    ar = torch.arange(n, device=device)
    out_loc = (table.long()[:, ar // PAGE_SLOTS] * PAGE_SLOTS + ar % PAGE_SLOTS).reshape(B * n)
    caches = {}
    for name, layout, numerics in (("fp8", "fp8", "exact"), ("bf16", "bf16", "exact"), ("fp4sim", "bf16", "fp4sim")):
        cache = empty_cache(num_pages, layout, device)
        cupy_dsa.store_index_k(raw, cache, positions=positions, out_loc=out_loc, norm_weight=w_norm,
                               freqs_cis=freqs, numerics=numerics)
        caches[name] = cache
    del raw, rot
    q8, w8 = _fp8_q(q_rows, w_rows)
    runs = {
        "fp8": (q8, caches["fp8"], w8),
        "fp4": (fp4_simulate(q_rows.to(torch.bfloat16)).to(torch.bfloat16), caches["fp4sim"], w_rows),
        "bf16": (q8, caches["bf16"], w8),
        "bf16-fp4sim": (q8, caches["fp4sim"], w8),
        "bf16+q-bf16": (q_rows.to(torch.bfloat16), caches["bf16"], w_rows),
        "bf16-reference": (q_ref.to(torch.bfloat16), caches["fp4sim"], w_rows),
    }
    table_rows = table.repeat_interleave(M, dim=0).contiguous()
    lens = torch.full((B * M,), n, dtype=torch.int32, device=device)
    last = M - 1  # recall and reference overlap on the largest-margin rows
    top_exact = {k: exact[:, last].topk(min(k, n), dim=-1).indices for k in TOPKS}
    top_ref = {k: reference[:, last].topk(min(k, n), dim=-1).indices for k in TOPKS}
    scores = {"exact": exact, "reference": reference}
    for fmt, (qq, cache, ww) in runs.items():
        logits = cupy_dsa.paged_mqa_logits(qq[:, None].contiguous(), cache, ww.float().contiguous(), lens,
                                           table_rows, n, clean_logits=False)[:, :n]
        scores[fmt] = logits.view(B, M, n)
    stage2_q = {"fp8": (q8, w8), "bf16": (q_rows.to(torch.bfloat16), w_rows)}
    _rescore(acc, scores["fp8"], k_all, q8, w8, stage2_q, out_loc, num_pages, lens, table_rows, needles, top_exact,
             top_ref, B, M, n, last)
    for fmt, s in scores.items():
        s_needle = s[ar_b, :, needles]                                                  # [B, M]
        ahead = (s >= s_needle[..., None]).sum(-1) - 1                                  # others at or above the needle
        for k in TOPKS:
            kk = min(k, n)
            hits = (ahead < kk).sum(0).tolist()
            top = s[:, last].topk(kk, dim=-1).indices
            recall = _overlap(top, top_exact[k], n) / kk
            overlap = _overlap(top, top_ref[k], n) / kk
            acc.add(fmt, k, hits, recall.tolist(), overlap.tolist())
    acc.queries += B


def _rescore(acc, fp8, k_all, q8, w8, stage2_q, out_loc, num_pages, lens, table_rows, needles, top_exact, top_ref,
             B, M, n, last):
    """The fp8-rescore formats: two-level pages from the keys the store makes, stage 1 = the fp8 format's logits
    (``fp8`` [B, M, n], from ``q8`` / ``w8``), stage 2 with ``stage2_q[RESCORE_STAGE2_Q[format]]`` (q [B*M, 64, 128],
    weights [B*M, 64]); per k and K' the selection's needle hits, recall, reference overlap, and the missed exact
    top-k entries with their fp8 ranks (on the largest-margin rows, as recall)."""
    from cupy_dsa.rescore import empty_lo_cache, rescore_topk_reference, store_two_level_reference

    device = fp8.device
    hi, lo = empty_cache(num_pages, "fp8", device), empty_lo_cache(num_pages, device)
    store_two_level_reference(k_all.reshape(B * n, DIM), hi, lo, out_loc)
    s1 = fp8.reshape(B * M, n).contiguous()
    # fp8 rank of every key on the largest-margin rows (ties: lower position first, as stage 1)
    order = torch.sort(fp8[:, last], dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(n, device=device).expand(B, n).contiguous())
    for k in TOPKS:
        kk = min(k, n)
        acc.rank_needed.setdefault(k, []).extend((rank.gather(1, top_exact[k]).amax(-1) + 1).tolist())
        for fmt, mult in RESCORE_MULTIPLES.items():
            q2, w2 = stage2_q[RESCORE_STAGE2_Q[fmt]]
            sel = rescore_topk_reference(q8[:, None].contiguous(), w8.float().contiguous(), hi, lo, lens, table_rows,
                                         k, mult * k, stage1_logits=s1, q_rescore=q2.contiguous(),
                                         weights_rescore=w2.float().contiguous()).raw_indices.long().view(B, M, k)
            hits = (sel == needles[:, None, None]).any(-1).sum(0).tolist()
            top = sel[:, last, :kk]
            recall = _overlap(top, top_exact[k], n) / kk
            overlap = _overlap(top, top_ref[k], n) / kk
            acc.add(fmt, k, hits, recall.tolist(), overlap.tolist())
            kept = torch.zeros(B, n, dtype=torch.bool, device=device)
            kept.scatter_(1, top, True)
            miss = ~kept.gather(1, top_exact[k])
            acc.add_missed(fmt, k, rank.gather(1, top_exact[k])[miss].tolist(), mult * k)


def _overlap(a, b, n):
    """|a & b| per row for index sets a, b [B, k] over n columns."""
    mask = torch.zeros(a.shape[0], n, dtype=torch.bool, device=a.device)
    mask.scatter_(1, b, True)
    return mask.gather(1, a).sum(-1).double()
