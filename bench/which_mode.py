"""The README's "Which mode" table (``<!-- model:modes -->``): per mode of the plugin, what it costs (index bytes per
token, the indexer's decode step against stock SGLang's) and what it keeps (recall of the exact top-k on the needle
suite), each figure read from a committed result, with the advice those figures give and the runs they come from.
Rendered from the files, never typed: ``python -m cupy_dsa.bench.which_mode`` rewrites the block (the GPU suite's
re-measure mode runs it after the runs it re-renders); tests/test_readme_blocks.py holds the README to it."""

from __future__ import annotations

import json
import re
from pathlib import Path

from . import bytes as bytes_mod
from .provenance import commit_label
from .readme import STALE_MARK, kernel_changes_since

RESULTS = Path(__file__).resolve().parent / "results"
SOURCES = {"serve": "h200-serve.json", "rescore": "h200-serve-rescore.json", "recall": "h200-recall.json"}
BLOCK = re.compile(r"(<!-- model:modes -->\n).*?(<!-- /model:modes -->)", re.S)

# mode -> (index-key layout of bench bytes, the recall suite's format with the mode's default numerics, the serve
# run's column (top-k excluded), the serve-rescore run's column (top-k included))
MODES = {
    "fp8": ("fp8", "fp8", "fp8_ms", "fp8_topk_ms"),
    "bf16": ("bf16", "bf16", "bf16_ms", "bf16_topk_ms"),
    "bf16-fp4sim": ("bf16-fp4sim", "bf16-fp4sim", None, None),
    "bf16-reference": ("bf16-fp4sim", "bf16-reference", None, None),
    "fp8-cupy": ("fp8", "fp8", "fp8_cupy_ms", None),
    "fp8-rescore": ("fp8-rescore", "fp8-rescore-4x-bf16q", None, "fp8_rescore_dg_ms"),
}
NOT_TIMED = {"bf16-fp4sim": "as `bf16` (the same kernels; the store rounds differently)",
             "bf16-reference": "not timed (its query is built in the step)",
             "fp8-rescore": "— (it replaces the top-k: next column)"}
SERVE_STEP = ("decode", 32768)      # batch x 32K, top-k excluded
RESCORE_STEP = ("decode", 98304)    # 48 x 96K, top-k included
RECALL_K = 512


def _load(results: Path) -> dict:
    return {key: json.loads((results / name).read_text()) for key, name in SOURCES.items()}


def _row(doc, phase, context):
    return next(r for r in doc["timings"] if r["phase"] == phase and r["context"] == context)


def _recall(doc):
    rows = [r for r in doc["recall"] if "needle_rate" in r and not r.get("error")]
    ctx = max(r["context_tokens"] for r in rows)
    return ctx, {r["format"]: r["recall_mean"] for r in rows if r["context_tokens"] == ctx and r["k"] == RECALL_K}


def _ratio(row, key, base):
    value = row.get(key) if key else None
    return None if value is None or not row.get(base) else value / row[base]


def _source(name, doc) -> str:
    return f"`{name}` ({doc['device']}, commit `{commit_label(doc)}`, {doc['date'][:10]})"


def _stale_line(docs: dict) -> str:
    """One stale line for the runs measured before a later kernel commit ('' when none; where git cannot tell, the
    run is left out)."""
    old = []
    for key, doc in docs.items():
        since = kernel_changes_since(doc["git_commit"]) if doc.get("git_commit") else None
        if since and since[0]:
            old.append(f"`{SOURCES[key]}` {since[0]} kernel commit{'s' if since[0] > 1 else ''} ago")
    if not old:
        return ""
    return (f"\n\n{STALE_MARK} measured before later kernel commits ({'; '.join(old)}): these figures are those "
            "commits' until a GPU run re-measures them (`MEASURE_ALL=1 bash scripts/run_gpu_suite.sh`).")


def render(results: Path = RESULTS) -> str:
    docs = _load(results)
    bytes_rows = {r["layout"]: r for r in bytes_mod.rows() if r["model"] == "DeepSeek-V4-Flash"}
    serve = _row(docs["serve"], *SERVE_STEP)
    rescore = _row(docs["rescore"], *RESCORE_STEP)
    recall_ctx, recall = _recall(docs["recall"])
    fp8_bytes = bytes_rows["fp8"]["index_bytes_per_token"]
    serve_step = f"{serve['batch']} x {SERVE_STEP[1] // 1024}K"
    rescore_step = f"{rescore['batch']} x {RESCORE_STEP[1] // 1024}K"
    lines = [f"| mode | index keys, B per token (vs `fp8`) | cost: decode {serve_step}, top-k excluded, vs `fp8` "
             f"| cost: decode {rescore_step}, top-k included, vs `fp8` + top-k | fidelity: exact top-{RECALL_K} kept "
             f"at {recall_ctx // 2**20}M tokens (needle suite) |", "|---|---|---|---|---|"]
    figures = {}
    for mode, (layout, fmt, serve_key, rescore_key) in MODES.items():
        b = bytes_rows[layout]["index_bytes_per_token"]
        cost = _ratio(serve, serve_key, "fp8_ms")
        cost_k = _ratio(rescore, rescore_key, "fp8_topk_ms")
        figures[mode] = (cost, cost_k, recall.get(fmt))
        lines.append(f"| `{mode}` | {b:,.0f} ({b / fp8_bytes:.2f}x) | "
                     f"{f'{cost:.2f}x' if cost is not None else NOT_TIMED.get(mode, '—')} | "
                     f"{f'{cost_k:.2f}x' if cost_k is not None else '—'} | "
                     f"{f'{100 * recall[fmt]:.1f}%' if fmt in recall else '—'} |")
    lines += ["", _advice(figures), "",
              f"Cost: {_source(SOURCES['serve'], docs['serve'])} and {_source(SOURCES['rescore'], docs['rescore'])} "
              f"(`fp8-rescore` with SGLang's stage 1, its default); fidelity: {_source(SOURCES['recall'], docs['recall'])}"
              " (synthetic keys, a stress test of the formats, not a model's accuracy); bytes: `cupy-dsa bench bytes`, "
              "DeepSeek-V4-Flash's 21 C4 layers. The recall suite scores fp8 keys with cupy_dsa's fp8 kernels, so `fp8` and "
              "`fp8-cupy` share its figure (SGLang's own fp8 store and DeepGEMM did not run in it)."]
    return "\n".join(lines) + _stale_line(docs)


def _advice(figures: dict) -> str:
    """What the figures say, in the order an operator asks: the cheapest mode, the one that keeps most, and where
    `bf16` stands; every figure and every ranking from the table above (a mode's step cost: with the top-k where it
    was timed so, else without)."""
    kept = {m: f[2] for m, f in figures.items() if f[2] is not None}
    step = {m: (f[1] if f[1] is not None else f[0]) for m, f in figures.items()}
    step = {m: c for m, c in step.items() if c is not None}
    cheapest = min(step, key=step.get)
    best = max(kept, key=kept.get)
    bf16 = figures["bf16"]
    off = ", the switch off (stock SGLang)," if cheapest == "fp8" else ""
    text = (f"The cheapest mode is `{cheapest}`{off} which keeps {100 * kept[cheapest]:.1f}% of the exact top-k. "
            f"`{best}` keeps the most ({100 * kept[best]:.1f}%) at {step[best]:.2f}x the stock step"
            f"{' with its top-k' if figures[best][1] is not None else ''}.")
    if "bf16" not in (cheapest, best):
        text += (f" `bf16` keeps {100 * bf16[2]:.1f}% for {bf16[0]:.2f}x the stock indexer step"
                 + (f" ({bf16[1]:.2f}x with the top-k)." if bf16[1] is not None else "."))
    return text + (" Whether a served model gains from what a mode keeps is not measured: compare them on your "
                   "server with `cupy-dsa needle`.")


def rewrite(readme: Path) -> bool:
    """Re-render the block of ``readme``; whether it changed."""
    text = readme.read_text()
    if not BLOCK.search(text):
        raise ValueError(f"{readme}: no <!-- model:modes --> block")
    new = BLOCK.sub(lambda m: m[1] + render() + "\n" + m[2], text)
    if new != text:
        readme.write_text(new)
    return new != text


if __name__ == "__main__":
    import sys

    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "README.md"
    print(f"{target}: {'rewrote' if rewrite(target) else 'unchanged'} model:modes")
