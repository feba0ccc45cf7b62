"""What one C4 layer's indexer allocates for a prefill chunk, per mode, against stock SGLang 0.5.23's route for the
same step (an analytic model: ``scripts/gpu_prefill_memory.py`` measures the plugin's side on a GPU), and what a
request's index keys take. SGLang #35201: one 800K-token request ran out of memory in the C4 logits of a long prefill.

The step: ``rows`` new tokens of one request (a prefill chunk, SGLang's default 8192) that see up to ``entries`` index
entries (tokens / 4). Counted: the query the logits read, the fp32 logits block (the largest buffer), the keys
SGLang's non-paged route gathers, fp8-rescore's candidate buffers, the top-k outputs. Not counted: buffers of a few
KiB (plans, lengths) and what every mode shares outside the indexer.

* **Stock SGLang** (``SGLANG_OPT_DSV4_NONPAGED_INDEXER``, a single eager request of >= 8192 rows): it gathers the
  request's fp8 keys (132 B per entry) and computes ``[rows, ceil64(entries)]`` fp32 logits, in row chunks only when
  its free-memory budget plans them (its DeepGEMM route; none on the torch route sm_120 defaults to).
* **The plugin**: the keys are read in place (no gather); the logits in SGLang's row chunks where it plans them,
  otherwise in chunks of at most ``SGLANG_CUPY_DSA_LOGITS_BUDGET_MIB`` (default 2048 MiB).
"""

from __future__ import annotations

from .. import layouts
from .modes import DEFAULT_LOGITS_BUDGET_MIB, MODE_RECORDS

HEADS, HEAD_DIM = 64, layouts.HEAD_DIM
FP8_ENTRY_BYTES = layouts.FP8_BYTES_PER_TOKEN   # 132: SGLang's fp8 key + its scale
K_PRIME_MULTIPLE = 4                             # fp8-rescore's default K' = 4 x index_topk


def _ceil64(n: int) -> int:
    return (n + 63) // 64 * 64


def query_bytes(query: str, rows: int) -> int:
    """The query and head weights the logits read: fp8 q + fp32 weights (q's scale folded in), or a bf16 q (the bf16
    and fp4sim settings: ``prepare_index_q`` returns bf16) + fp32 weights."""
    per_row = HEADS * HEAD_DIM * (1 if query == "fp8" else 2) + HEADS * 4
    return rows * per_row


def chunk_rows(rows: int, width: int, budget_bytes: int, sglang_rows_per_chunk: int | None = None) -> int:
    """Rows per logits block: SGLang's ``rows_per_chunk`` when it plans one, else the budget's (core.row_chunks)."""
    if sglang_rows_per_chunk is not None:
        return min(rows, sglang_rows_per_chunk)
    row_bytes = _ceil64(width) * 4
    return min(rows, max(1, budget_bytes // row_bytes))


def prefill_step(mode: str, *, rows: int = 8192, entries: int = 200_000, index_topk: int = 512,
                 budget_mib: int = DEFAULT_LOGITS_BUDGET_MIB, sglang_rows_per_chunk: int | None = None) -> dict:
    """Bytes one C4 layer's indexer holds at its peak for the step, by buffer, and ``"total"``. ``mode`` ``"fp8"`` is
    stock SGLang's route (its logits unchunked unless ``sglang_rows_per_chunk`` is given)."""
    rec = MODE_RECORDS[mode]
    width = _ceil64(entries)
    out = {"top-k outputs": rows * index_topk * 4 * 2}   # page indices + raw positions, int32
    if not rec.hooked:
        rc = rows if sglang_rows_per_chunk is None else min(rows, sglang_rows_per_chunk)
        out.update({"query": query_bytes("fp8", rows), "gathered keys": entries * FP8_ENTRY_BYTES,
                    "logits": rc * width * 4})
    else:
        rc = chunk_rows(rows, width, budget_mib << 20, sglang_rows_per_chunk)
        out["query"] = query_bytes("fp8", rows) if rec.two_level else query_bytes(rec.query, rows)
        if rec.two_level:   # stage 2's query (the default bf16 setting) beside stage 1's fp8 one
            out["query"] += query_bytes(rec.query, rows)
            k_prime = min(width, K_PRIME_MULTIPLE * index_topk)
            out["candidates"] = rc * k_prime * 8 * 2   # candidate positions + their stage-2 keys, int64
        out["logits"] = rc * width * 4
    out["logits rows per chunk"] = rc
    out["total"] = sum(v for k, v in out.items() if k != "logits rows per chunk")
    return out


def index_key_bytes(mode: str, tokens: int, n_c4: int) -> int:
    """Index keys of one request of ``tokens`` tokens over ``n_c4`` C4 layers (one entry per 4 tokens)."""
    return n_c4 * (tokens // 4) * MODE_RECORDS[mode].bytes_per_entry


def memory_table(*, tokens: int = 1 << 20, n_c4: int = 21, rows: int = 8192, index_topk: int = 512,
                 budget_mib: int = DEFAULT_LOGITS_BUDGET_MIB) -> str:
    """Markdown: per mode, a ``tokens``-token request's index keys and the prefill step's peak per C4 layer (a chunk of
    ``rows`` rows seeing the whole request)."""
    gib = float(1 << 30)
    lines = [f"| mode | index keys, one {tokens / (1 << 20):g}M-token request ({n_c4} C4 layers) | one C4 layer's "
             f"prefill step, {rows} rows after {tokens / (1 << 20):g}M tokens: peak (logits block) |", "|---|---|---|"]
    for mode in MODE_RECORDS:
        step = prefill_step(mode, rows=rows, entries=tokens // 4, index_topk=index_topk, budget_mib=budget_mib)
        who = "stock SGLang, logits unchunked" if mode == "fp8" else f"{step['logits rows per chunk']}-row chunks"
        lines.append(f"| `{mode}` | {index_key_bytes(mode, tokens, n_c4) / gib:.2f} GiB | {step['total'] / gib:.2f} "
                     f"GiB ({step['logits'] / gib:.2f} GiB, {who}) |")
    return "\n".join(lines)


__all__ = ["prefill_step", "index_key_bytes", "memory_table", "query_bytes", "chunk_rows"]
