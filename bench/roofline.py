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
from .provenance import commit_label


@dataclass(frozen=True)
class GpuModel:
    name: str
    dram_bytes_per_s: float
    bf16_flops: float           # dense bf16 tensor-core rate a large matmul reaches
    fp8_flops: float            # the same for fp8 (stock's keys on fp8 tensor cores)
    source: str


RTX_PRO_6000 = GpuModel(
    "RTX PRO 6000 Blackwell (sm_120, 188 SMs)", 1.792e12, 504e12, 1.01e15,
    "the spec sheet's dense rates at 2,617 MHz and its 512-bit GDDR7 at 28 Gbps; third parties measured torch's bf16 "
    "GEMM at 417 TFLOP/s on the Server Edition (github.com/zzc0721/torch-performance-test-data issue 162; 350-368 on "
    "the Workstation Edition, issue 160) and cuBLAS MXFP8 at 609-619 (Dao-AILab/quack issue 153); this project has "
    "not run on this GPU, and the model scales with these rates")

# The step kinds' cases in `bench variants --emulate sm_120` whose product-config share of the roofline the README
# model carries to sm_120: decode of the read time, verify and prefill of max(read, flops at the register-operand
# bf16 mma.sync ceiling measured in the same run).
EMULATED_SHARE_CASES = {"decode": ("decode", "64 x 32K, next_n 1"), "verify": ("verify", "64 x 32K, next_n 4"),
                        "prefill": ("prefill", "4K x 64K causal")}


def measured_shares(emulation: dict) -> dict[str, float]:
    """Per step kind, the share (0-1) of its roofline that sm_120's product config reached in an emulation run
    (``bench variants --emulate sm_120``'s JSON). ValueError naming the case where the run lacks it or predates the
    mma.sync ceiling."""
    rows = {(r["op"], r["case"]): r for r in emulation.get("rows") or []
            if r.get("product") and r.get("target") == "sm_120"}
    shares = {}
    for phase, key in EMULATED_SHARE_CASES.items():
        r = rows.get(key)
        if r is None or r.get("pct_mma_roofline") is None:
            raise ValueError(f"emulation: no sm_120 product row for {key[0]} {key[1]} with the mma.sync ceiling "
                             "(a `bench variants --emulate sm_120` run of this version has one)")
        shares[phase] = r["pct_mma_roofline"] / 100.0
    return shares


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


def model_rows(case_list, n_c4: int, gpu: GpuModel = RTX_PRO_6000, shares: dict | None = None) -> list[dict]:
    """Per case, per step over ``n_c4`` layers: bytes, flops, and the modelled ms of bf16 keys (bf16 mma) and of
    fp8 keys (on fp8 tensor cores and, as cupy_dsa's fp8-key kernels run, on bf16-rate mma). With ``shares``
    (:func:`measured_shares`): bf16 keys' time divided by the share of the roofline its kind reached."""
    from .serve import case_label

    out = []
    for c in case_list:
        b16, flops = case_work(c, "bf16")
        b8, _ = case_work(c, "fp8")
        t16 = n_c4 * max(b16 / gpu.dram_bytes_per_s, flops / gpu.bf16_flops)
        t8 = n_c4 * max(b8 / gpu.dram_bytes_per_s, flops / gpu.fp8_flops)
        t8_bf16_rate = n_c4 * max(b8 / gpu.dram_bytes_per_s, flops / gpu.bf16_flops)
        row = {"case": case_label(c), "bf16_mb": n_c4 * b16 / 1e6, "fp8_mb": n_c4 * b8 / 1e6,
               "gflop": n_c4 * flops / 1e9, "bf16_ms": 1e3 * t16, "fp8_ms": 1e3 * t8,
               "fp8_bf16_rate_ms": 1e3 * t8_bf16_rate,
               "bf16_bound": "read" if b16 / gpu.dram_bytes_per_s >= flops / gpu.bf16_flops else "matmul",
               "ratio": t16 / t8}
        if shares is not None:
            row["share"] = shares[c.phase]
            row["bf16_share_ms"] = 1e3 * t16 / shares[c.phase]
        out.append(row)
    return out


def markdown(rows: list[dict], gpu: GpuModel, model_name: str, n_c4: int, shares_from: str | None = None) -> str:
    """The model's table; ``shares_from`` (the emulation run's words) adds the column of the measured shares."""
    measured = shares_from is not None and all("bf16_share_ms" in r for r in rows)
    lines = [f"Roofline MODEL (not a measurement) of one step's indexer logits on the {gpu.name}, {model_name}, "
             f"{n_c4} C4 layers: keys read once per layer, {gpu.dram_bytes_per_s / 1e9:,.0f} GB/s, bf16 "
             f"{gpu.bf16_flops / 1e12:.0f} TFLOP/s, fp8 {gpu.fp8_flops / 1e12:,.0f} TFLOP/s ({gpu.source})."]
    if measured:
        lines += ["", "bf16 ms at the measured share: the bf16 time divided by the share of its roofline that sm_120's "
                  f"product config of the same step kind reached in {shares_from} (decode: of the read time; verify "
                  "and prefill: of max(read, flops at the register-operand bf16 mma.sync ceiling of that run)), "
                  "taking sm_120's bf16 mma.sync ceiling to be its published rate."]
    lines += ["",
              "| case | bf16 keys MB | fp8 keys MB | GFLOP | bf16 ms (bound) | "
              + ("bf16 ms at the measured share | " if measured else "") + "fp8 ms | fp8 ms at the bf16 rate | "
              "bf16 / fp8 |",
              "|---|---|---|---|---|" + ("---|" if measured else "") + "---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['bf16_mb']:,.0f} | {r['fp8_mb']:,.0f} | {r['gflop']:,.0f} | "
                     f"{r['bf16_ms']:.2f} ({r['bf16_bound']}) | "
                     + (f"{r['bf16_share_ms']:.2f} ({100 * r['share']:.0f}%) | " if measured else "")
                     + f"{r['fp8_ms']:.2f} | {r['fp8_bf16_rate_ms']:.2f} | {r['ratio']:.2f}x |")
    return "\n".join(lines)


README_BATCH = 64  # the batch of the H200 cost table (`bench serve --batch 64`), so the two read side by side


def readme_block(emulation: dict) -> str:
    """The README's model table: V4-Flash, batch 64 (the H200 cost table's) decode and verify next_n 4 at 8K / 32K
    / 128K tokens, prefill chunks of 4,096 and 16,384 tokens (``bench serve``'s cases; ``bench serve`` prints the
    model of any case), with the shares measured in ``emulation`` (a ``bench variants --emulate sm_120`` JSON)."""
    from .models import BUILTIN
    from .serve import cases

    model = BUILTIN["v4-flash"]
    ctx = (8192, 32768, 131072)
    case_list = [c for c in cases(README_BATCH, ctx, 1, 4096) if c.phase == "decode"]
    case_list += [c for c in cases(README_BATCH, ctx, 4, 4096) if c.phase == "verify"]
    case_list += [c for chunk in (4096, 16384) for c in cases(1, ctx, 1, chunk) if c.phase == "prefill"]
    shares = measured_shares(emulation)
    run = (f"`bench variants --emulate sm_120` on an {emulation.get('device', 'unknown GPU')} at commit "
           f"{commit_label(emulation, 'unknown')}")
    return markdown(model_rows(case_list, model.n_c4, shares=shares), RTX_PRO_6000, model.name, model.n_c4,
                    shares_from=run)
