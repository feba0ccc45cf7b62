"""Timing and ceilings: CUDA-graph replay timed with CUDA events, peak-memory deltas, and the copy /
matmul / read-only / register-operand mma.sync ceilings every ratio in the bench is measured against (in the
same process)."""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

L2_FALLBACK_BYTES = 50 * 2**20  # H200


@dataclass
class Timing:
    seconds: float          # median time of one call
    p10: float
    p90: float
    reps: int               # timed repetitions (each of `calls` calls)
    calls: int              # calls per repetition (rotating input buffers)
    method: str             # "cuda-graph" | "cuda-events" | "cpu"


def capture_graph(step: Callable[[], object], warmups: int = 2):
    """``warmups`` runs of ``step`` on a side stream (compiles, allocator pools), then one CUDA-graph capture of
    it; returns ``(graph, what the captured step returned)``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = step()
    return graph, result


def l2_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "L2_cache_size", 0) or L2_FALLBACK_BYTES)


def rotations(device: torch.device, bytes_per_call: int, cap: int = 64) -> int:
    """How many distinct input buffers to cycle so that consecutive calls cannot hit in L2
    (3x the L2 size in total), capped."""
    if device.type != "cuda" or bytes_per_call <= 0:
        return 1
    return max(1, min(cap, math.ceil(3 * l2_bytes(device) / bytes_per_call)))


def _quantiles(samples: Sequence[float]) -> tuple[float, float, float]:
    s = sorted(samples)
    n = len(s)
    return statistics.median(s), s[max(0, int(0.1 * (n - 1)))], s[min(n - 1, int(math.ceil(0.9 * (n - 1))))]


# A replay of at least this long (the calls repeated back to back inside the graph) keeps the graph launch
# and the first kernel's launch latency out of the per-call time; the warm-up runs replays for at least this
# long so the SM clock has ramped up from idle (H200: 345 MHz idle, 1980 MHz under load) before timing.
MIN_REPLAY_S = 1e-3
MIN_WARMUP_S = 0.05
MAX_REPEATS = 64


def time_calls(calls: Sequence[Callable[[], object]], device: torch.device, *, reps: int = 25,
               warmup: int = 3, use_graph: bool = True, min_replay_s: float = MIN_REPLAY_S,
               min_warmup_s: float = MIN_WARMUP_S) -> Timing:
    """Median time of one call. One repetition runs every callable of ``calls`` (each on its own input
    buffers) ``k`` times back to back, ``k`` chosen so that it lasts at least ``min_replay_s``; on CUDA the
    repetition is captured in a CUDA graph and each replay is timed with events, after replays for at least
    ``min_warmup_s`` (and ``warmup`` of them); the per-call time is the replay time / (``len(calls)`` * k)."""
    n = len(calls)
    if device.type != "cuda":
        for f in calls[:1]:
            f()
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for f in calls:
                f()
            samples.append((time.perf_counter() - t0) / n)
        med, lo, hi = _quantiles(samples)
        return Timing(med, lo, hi, reps, n, "cpu")

    with torch.cuda.device(device):
        for f in calls:  # eager warm-up: compiles kernels, allocates
            f()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for f in calls:  # one eager pass: how many passes make a replay of min_replay_s
            f()
        torch.cuda.synchronize()
        t_pass = max(time.perf_counter() - t0, 1e-6)
        k = max(1, min(MAX_REPEATS, math.ceil(min_replay_s / t_pass))) if min_replay_s > 0 else 1
        run = None
        method = "cuda-events"
        if use_graph:
            try:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for f in calls:
                        f()
                torch.cuda.current_stream().wait_stream(side)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for _ in range(k):
                        for f in calls:
                            f()
                torch.cuda.synchronize()
                run = graph.replay
                method = "cuda-graph"
            except Exception:  # an op that cannot be captured is timed eagerly
                torch.cuda.synchronize()
                run = None
        if run is None:
            def run():
                for _ in range(k):
                    for f in calls:
                        f()
        t0 = time.perf_counter()
        done = 0
        while done < warmup or (time.perf_counter() - t0 < min_warmup_s and done < 10000):
            run()
            done += 1
            if done % 8 == 0:
                torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for i in range(reps):
            starts[i].record()
            run()
            ends[i].record()
        torch.cuda.synchronize()
        samples = [s.elapsed_time(e) * 1e-3 / (n * k) for s, e in zip(starts, ends)]
        del run
    med, lo, hi = _quantiles(samples)
    return Timing(med, lo, hi, reps, n * k, method)


def peak_extra_bytes(fn: Callable[[], object], device: torch.device) -> int | None:
    """Peak memory allocated by one eager call above what was allocated before it (its output included)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del out
    return int(peak)


# --------------------------------------------------------------------------------------------------
# Ceilings
# --------------------------------------------------------------------------------------------------

def copy_bandwidth(device: torch.device, nbytes: int, reps: int = 20) -> float:
    """Device-to-device copy of ``nbytes`` (torch ``copy_``); bytes/s counting read + write."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    t = time_calls([lambda: dst.copy_(src)], device, reps=reps, use_graph=False)
    del src, dst
    return 2 * nbytes / t.seconds


def matmul_rate(device: torch.device, n: int, reps: int = 20) -> float:
    """bf16 ``n^3`` matmul (torch.mm); FLOP/s."""
    dtype = torch.bfloat16
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)
    t = time_calls([lambda: torch.mm(a, b, out=c)], device, reps=reps, use_graph=False)
    del a, b, c
    return 2 * n**3 / t.seconds


_READ_SRC = r"""
extern "C" __global__ void read_stream(const uint4* __restrict__ p, unsigned long long n16,
                                       unsigned int* __restrict__ sink) {
  unsigned int acc = 0;
  unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
  for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n16; i += stride) {
    uint4 v = __ldcs(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;  // keeps the loads alive; practically never taken
}
"""


def read_bandwidth(device: torch.device, nbytes: int, reps: int = 20) -> float | None:
    """Read-only streaming bandwidth (a 16-byte-load CuPy kernel, 16 blocks per SM); bytes/s, or None
    when CuPy is unavailable. Decode logits are read-dominated, so this is their truer ceiling."""
    if device.type != "cuda":
        return None
    try:
        import cupy as cp
        import numpy as np

        idx = device.index if device.index is not None else torch.cuda.current_device()
        buf = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(3)
        sink = torch.zeros(1, dtype=torch.int32, device=device)
        with cp.cuda.Device(idx):
            kern = cp.RawKernel(_READ_SRC, "read_stream")
            kern.compile()
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        n16 = np.uint64(nbytes // 16)

        class _Ref:
            def __init__(self, ptr):
                self.ptr = ptr

            def __cuda_stream__(self):
                return (0, self.ptr)

        def call():
            stream = cp.cuda.Stream.from_external(_Ref(torch.cuda.current_stream(device).cuda_stream))
            with cp.cuda.Device(idx):
                kern((sms * 16,), (512,), (np.uint64(buf.data_ptr()), n16, np.uint64(sink.data_ptr())),
                     stream=stream)

        t = time_calls([call], device, reps=reps, use_graph=False)
        del buf, sink
        return nbytes / t.seconds
    except Exception:
        return None


# The register-operand mma.sync ceilings: what the mma.sync family (every arch's kernels but sm_90's wgmma ones,
# and all of sm_120's) can reach with no memory traffic at all. One CTA of W warps per SM (W = the residency
# asked), each warp running kMmaChains independent accumulator chains of one mma shape on operands that stay in
# registers; the operands are non-zero normal values (zeros can run faster than data). Template Fp8: 0 = bf16
# m16n8k16, 1 = e4m3 m16n8k32 (valid PTX from sm_89; measured only where it is native, see MMA_E4M3_NATIVE).
MMA_CHAINS = 8
MMA_WARPS_PER_SM = (4, 8, 16)           # residencies measured: 8 is sm_120's for the logits' product configs
MMA_FLOPS = {0: 2 * 16 * 8 * 16, 1: 2 * 16 * 8 * 32}   # per mma instruction: bf16 m16n8k16, e4m3 m16n8k32
MMA_CEILING_SRC = r"""
template <int Fp8>
__global__ void mma_ceiling(int iters, float* __restrict__ sink) {
  constexpr int kChains = %(chains)d;
  const unsigned lane = threadIdx.x & 31u;
  // bf16: 1.0 .. 1.05 in both halves; e4m3: 1.0 .. 1.375 in every byte (normal values, never zero)
  const unsigned a = Fp8 ? 0x38383838u + 0x01010101u * (lane & 3u) : 0x3f803f80u + 0x00010001u * (lane & 7u);
  const unsigned b = Fp8 ? 0x39393939u - 0x01010101u * (lane >> 3) : 0x3f813f81u + 0x00010001u * (lane >> 2);
  float d[kChains][4];
#pragma unroll
  for (int c = 0; c < kChains; ++c)  // distinct chains: ptxas may not merge them (it would where they are equal)
#pragma unroll
    for (int e = 0; e < 4; ++e) d[c][e] = 0.25f * (4 * c + e + 1);
  for (int i = 0; i < iters; ++i) {
#pragma unroll
    for (int c = 0; c < kChains; ++c) {
      if (Fp8) {
#if __CUDA_ARCH__ >= 890
        asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%%0,%%1,%%2,%%3}, {%%4,%%5,%%6,%%7}, "
                     "{%%8,%%9}, {%%0,%%1,%%2,%%3};\n"
                     : "+f"(d[c][0]), "+f"(d[c][1]), "+f"(d[c][2]), "+f"(d[c][3])
                     : "r"(a), "r"(a ^ 0x01000100u), "r"(a), "r"(a), "r"(b), "r"(b));
#endif
      } else {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%%0,%%1,%%2,%%3}, {%%4,%%5,%%6,%%7}, "
                     "{%%8,%%9}, {%%0,%%1,%%2,%%3};\n"
                     : "+f"(d[c][0]), "+f"(d[c][1]), "+f"(d[c][2]), "+f"(d[c][3])
                     : "r"(a), "r"(a ^ 0x00010001u), "r"(a), "r"(a), "r"(b), "r"(b));
      }
    }
  }
  float s = 0.0f;
#pragma unroll
  for (int c = 0; c < kChains; ++c) s += d[c][0] + d[c][1] + d[c][2] + d[c][3];
  if (s == 1234.5f) sink[0] = s;  // keeps the chains alive; practically never taken
}
""" % {"chains": MMA_CHAINS}


# Archs that run the e4m3 mma natively (SASS QMMA). On sm_90 / sm_100 ptxas emulates it with f16 HMMAs, and on
# this loop it computes the loop-invariant products once and turns each mma into FADDs (CUDA 13, read in the SASS):
# a "ceiling" measured there would count flops that never ran, so none is measured.
MMA_E4M3_NATIVE = ("sm_89", "sm_120", "sm_121")


def mma_ceiling_expressions(arch: str) -> list[str]:
    """The instantiations of ``MMA_CEILING_SRC`` measured on ``arch``: bf16 everywhere, e4m3 where native."""
    return ["mma_ceiling<0>"] + (["mma_ceiling<1>"] if arch in MMA_E4M3_NATIVE else [])


def mma_rates(device: torch.device, quick: bool = False, reps: int = 10) -> dict | None:
    """Register-operand mma.sync ceilings measured now on ``device``: ``{"bf16": {warps per SM: TFLOP/s},
    "e4m3": {...} or None}`` at the residencies of ``MMA_WARPS_PER_SM`` (one CTA per SM); None without a GPU
    or CuPy."""
    if device.type != "cuda":
        return None
    try:
        import cupy as cp
        import numpy as np

        from cupy_dsa import runtime

        idx = device.index if device.index is not None else torch.cuda.current_device()
        exprs = mma_ceiling_expressions(runtime.device_arch(idx))
        with cp.cuda.Device(idx):
            mod = cp.RawModule(code=MMA_CEILING_SRC, options=("-std=c++17",), name_expressions=exprs)
            fns = {e: mod.get_function(e) for e in exprs}
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        sink = torch.zeros(1, dtype=torch.float32, device=device)
        iters = 1024 if quick else 4096

        class _Ref:
            def __init__(self, ptr):
                self.ptr = ptr

            def __cuda_stream__(self):
                return (0, self.ptr)

        arch = runtime.device_arch(idx)
        out = {"bf16": None, "e4m3": None, "chains": MMA_CHAINS, "iters": iters, "arch": arch}
        if arch not in MMA_E4M3_NATIVE:
            out["e4m3_note"] = f"e4m3 mma.sync is not native on {arch} (ptxas emulates it): not measured"
        for fp8, name in ((0, "bf16"), (1, "e4m3")):
            expr = f"mma_ceiling<{fp8}>"
            if expr not in fns:
                continue
            rates = {}
            for warps in MMA_WARPS_PER_SM:
                def call(fn=fns[expr], warps=warps):
                    stream = cp.cuda.Stream.from_external(_Ref(torch.cuda.current_stream(device).cuda_stream))
                    with cp.cuda.Device(idx):
                        fn((sms,), (32 * warps,), (np.int32(iters), np.uint64(sink.data_ptr())), stream=stream)

                t = time_calls([call], device, reps=reps, use_graph=False)
                rates[str(warps)] = sms * warps * iters * MMA_CHAINS * MMA_FLOPS[fp8] / t.seconds / 1e12
            out[name] = rates
        return out
    except Exception:
        return None


def mma_ceiling_at(ceilings: dict, warps_per_sm: int | None, kind: str = "bf16") -> tuple[float, int] | None:
    """(TFLOP/s, the residency it was measured at) of the register-operand mma.sync ceiling that applies to a
    kernel running ``warps_per_sm`` warps per SM: the measured residency closest to it from below (the
    lowest one for fewer warps). None when ``ceilings`` has no mma.sync measurement (CPU, an older results
    file)."""
    rates = ((ceilings or {}).get("mma_sync") or {}).get(kind)
    if not rates or not warps_per_sm:
        return None
    measured = sorted(int(w) for w in rates)
    below = [w for w in measured if w <= warps_per_sm]
    w = below[-1] if below else measured[0]
    return rates[str(w)], w


def measure_ceilings(device: torch.device, quick: bool) -> dict:
    """Copy bandwidth, bf16 matmul rate and (GPU) read-only bandwidth and register-operand mma.sync ceilings,
    measured now on ``device``."""
    if device.type == "cuda":
        copy_n = 2**28 if quick else 2**30
        mm_n = 4096 if quick else 8192
    else:
        copy_n, mm_n = 2**24, 256
    reps = 20 if device.type == "cuda" else 3
    out = {
        "copy_bytes": copy_n,
        "copy_gbps": copy_bandwidth(device, copy_n, reps) / 1e9,
        "matmul_n": mm_n,
        "matmul_tflops": matmul_rate(device, mm_n, reps) / 1e12,
        "read_gbps": None,
        "l2_bytes": l2_bytes(device) or None,
    }
    if device.type == "cuda":
        r = read_bandwidth(device, 2 * copy_n)
        out["read_gbps"] = r / 1e9 if r else None
    out["mma_sync"] = mma_rates(device, quick)
    return out
