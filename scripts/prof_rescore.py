"""Per-kernel times of fp8-rescore's stages after stage 1 (candidates, stage 2, finish), CUDA-graph replays, at the
shapes of issue 31 (decode / verify rows x index entries). A contributor's tool: every launch of one
``rescore_topk(..., stage1_logits=)`` call is recorded, then the call is timed with its first n launches for each n
(a launch's time is the difference), then whole.
    usage: python3 scripts/prof_rescore.py [quick | prefill | select] [--ctas N]   (after pip install -e .)
``prefill``: rows over ONE request's entries (one block-table row for all), its keys L2-resident as a prefill
chunk's rows share them. ``select``: the per-row select alone (``paged_topk`` at k = 512 and at k = K' = 2048, the
candidates' select) with one CTA per row and with clusters of 2, 4 and 8 CTAs forced, and the heuristic's choice.
``--ctas N``: the select's CTAs per row forced to N (topk.select_cluster; ``select`` times only N). A summary table
last.
"""
import math
import sys

import torch

import cupy_dsa
from cupy_dsa import layouts, rescore, topk
from cupy_dsa.bench.sweeps import make_freqs  # the installed package (pip install -e .)
from cupy_dsa.bench.timing import time_calls

K = 1024
# (requests, next_n, index entries per request): decode 24K / 96K tokens, verify n3, bench rescore's 64 x 64K,
# one long request, few long requests (column chunks), a prefill-sized row count
CASES = [(48, 1, 6 * K), (48, 1, 24 * K), (48, 3, 6 * K), (48, 3, 24 * K), (64, 1, 64 * K), (1, 1, 64 * K),
         (8, 1, 256 * K), (2048, 1, 8 * K)]
PREFILL_CASES = [(2048, 1, 8 * K), (8192, 1, 8 * K)]


def build(dev, g, B, next_n, N, shared=False):
    """Caches of B requests x N entries (store_index_k of random keys, hi + lo), an fp8 q, weights, lengths, a
    block table, and stage 1's logits from cupy_dsa's fp8 kernel. shared: the B requests are one request's pages."""
    pages = math.ceil(N / 64)
    P = pages if shared else B * pages
    bt = torch.randperm(P, device=dev, generator=g).to(torch.int32).view(-1, pages).expand(B, pages).contiguous()
    slots = P * 64
    kv = torch.randn(slots, 128, device=dev, generator=g)
    pos = 4 * (torch.arange(slots, device=dev) % N)
    hi, lo = layouts.empty_cache(P, "fp8", dev), rescore.empty_lo_cache(P, dev)
    cupy_dsa.store_index_k(kv, hi, positions=pos, out_loc=torch.arange(slots, device=dev),
                           norm_weight=torch.ones(128, device=dev), freqs_cis=make_freqs(4 * N, dev), lo_cache=lo)
    qf = torch.randn(B, next_n, 64, 128, device=dev, generator=g)
    s = qf.abs().amax(-1).clamp_min(1e-4) / 448.0
    q = (qf / s[..., None]).to(torch.float8_e4m3fn)
    w = (torch.randn(B * next_n, 64, device=dev, generator=g) / 90.5 * s.reshape(B * next_n, -1)).contiguous()
    lens = torch.full((B,), N, dtype=torch.int32, device=dev)
    logits = cupy_dsa.paged_mqa_logits(q, hi, w, lens, bt, pages * 64, clean_logits=False)
    return q, w, hi, lo, lens, bt, logits


def select_only(dev, g, ctas_list=(1, 2, 4, 8)):
    """paged_topk over stage-1-like logits at each case's rows and width, us per call, by CTAs per row."""
    heuristic = topk.select_cluster
    n_sms = torch.cuda.get_device_properties(dev).multi_processor_count
    arch = cupy_dsa.runtime.device_arch(dev.index or 0)
    rows_out = []
    for B, next_n, N in CASES:
        R = B * next_n
        logits = torch.randn(R, N, device=dev, generator=g)
        lens = torch.full((R,), N, dtype=torch.int32, device=dev)
        table = torch.arange(R * (N // 64), device=dev, dtype=torch.int32).view(R, -1)
        chosen = heuristic(N, R, n_sms, arch)
        cells = []
        for k in (512, 2048):
            for ctas in ctas_list:
                topk.select_cluster = lambda *a, c=ctas: c
                try:
                    us = time_calls([lambda: topk.paged_topk(logits, lens, table, k)], dev, reps=15).seconds * 1e6
                finally:
                    topk.select_cluster = heuristic
                cells.append(f"k{k}/c{ctas} {us:.1f}")
        line = f"{R} x {N // K}K (heuristic: {chosen} CTAs per row): " + " ".join(cells)
        print(line, flush=True)
        rows_out.append(line)
        del logits
        torch.cuda.empty_cache()
    print("per-row select alone, us per call (CUDA-graph replays):")
    for line in rows_out:
        print(line)


def main():
    dev = torch.device("cuda")
    g = torch.Generator(device=dev)
    g.manual_seed(0)
    args = sys.argv[1:]
    forced = None
    if "--ctas" in args:
        i = args.index("--ctas")
        forced = int(args[i + 1])
        topk.select_cluster = lambda *a: forced
        del args[i:i + 2]
    mode = args[0] if args else "all"
    if mode == "select":
        return select_only(dev, g, (forced,) if forced else (1, 2, 4, 8))
    cases = {"quick": CASES[:2], "prefill": PREFILL_CASES}.get(mode, CASES)
    launch = rescore._launch
    recorded = []

    def record(problem, device, grid, **args):
        recorded.append((problem, device, grid, args))
        launch(problem, device, grid, **args)

    def time_prefix(call, n):
        """The call with only its first n launches (the rest skipped): a launch's own time is the difference of two
        prefixes (the column-chunk launches share a work buffer that the call zeroes, so none is timed alone)."""
        def limited(problem, device, grid, **args):
            done[0] += 1
            if done[0] <= n:
                launch(problem, device, grid, **args)

        def step():
            done[0] = 0
            rescore._launch = limited
            try:
                call()
            finally:
                rescore._launch = launch
        done = [0]
        return time_calls([step], dev, reps=15).seconds * 1e6

    out = []
    for B, next_n, N in cases:
        q, w, hi, lo, lens, bt, logits = build(dev, g, B, next_n, N, shared=mode == "prefill")

        def call():
            return rescore.rescore_topk(q, w, hi, lo, lens, bt, 512, stage1_logits=logits)

        call()
        recorded.clear()
        rescore._launch = record
        try:
            call()
        finally:
            rescore._launch = launch
        parts, before = {}, time_prefix(call, 0)
        for i, (problem, _, _, _) in enumerate(recorded):
            upto = time_prefix(call, i + 1)
            parts[problem[0]] = parts.get(problem[0], 0.0) + upto - before
            before = upto
        total = time_calls([call], dev, reps=15).seconds * 1e6
        label = f"{B * next_n} x {N // K}K"
        out.append((label, total, parts))
        print(label, f"total {total:.1f} us", " ".join(f"{k} {v:.1f}" for k, v in parts.items()), flush=True)
        del q, w, hi, lo, logits
        torch.cuda.empty_cache()
    print("stages after stage 1, us per call (CUDA-graph replays):")
    for label, total, parts in out:
        print(f"{label:>12}  total {total:7.1f} | " + " ".join(f"{k} {v:.1f}" for k, v in parts.items()))


if __name__ == "__main__":
    main()
