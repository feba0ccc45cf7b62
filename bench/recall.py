"""``cupy-dsa bench recall``: needle-in-a-haystack at the indexer level, through the real store and logits.

Each query is one request with its own haystack of synthetic keys. Raw keys go through
``store_index_k`` (RMSNorm -> RoPE -> Hadamard -> fp8 / bf16 / fp4-simulated store), logits come from
``paged_mqa_logits``, and the top-k sets are compared with the top-k of exact fp64 scores computed from
the fp32 rotated keys (``rotate_index_k_reference``) and the unquantized queries.
"""

from __future__ import annotations

import math

import torch

import cupy_dsa
from cupy_dsa.layouts import PAGE_SLOTS, empty_cache
from cupy_dsa.store import rotate_index_k_reference

from .sweeps import DIM, HEADS, make_freqs

TOPKS = (512, 1024)
FORMATS = ("fp8", "fp4", "bf16-fp4sim", "bf16", "bf16+q-bf16")
FORMAT_NOTES = {
    "fp8": "fp8 layout (SGLang default, 132 B), q fp8 per (row, head) scale folded into the weights",
    "fp4": "SGLang's fp4 indexer simulated: fp4sim keys (bf16 layout) and fp4-simulated q (block 32, ue8m0)",
    "bf16-fp4sim": "bf16 layout, fp4sim keys (DeepSeek reference QAT numerics), q fp8",
    "bf16": "bf16 layout, exact keys, q fp8",
    "bf16+q-bf16": "bf16 layout, exact keys, q bf16 (the q-precision floor)",
}
N_OUTLIERS = 4
RANK = 16
NEEDLE_HEADS = 16
MAX_DISTRACTORS = 2048

RECALL_NOTE = (
    "Keys are SYNTHETIC. Raw (pre-norm) key = s * (mu + U z + e): mu a shared mean (N(0,1) per channel, "
    "so all keys are correlated), U z a rank-16 factor (z ~ N(0,1)), e ~ N(0, 0.3^2), s heavy-tailed "
    "per-channel scales exp(N(0, 0.75^2)) with 4 outlier channels x20; norm weight exp(N(0, 0.2^2)). "
    "Raw keys go through store_index_k (RMSNorm, interleaved RoPE at position 4i with theta 1.6e5, "
    "Hadamard). One needle per query at a uniformly random depth; min(n/2, 2048) near-duplicate "
    "distractors of the needle (needle raw key + s * sigma * N(0,1), sigma log-uniform in [0.02, 0.6]) at "
    "random depths (so RoPE rotates them differently). Query (in the rotated basis): 16 of 64 heads point "
    "at the exact rotated needle key plus N(0, 0.5^2/128) noise (norm ~4), 48 heads at random directions "
    "plus the mean key direction (norm ~1.4); positive weights |N(1, 0.25^2)| / sqrt(8192). recall@k = |top-k(format) & "
    "top-k(exact fp64)| / k; needle rate = share of queries whose needle is in the format's top-k. "
    "Rows with n <= k are trivial (everything is selected). This is a stress test: the distractors crowd "
    "the top-k, so its boundary falls among near-ties; the figures compare formats, they do not predict a "
    "model's accuracy."
)


def contexts(device: torch.device, quick: bool) -> tuple[list[int], int]:
    """(context lengths in raw tokens, queries per context)."""
    if device.type != "cuda":
        return [4096, 8192], 2  # the torch reference store is slow; 1K and 2K index entries
    if quick:
        return [4096, 65536], 8
    return [1024, 4096, 16384, 65536, 262144, 1048576], 32


class _World:
    """Fixed 'model' statistics shared by every haystack: channel scales, mean, factors, norm weight."""

    def __init__(self, device, seed):
        g = torch.Generator(device="cpu")
        g.manual_seed(seed)
        s = torch.exp(0.75 * torch.randn(DIM, generator=g))
        s[torch.randperm(DIM, generator=g)[:N_OUTLIERS]] *= 20.0
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
    s = q.abs().amax(-1).clamp_min(1e-4) / 448.0          # [B, 64]
    q8 = (q / s[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q8, w * s


def _haystack(world, B, n, device, g):
    """Raw keys [B*n, 128], needle index [B], distractor indices per request."""
    z = torch.randn(B * n, RANK, device=device, generator=g)
    e = 0.3 * torch.randn(B * n, DIM, device=device, generator=g)
    pre = world.mu + z @ world.U.T + e
    needles = torch.randint(0, n, (B,), device=device, generator=g)
    nd = min(n // 2, MAX_DISTRACTORS)
    if nd:
        # distinct random slots per request, skipping the needle's slot
        r = torch.rand(B, n, device=device, generator=g)
        r[torch.arange(B, device=device), needles] = 2.0
        dist = r.argsort(-1)[:, :nd]                                     # [B, nd]
        sigma = torch.exp(torch.empty(B, nd, 1, device=device).uniform_(math.log(0.02), math.log(0.6),
                                                                          generator=g))
        base = pre.view(B, n, DIM)[torch.arange(B, device=device), needles]   # [B, 128]
        pre.view(B, n, DIM)[torch.arange(B, device=device)[:, None], dist] = (
            base[:, None, :] + sigma * torch.randn(B, nd, DIM, device=device, generator=g))
    return pre * world.scale, needles


def _queries(rot_needle, mean_dir, B, device, g):
    """q [B, 64, 128] fp32 in the rotated basis and weights [B, 64]."""
    unit = rot_needle / rot_needle.norm(dim=-1, keepdim=True)
    q = torch.randn(B, HEADS, DIM, device=device, generator=g) / math.sqrt(DIM)
    q[:, :NEEDLE_HEADS] = 4.0 * (unit[:, None, :] + 0.5 * q[:, :NEEDLE_HEADS])
    q[:, NEEDLE_HEADS:] = q[:, NEEDLE_HEADS:] + mean_dir
    w = (1.0 + 0.25 * torch.randn(B, HEADS, device=device, generator=g)).abs() / math.sqrt(HEADS * DIM)
    return q, w


def run(device: torch.device, quick: bool, seed: int, progress=None) -> list[dict]:
    ctxs, n_queries = contexts(device, quick)
    world = _World(device, seed)
    freqs = make_freqs(max(ctxs), device)
    g = torch.Generator(device=device)
    g.manual_seed(seed + 1)
    task = progress.add_task("recall", total=len(ctxs)) if progress else None
    rows = []
    for L in ctxs:
        n = L // 4
        acc = {(f, k): {"needle": 0, "recall": [], "q": 0} for f in FORMATS + ("exact",) for k in TOPKS}
        error = None
        chunk = max(1, min(n_queries, 2**20 // n))
        try:
            done = 0
            while done < n_queries:
                B = min(chunk, n_queries - done)
                _chunk(world, freqs, B, n, device, g, acc)
                done += B
        except Exception as exc:  # a failing op ends this context; the row says why
            error = f"{type(exc).__name__}: {exc}"[:300]
        for (fmt, k), a in acc.items():
            rec = a["recall"]
            rows.append({
                "context_tokens": L, "index_entries": n, "k": k, "format": fmt, "queries": a["q"],
                "needle_in_topk": (a["needle"] / a["q"]) if a["q"] else None,
                "recall_mean": (sum(rec) / len(rec)) if rec else None,
                "recall_min": min(rec) if rec else None,
                "trivial": n <= k, "error": error,
            })
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if progress:
            progress.advance(task)
    return rows


def _chunk(world, freqs, B, n, device, g, acc):
    raw, needles = _haystack(world, B, n, device, g)
    N = B * n
    positions = (4 * torch.arange(n, device=device, dtype=torch.int32)).repeat(B)
    pages_req = n // PAGE_SLOTS
    num_pages = B * pages_req
    perm = torch.randperm(num_pages, device=device, generator=g)
    table = perm.view(B, pages_req).to(torch.int32).contiguous()
    ar = torch.arange(n, device=device)
    out_loc = (table.long()[:, ar // PAGE_SLOTS] * PAGE_SLOTS + ar % PAGE_SLOTS).reshape(N)
    w_norm = world.norm_weight

    rot = rotate_index_k_reference(raw, positions, w_norm, freqs, numerics="exact")     # fp32 [N, 128]
    rot_b = rot.view(B, n, DIM)
    rot_needle = rot_b[torch.arange(B, device=device), needles]
    mean_dir = rot.mean(0)
    mean_dir = mean_dir / mean_dir.norm()
    q, w = _queries(rot_needle, mean_dir, B, device, g)

    # exact fp64 scores and top-k
    exact_top = {}
    for b in range(B):
        s = torch.relu(q[b].double() @ rot_b[b].double().T)            # [64, n]
        logit = w[b].double() @ s                                         # [n]
        for k in TOPKS:
            exact_top[(b, k)] = torch.topk(logit, min(k, n)).indices
    del rot, rot_b

    caches = {}
    for name, layout, numerics in (("fp8", "fp8", "exact"), ("bf16", "bf16", "exact"),
                                   ("fp4sim", "bf16", "fp4sim")):
        c = empty_cache(num_pages, layout, device)
        cupy_dsa.store_index_k(raw, c, positions=positions, out_loc=out_loc, norm_weight=w_norm,
                               freqs_cis=freqs, numerics=numerics)
        caches[name] = c
    del raw

    q8, w8 = _fp8_q(q, w)
    qb = q.to(torch.bfloat16)
    q4 = fp4_simulate(q).to(torch.bfloat16)
    lens = torch.full((B,), n, dtype=torch.int32, device=device)
    runs = {
        "fp8": (q8, caches["fp8"], w8),
        "fp4": (q4, caches["fp4sim"], w),
        "bf16-fp4sim": (q8, caches["fp4sim"], w8),
        "bf16": (q8, caches["bf16"], w8),
        "bf16+q-bf16": (qb, caches["bf16"], w),
    }
    for fmt, (qq, cache, ww) in runs.items():
        logits = cupy_dsa.paged_mqa_logits(qq[:, None].contiguous(), cache, ww.float().contiguous(), lens, table, n,
                                           clean_logits=False)[:, :n]
        for k in TOPKS:
            top = torch.topk(logits, min(k, n), dim=-1).indices               # [B, k]
            for b in range(B):
                ex = exact_top[(b, k)]
                inter = torch.isin(top[b], ex).sum()
                a = acc[(fmt, k)]
                a["recall"].append(float(inter) / min(k, n))
                a["needle"] += int((top[b] == needles[b]).any())
                a["q"] += 1
    for k in TOPKS:
        for b in range(B):
            a = acc[("exact", k)]
            a["recall"].append(1.0)
            a["needle"] += int((exact_top[(b, k)] == needles[b]).any())
            a["q"] += 1
