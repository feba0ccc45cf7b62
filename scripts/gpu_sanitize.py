"""Small launches of every kernel family for compute-sanitizer (run by scripts/run_gpu_suite.sh; `logits` or
`rescore` as the argument: those kernels only; `rescore` also runs the top-k's).

Shapes are small (the sanitizer slows kernels down 10-100x) but cover every template axis and the
out-of-range cases: negative / past-the-end out_loc, positions past the RoPE table, block-table entries
outside [0, P), zero-length rows, key counts not a multiple of 64. Exits non-zero on a Python error;
memory errors are reported by the sanitizer itself.
"""
import torch

import cupy_dsa
from cupy_dsa import heuristics, logits, runtime

dev = torch.device("cuda", torch.cuda.current_device())
ARCH = runtime.device_arch(dev.index)
torch.manual_seed(0)
P, max_pos = 8, 4096


def store_cases():
    for layout in ("bf16", "fp8"):
        for numerics in (("exact", "fp4sim") if layout == "bf16" else ("exact",)):
            for key_style in ("v4", "v32"):
                for in_dtype in (torch.float32, torch.bfloat16):
                    yield layout, numerics, key_style, in_dtype


def run_store():
    n = 0
    for layout, numerics, key_style, in_dtype in store_cases():
        N = 77
        kv = torch.randn(N, 128, device=dev).to(in_dtype)
        cache = cupy_dsa.empty_cache(P, layout, device=dev)
        out_loc = torch.randint(-70, P * 64 + 70, (N,), device=dev)   # some < 0, some past the end
        positions = torch.randint(-3, max_pos + 50, (N,), device=dev)   # some past the table
        w = torch.rand(128, device=dev)
        b = torch.randn(128, device=dev) if key_style == "v32" else None
        freqs = torch.randn(max_pos, 64, device=dev)
        cupy_dsa.store_index_k(kv, cache, positions=positions, out_loc=out_loc, norm_weight=w, norm_bias=b,
                               freqs_cis=freqs, numerics=numerics, key_style=key_style)
        for is_decode in (True, False):
            plan = torch.randint(0, 256, (N, 16), dtype=torch.uint8, device=dev)
            plan[:, 0:4] = torch.randint(0, 600, (N, 1), device=dev).to(torch.int32).view(torch.uint8)
            if not is_decode:
                plan[::5, 0:4] = 255                                      # invalid entries; some ragged_id past out_loc
                plan[:, 4:6] = torch.randint(0, N + 40, (N, 1), device=dev).to(torch.int16).view(torch.uint8)
            cupy_dsa.store_index_k_from_plan(kv, plan, cache=cache, out_loc=out_loc, norm_weight=w, norm_bias=b,
                                             freqs_cis=freqs, is_decode=is_decode, numerics=numerics,
                                             key_style=key_style)
        n += 3
    return n


def decode_kernels(layout, q_fp8, next_n):
    """The product decode config of each kernel that serves the problem (sm_90 bf16 keys: wgmma and mma.sync),
    and the emulated archs' product configs (sm_120: 8 warps sharing a tile's q at next_n 4)."""
    first = {}
    for cfg in logits.DECODE.candidates((layout, q_fp8, next_n), ARCH):
        first.setdefault(cfg.kernel, cfg)
    emulated = [logits.DECODE.select((layout, q_fp8, next_n), a) for a in heuristics.EMULATED_ARCHS]
    return list(dict.fromkeys(list(first.values()) + emulated))


def prefill_configs(layout, q_fp8, varlen):
    """The product prefill config of this GPU and of each emulated arch."""
    return list(dict.fromkeys(logits.PREFILL.select((layout, q_fp8, varlen), a)
                              for a in (ARCH,) + heuristics.EMULATED_ARCHS))


def run_decode():
    """Both decode kernels (sm_90: wgmma and mma.sync for bf16 keys), plans built inside and given, mixed
    lengths with zeros, one request longer than the table and the width, all-zero lengths, 2-D lengths."""
    n = 0
    for layout in ("bf16", "fp8"):
        cache = cupy_dsa.empty_cache(P, layout, device=dev)
        cache.random_(0, 120)                                  # small bytes: finite fp8 and bf16 values
        for q_dtype in (torch.float8_e4m3fn, torch.bfloat16):
            for next_n in (1, 2, 3, 4):
                for cfg in decode_kernels(layout, int(q_dtype == torch.float8_e4m3fn), next_n):
                    with logits.DECODE.forced(cfg, ARCH):
                        B, max_pages = 7, 5
                        q = torch.randn(B, next_n, 64, 128, device=dev).to(q_dtype)
                        w = torch.rand(B * next_n, 64, device=dev)
                        lens = torch.tensor([0, 77, 5 * 64 + 9, 3, 0, 200, 64], dtype=torch.int32, device=dev)
                        lens2 = (lens[:, None] - torch.arange(next_n, device=dev)[None, :]).to(torch.int32)
                        bt = torch.randint(-2, P + 3, (B, max_pages), dtype=torch.int32, device=dev)  # bad entries
                        for ctx in (lens, lens2.contiguous(), torch.zeros_like(lens)):
                            plan = cupy_dsa.paged_mqa_logits_plan(ctx, next_n)
                            for clean in (False, True):
                                for width in (max_pages * 64, 3 * 64 + 5):
                                    cupy_dsa.paged_mqa_logits(q, cache, w, ctx, bt, width, clean_logits=clean,
                                                              plan=plan if clean else None)
                                    n += 1
    return n


def run_prefill():
    """Every product prefill kernel of this GPU and of the emulated archs (on sm_90 the wgmma kernel for bf16
    keys; sm_120's 8-warp mma.sync tiles), paged with invalid entries, compressed and row ranges, varlen, and
    contiguous keys not a multiple of 64."""
    n = 0
    for layout in ("bf16", "fp8"):
        cache = cupy_dsa.empty_cache(P, layout, device=dev)
        cache.random_(0, 120)
        for q_dtype in (torch.float8_e4m3fn, torch.bfloat16):
            qf = int(q_dtype == torch.float8_e4m3fn)
            T = 37
            q = torch.randn(T, 64, 128, device=dev).to(q_dtype)
            w = torch.rand(T, 64, device=dev)
            ks = torch.randint(0, 50, (T,), dtype=torch.int32, device=dev)
            ke = ks + torch.randint(0, 200, (T,), dtype=torch.int32, device=dev)
            bt = torch.randint(-1, P + 1, (4,), dtype=torch.int32, device=dev)
            for cfg in prefill_configs(layout, qf, 0):
                with logits.PREFILL.forced(cfg, ARCH):
                    cupy_dsa.mqa_logits(q, cache, w, ks, ke.clamp(max=4 * 64), block_table=bt)
                    cupy_dsa.mqa_logits(q, cache, w, ks, ke.clamp(max=4 * 64), block_table=bt, max_seqlen_k=100,
                                        clean_logits=False, rows=(3, 30))
                    n += 2
            # varlen: 4 requests (one empty, one row), invalid entries, the plan built inside and given,
            # offsets past the rows (a device tensor is clipped, never trusted), a row chunk
            bt2 = torch.randint(-1, P + 1, (4, 4), dtype=torch.int32, device=dev)
            cu = torch.tensor([0, 9, 9, 10, 37], dtype=torch.int32, device=dev)
            bad = torch.tensor([0, 30, 12, 99, 40], dtype=torch.int32, device=dev)
            for cfg in prefill_configs(layout, qf, 1):
                with logits.PREFILL.forced(cfg, ARCH):
                    cupy_dsa.mqa_logits(q, cache, w, ks, ke, block_table=bt2, cu_rows=cu, clean_logits=True)
                    cupy_dsa.mqa_logits(q, cache, w, ks, ke, block_table=bt2, cu_rows=cu, clean_logits=False,
                                        rows=(5, 30), plan=cupy_dsa.mqa_logits_plan(cu, rows=(5, 30)))
                    cupy_dsa.mqa_logits(q, cache, w, ks, ke, block_table=bt2, cu_rows=bad, clean_logits=False)
                    n += 3
            if layout == "bf16":
                S = 201                                         # not a multiple of 64: no read past S
                kv = torch.randn(S, 128, device=dev).to(torch.bfloat16)
                for cfg in prefill_configs("contiguous", qf, 0):
                    with logits.PREFILL.forced(cfg, ARCH):
                        cupy_dsa.mqa_logits(q, kv, w, ks, ke.clamp(max=S))
                        n += 1
    return n


def run_logits():
    return run_decode() + run_prefill()


def run_rescore():
    """fp8-rescore: the two-level store (out_loc out of range) and both top-k ops (stage 1 from our fp8
    logits and from caller logits, stage 2, selection) with block-table entries outside [0, P), zero and
    short rows, next_n 1-4 with 1-D and 2-D lengths, prefill and varlen rows."""
    from cupy_dsa import rescore

    n = 0
    hi = cupy_dsa.empty_cache(P, "fp8", device=dev)
    lo = rescore.empty_lo_cache(P, device=dev)
    N = 77
    kv = torch.randn(N, 128, device=dev)
    out_loc = torch.randint(-70, P * 64 + 70, (N,), device=dev)
    positions = torch.randint(0, max_pos, (N,), device=dev)
    cupy_dsa.store_index_k(kv, hi, positions=positions, out_loc=out_loc, norm_weight=torch.rand(128, device=dev),
                           freqs_cis=torch.randn(max_pos, 64, device=dev), lo_cache=lo)
    n += 1
    K, KP, max_pages = 16, 64, 5
    for next_n in (1, 2, 3, 4):
        B = 7
        q = torch.randn(B, next_n, 64, 128, device=dev).to(torch.float8_e4m3fn)
        w = torch.rand(B * next_n, 64, device=dev)
        lens = torch.tensor([0, 77, 5 * 64 + 9, 3, 0, 200, 64], dtype=torch.int32, device=dev)
        lens2 = (lens[:, None] - torch.arange(next_n, device=dev)[None, :]).to(torch.int32).contiguous()
        bt = torch.randint(-2, P + 3, (B, max_pages), dtype=torch.int32, device=dev)
        for ctx in (lens, lens2):
            rescore.rescore_topk(q, w, hi, lo, ctx, bt, K, KP)
            logits_in = torch.randn(B * next_n, max_pages * 64, device=dev)
            rescore.rescore_topk(q, w, hi, lo, ctx, bt, K, KP, stage1_logits=logits_in)
            # the caller's candidates (SGLang's top-k at k = K'): -1, negative, past a row's length and past the
            # table among them, with the stage-1 ranks
            given = torch.randint(-3, max_pages * 64 + 40, (B * next_n, KP), dtype=torch.int32, device=dev)
            rescore.rescore_topk(q, w, hi, lo, ctx, bt, K, stage1_logits=logits_in, candidates=given, fp8_rank=True)
            n += 3
    T = 37
    q = torch.randn(T, 64, 128, device=dev).to(torch.float8_e4m3fn)
    w = torch.rand(T, 64, device=dev)
    ks = torch.randint(0, 50, (T,), dtype=torch.int32, device=dev)
    ke = (ks + torch.randint(0, 200, (T,), dtype=torch.int32, device=dev)).clamp(max=4 * 64)
    bt = torch.randint(-1, P + 1, (4,), dtype=torch.int32, device=dev)
    rescore.rescore_topk_prefill(q, w, hi, lo, ks, ke, bt, K, KP)
    bt2 = torch.randint(-1, P + 1, (4, 4), dtype=torch.int32, device=dev)
    cu = torch.tensor([0, 9, 9, 10, 37], dtype=torch.int32, device=dev)
    rescore.rescore_topk_prefill(q, w, hi, lo, ks, ke, bt2, K, KP, cu_rows=cu)
    n += 2
    # long rows, every way of selecting the candidates: per row, by a cluster of CTAs (sm_90+, few rows: the
    # default here) or by one CTA (a row in the arch's large shared-memory cache, or past every cache), and column
    # chunks (the first digit counted by several CTAs per row, the K'-th key's bin collected and, for flat logits, past
    # what is collected: read from the row); with the stage-1 ranks
    from cupy_dsa import topk
    B = 2
    q = torch.randn(B, 1, 64, 128, device=dev).to(torch.float8_e4m3fn)
    w = torch.rand(B, 64, device=dev)
    per_row, cluster = rescore.select_per_row, topk.select_cluster
    routes = ((per_row, cluster), (per_row, lambda *args: 1), (lambda *args: False, cluster))
    for width in (20480, 53248):
        lens = torch.tensor([width - 480, 9000], dtype=torch.int32, device=dev)
        bt = torch.randint(-1, P + 1, (B, width // 64), dtype=torch.int32, device=dev)
        for route, ctas in routes:
            rescore.select_per_row, topk.select_cluster = route, ctas
            try:
                for s1 in (torch.zeros(B, width, device=dev), torch.round(torch.randn(B, width, device=dev) * 8) / 8):
                    rescore.rescore_topk(q, w, hi, lo, lens, bt, 512, 2048, stage1_logits=s1, fp8_rank=True)
                    n += 1
            finally:
                rescore.select_per_row, topk.select_cluster = per_row, cluster
    return n


def run_topk():
    """paged_topk: lengths 0, trivial, past the width; rows in the small and the large shared-memory cache and past
    both, by one CTA and (sm_90+) by a cluster of CTAs per row; an unaligned logits
    view (the vector loads' scalar head); flat rows (the boundary bin past what is collected) and ties."""
    from cupy_dsa import topk

    n, cluster = 0, topk.select_cluster
    for width, k in ((300, 16), (9001, 512), (20480, 512), (53248, 512)):
        R = 6
        base = torch.randn(R, width + 3, device=dev)
        lens = torch.tensor([0, k, k + 1, width // 2, width, width + 9], dtype=torch.int32, device=dev)
        table = torch.randint(0, 1 << 20, (R, -(-width // 64)), dtype=torch.int32, device=dev)
        for logits_in in (base[:, 1:width + 1], torch.zeros(R, width, device=dev),
                          torch.round(base[:, :width] * 4) / 4):
            for ctas in (cluster, lambda *args: 1):   # a cluster per row (sm_90+, these few rows) and one CTA
                topk.select_cluster = ctas
                try:
                    topk.paged_topk(logits_in, lens, table, k, raw_indices=True)
                finally:
                    topk.select_cluster = cluster
                n += 1
    return n


def _poisoned(rows, width, seed):
    """Logits with NaN (both signs, payloads), +inf and -inf mixed in, a row of NaN only and one of +inf only."""
    g = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(rows, width, device=dev, generator=g)
    kind = torch.randint(0, 6, (rows, width), device=dev, generator=g)
    nan = (torch.randint(1, 1 << 22, (rows, width), device=dev, generator=g, dtype=torch.int32) | 0x7F800000
           | (torch.randint(0, 2, (rows, width), device=dev, generator=g, dtype=torch.int32) << 31)).view(torch.float32)
    x = torch.where(kind == 0, nan, torch.where(kind == 1, torch.full_like(x, float("inf")),
                                                torch.where(kind == 2, torch.full_like(x, float("-inf")), x)))
    x[0], x[1] = float("nan"), float("inf")
    return x


def run_nonfinite():
    """Non-finite inputs (issue 49): kv rows with NaN / +-inf through every store layout (the non-finite counter's
    atomics), and paged_topk and fp8-rescore's selects (decode and prefill) on logits full of NaN / +-inf and on
    non-finite keys, with this GPU's configs and with sm_120's forced."""
    from cupy_dsa import rescore, topk

    n = 0
    for layout in ("bf16", "fp8"):
        kv = torch.randn(77, 128, device=dev)
        kv[::5, 3], kv[1::7, 90], kv[2::11, 0] = float("nan"), float("inf"), float("-inf")
        cache = cupy_dsa.empty_cache(P, layout, device=dev)
        lo = rescore.empty_lo_cache(P, device=dev) if layout == "fp8" else None
        cupy_dsa.store_index_k(kv, cache, positions=torch.arange(77, device=dev), out_loc=torch.arange(77, device=dev),
                               norm_weight=torch.rand(128, device=dev), freqs_cis=torch.randn(max_pos, 64, device=dev),
                               lo_cache=lo)
        n += 1
    hi, lo = cache, lo   # the fp8 pair: some keys non-finite
    modules = (logits, rescore, topk)
    for arch_runtime in (runtime, runtime.ReportedArch("sm_120")):
        saved = [m.runtime for m in modules]
        for m in modules:
            m.runtime = arch_runtime
        try:
            for width, k in ((300, 16), (9001, 512), (20480, 512), (53248, 512)):
                R = 6
                lens = torch.tensor([0, k, k + 1, width // 2, width, width + 9], dtype=torch.int32, device=dev)
                table = torch.randint(0, 1 << 20, (R, -(-width // 64)), dtype=torch.int32, device=dev)
                topk.paged_topk(_poisoned(R, width, width), lens, table, k, raw_indices=True)
                n += 1
            B, max_pages = 5, 5
            q = torch.randn(B, 1, 64, 128, device=dev).to(torch.float8_e4m3fn)
            w = torch.rand(B, 64, device=dev)
            lens = torch.tensor([0, 77, 5 * 64 - 3, 16, 200], dtype=torch.int32, device=dev)
            bt = torch.randint(-2, P + 3, (B, max_pages), dtype=torch.int32, device=dev)
            rescore.rescore_topk(q, w, hi, lo, lens, bt, 16, 64)
            rescore.rescore_topk(q, w, hi, lo, lens, bt, 16, 64, stage1_logits=_poisoned(B, max_pages * 64, 3))
            T = 9
            qp = torch.randn(T, 64, 128, device=dev).to(torch.float8_e4m3fn)
            ke = torch.randint(0, 4 * 64, (T,), dtype=torch.int32, device=dev)
            rescore.rescore_topk_prefill(qp, torch.rand(T, 64, device=dev), hi, lo, torch.zeros_like(ke), ke,
                                         torch.randint(-1, P + 1, (4,), dtype=torch.int32, device=dev), 16, 64,
                                         stage1_logits=_poisoned(T, 4 * 64, 4))
            n += 3
        finally:
            for m, r in zip(modules, saved):
                m.runtime = r
    return n


if __name__ == "__main__":
    import sys

    # every declared config in one program per source, as the GPU test session loads them (the same CuPy
    # cache entry: no compile under the sanitizer, also for the emulated archs' configs forced below)
    from cupy_dsa import launch
    print("declared instantiations loaded:", runtime.warm_up_expressions(dev.index, launch.declared_expressions(ARCH)))
    print("instantiations warmed:", cupy_dsa.warm_up(dev))
    if sys.argv[1:] == ["logits"]:     # racecheck / initcheck: the decode kernels, the plan and prefill
        print("logits launches:", run_logits())
    elif sys.argv[1:] == ["rescore"]:  # the selection kernels: fp8-rescore's and the top-k
        print("rescore launches:", run_rescore())
        print("topk launches:", run_topk())
        print("non-finite launches:", run_nonfinite())
    elif sys.argv[1:] == ["nonfinite"]:  # issue 49: the store and the selects on non-finite inputs
        print("non-finite launches:", run_nonfinite())
    else:
        print("store launches:", run_store())
        print("logits launches:", run_logits())
        print("rescore launches:", run_rescore())
        print("topk launches:", run_topk())
        print("non-finite launches:", run_nonfinite())
    torch.cuda.synchronize()
    print("gpu_sanitize: done")
