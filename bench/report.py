"""Rendering a results document: rich tables fitted to the console and the markdown headline table
(the plots: :mod:`.plots`; the README blocks: :mod:`.readme`; schema and provenance: :mod:`.provenance`)."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text

from .bytes import memory_text
from .provenance import commit_text

# --------------------------------------------------------------------------------------------------
# formatting helpers
# --------------------------------------------------------------------------------------------------

def _f(x, fmt="{:.1f}", none="—"):
    return none if x is None else fmt.format(x)


def _pct(x):
    return "—" if x is None else f"{100 * x:.1f}%"


def _num(x, decimals=0):
    """A rate with ``decimals`` decimals, or three significant digits where that would print fewer (CPU
    rates are small: never '0')."""
    if x is None:
        return "—"
    return f"{x:.{decimals}f}" if abs(x) >= 10 ** (2 - decimals) else f"{x:.3g}"


def _si(n):
    n = int(n)
    for unit, div in (("M", 2**20), ("K", 2**10)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return str(n)


def _verdict(row):
    v = row.get("verdict")
    if v is None:
        return "—"
    return "[green]pass[/]" if v == "pass" else "[red]miss[/]"


def _target_pct(t):
    return "—" if t is None else f">={100 * t:.0f}%"


# --------------------------------------------------------------------------------------------------
# fitting a table to the console
# --------------------------------------------------------------------------------------------------

EMPTY_CELLS = ("", "—")


def _plain(cell) -> str:
    return Text.from_markup(cell).plain.strip() if isinstance(cell, str) else str(cell)


def _table_of(table: Table, columns, title, caption=None) -> Table:
    """A table of some of ``table``'s columns, with its rows and section breaks."""
    t = Table(title=title, caption=caption)
    for c in columns:
        t.add_column(c.header, justify=c.justify)
    cells = [list(c.cells) for c in columns]
    for i, row in enumerate(table.rows):
        t.add_row(*(col[i] for col in cells), end_section=row.end_section)
    return t


def fitted(console, table: Table, keys: int = 1) -> list[Table]:
    """``table`` as it fits ``console``'s width: the columns empty in every row are dropped (the caption names
    them); if it is still wider than the console, it is split into parts that each repeat the first ``keys``
    columns (what identifies a row), the others in their order, so the first part holds the most telling."""
    columns = list(table.columns)
    if not table.rows:
        return [table]
    shown = [c for i, c in enumerate(columns) if i < keys or any(_plain(x) not in EMPTY_CELLS for x in c.cells)]
    hidden = [str(c.header) for c in columns if c not in shown]
    caption = f"not shown (empty in every row): {', '.join(hidden)}" if hidden else None
    unbounded = console.options.update(max_width=1 << 20)

    def fits(t):
        return console.measure(t, options=unbounded).maximum <= console.width

    whole = _table_of(table, shown, table.title, caption)
    if len(shown) <= keys + 1 or fits(whole):
        return [whole]
    key_columns, parts = shown[:keys], [[]]
    for c in shown[keys:]:
        if parts[-1] and not fits(_table_of(table, key_columns + parts[-1] + [c], table.title)):
            parts.append([])
        parts[-1].append(c)
    return [_table_of(table, key_columns + part, f"{table.title} ({i + 1}/{len(parts)})",
                      caption if i == len(parts) - 1 else None) for i, part in enumerate(parts)]


def print_fitted(console, table: Table, keys: int = 1) -> None:
    for t in fitted(console, table, keys):
        console.print(t)


# --------------------------------------------------------------------------------------------------
# rich tables
# --------------------------------------------------------------------------------------------------

CPU_NO_RATIOS = ("CPU backend: no ceilings are measured and no ratios to them (% of copy / read / matmul, "
                 "targets) are printed: the ops run their torch references, which are test oracles, not tuned "
                 "code, so a ratio to the CPU's copy or matmul rate would mean nothing. GB/s and TFLOP/s only show "
                 "that the pipeline runs; performance figures come from a GPU run.")


def ceilings_table(doc) -> Table:
    c = doc["ceilings"]
    if doc.get("backend") == "cpu" and not c.get("copy_gbps"):
        t = Table(title=f"Ceilings ({doc['device']}, backend cpu)")
        t.add_column("not measured on the CPU backend")
        t.add_row("ratios to ceilings are GPU figures; see the note below")
        return t
    t = Table(title=f"Ceilings measured in this run ({doc['device']}, backend {doc['backend']})")
    mma = c.get("mma_sync") or {}
    for col in ("d2d copy (read+write)", "read-only stream", "bf16 matmul", "L2") + (
            ("mma.sync bf16 / e4m3 (TFLOP/s at 4/8/16 warps per SM)",) if mma.get("bf16") else ()):
        t.add_column(col, justify="right")

    def rates(r):
        return "/".join(f"{r[w]:.0f}" for w in sorted(r, key=int)) if r else "not native"

    t.add_row(
        f"{_f(c.get('copy_gbps'), '{:.0f}')} GB/s" + (f" ({c['copy_bytes'] / 2**20:.0f} MiB)" if c.get("copy_bytes") else ""),
        f"{_f(c.get('read_gbps'), '{:.0f}')} GB/s",
        f"{_f(c.get('matmul_tflops'), '{:.3g}')} TFLOP/s" + (f" ({c['matmul_n']}^3)" if c.get("matmul_n") else ""),
        "—" if not c.get("l2_bytes") else f"{c['l2_bytes'] / 2**20:.0f} MiB",
        *((f"{rates(mma['bf16'])} / {rates(mma.get('e4m3'))}",) if mma.get("bf16") else ()))
    return t


def bytes_table(doc) -> Table:
    t = Table(title=f"Index-key bytes and capacity ({memory_text(doc)} of KV memory)")
    for col in ("model", "index keys", "B/entry", "idx B/tok/layer", "idx layers", "idx B/tok",
                "main KV B/tok", "total B/tok", "idx share", "tokens fit", "tokens fit vs fp8"):
        t.add_column(col, justify="right" if col not in ("model", "index keys") else "left")
    for r in doc["bytes"]:
        model = r["model"].replace("DeepSeek-", "") + (" (assumed)" if r["assumed"] else "")
        t.add_row(model, r["layout"], str(r["bytes_per_entry"]), f"{r['index_bytes_per_token_per_layer']:g}",
                  str(r["index_layers"]), f"{r['index_bytes_per_token']:,.0f}",
                  f"{r['main_kv_bytes_per_token']:,.0f}", f"{r['total_kv_bytes_per_token']:,.0f}",
                  _pct(r["index_share"]), f"{r['tokens_fit'] / 1e6:,.2f}M", f"{r['tokens_fit_vs_fp8']:.3f}x")
    return t


def store_table(doc) -> Table:
    t = Table(title="store_index_k (fused norm/RoPE/Hadamard/store)")
    for col in ("N tokens", "layout", "numerics", "kv", "time", "tokens/s", "GB/s", "% copy", "target",
                "result"):
        t.add_column(col, justify="right")
    for r in doc["store"]:
        if r.get("error"):
            t.add_row(_si(r["n_tokens"]), r["layout"], r["numerics"], r["kv_dtype"], f"[red]{r['error'][:60]}[/]",
                      "", "", "", "", "")
            continue
        t.add_row(_si(r["n_tokens"]), r["layout"], r["numerics"], r["kv_dtype"], f"{r['time_us']:.1f} us",
                  f"{_num(r['tokens_per_s'] / 1e9, 2)} G", _num(r["gbps"]), _pct(r["pct_copy"]),
                  _target_pct(r.get("target_pct_copy")), _verdict(r))
    return t


def query_table(doc) -> Table:
    t = Table(title="prepare_index_q (RoPE/Hadamard/fp4sim or fp8 indexer query)")
    for col in ("T tokens", "numerics", "time", "GB/s", "% read"):
        t.add_column(col, justify="right")
    for r in doc.get("query", []):
        if r.get("error"):
            t.add_row(_si(r["n_tokens"]), r["numerics"], f"[red]{r['error'][:60]}[/]", "", "")
            continue
        t.add_row(_si(r["n_tokens"]), r["numerics"], f"{r['time_us']:.1f} us", _num(r["gbps"]), _pct(r["pct_read"]))
    return t


DECODE_KEYS = 4  # batch, next_n, layout, q: what identifies a decode row


def _gpu_ratio(doc, value, fmt) -> str:
    """A ratio of two timings of this run; on the CPU backend a dash: the torch reference's timings say that the
    pipeline runs, and their ratios (a layout 20x another) would read as GPU costs."""
    return "—" if doc.get("backend") == "cpu" else _f(value, fmt)


def decode_table(doc) -> Table:
    t = Table(title="paged_mqa_logits, decode (context in index entries per request, one per 4 raw tokens of a "
                    "C4 layer; `bench serve` counts raw tokens; width = max_context_len)")
    for col in ("batch", "next_n", "layout", "q", "time", "% read", "target", "result", "DeepGEMM", "ours/DG",
                "time vs fp8", "entries", "key GB/s", "plan", "DG rel L2", "torch", "speed-up", "mem ours"):
        t.add_column(col, justify="right")
    for r in doc["logits"]:
        if r.get("mode") != "decode":
            continue
        head = (r.get("batch_name", f"{r['batch']} x {_si(r['context'])}"), str(r["next_n"]), r["layout"],
                r["q_dtype"])
        if r.get("error"):
            t.add_row(*head, f"[red]{r['error'][:60]}[/]", *[""] * 13)
            continue
        target = _target_pct(r.get("target_pct_read")) if r.get("target_pct_read") else (
            f"<={r['target_us']:g} us" if r.get("target_us") else "—")
        if r.get("target_vs_fp8_query"):
            target = f"{r['vs_fp8_query']:.3f}x fp8 q, <= {r['target_vs_fp8_query']:.2f}x"
        t.add_row(*head, f"{r['time_us']:.1f} us", _pct(r.get("pct_read")), target, _verdict(r),
                  _f(r.get("deepgemm_us"), "{:.1f} us"), _f(r.get("vs_deepgemm"), "{:.2f}x"),
                  _gpu_ratio(doc, r.get("time_vs_fp8"), "{:.2f}x"), _si(r.get("entries", 0)),
                  _num(r.get("key_gbps")), _f(r.get("plan_us"), "{:.1f} us"), _f(r.get("deepgemm_rel_l2"), "{:.1e}"),
                  _f(r.get("torch_time_us"), "{:.0f} us"), _gpu_ratio(doc, r.get("speedup_vs_torch"), "{:.1f}x"),
                  _f(r.get("peak_extra_mb"), "{:.1f} MB"))
    return t


PREFILL_KEYS = 3  # T x S, kv, layout


def prefill_shape(r) -> str:
    """'4K x 64K', or '16K x 16K, fresh prompt' (no prefix, SGLang's ranges)."""
    return f"{_si(r['rows'])} x {_si(r['keys'])}" + (", fresh prompt" if r.get("prompt") == "fresh" else "")


def prefill_target(r) -> str:
    """The row's targets: % of the matmul, time over DeepGEMM's, over the contiguous keys' ('' when none)."""
    parts = [_target_pct(r["target_pct_matmul"]) if r.get("target_pct_matmul") else "",
             f"<= {r['target_vs_deepgemm']:.2f}x DG" if r.get("target_vs_deepgemm") else "",
             f"<= {r['target_vs_contiguous']:.2f}x contiguous" if r.get("target_vs_contiguous") else ""]
    return ", ".join(p for p in parts if p)


def prefill_table(doc) -> Table:
    t = Table(title="mqa_logits, prefill (causal: ks = 0, ke = S - T + i + 1; fresh prompt: S = T, SGLang's ranges; "
                    "ragged: several extend requests)")
    for col in ("T x S", "kv", "layout", "time", "% matmul", "target", "result", "DeepGEMM fp8", "ours/DG",
                "vs contig", "TFLOP/s", "mem ours"):
        t.add_column(col, justify="right")
    for r in doc["logits"]:
        if r.get("mode") != "prefill":
            continue
        shape = prefill_shape(r)
        if r.get("error"):
            t.add_row(shape, r["kv"], r["layout"], f"[red]{r['error'][:60]}[/]", *[""] * 8)
            continue
        dg = (f"{r['deepgemm_us'] / 1e3:.3f} ms" if r.get("deepgemm_us")
              else ("—" if r["kv"] == "paged" else (r.get("deepgemm_note") or "—")[:30]))
        target = prefill_target(r) or "—"
        t.add_row(shape, r["kv"], r["layout"], f"{r['time_us'] / 1e3:.3f} ms", _pct(r["pct_matmul"]), target,
                  _verdict(r), dg, _f(r.get("vs_deepgemm"), "{:.2f}x"), _gpu_ratio(doc, r.get("vs_contiguous"), "{:.3f}x"),
                  _num(r["tflops"], 1), _f(r.get("peak_extra_mb"), "{:.0f} MB"))
    return t


def route_target(r, dg_rows: str = "") -> str:
    """A verify / extend row's targets: time over DeepGEMM's rows (``dg_rows`` names them), share of the read
    stream, the roofline or the matmul ('' when none)."""
    parts = [f"<= {r['target_vs_deepgemm_rows']:.2f}x{dg_rows}" if r.get("target_vs_deepgemm_rows") else ""]
    parts += [f"{_target_pct(r[f'target_pct_{c}'])} of {c}" for c in ("read", "roofline", "matmul")
              if r.get(f"target_pct_{c}")]
    return ", ".join(p for p in parts if p)


def verify_extend_table(doc) -> Table:
    t = Table(title="MTP verify and multi-request extend: SGLang's rows vs grouped / varlen launches")
    for col in ("case", "n", "route", "time", "% read", "% roofline", "TFLOP/s", "% matmul", "DG rows",
                "ours/DG rows", "DG grouped", "target", "result"):
        t.add_column(col, justify="right")
    for r in doc["logits"]:
        if r.get("mode") not in ("verify", "extend"):
            continue
        head = (f"{r['mode']} {r['batch_name']}", str(r["next_n"]), r.get("route", "—"))
        if r.get("error"):
            t.add_row(*head, f"[red]{r['error'][:60]}[/]", *[""] * 9)
            continue
        tgt = route_target(r) or "—"
        if r.get("target_vs_fp8_query"):
            tgt = f"{r['vs_fp8_query']:.3f}x fp8 q, <= {r['target_vs_fp8_query']:.2f}x"
        t.add_row(*head, f"{r['time_us']:.1f} us", _pct(r.get("pct_read")), _pct(r.get("pct_roofline")),
                  _num(r.get("tflops"), 1) if r.get("tflops") else "—", _pct(r.get("pct_matmul")),
                  _f(r.get("deepgemm_rows_us"), "{:.1f} us"), _f(r.get("vs_deepgemm_rows"), "{:.2f}x"),
                  _f(r.get("deepgemm_grouped_us"), "{:.1f} us"), tgt, _verdict(r))
    return t


def _margin(m):
    return "—" if m is None else f"{100 * m:.3g}%"


def _recall_rows(doc):
    """Recall rows of the current schema (needle_rate per margin); older documents have none."""
    return [r for r in doc["recall"] if "needle_rate" in r]


def _recall_grid(rows):
    ctxs = sorted({r["context_tokens"] for r in rows})
    fmts = list(dict.fromkeys(r["format"] for r in rows))
    ks = sorted({r["k"] for r in rows})
    at = {(r["context_tokens"], r["k"], r["format"]): r for r in rows}
    return ctxs, fmts, ks, at


def _recall_context_table(doc, title: str, value: str, cell) -> Table:
    """One row per (k, format), one column per context: ``cell(row)`` where the row has ``value``, else
    'err' (the row failed) or a dash."""
    rows = _recall_rows(doc)
    ctxs, fmts, ks, at = _recall_grid(rows)
    t = Table(title=title)
    t.add_column("k")
    t.add_column("format")
    for c in ctxs:
        t.add_column(f"{_si(c)} tok", justify="right")
    for k in ks:
        for fmt in fmts:
            cells = []
            for c in ctxs:
                r = at.get((c, k, fmt))
                if r is None or r.get(value) is None:
                    cells.append("[red]err[/]" if (r and r.get("error")) else "—")
                else:
                    cells.append(cell(r))
            t.add_row(str(k), fmt, *cells)
    return t


def resolution_table(doc) -> Table:
    rows = _recall_rows(doc)
    margins = rows[0]["margins"] if rows else []

    def cell(r):
        if r["trivial"]:
            return "[dim]trivial[/]"
        return f"[red]>{_margin(max(margins))}[/]" if r["resolution"] is None else _margin(r["resolution"])

    return _recall_context_table(
        doc, "Needle resolution (synthetic keys): smallest margin over the best distractor at which the format "
             "keeps >= 99% of needles in its top-k (exact fp64 keeps 100% at every margin by construction)",
        "needle_rate", cell)


def needle_margin_table(doc) -> Table | None:
    rows = [r for r in _recall_rows(doc) if r.get("needle_rate") is not None and not r["trivial"]]
    if not rows:
        return None
    # every context at the smallest k (V4-Flash's 512), the largest context at the other k
    L = max(r["context_tokens"] for r in rows)
    k0 = min(r["k"] for r in rows)
    rows = sorted((r for r in rows if r["k"] == k0 or r["context_tokens"] == L),
                  key=lambda r: (r["k"], r["context_tokens"]))
    margins = rows[0]["margins"]
    t = Table(title=f"Needle-in-top-k rate by margin over the best distractor ({rows[0]['queries']} needles per "
                    f"context; non-trivial contexts)")
    for col in ("k", "context", "format"):
        t.add_column(col)
    for m in margins:
        t.add_column(_margin(m), justify="right")
    for i, r in enumerate(rows):
        if i and (r["k"], r["context_tokens"]) != (rows[i - 1]["k"], rows[i - 1]["context_tokens"]):
            t.add_section()
        t.add_row(str(r["k"]), f"{_si(r['context_tokens'])} tok", r["format"],
                  *[f"{100 * x:.0f}%" for x in r["needle_rate"]])
    return t


def recall_table(doc) -> Table:
    def cell(r):
        text = f"{100 * r['recall_mean']:.2f}% / {100 * r['ref_overlap_mean']:.2f}%"
        return f"[dim]{text}[/]" if r["trivial"] else text

    return _recall_context_table(
        doc, "recall@k vs exact fp64 top-k / top-k overlap with the DeepSeek-V4 reference numerics (synthetic keys)",
        "recall_mean", cell)


def rescore_query(row) -> str:
    """The stage-2 query of an fp8-rescore recall row: the format names it (``-bf16q``: the bf16 query, the
    plugin's default; else SGLang's fp8 q)."""
    return "bf16" if str(row.get("format", "")).endswith("-bf16q") else "fp8"


def rescore_table(doc) -> Table | None:
    """fp8-rescore rows (recall runs that have them): per context, k and K', the share of the exact top-k kept, the
    missed entries (of them beyond K') and the worst fp8 rank of a miss; None for older documents."""
    rows = [r for r in _recall_rows(doc) if r.get("k_prime") is not None and not r["trivial"] and not r.get("error")]
    if not rows:
        return None
    t = Table(title="fp8-rescore (two-level keys, CPU reference): exact top-k entries kept, misses and their fp8 "
                    "ranks (largest-margin rows; ranks 0-based)")
    for col in ("context", "k", "K'", "stage-2 query", "outliers", "kept of exact top-k", "missed", "beyond K'",
                "worst fp8 rank missed", "fp8 rank holding the top-k (median / max)"):
        t.add_column(col, justify="right")
    for r in sorted(rows, key=lambda r: (r["context_tokens"], r["k"], r["k_prime"], rescore_query(r))):
        t.add_row(f"{_si(r['context_tokens'])} tok", str(r["k"]), str(r["k_prime"]), rescore_query(r),
                  _f(r.get("outlier_scale"), "x{:g}"), f"{100 * r['recall_mean']:.3f}%", str(r["missed_entries"]),
                  str(r["missed_beyond_k_prime"]), _f(r["missed_fp8_rank_max"], "{:d}"),
                  f"{r['fp8_rank_needed_median']} / {r['fp8_rank_needed_max']}")
    return t


def print_all(console, doc, sections) -> None:
    """Every table of ``sections``, each fitted to the console's width (:func:`fitted`)."""
    for n in doc["notes"].get("general", []):
        console.print(f"[yellow]{n}[/]")
    if any(s in sections for s in ("store", "query", "logits")):
        print_fitted(console, ceilings_table(doc))
        if doc.get("backend") == "cpu" and not doc["ceilings"].get("copy_gbps"):
            console.print(f"  [dim]- {CPU_NO_RATIOS}[/]")
    if "bytes" in sections and doc["bytes"]:
        print_fitted(console, bytes_table(doc), keys=2)
        for n in doc["notes"]["bytes"]:
            console.print(f"  [dim]- {n}[/]")
    if "store" in sections and doc["store"]:
        print_fitted(console, store_table(doc), keys=4)
        for n in doc["notes"]["store"]:
            console.print(f"  [dim]- {n}[/]")
    if "query" in sections and doc.get("query"):
        print_fitted(console, query_table(doc), keys=2)
        for n in doc["notes"].get("query", []):
            console.print(f"  [dim]- {n}[/]")
    if "logits" in sections and doc["logits"]:
        print_fitted(console, decode_table(doc), keys=DECODE_KEYS)
        print_fitted(console, prefill_table(doc), keys=PREFILL_KEYS)
        print_fitted(console, verify_extend_table(doc), keys=3)
        for n in doc["notes"]["logits"]:
            console.print(f"  [dim]- {n}[/]")
    if "recall" in sections and doc["recall"] and not _recall_rows(doc):
        console.print("[yellow]recall: rows of an older bench version (no margin sweep); re-run `cupy-dsa bench "
                      "recall` for the current tables.[/]")
    if "recall" in sections and _recall_rows(doc):
        print_fitted(console, resolution_table(doc), keys=2)
        nm = needle_margin_table(doc)
        if nm is not None:
            print_fitted(console, nm, keys=3)
        print_fitted(console, recall_table(doc), keys=2)
        rt = rescore_table(doc)
        if rt is not None:
            print_fitted(console, rt, keys=3)
        for n in doc["notes"]["recall"]:
            console.print(f"  [dim]- {n}[/]")
    if doc.get("recall_diverse"):  # `bench recall --suite diverse`
        from .recall_diverse import markdown as diverse_markdown

        console.print("recall, diverse suite (synthetic keys): share of the exact top-k missed per format, and its "
                      "error budget", markup=False, highlight=False)
        console.print(diverse_markdown(doc["recall_diverse"]), markup=False, highlight=False, soft_wrap=True)
        for n in doc["notes"].get("recall_diverse", []):
            console.print(f"  - {n}", markup=False, highlight=False, style="dim")
    errors = [r for s in ("store", "query", "logits", "recall", "recall_diverse") for r in doc.get(s, [])
              if r.get("error")]
    if errors:
        console.print(f"[red]{len(errors)} row(s) failed; see the 'error' fields.[/]")


# --------------------------------------------------------------------------------------------------
# markdown headline
# --------------------------------------------------------------------------------------------------

def _md_verdict(r):
    return {"pass": "pass", "miss": "**miss**"}.get(r.get("verdict"), "—")


def markdown_headline(doc: dict) -> str:
    """A compact markdown table of the headline figures (what the README quotes)."""
    c = doc["ceilings"]
    lines = [
        f"cupy-dsa bench — {doc['device']} ({doc['backend']}{', quick' if doc['quick'] else ''}), "
        f"{doc['date'][:10]}, {commit_text(doc)}. " + (
            f"Ceilings measured in the same run: d2d copy {_f(c.get('copy_gbps'), '{:.0f}')} GB/s (read+write), "
            f"read-only {_f(c.get('read_gbps'), '{:.0f}')} GB/s, bf16 matmul {_f(c.get('matmul_tflops'), '{:.0f}')} "
            f"TFLOP/s." if c.get("copy_gbps") else
            "No ceilings measured (CPU backend or no throughput section): no ratios to them."),
        "",
        "| figure | result | ratio | target | |",
        "|---|---|---|---|---|",
    ]
    for r in doc["store"]:
        if r.get("error") or r["kv_dtype"] != "float32":
            continue
        lines.append(f"| store {_si(r['n_tokens'])} tokens, {r['layout']} {r['numerics']} | {r['time_us']:.0f} us, "
                     f"{_num(r['gbps'])} GB/s | {_pct(r['pct_copy'])} of copy | "
                     f"{_target_pct(r.get('target_pct_copy'))} | {_md_verdict(r)} |")
    for r in doc.get("query", []):
        if r.get("error"):
            continue
        ratio = f"{_pct(r['pct_read'])} of read" if r.get("pct_read") is not None else "—"
        lines.append(f"| prepare_index_q, T = {_si(r['n_tokens'])}, {r['numerics']} query | {r['time_us']:.1f} us, "
                     f"{_num(r['gbps'])} GB/s | {ratio} | — | |")
    for r in doc["logits"]:
        if r.get("error"):
            continue
        if r["mode"] in ("verify", "extend"):
            dg = (f"; DeepGEMM rows {r['deepgemm_rows_us']:.1f} us, ours {r['vs_deepgemm_rows']:.2f}x"
                  if r.get("vs_deepgemm_rows") else "")
            ratio = (f"{_pct(r.get('pct_read'))} of read, {_pct(r.get('pct_roofline'))} of roofline"
                     if r["mode"] == "verify" else f"{_pct(r.get('pct_matmul'))} of matmul")
            tgt = route_target(r, " DG rows") or "—"
            lines.append(f"| {r['mode']} {r['batch_name']}, n {r['next_n']}, {r['route']} | {r['time_us']:.1f} us{dg} | "
                         f"{ratio} | {tgt} | {_md_verdict(r)} |")
            continue
        if r["mode"] == "decode":
            if r["q_dtype"] != "fp8":
                continue
            dg = (f"; DeepGEMM fp8 {r['deepgemm_us']:.1f} us, ours {r['vs_deepgemm']:.2f}x"
                  if r.get("vs_deepgemm") else "")
            tgt = _target_pct(r["target_pct_read"]) if r.get("target_pct_read") else (
                f"<= {r['target_us']:g} us" if r.get("target_us") else "—")
            lines.append(f"| decode {r.get('batch_name', r['batch'])} ({_si(r.get('entries', 0))} entries), "
                         f"next_n {r['next_n']}, {r['layout']} keys | {r['time_us']:.1f} us{dg} | "
                         f"{_pct(r.get('pct_read'))} of read | {tgt} | {_md_verdict(r)} |")
        else:
            dg = (f"; DeepGEMM fp8 {r['deepgemm_us'] / 1e3:.2f} ms, ours {r['vs_deepgemm']:.2f}x"
                  if r.get("vs_deepgemm") else "")
            vs = f", {r['vs_contiguous']:.3f}x contiguous" if r.get("vs_contiguous") else ""
            tgt = prefill_target(r) or "—"
            lines.append(f"| prefill {prefill_shape(r)}, {r['kv']} {r['layout']} | "
                         f"{r['time_us'] / 1e3:.2f} ms, {_num(r['tflops'])} TFLOP/s{dg} | "
                         f"{_pct(r['pct_matmul'])} of matmul{vs} | {tgt} | {_md_verdict(r)} |")
    rec = [r for r in _recall_rows(doc) if r.get("recall_mean") is not None and not r["trivial"]]
    if rec:
        L = max(r["context_tokens"] for r in rec)
        margins = rec[0]["margins"]
        for k in sorted({r["k"] for r in rec}):
            at = [r for r in rec if r["context_tokens"] == L and r["k"] == k]
            fm = [r for r in at if r["format"] not in ("exact", "reference")]
            res = ", ".join(f"{r['format']} {_margin(r['resolution']) if r['resolution'] else '>' + _margin(max(margins))}"
                            for r in fm)
            ref = next((r for r in at if r["format"] == "reference"), None)
            ref_res = (_margin(ref["resolution"]) if ref and ref["resolution"] else f">{_margin(max(margins))}")
            lines.append(f"| needle resolution, top-{k} at {_si(L)} tokens (synthetic; margin for >=99% kept) | {res} | "
                         f"exact: {_margin(min(margins))} (by construction), reference numerics: {ref_res} | — | |")
            lines.append(f"| recall@{k} vs exact fp64 at {_si(L)} tokens (synthetic) | "
                         + ", ".join(f"{r['format']} {100 * r['recall_mean']:.2f}%" for r in fm) + " | — | — | |")
            lines.append(f"| top-{k} overlap with the DeepSeek-V4 reference numerics at {_si(L)} tokens (synthetic) | "
                         + ", ".join(f"{r['format']} {100 * r['ref_overlap_mean']:.2f}%" for r in fm)
                         + " | " + "".join(f"exact fp64 {100 * r['ref_overlap_mean']:.2f}%" for r in at
                                           if r["format"] == "exact") + " | — | |")
    for r in doc["bytes"]:
        if r["model"] == "DeepSeek-V4-Flash" and r["layout"] in ("fp8", "bf16"):
            lines.append(f"| V4-Flash capacity, {r['layout']} index keys | {r['tokens_fit'] / 1e6:.2f}M tokens in "
                         f"{memory_text(r)} | {r['tokens_fit_vs_fp8']:.3f}x of fp8 | — | |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------
# row selection (shared by the README blocks and the plots)
# --------------------------------------------------------------------------------------------------

def _ok(doc, mode):
    return [r for r in doc["logits"] if r.get("mode") == mode and not r.get("error")]


def _decode_pairs(doc):
    """(batch name, next_n, bf16 row, fp8 row) of the fp8-q decode rows that have both layouts."""
    at = {(r["batch_name"], r["next_n"], r["layout"]): r for r in _ok(doc, "decode") if r["q_dtype"] == "fp8"}
    keys = dict.fromkeys((b, n) for b, n, _ in at)
    return [(b, n, at[b, n, "bf16"], at[b, n, "fp8"]) for b, n in keys if (b, n, "bf16") in at and (b, n, "fp8") in at]


SERVED_ROUTE = {"verify": "grouped", "extend": "varlen"}  # what the plugin launches; "rows" is SGLang's call


def _route_pairs(doc):
    """(mode, batch name, next_n, rows row, served-route row) of the verify / extend rows."""
    at = {(r["mode"], r["batch_name"], r["next_n"], r["route"]): r for m in SERVED_ROUTE for r in _ok(doc, m)}
    keys = dict.fromkeys((m, b, n) for m, b, n, _ in at)
    return [(m, b, n, at[m, b, n, "rows"], at[m, b, n, SERVED_ROUTE[m]]) for m, b, n in keys
            if (m, b, n, "rows") in at and (m, b, n, SERVED_ROUTE[m]) in at]


# --------------------------------------------------------------------------------------------------
# the structure `bench report` reads, checked before anything is rendered
# --------------------------------------------------------------------------------------------------

def _is(kind, v) -> bool:
    if kind == "int":
        return isinstance(v, int) and not isinstance(v, bool)
    if kind == "rows":
        return isinstance(v, list) and all(isinstance(r, dict) for r in v)
    if kind == "ints":
        return isinstance(v, list) and all(_is("int", x) for x in v)
    return isinstance(v, {"str": str, "bool": bool, "dict": dict, "list": list}[kind])


_BENCH_FIELDS = {"device": "str", "backend": "str", "quick": "bool", "ceilings": "dict", "targets": "dict",
                 "notes": "dict", "bytes": "rows", "store": "rows", "logits": "rows", "recall": "rows",
                 "query": "rows?"}
# field -> kind ("?": may be absent or null); what the renderers of each result read without looking
STRUCTURE = {
    "cupy-dsa-bench/2": _BENCH_FIELDS,
    "cupy-dsa-bench/1": _BENCH_FIELDS,
    "cupy-dsa-serve/1": {"model": "dict", "batch": "int", "contexts": "ints", "next_n": "ints", "chunk": "ints",
                         "memory": "rows", "timings": "rows", "measured": "bool", "device": "str?",
                         "notes": "list?"},
    "cupy-dsa-rescore/1": {"device": "str", "rows": "rows", "memory": "rows", "columns": "dict?", "ceilings": "dict?"},
    "cupy-dsa-emulate/1": {"device": "str", "target": "str", "rows": "rows", "ceilings": "dict"},
    "cupy-dsa-needle/1": {"settings": "dict", "server": "dict", "cells": "rows", "label": "str",
                          "calibration": "dict?"},
}


def structure_problem(doc) -> str | None:
    """What in ``doc`` does not have the structure its schema promises (a field missing or of another type, a row
    that is not an object), or None. Documents of other schemas are not judged here."""
    fields = STRUCTURE.get(doc.get("schema")) if isinstance(doc, dict) else None
    for name, kind in (fields or {}).items():
        optional = kind.endswith("?")
        kind = kind.rstrip("?")
        if name not in doc or doc[name] is None:
            if not optional:
                return f"it has no {name!r} field"
            continue
        if not _is(kind, doc[name]):
            want = {"rows": "a list of objects", "ints": "a list of integers", "int": "an integer",
                    "str": "a string", "bool": "true or false", "dict": "an object", "list": "a list"}[kind]
            return f"its {name!r} is {json_type(doc[name])}, expected {want}"
    return None


def json_type(v) -> str:
    text = repr(v)
    return f"{type(v).__name__} {text if len(text) <= 40 else text[:37] + '...'}"
