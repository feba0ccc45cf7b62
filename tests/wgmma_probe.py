"""Standalone probe of the sm_90a wgmma paged-decode logits kernel (kernels/mqa_logits_sm90.cuh).

Not collected by pytest (no test_ prefix). On an H100/H200: python3 tests/wgmma_probe.py [--quick]
* correctness: next_n 1..4, fp8 / bf16 q, 1-D / 2-D lengths, shuffled block tables with invalid entries,
  widths not multiples of 64, clean on/off, vs cupy_dsa.logits.paged_mqa_logits_reference (rel L2 <= 1e-5
  on visible entries, -inf masks exact) and vs the current kernel (cupy_dsa.paged_mqa_logits);
* both schedules (grid (B, G) and the balanced 1-D grid) and every variant (stages / occupancy / split)
  bitwise equal to the default;
* timing with CUDA-graph replays: B=64 x 32K (next_n 1..4), B=1 x 8K, B=64 with mixed lengths, GB/s (keys + q + weights read,
  logits written) and % of a 1 GiB torch d2d copy (read + write counted) measured in the same run.
Prints PASS / FAIL lines and a final SUMMARY line.
"""
from __future__ import annotations

import math
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cupy_dsa import runtime  # noqa: E402
from cupy_dsa.logits import paged_mqa_logits_reference  # noqa: E402

FP8 = torch.float8_e4m3fn
H, D, PS = 64, 128, 64
PAGE_BYTES = PS * D * 2
# next_n -> (stages, min CTAs per SM, split): the instantiations this probe compiles (for both q dtypes);
# the first one is the default
VARIANTS = {1: [(4, 2, 1), (3, 3, 1)], 2: [(2, 3, 1), (2, 3, 2), (4, 2, 2)], 3: [(3, 2, 1), (3, 2, 3)],
            4: [(2, 2, 2), (2, 2, 1)]}


def smem_bytes(next_n, stages):  # mirrors dsa::sm90::Smem
    return 1024 + next_n * H * D * 2 + stages * PAGE_BYTES + next_n * H * 4


def expr(q_fp8, next_n, stages, min_blocks, split, balanced=False):
    name = "mqa_logits_sm90_balanced_kernel" if balanced else "mqa_logits_sm90_kernel"
    return f"{name}<{q_fp8}, {next_n}, {stages}, {min_blocks}, {split}>"


class Sm90Logits:
    def __init__(self, device):
        import cupy as cp

        self.device = device
        self.n_sms = torch.cuda.get_device_properties(device).multi_processor_count
        exprs = [expr(qf, nn, *v, bal) for qf in (0, 1) for nn, vs in VARIANTS.items() for v in vs
                 for bal in (False, True)]
        t0 = time.time()
        with cp.cuda.Device(device.index or 0):
            mod = cp.RawModule(code='#include "mqa_logits_sm90.cuh"\n',
                               options=runtime.compile_options("sm_90") + (f"-I{runtime.kernel_dir()}",),
                               name_expressions=exprs)
            self.fns = {}
            for e in exprs:
                f = mod.get_function(e)
                f.compile()
                self.fns[e] = f
        print(f"compiled {len(exprs)} instantiations in {time.time() - t0:.1f} s", flush=True)

    def __call__(self, q, cache, w, ctx, bt, width, *, clean=False, out=None, variant=None, grid_y=None,
                 cps=None, balanced=False):
        B, next_n = q.shape[:2]
        stages, min_blocks, split = variant or VARIANTS[next_n][0]
        rows = B * next_n
        if out is None:
            out = torch.empty(rows, -(-width // 4) * 4, dtype=torch.float32, device=q.device)[:, :width]
        pages = -(-width // PS)
        cps = cps or min_blocks
        if balanced:
            grid = (grid_y or self.n_sms * cps, 1, 1)
        else:
            if grid_y is None:
                grid_y = max(1, min(pages, self.n_sms * cps // B, 65535))  # <= cps CTAs per SM in one wave
            grid = (B, grid_y, 1)
        e = expr(int(q.dtype == FP8), next_n, stages, min_blocks, split, balanced)
        f = self.fns[e]
        sm = smem_bytes(next_n, stages)
        if f.max_dynamic_shared_size_bytes < sm:
            f.max_dynamic_shared_size_bytes = sm
        args = (q.data_ptr(), w.data_ptr(), cache.data_ptr(), np.int64(cache.shape[0]), bt.data_ptr(),
                np.int64(bt.stride(0)), np.int32(bt.shape[1]), ctx.data_ptr(), np.int32(1 if ctx.dim() == 2 else 0),
                np.int32(width), out.data_ptr(), np.int64(out.stride(0)), np.int32(1 if clean else 0))
        if balanced:
            args = args + (np.int32(B),)
        f(grid, (128, 1, 1), args, shared_mem=sm, stream=runtime._stream_for(q.device))
        return out


def lazy_current_compiles():
    """Let the current kernel compile only the instantiations this probe launches (the runtime compiles all
    ~50 of mqa_logits.cu on first use: ~40 s of NVRTC)."""
    import cupy as cp

    def get_function(filename, name_expression, device_index):
        key = (device_index, filename, name_expression)
        fn = runtime._FUNCTIONS.get(key)
        if fn is None:
            with cp.cuda.Device(device_index):
                mod = cp.RawModule(code=runtime.read_source(filename),
                                   options=runtime.compile_options(runtime.device_arch(device_index)),
                                   name_expressions=[name_expression])
                fn = mod.get_function(name_expression)
                fn.compile()
            runtime._FUNCTIONS[key] = fn
        return fn

    runtime.get_function = get_function


_FAIL_LINES = [0]


def fail(msg):
    _FAIL_LINES[0] += 1
    if _FAIL_LINES[0] <= 12:
        print("FAIL " + msg, flush=True)


def make_case(B, next_n, max_pages, P, q_dtype, lens_2d, dev):
    k = torch.randn(P, PS, D, device=dev).to(torch.bfloat16)
    cache = k.view(torch.uint8).reshape(P, PAGE_BYTES).contiguous()
    qf = torch.randn(B, next_n, H, D, device=dev)
    q = (qf * 3).to(FP8) if q_dtype == FP8 else qf.to(torch.bfloat16)
    w = torch.randn(B * next_n, H, device=dev)
    max_len = max_pages * PS
    if lens_2d:
        ctx = torch.randint(0, max_len + 1, (B, next_n), dtype=torch.int32)
    else:
        ctx = torch.randint(0, max_len + 1, (B,), dtype=torch.int32)
        ctx[0] = 0
        ctx[1] = min(next_n - 1, max_len)
        ctx[2] = max_len - 13                     # long, not a multiple of 64
    bt = torch.stack([torch.randperm(P)[:max_pages] for _ in range(B)]).to(torch.int32)
    bad = torch.rand(B, max_pages) < 0.1
    bt[bad] = torch.where(torch.rand(int(bad.sum())) < 0.5, -1, P + 3).to(torch.int32)
    bt[2, 1] = -5                                 # at least one invalid entry inside a long row
    return q, cache, w, ctx.to(dev), bt.to(dev)


def rel_l2(got, want, vis):
    g, wv = got[vis].double(), want[vis].double()
    if wv.numel() == 0:
        return 0.0
    return float((g - wv).norm() / wv.norm().clamp_min(1e-30))


def correctness(k, dev):
    fails = 0
    worst = 0.0
    worst_cur = 0.0
    cur_ok = True
    try:
        from cupy_dsa import paged_mqa_logits as current
    except Exception as e:  # noqa: BLE001
        print(f"current kernel unavailable: {e!r}")
        current = None
    for next_n in (1, 2, 3, 4):
        for q_dtype in (FP8, torch.bfloat16):
            for lens_2d in (False, True):
                torch.manual_seed(1000 * next_n + (q_dtype == FP8) * 10 + lens_2d)
                B, mp, P = 5, 37, 200
                q, cache, w, ctx, bt = make_case(B, next_n, mp, P, q_dtype, lens_2d, dev)
                for width in (mp * PS, mp * PS - 45, 10 * PS + 3):
                    ref = paged_mqa_logits_reference(q, cache, w, ctx, bt, width, clean_logits=True)
                    vis = ref != -math.inf
                    for clean, bal in ((True, False), (False, False), (True, True), (False, True)):
                        buf = torch.full((B * next_n, -(-width // 4) * 4 + 8), math.nan, device=dev)
                        out = buf[:, :width]
                        k(q, cache, w, ctx, bt, width, clean=clean, out=out, balanced=bal,
                          grid_y=3 if bal and lens_2d else None)
                        torch.cuda.synchronize()
                        err = rel_l2(out, ref, vis)
                        worst = max(worst, err)
                        bad = []
                        if not err <= 1e-5:
                            bad.append(f"relL2 {err:.3g}")
                        if torch.isnan(out[vis]).any():
                            bad.append(f"{int(torch.isnan(out[vis]).sum())} visible NaN")
                        if clean:
                            wrong = int((out[~vis] != -math.inf).sum())
                            if wrong:
                                bad.append(f"{wrong} masked entries not -inf")
                        written = int((~torch.isnan(buf[:, width:])).sum())
                        if written:
                            bad.append(f"{written} writes past width")
                        if current is not None and clean:
                            try:
                                c = current(q, cache, w, ctx, bt, width, clean_logits=True)
                                torch.cuda.synchronize()
                                ec = rel_l2(out, c, vis)
                                worst_cur = max(worst_cur, ec)
                                if not torch.equal(c == -math.inf, out == -math.inf):
                                    cur_ok = False
                                    bad.append("-inf mask differs from current kernel")
                            except Exception as e:  # noqa: BLE001
                                print(f"current kernel failed: {e!r}")
                                current = None
                        what = (f"next_n={next_n} q={'fp8' if q_dtype == FP8 else 'bf16'} "
                                f"lens={'2d' if lens_2d else '1d'} width={width} clean={int(clean)} "
                                f"{'balanced' if bal else 'grid'}")
                        if bad:
                            fails += 1
                            fail(f"correctness {what}: {'; '.join(bad)}")
                # every variant bitwise equal to the default one (clean, full width)
                width = mp * PS
                first = k(q, cache, w, ctx, bt, width, clean=True)
                for v in VARIANTS[next_n]:
                    for gy, bal in ((1, False), (3, False), (37, False), (1, True), (7, True), (None, True)):
                        o = k(q, cache, w, ctx, bt, width, clean=True, variant=v, grid_y=gy, balanced=bal)
                        if not torch.equal(o, first):
                            nd = int((o != first).sum())
                            vf = first != -math.inf
                            if torch.equal(o == -math.inf, ~vf) and rel_l2(o, first, vf) <= 1e-6:
                                print(f"NOTE variant next_n={next_n} {v} G={gy} bal={bal}: {nd} entries differ in "
                                      f"rounding (rel L2 {rel_l2(o, first, vf):.2g})")
                            else:
                                fails += 1
                                fail(f"variant next_n={next_n} {v} G={gy} bal={bal}: {nd} entries differ")
    print(f"{'PASS' if fails == 0 else 'FAIL'} correctness: {fails} failing checks, worst rel L2 vs reference "
          f"{worst:.3g}, vs current kernel {worst_cur:.3g} (masks equal: {cur_ok})", flush=True)
    return fails


def graph_time(fn, reps=20, per_graph=5):
    """Device time of one call in us: the bench's CUDA-graph timer over a graph of ``per_graph`` calls."""
    from cupy_dsa.bench.timing import time_calls

    return time_calls([fn] * per_graph, torch.device("cuda"), reps=reps).seconds * 1e6


def copy_gbps(dev):
    n = 1 << 30
    src = torch.empty(n // 4, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    ts = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    del src, dst
    return 2 * n / statistics.median(ts) / 1e3


def timing(k, dev, quick):
    copy = copy_gbps(dev)
    print(f"d2d copy 1 GiB: {copy:.0f} GB/s (read + write)", flush=True)
    try:
        from cupy_dsa import paged_mqa_logits as current
    except Exception:  # noqa: BLE001
        current = None
    # (B, max context, next_n, mixed lengths uniform in [1, max])
    cases = [(64, 32768, 1, False), (64, 32768, 2, False), (64, 32768, 3, False), (64, 32768, 4, False),
             (1, 8192, 1, False), (1, 8192, 2, False), (64, 65536, 1, True), (64, 65536, 2, True)]
    if quick:
        cases = cases[:2]
    for B, ctx_len, next_n, mixed in cases:
        pages = ctx_len // PS
        P = B * pages
        torch.manual_seed(7)
        cache = torch.randint(0, 120, (P, PAGE_BYTES), dtype=torch.uint8, device=dev)
        q = (torch.randn(B, next_n, H, D, device=dev) * 3).to(FP8)
        w = torch.randn(B * next_n, H, device=dev)
        if mixed:
            ctx = torch.randint(1, ctx_len + 1, (B,), dtype=torch.int32, device=dev)
        else:
            ctx = torch.full((B,), ctx_len, dtype=torch.int32, device=dev)
        keys = int(ctx.long().sum())
        bt = torch.randperm(P, device=dev).to(torch.int32).view(B, pages)
        nbytes = keys * 256 + q.numel() + w.numel() * 4 + keys * next_n * 4
        out = torch.empty(B * next_n, ctx_len, device=dev)
        tagc = f"B={B:2d} ctx={'<=' if mixed else ''}{ctx_len} next_n={next_n}"

        def line(name, us):
            gbs = nbytes / us / 1e3
            print(f"time {tagc} {name:30s}: {us:7.1f} us {gbs:5.0f} GB/s {100 * gbs / copy:5.1f}% of copy "
                  f"{keys * next_n / us / 1e3:5.1f} G pairs/s", flush=True)
            return us

        configs = []  # (variant, grid_y, cps, balanced)
        for i, v in enumerate(VARIANTS[next_n][:2]):
            if B == 1:
                configs += [(v, 128, None, False)] + ([(v, 64, None, False)] if i == 0 else [])
            else:
                configs += [(v, None, v[1], False)] + ([(v, None, 4 * v[1], False)] if mixed and i == 0 else [])
        v0 = VARIANTS[next_n][0]
        configs += [(v0, None, v0[1], True), (v0, None, 2 * v0[1], True)]
        best = {}
        for v, gy, cps, bal in configs:
            us = graph_time(lambda: k(q, cache, w, ctx, bt, ctx_len, out=out, variant=v, grid_y=gy, cps=cps,
                                      balanced=bal))
            tag = (f"{'bal' if bal else 'grid'} st={v[0]} mB={v[1]} sp={v[2]} "
                   + (f"G={gy}" if gy else f"{'C' if bal else 'cps'}={cps}"))
            line(tag, us)
            best[bal] = min(best.get(bal, 1e30), us)
        cur = None
        if current is not None:
            try:
                cur = line("current mma.sync kernel", graph_time(
                    lambda: current(q, cache, w, ctx, bt, ctx_len, out=out)))
            except Exception as e:  # noqa: BLE001
                print(f"current kernel failed: {e!r}")
        if cur is not None:
            print(f"SPEEDUP {tagc}: best grid {cur / best[False]:.2f}x, best balanced {cur / best[True]:.2f}x "
                  f"vs current {cur:.1f} us", flush=True)
        del cache


def main():
    quick = "--quick" in sys.argv
    if not torch.cuda.is_available():
        print("SKIP: needs a CUDA GPU")
        return 0
    dev = torch.device("cuda", torch.cuda.current_device())
    arch = runtime.device_arch(dev.index)
    print("device:", torch.cuda.get_device_name(dev), arch, flush=True)
    if arch != "sm_90":
        print("SKIP: the wgmma kernel needs sm_90")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    lazy_current_compiles()
    k = Sm90Logits(dev)
    fails = correctness(k, dev)
    if "--no-time" not in sys.argv:
        timing(k, dev, quick)
    print(f"SUMMARY {'PASS' if fails == 0 else 'FAIL'} ({fails} failing checks)")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
