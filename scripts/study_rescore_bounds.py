"""Issue 31's pruning lever, studied on the CPU: can a bound on |stage-2 score - stage-1 score| prove some of
fp8-rescore's K' = 4k candidates in or out of the top-k, so that stage 2 need not score them?

Keys and queries are `bench recall --suite diverse`'s (topics, drift, outlier channels, realistic per-head query
scales), one request of N keys, 8 query rows, two seeds. Stage 1 = fp8 q x fp8 (hi) keys, stage 2 = bf16 q x
two-level keys (hi + int8 residual), both in fp64 (the kernels' fp32 rounding is ignored). Per (row, key), with
q1 the dequantized fp8 q, q2 the bf16 q, r = k_hat - hi, summed over heads with |w_h|:
  L1 bound  ||q2_h||_1 ||r||_inf + ||q2_h - q1_h||_1 ||hi||_inf   (the residual page's scale bounds ||r||_inf)
  C-S bound ||q2_h||_2 ||r||_2   + ||q2_h - q1_h||_2 ||hi||_2      (needs each key's norms)
A candidate is out when its upper bound is below the k-th greatest lower bound, in when fewer than k others'
upper bounds exceed its lower bound; the rest must be scored. The empirical band (each row's max |s2 - s1|) is
not a bound: it shows what an adaptive K' could reach if the fidelity contract allowed it.
Last per seed: the share of the exact top-k (fp64, unquantized q and keys) the rescore misses when stage 2 scores
the exact two-level key, the same key formed once and rounded to f16 relative to lo_scale (one mma per candidate
instead of two), and the bf16 key.
    usage: python3 scripts/study_rescore_bounds.py [N keys, default 16384]      (CPU, seconds)
"""
import sys

import torch

from cupy_dsa.bench import recall_diverse as rd
from cupy_dsa.bench.sweeps import make_freqs
from cupy_dsa.rescore import residual_encode_reference, two_level_dequant_reference
from cupy_dsa.store import rotate_index_k_reference

ROWS, TOPK = 8, 512


def still_to_score(s1, band, cand, k):
    """Share of each row's stage-1 candidates `cand` [rows, K'] that the band proves neither in nor out of the
    top-k."""
    shares = []
    for r, c in enumerate(cand):
        lo, hi = s1[r, c] - band[r, c], s1[r, c] + band[r, c]
        out = hi < lo.topk(k).values[-1]
        above = torch.searchsorted(-hi.sort(descending=True).values, -lo) - (hi > lo).long()
        shares.append(1.0 - (out | (above < k)).double().mean().item())
    return min(shares), max(shares)


def main():
    n = int(sys.argv[1]) if sys.argv[1:] else 16384
    dev, kp = torch.device("cpu"), 4 * TOPK
    for seed in (0, 1):
        torch.manual_seed(seed)  # the topic segments' lengths draw from the global generator
        g = torch.Generator().manual_seed(seed)
        world = rd._World(dev, seed, rd.OUTLIER_SCALE)
        raw, topic = rd._raw_keys(world, n, dev, g)
        k_exact = rotate_index_k_reference(raw, 4 * torch.arange(n, dtype=torch.int32), world.norm_weight,
                                           make_freqs(4 * n, dev))
        q, w, _ = rd._queries(k_exact, topic, ROWS, dev, g)
        hi_codes, hi_scale, lo, lo_scale = residual_encode_reference(k_exact)
        hi = hi_codes.view(torch.float8_e4m3fn).float() * hi_scale[:, None]
        k_hat = two_level_dequant_reference(hi_codes, hi_scale, lo, lo_scale)
        q1, q2 = rd._query_of("fp8", q, w)[2], rd._query_of("bf16", q, w)[2]   # the queries dequantized
        s1, s2 = rd._scores64(q1, w, hi), rd._scores64(q2, w, k_hat)
        wa, dq = w.abs().double(), (q2 - q1).double()
        l1 = ((wa * q2.double().abs().sum(-1)).sum(-1)[:, None] * (k_hat - hi).double().abs().amax(-1)[None]
              + (wa * dq.abs().sum(-1)).sum(-1)[:, None] * hi.double().abs().amax(-1)[None])
        cs = ((wa * q2.double().norm(dim=-1)).sum(-1)[:, None] * (k_hat - hi).double().norm(dim=-1)[None]
              + (wa * dq.norm(dim=-1)).sum(-1)[:, None] * hi.double().norm(dim=-1)[None])
        emp = (s2 - s1).abs().amax(-1, keepdim=True).expand_as(s1)
        cand = s1.topk(kp).indices
        gap = (s1.topk(TOPK).values[:, -1] - s1.gather(1, cand[:, -1:])[:, 0]).mean()
        print(f"seed {seed}, {n} keys, k {TOPK}, K' {kp}: stage-1 score gap rank k..K' {gap:.2f}; "
              f"median band: L1 {l1.median(-1).values.mean():.2f}, C-S {cs.median(-1).values.mean():.2f}, "
              f"empirical max |s2 - s1| {emp[:, 0].mean():.3f}")
        for name, band in (("L1 bound", l1), ("C-S bound", cs), ("empirical (not a bound)", emp)):
            a, b = still_to_score(s1, band, cand, TOPK)
            print(f"  {name:24s} share of K' still to score per row: {a:.3f}-{b:.3f}")
        top_exact = rd._scores64(q, w, k_exact).topk(TOPK).indices
        missed = []
        for name, key in (("two-level", k_hat), ("two-level as one f16", (k_hat / lo_scale[:, None]).half().float()
                                                  * lo_scale[:, None]), ("bf16", k_exact.to(torch.bfloat16).float())):
            chosen = cand.gather(1, rd._scores64(q2, w, key).gather(1, cand).topk(TOPK).indices)
            missed.append(f"{name} {1 - rd._recall(chosen, top_exact, n).mean():.4f}")
        print("  exact top-k missed by the rescore, stage-2 key: " + ", ".join(missed))


if __name__ == "__main__":
    main()
