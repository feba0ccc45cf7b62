"""A roofline model of ``bench serve``'s cases on a GPU we did not run on: the bytes and flops of one forward's
indexer logits (every C4 layer) against that GPU's DRAM bandwidth and tensor-core rate. A model, not a
measurement: it counts each request's keys read once per layer (the grouped routes; stock SGLang's one row per
token reads a verify request's keys next_n times) and leaves out the store, the schedule, top-k, launch gaps and
L2 hits (sm_120's 128 MB L2 holds a small batch's keys)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from cupy_dsa.layouts import BYTES_PER_TOKEN, HEAD_DIM, N_HEADS, PAGE_SLOTS

from .bytes import C4_RATIO


@dataclass(frozen=True)
class GpuModel:
    name: str
    dram_bytes_per_s: float
    bf16_flops: float           # dense bf16 tensor-core rate a large matmul reaches
    fp8_flops: float            # the same for fp8 (stock's keys on fp8 tensor cores)
    source: str


RTX_PRO_6000 = GpuModel(
    "RTX PRO 6000 Blackwell (sm_120, 188 SMs)", 1.792e12, 417e12, 610e12,
    "1,792 GB/s: the spec sheet's 512-bit GDDR7 at 28 Gbps; 417 TFLOP/s bf16: torch's bf16 matmul at 8192^3 on the "
    "Server Edition as a third party reported it (github.com/zzc0721/torch-performance-test-data issue 162; 350 on "
    "the Workstation Edition, issue 160); 610 TFLOP/s fp8: ASSUMED, about 1.5x that bf16 rate, as block-scaled fp8 "
    "GEMMs on this GPU class are reported to run; this project has not run on this GPU, and the model scales with "
    "these rates")


def case_work(case, layout: str) -> tuple[float, float]:
    """(key bytes, flops) of one C4 layer's logits for a ``bench serve`` case: every request's keys read once,
    2 * 64 heads * 128 per (row, visible entry)."""
    per_entry = BYTES_PER_TOKEN[layout]
    if case.phase == "prefill":
        entries = (case.context + case.chunk) // C4_RATIO
        seen = sum((case.context + i + 1) // C4_RATIO for i in range(case.chunk))
        rows_entries = seen
        key_bytes = math.ceil(entries / PAGE_SLOTS) * PAGE_SLOTS * per_entry
    else:
        entries = (case.context + case.next_n) // C4_RATIO
        rows_entries = case.batch * case.next_n * entries
        key_bytes = case.batch * math.ceil(entries / PAGE_SLOTS) * PAGE_SLOTS * per_entry
    return float(key_bytes), 2.0 * N_HEADS * HEAD_DIM * rows_entries


def model_rows(case_list, n_c4: int, gpu: GpuModel = RTX_PRO_6000) -> list[dict]:
    """Per case, per step over ``n_c4`` layers: bytes, flops, and the modelled ms of bf16 keys (bf16 mma) and of
    fp8 keys (on fp8 tensor cores and, as cupy_dsa's fp8-key kernels run, on bf16-rate mma)."""
    from .serve import case_label

    out = []
    for c in case_list:
        b16, flops = case_work(c, "bf16")
        b8, _ = case_work(c, "fp8")
        t16 = n_c4 * max(b16 / gpu.dram_bytes_per_s, flops / gpu.bf16_flops)
        t8 = n_c4 * max(b8 / gpu.dram_bytes_per_s, flops / gpu.fp8_flops)
        t8_bf16_rate = n_c4 * max(b8 / gpu.dram_bytes_per_s, flops / gpu.bf16_flops)
        out.append({"case": case_label(c), "bf16_mb": n_c4 * b16 / 1e6, "fp8_mb": n_c4 * b8 / 1e6,
                    "gflop": n_c4 * flops / 1e9, "bf16_ms": 1e3 * t16, "fp8_ms": 1e3 * t8,
                    "fp8_bf16_rate_ms": 1e3 * t8_bf16_rate,
                    "bf16_bound": "read" if b16 / gpu.dram_bytes_per_s >= flops / gpu.bf16_flops else "matmul",
                    "ratio": t16 / t8})
    return out


def markdown(rows: list[dict], gpu: GpuModel, model_name: str, n_c4: int) -> str:
    lines = [f"Roofline MODEL (not a measurement) of one step's indexer logits on the {gpu.name}, {model_name}, "
             f"{n_c4} C4 layers: keys read once per layer, {gpu.dram_bytes_per_s / 1e9:,.0f} GB/s, bf16 "
             f"{gpu.bf16_flops / 1e12:.0f} TFLOP/s, fp8 {gpu.fp8_flops / 1e12:.0f} TFLOP/s ({gpu.source}).",
             "",
             "| case | bf16 keys MB | fp8 keys MB | GFLOP | bf16 ms (bound) | fp8 ms | fp8 ms at the bf16 rate | "
             "bf16 / fp8 |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['bf16_mb']:,.0f} | {r['fp8_mb']:,.0f} | {r['gflop']:,.0f} | "
                     f"{r['bf16_ms']:.2f} ({r['bf16_bound']}) | {r['fp8_ms']:.2f} | {r['fp8_bf16_rate_ms']:.2f} | "
                     f"{r['ratio']:.2f}x |")
    return "\n".join(lines)


README_BATCH = 64  # the batch of the H200 cost table (`bench serve --batch 64`), so the two read side by side


def readme_block() -> str:
    """The README's model table: V4-Flash, batch 64 (the H200 cost table's) decode and verify next_n 4 at 8K / 32K
    / 128K tokens, prefill chunks of 4,096 and 16,384 tokens (``bench serve``'s cases; ``bench serve`` prints the
    model of any case)."""
    from .models import BUILTIN
    from .serve import cases

    model = BUILTIN["v4-flash"]
    ctx = (8192, 32768, 131072)
    case_list = [c for c in cases(README_BATCH, ctx, 1, 4096) if c.phase == "decode"]
    case_list += [c for c in cases(README_BATCH, ctx, 4, 4096) if c.phase == "verify"]
    case_list += [c for chunk in (4096, 16384) for c in cases(1, ctx, 1, chunk) if c.phase == "prefill"]
    return markdown(model_rows(case_list, model.n_c4), RTX_PRO_6000, model.name, model.n_c4)
