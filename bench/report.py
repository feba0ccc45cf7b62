"""Result document (JSON schema), rich tables, the markdown headline table and the PNG plot."""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
import subprocess
from pathlib import Path

from rich.table import Table
from rich.text import Text

# /2: recall rows carry the margin sweep (needle_rate per margin, resolution, ref_overlap); `bench report`
# still re-prints /1 documents (without their recall rows, which had no margins).
SCHEMA = "cupy-dsa-bench/2"
READABLE_SCHEMAS = (SCHEMA, "cupy-dsa-bench/1")
SECTIONS = ("bytes", "store", "query", "logits", "recall")


# --------------------------------------------------------------------------------------------------
# document
# --------------------------------------------------------------------------------------------------

def _git(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True, timeout=5)


def _running_from_checkout() -> bool:
    """Whether this code is a git checkout's own files (the clone, or an editable install of it): this file
    must be tracked where it is. An installed copy that merely sits inside some repository (a virtual
    environment in the clone) is not, and the repository's HEAD says nothing about what was installed."""
    here = Path(__file__).resolve()
    try:
        return _git(here.parent, "ls-files", "--error-unmatch", here.name).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def git_commit() -> str | None:
    """Commit of the code that ran: CUPY_DSA_COMMIT (set when the tree was copied without .git), else the
    checkout's HEAD when the code runs from a checkout, with ``-dirty`` when tracked files differ from it;
    None otherwise (:func:`no_commit_reason` says why)."""
    if os.environ.get("CUPY_DSA_COMMIT"):
        return os.environ["CUPY_DSA_COMMIT"]
    if not _running_from_checkout():
        return None
    root = Path(__file__).resolve().parent
    try:
        head = _git(root, "rev-parse", "--short=12", "HEAD")
        if head.returncode != 0:
            return None
        dirty = _git(root, "status", "--porcelain", "--untracked-files=no").stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("-dirty" if dirty else "")


NO_COMMIT = "no commit recorded (not run from a git checkout; set CUPY_DSA_COMMIT to record one)"
INSTALLED_COPY = ("installed copy, commit unknown (a non-editable install keeps no git metadata; set "
                  "CUPY_DSA_COMMIT to record one, or run from an editable install: pip install -e .)")


def no_commit_reason() -> str:
    """Why :func:`git_commit` found none: an installed copy (``bench/`` inside the ``cupy_dsa`` package, as pip
    lays it out) or a tree without git metadata."""
    return INSTALLED_COPY if Path(__file__).resolve().parents[1].name == "cupy_dsa" else NO_COMMIT


def commit_text(doc: dict, code=True) -> str:
    """``commit `abc...` `` (saying when the checkout had uncommitted changes) or a sentence saying that the
    run recorded none and why."""
    c = doc.get("git_commit")
    if not c:
        return doc.get("commit_note") or NO_COMMIT
    text = f"commit `{c}`" if code else f"commit {c}"
    return text + (" (the checkout had uncommitted changes)" if c.endswith("-dirty") else "")


def provenance() -> dict:
    """When and from what a run came: date, commit (or why none), cupy_dsa and torch versions."""
    import torch

    import cupy_dsa

    commit = git_commit()
    return {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "git_commit": commit,
            "commit_note": None if commit else no_commit_reason(),
            "cupy_dsa_version": getattr(cupy_dsa, "__version__", None), "torch_version": torch.__version__}


def new_document(*, backend: str, device_name: str, quick: bool, seed: int, gpu_mem_gb: float) -> dict:
    return {
        "schema": SCHEMA,
        **provenance(),
        "device": device_name,
        "backend": backend,
        "quick": quick,
        "seed": seed,
        "gpu_mem_gb": gpu_mem_gb,
        "ceilings": {"copy_gbps": None, "matmul_tflops": None, "read_gbps": None, "copy_bytes": None,
                     "matmul_n": None, "l2_bytes": None},
        "targets": {},
        "notes": {s: [] for s in SECTIONS},
        "bytes": [], "store": [], "query": [], "logits": [], "recall": [],
    }


def write_json(doc: dict, path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc, indent=1, default=str) + "\n")


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
    for col in ("d2d copy (read+write)", "read-only stream", "bf16 matmul", "L2"):
        t.add_column(col, justify="right")
    t.add_row(
        f"{_f(c.get('copy_gbps'), '{:.0f}')} GB/s" + (f" ({c['copy_bytes'] / 2**20:.0f} MiB)" if c.get("copy_bytes") else ""),
        f"{_f(c.get('read_gbps'), '{:.0f}')} GB/s",
        f"{_f(c.get('matmul_tflops'), '{:.3g}')} TFLOP/s" + (f" ({c['matmul_n']}^3)" if c.get("matmul_n") else ""),
        "—" if not c.get("l2_bytes") else f"{c['l2_bytes'] / 2**20:.0f} MiB")
    return t


def bytes_table(doc) -> Table:
    t = Table(title=f"Index-key bytes and capacity ({doc['gpu_mem_gb']:g} GB of KV memory)")
    for col in ("model", "index keys", "B/entry", "idx B/tok/layer", "idx layers", "idx B/tok",
                "main KV B/tok", "total B/tok", "idx share", "tokens fit", "vs fp8"):
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


def decode_table(doc) -> Table:
    t = Table(title="paged_mqa_logits, decode (index entries per request; width = max_context_len)")
    for col in ("batch", "next_n", "layout", "q", "time", "% read", "target", "result", "DeepGEMM", "ours/DG",
                "vs fp8", "entries", "key GB/s", "plan", "DG rel L2", "torch", "speed-up", "mem ours"):
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
                  _f(r.get("time_vs_fp8"), "{:.2f}x"), _si(r.get("entries", 0)), _num(r.get("key_gbps")),
                  _f(r.get("plan_us"), "{:.1f} us"), _f(r.get("deepgemm_rel_l2"), "{:.1e}"),
                  _f(r.get("torch_time_us"), "{:.0f} us"), _f(r.get("speedup_vs_torch"), "{:.1f}x"),
                  _f(r.get("peak_extra_mb"), "{:.1f} MB"))
    return t


PREFILL_KEYS = 3  # T x S, kv, layout


def prefill_table(doc) -> Table:
    t = Table(title="mqa_logits, prefill (causal: ks = 0, ke = S - T + i + 1; ragged: several extend requests)")
    for col in ("T x S", "kv", "layout", "time", "% matmul", "target", "result", "DeepGEMM fp8", "ours/DG",
                "vs contig", "TFLOP/s", "mem ours"):
        t.add_column(col, justify="right")
    for r in doc["logits"]:
        if r.get("mode") != "prefill":
            continue
        shape = f"{_si(r['rows'])} x {_si(r['keys'])}"
        if r.get("error"):
            t.add_row(shape, r["kv"], r["layout"], f"[red]{r['error'][:60]}[/]", *[""] * 8)
            continue
        dg = (f"{r['deepgemm_us'] / 1e3:.3f} ms" if r.get("deepgemm_us")
              else ("—" if r["kv"] == "paged" else (r.get("deepgemm_note") or "—")[:30]))
        target = (_target_pct(r.get("target_pct_matmul")) if r.get("target_pct_matmul")
                  else (f"<= {r['target_vs_contiguous']:.2f}x" if r.get("target_vs_contiguous") else "—"))
        t.add_row(shape, r["kv"], r["layout"], f"{r['time_us'] / 1e3:.3f} ms", _pct(r["pct_matmul"]), target,
                  _verdict(r), dg, _f(r.get("vs_deepgemm"), "{:.2f}x"), _f(r.get("vs_contiguous"), "{:.3f}x"),
                  _num(r["tflops"], 1), _f(r.get("peak_extra_mb"), "{:.0f} MB"))
    return t


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
        tgt = f"<= {r['target_vs_deepgemm_rows']:.2f}x" if r.get("target_vs_deepgemm_rows") else "—"
        if r.get("target_pct_matmul"):
            tgt += f", {_target_pct(r['target_pct_matmul'])}"
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
        for n in doc["notes"]["recall"]:
            console.print(f"  [dim]- {n}[/]")
    errors = [r for s in ("store", "query", "logits", "recall") for r in doc.get(s, []) if r.get("error")]
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
    for r in doc["logits"]:
        if r.get("error"):
            continue
        if r["mode"] in ("verify", "extend"):
            dg = (f"; DeepGEMM rows {r['deepgemm_rows_us']:.1f} us, ours {r['vs_deepgemm_rows']:.2f}x"
                  if r.get("vs_deepgemm_rows") else "")
            ratio = (f"{_pct(r.get('pct_read'))} of read, {_pct(r.get('pct_roofline'))} of roofline"
                     if r["mode"] == "verify" else f"{_pct(r.get('pct_matmul'))} of matmul")
            tgt = f"<= {r['target_vs_deepgemm_rows']:.2f}x DG rows" if r.get("target_vs_deepgemm_rows") else "—"
            if r.get("target_pct_matmul"):
                tgt += f", {_target_pct(r['target_pct_matmul'])} of matmul"
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
            tgt = (_target_pct(r.get("target_pct_matmul")) if r.get("target_pct_matmul")
                   else (f"<= {r['target_vs_contiguous']:.2f}x contiguous" if r.get("target_vs_contiguous") else "—"))
            lines.append(f"| prefill {_si(r['rows'])} x {_si(r['keys'])}, {r['kv']} {r['layout']} | "
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
                         f"{r['gpu_mem_gb']:g} GB | {r['tokens_fit_vs_fp8']:.3f}x of fp8 | — | |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------
# plot
# --------------------------------------------------------------------------------------------------

PLOT_SUFFIX = ".png"


# Served formats (SGLang's fp8 default, the plugin's bf16 keys) are drawn last, thick and solid, so that a
# format with the same figures (bf16+q-bf16 often equals bf16) cannot hide them; the others are thin,
# dashed or dotted, with hollow markers.
SERVED_FORMATS = ("bf16", "fp8")
FORMAT_STYLE = {
    "bf16": dict(color="C0", marker="o", linestyle="-", linewidth=2.4, markersize=6, zorder=5),
    "fp8": dict(color="C1", marker="s", linestyle="-", linewidth=2.0, markersize=5, zorder=4),
    "bf16+q-bf16": dict(color="C2", marker="D", linestyle="--", linewidth=1.0, markersize=7, fillstyle="none"),
    "bf16-fp4sim": dict(color="C3", marker="^", linestyle="--", linewidth=1.0, markersize=5, fillstyle="none"),
    "fp4": dict(color="C4", marker="v", linestyle=":", linewidth=1.0, markersize=5, fillstyle="none"),
    "bf16-fp4sim+q-fp4": dict(color="C5", marker="x", linestyle=":", linewidth=1.0, markersize=5),
    "exact": dict(color="0.3", marker=".", linestyle="-.", linewidth=0.8, markersize=4),
    "reference": dict(color="0.6", marker=".", linestyle="-.", linewidth=0.8, markersize=4),
}


def _plot_order(formats):
    """Served formats last (drawn on top); their legend entries are put first by :func:`_served_legend`."""
    return [f for f in formats if f not in SERVED_FORMATS] + [f for f in SERVED_FORMATS if f in formats]


def _style(fmt):
    return FORMAT_STYLE.get(fmt, dict(marker="o", linestyle="-", linewidth=1.0))


def _served_legend(ax, **kw):
    handles, labels = ax.get_legend_handles_labels()
    order = sorted(range(len(labels)), key=lambda i: (labels[i].split(" ")[0] not in SERVED_FORMATS, i))
    ax.legend([handles[i] for i in order], [labels[i] for i in order], **kw)


def _needle_panel(ax, rec, k0, ctx):
    for fmt in _plot_order(list(dict.fromkeys(r["format"] for r in rec))):
        r = next((r for r in rec if r["format"] == fmt and r["k"] == k0 and r["context_tokens"] == ctx), None)
        if r is None or r.get("needle_rate") is None:
            continue
        label = f"{fmt} (served)" if fmt in SERVED_FORMATS else fmt
        ax.plot([100 * m for m in r["margins"]], [100 * x for x in r["needle_rate"]], label=label, **_style(fmt))
    ax.axhline(100 * 0.99, color="grey", linewidth=0.6)
    ax.set_xscale("log")
    ax.set_xlabel("margin of the needle over the best distractor (exact fp64, %)")
    ax.set_ylabel(f"% of needles in top-{k0}")
    ax.set_ylim(-3, 103)
    ax.set_title(f"needle in top-{k0} vs margin, {_si(ctx)} tokens (synthetic)", fontsize=9)
    ax.grid(alpha=0.3)
    _served_legend(ax, fontsize=6)


def _recall_panel(ax, rec, kind):
    ks = sorted({r["k"] for r in rec})
    for fmt in _plot_order(list(dict.fromkeys(r["format"] for r in rec))):
        if kind == "recall" and fmt == "exact" or kind == "overlap" and fmt == "reference":
            continue
        for kk in ks:
            pts = sorted((r["context_tokens"], r) for r in rec if r["format"] == fmt and r["k"] == kk
                         and not r["trivial"])
            if kind == "resolution":
                y = [100 * r["resolution"] if r["resolution"] else float("nan") for _, r in pts]
            else:
                y = [100 * r["recall_mean" if kind == "recall" else "ref_overlap_mean"] for _, r in pts]
            style = dict(_style(fmt), **({} if kk == ks[0] else {"linestyle": (0, (1, 2)), "alpha": 0.7}))
            label = (f"{fmt} (served)" if fmt in SERVED_FORMATS else fmt) if kk == ks[0] else None
            ax.plot([p[0] for p in pts], y, label=label, **style)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (raw tokens; index entries = tokens / 4)")
    styles = " / ".join(f"{'as styled' if kk == ks[0] else 'fine dots'} k={kk}" for kk in ks)
    if kind == "resolution":
        ax.set_yscale("log")
        ax.set_ylabel("smallest margin with >= 99% kept (%)")
        ax.set_title(f"needle resolution vs context ({styles}; gap = not resolved)", fontsize=8)
    else:
        ax.set_ylabel("%")
        ax.set_title((f"recall@k vs exact fp64 ({styles})" if kind == "recall" else
                      f"top-k overlap with DeepSeek-V4 reference numerics ({styles})"), fontsize=8)
    ax.grid(alpha=0.3)
    _served_legend(ax, fontsize=6)


def _batch_labels(ax, names, offset=0.0):
    ax.set_xticks([i + offset for i in range(len(names))])
    ax.set_xticklabels([str(s).replace(" + ", "\n+ ") for s in names], fontsize=6, rotation=30, ha="right")


def _decode_panel(ax, dec, has_ceiling):
    shapes = list(dict.fromkeys(r.get("batch_name") for r in dec if r["next_n"] == 1 and r["q_dtype"] == "fp8"))
    for j, lay in enumerate(SERVED_FORMATS):
        vals = []
        for s in shapes:
            r = next((r for r in dec if r.get("batch_name") == s and r["next_n"] == 1
                      and r["layout"] == lay and r["q_dtype"] == "fp8"), None)
            if has_ceiling:
                vals.append(100 * r["pct_read"] if r and r.get("pct_read") else 0)
            else:
                vals.append(r["key_gbps"] if r else 0)
        ax.bar([i + 0.4 * j for i in range(len(shapes))], vals, width=0.4, label=f"{lay} keys",
               color=FORMAT_STYLE[lay]["color"])
    _batch_labels(ax, shapes, 0.2)
    ax.set_ylabel("% of the read-only stream (key bytes)" if has_ceiling else "key GB/s (no ceiling: CPU backend)")
    ax.set_title("decode logits, next_n=1, fp8 q", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")


def _decode_deepgemm_panel(ax, dec):
    shapes = list(dict.fromkeys(r["batch_name"] for r in dec if r.get("vs_deepgemm")))
    for lay in _plot_order(list(SERVED_FORMATS)):
        for n in sorted({r["next_n"] for r in dec if r.get("vs_deepgemm")}):
            y = [next((r["vs_deepgemm"] for r in dec if r["batch_name"] == s and r["next_n"] == n
                       and r["layout"] == lay and r["q_dtype"] == "fp8" and r.get("vs_deepgemm")), float("nan"))
                 for s in shapes]
            style = dict(_style(lay), **({} if n == 1 else {"linestyle": "--", "fillstyle": "none"}))
            ax.plot(range(len(shapes)), y, label=f"{lay} keys, next_n {n}", **style)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    _batch_labels(ax, shapes)
    ax.set_ylim(bottom=0)
    ax.set_ylabel("our time / DeepGEMM fp8 time")
    ax.set_title("decode vs DeepGEMM fp8_paged_mqa_logits (1 = parity)", fontsize=9)
    ax.grid(alpha=0.3)
    _served_legend(ax, fontsize=6)


def _prefill_panel(ax, pre):
    labels = [f"{_si(r['rows'])} x {_si(r['keys'])}\n{r['kv']} {r['layout']}" for r in pre]
    bars = ax.bar(range(len(pre)), [100 * r["pct_matmul"] if r.get("pct_matmul") else r["tflops"] for r in pre],
                  color=[FORMAT_STYLE[r["layout"]]["color"] if r["layout"] in FORMAT_STYLE else "C7" for r in pre])
    for b, r in zip(bars, pre):
        if r.get("vs_deepgemm"):
            ax.annotate(f"{r['vs_deepgemm']:.2f}x DG", (b.get_x() + b.get_width() / 2, b.get_height()),
                        ha="center", va="bottom", fontsize=6)
    ax.set_xticks(range(len(pre)))
    ax.set_xticklabels(labels, fontsize=6, rotation=30, ha="right")
    has_ceiling = any(r.get("pct_matmul") for r in pre)
    ax.set_ylabel("% of the bf16 matmul (useful FLOPs)" if has_ceiling else "TFLOP/s (no ceiling: CPU backend)")
    ax.set_title("prefill / extend mqa_logits (label: our time / DeepGEMM fp8)", fontsize=9)
    ax.grid(alpha=0.3, axis="y")


def _routes_deepgemm_panel(ax, doc):
    pairs = [p for p in _route_pairs(doc) if p[4].get("vs_deepgemm_rows")]
    names = [f"{m} {b}" + (f", n {n}" if m == "verify" else "") for m, b, n, _, _ in pairs]
    x = range(len(pairs))
    ax.bar([i - 0.2 for i in x], [p[3]["vs_deepgemm_rows"] for p in pairs], width=0.4, color="0.7",
           label="ours, rows (SGLang's call)")
    ax.bar([i + 0.2 for i in x], [p[4]["vs_deepgemm_rows"] for p in pairs], width=0.4,
           color=FORMAT_STYLE["bf16"]["color"], label="ours, grouped / varlen (served)")
    ax.plot([i + 0.2 for i in x], [p[4].get("target_vs_deepgemm_rows") or float("nan") for p in pairs],
            linestyle="none", marker="_", markersize=14, color="k", label="target")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    _batch_labels(ax, names)
    ax.set_ylabel("our time / DeepGEMM fp8 rows time")
    ax.set_title("MTP verify and extend vs DeepGEMM (1 = parity)", fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=6)


def _store_panel(ax, doc, has_ceiling):
    rows = [r for r in doc["store"] if not r.get("error")]
    ax.bar(range(len(rows)), [100 * (r["pct_copy"] or 0) if has_ceiling else r["gbps"] for r in rows])
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([f"{r['layout']}\n{r['numerics']}\n{r['kv_dtype']}" for r in rows], fontsize=6)
    ax.set_ylabel("% of d2d copy bandwidth" if has_ceiling else "GB/s (no ceiling: CPU backend)")
    ax.set_title("store_index_k", fontsize=9)


def _bytes_panel(ax, doc):
    rows = doc["bytes"]
    models = list(dict.fromkeys(r["model"] for r in rows))
    lays = list(dict.fromkeys(r["layout"] for r in rows))
    for j, lay in enumerate(lays):
        ax.bar([i + 0.2 * j for i in range(len(models))],
               [next(r["tokens_fit"] for r in rows if r["model"] == m and r["layout"] == lay) / 1e6 for m in models],
               width=0.2, label=lay, color=_style(lay).get("color"))
    ax.set_xticks([i + 0.3 for i in range(len(models))])
    ax.set_xticklabels([m.replace("DeepSeek-", "") for m in models], fontsize=7)
    ax.set_ylabel(f"M tokens in {doc['gpu_mem_gb']:g} GB")
    ax.set_title("KV capacity by index-key layout", fontsize=9)
    ax.legend(fontsize=7)


def plot(doc: dict, path: str) -> None:
    if Path(path).suffix.lower() != PLOT_SUFFIX:
        raise ValueError(f"plot: expected a file name ending in .png (the plot is PNG), got {path!r}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    has_ceiling = bool(doc["ceilings"].get("copy_gbps"))
    rec = [r for r in _recall_rows(doc) if r.get("recall_mean") is not None]
    k0 = min((r["k"] for r in rec), default=None)
    dec = _ok(doc, "decode")
    pre = _ok(doc, "prefill")
    panels = [lambda ax, c=c: _needle_panel(ax, rec, k0, c)
              for c in sorted({r["context_tokens"] for r in rec if r["k"] == k0 and not r["trivial"]})]
    if rec:
        panels += [lambda ax, kind=kind: _recall_panel(ax, rec, kind) for kind in ("resolution", "recall", "overlap")]
    if dec:
        panels.append(lambda ax: _decode_panel(ax, dec, has_ceiling))
    if any(r.get("vs_deepgemm") for r in dec):
        panels.append(lambda ax: _decode_deepgemm_panel(ax, dec))
    if pre:
        panels.append(lambda ax: _prefill_panel(ax, pre))
    if any(p[4].get("vs_deepgemm_rows") for p in _route_pairs(doc)):
        panels.append(lambda ax: _routes_deepgemm_panel(ax, doc))
    if any(not r.get("error") for r in doc["store"]):
        panels.append(lambda ax: _store_panel(ax, doc, has_ceiling))
    if doc["bytes"]:
        panels.append(lambda ax: _bytes_panel(ax, doc))
    ncol = min(2, max(1, len(panels)))
    nrow = max(1, (len(panels) + ncol - 1) // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(6.4 * ncol, 4.6 * nrow), squeeze=False, layout="constrained")
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    for ax, draw in zip(axes.flat, panels):
        draw(ax)
    if not panels:
        axes[0, 0].text(0.5, 0.5, "no data", ha="center")
    fig.suptitle(f"cupy-dsa bench — {doc['device']} — {doc['date'][:10]} — {commit_text(doc, code=False)}",
                 fontsize=10)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)


# --------------------------------------------------------------------------------------------------
# README blocks: the figures the README quotes, rendered from a results document
# --------------------------------------------------------------------------------------------------

README_BLOCK = re.compile(r"(<!-- results:(?P<name>[a-z-]+) -->\n)(?P<body>.*?)(<!-- /results:(?P=name) -->)", re.S)


def _range(values, fmt="{:.2f}", unit="x") -> str:
    """``lo-hi`` of the values (one figure when they agree at that precision)."""
    lo, hi = fmt.format(min(values)), fmt.format(max(values))
    return f"{lo}{unit}" if lo == hi else f"{lo}-{hi}{unit}"


def _ok(doc, mode):
    return [r for r in doc["logits"] if r.get("mode") == mode and not r.get("error")]


def _md_target(r, text):
    return f"{text}: {_md_verdict(r)}" if r.get("verdict") else "—"


def _decode_pairs(doc):
    """(batch name, next_n, bf16 row, fp8 row) of the fp8-q decode rows that have both layouts."""
    at = {(r["batch_name"], r["next_n"], r["layout"]): r for r in _ok(doc, "decode") if r["q_dtype"] == "fp8"}
    keys = dict.fromkeys((b, n) for b, n, _ in at)
    return [(b, n, at[b, n, "bf16"], at[b, n, "fp8"]) for b, n in keys if (b, n, "bf16") in at and (b, n, "fp8") in at]


def readme_decode(doc) -> str:
    lines = ["| batch | next_n | entries | ours, bf16 keys | ours, fp8 keys | DeepGEMM fp8 | bf16 / DG | fp8 / DG "
             "| bf16 % of read | target |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for b, n, bf, f8 in _decode_pairs(doc):
        tgt = (_target_pct(bf["target_pct_read"]) if bf.get("target_pct_read")
               else (f"<= {bf['target_us']:g} us" if bf.get("target_us") else ""))
        lines.append(f"| {b} | {n} | {_si(bf['entries'])} | {bf['time_us']:.1f} us | {f8['time_us']:.1f} us | "
                     f"{_f(bf.get('deepgemm_us'), '{:.1f} us')} | {_f(bf.get('vs_deepgemm'), '{:.2f}x')} | "
                     f"{_f(f8.get('vs_deepgemm'), '{:.2f}x')} | {_pct(bf.get('pct_read'))} | "
                     f"{_md_target(bf, tgt) if tgt else '—'} |")
    return "\n".join(lines)


SERVED_ROUTE = {"verify": "grouped", "extend": "varlen"}  # what the plugin launches; "rows" is SGLang's call


def _route_pairs(doc):
    """(mode, batch name, next_n, rows row, served-route row) of the verify / extend rows."""
    at = {(r["mode"], r["batch_name"], r["next_n"], r["route"]): r for m in SERVED_ROUTE for r in _ok(doc, m)}
    keys = dict.fromkeys((m, b, n) for m, b, n, _ in at)
    return [(m, b, n, at[m, b, n, "rows"], at[m, b, n, SERVED_ROUTE[m]]) for m, b, n in keys
            if (m, b, n, "rows") in at and (m, b, n, SERVED_ROUTE[m]) in at]


def _us_or_ms(us):
    return f"{us / 1e3:.2f} ms" if us >= 1e3 else f"{us:.1f} us"


def readme_verify_extend(doc) -> str:
    lines = ["| case | ours, rows | ours, grouped / varlen | DG rows (fp8) | ours / DG rows | target |",
             "|---|---|---|---|---|---|"]
    for m, b, n, rows, served in _route_pairs(doc):
        extra = (f" ({_pct(served['pct_roofline'])} of roofline)" if m == "verify" and served.get("pct_roofline")
                 else (f" ({served['tflops']:.0f} TF/s)" if served.get("tflops") else ""))
        tgt = f"<= {served['target_vs_deepgemm_rows']:.2f}x" if served.get("target_vs_deepgemm_rows") else ""
        if served.get("target_pct_matmul"):
            tgt += f", {_target_pct(served['target_pct_matmul'])} of matmul"
        lines.append(f"| {m} {b}{f', n {n}' if m == 'verify' else ''} | {_us_or_ms(rows['time_us'])} | "
                     f"{_us_or_ms(served['time_us'])}{extra} | {_us_or_ms(served['deepgemm_rows_us'])} | "
                     f"{_f(served.get('vs_deepgemm_rows'), '{:.2f}x')} | {_md_target(served, tgt) if tgt else '—'} |")
    return "\n".join(lines)


def readme_prefill(doc) -> str:
    lines = ["| T x S | keys | time | TFLOP/s | % of bf16 matmul | DeepGEMM fp8 | ours / DG | vs contiguous | target |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in _ok(doc, "prefill"):
        tgt = (_target_pct(r["target_pct_matmul"]) if r.get("target_pct_matmul")
               else (f"<= {r['target_vs_contiguous']:.2f}x contiguous" if r.get("target_vs_contiguous") else ""))
        lines.append(f"| {_si(r['rows'])} x {_si(r['keys'])} | {r['kv']} {r['layout']} | {r['time_us'] / 1e3:.2f} ms | "
                     f"{r['tflops']:.0f} | {_pct(r['pct_matmul'])} | "
                     f"{_f(r.get('deepgemm_us') and r['deepgemm_us'] / 1e3, '{:.2f} ms')} | "
                     f"{_f(r.get('vs_deepgemm'), '{:.2f}x')} | {_f(r.get('vs_contiguous'), '{:.3f}x')} | "
                     f"{_md_target(r, tgt) if tgt else '—'} |")
    return "\n".join(lines)


def readme_headline(doc) -> str:
    """The ranges the README's prose quotes, each over the rows it names."""
    pairs = [p for p in _decode_pairs(doc) if p[2].get("vs_deepgemm") and p[3].get("vs_deepgemm")]
    n1 = [p for p in pairs if p[1] == 1]
    big = [p for p in n1 if p[2]["entries"] >= 2**18]
    served = _route_pairs(doc)
    out = []
    if pairs:
        key_ratio = pairs[0][2]["key_bytes"] / pairs[0][3]["key_bytes"]
        out.append(f"- bf16 index keys are {key_ratio:.2f}x the key bytes of fp8 (256 B vs 132 B per entry).")
    if big:
        out.append(f"- decode, next_n 1, batches of 256K entries or more: bf16 keys take "
                   f"{_range([p[2]['vs_deepgemm'] for p in big])} DeepGEMM's fp8 time at "
                   f"{_range([100 * p[2]['pct_read'] for p in big], '{:.0f}', '%')} of the read stream; "
                   f"our fp8 layout takes {_range([p[3]['vs_deepgemm'] for p in big])}.")
    if n1:
        out.append(f"- decode, next_n 1, every batch: bf16 keys {_range([p[2]['vs_deepgemm'] for p in n1])} "
                   f"DeepGEMM, fp8 layout {_range([p[3]['vs_deepgemm'] for p in n1])}.")
    for n in sorted({p[1] for p in pairs} - {1}):
        at = [p for p in pairs if p[1] == n]
        out.append(f"- decode, next_n {n}: bf16 keys {_range([p[2]['vs_deepgemm'] for p in at])} DeepGEMM, "
                   f"fp8 layout {_range([p[3]['vs_deepgemm'] for p in at])}.")
    for n in sorted({p[2] for p in served if p[0] == "verify"}):
        at = [p[4] for p in served if p[0] == "verify" and p[2] == n and p[4].get("vs_deepgemm_rows")]
        out.append(f"- verify, next_n {n}, grouped launch: {_range([r['vs_deepgemm_rows'] for r in at])} "
                   f"DeepGEMM's rows time, {_range([100 * r['pct_roofline'] for r in at], '{:.0f}', '%')} of roofline.")
    ext = [p[4] for p in served if p[0] == "extend" and p[4].get("vs_deepgemm_rows")]
    if ext:
        out.append(f"- extend, varlen launch: {_range([r['vs_deepgemm_rows'] for r in ext])} DeepGEMM's rows time, "
                   f"{_range([r['tflops'] for r in ext], '{:.0f}', ' TFLOP/s')} useful.")
    qb = [r for m in ("decode", "extend") for r in _ok(doc, m) if r.get("vs_fp8_query")]
    if qb:
        out.append(f"- bf16-reference's bf16 query on bf16 keys (decode 64 x 32K and every extend case): "
                   f"{_range([r['vs_fp8_query'] for r in qb], '{:.2f}')} the fp8 query's time.")
    pre = [r for r in _ok(doc, "prefill") if r.get("vs_deepgemm")]
    if pre:
        out.append(f"- prefill, bf16 keys: {_range([r['vs_deepgemm'] for r in pre])} DeepGEMM's fp8 time, "
                   f"{_range([100 * r['pct_matmul'] for r in pre], '{:.0f}', '%')} of the bf16 matmul.")
    return "\n".join(out)


def readme_environment(doc) -> str:
    c = doc["ceilings"]
    ceil = (f" Ceilings measured in the same run: read-only {c['read_gbps']:.0f} GB/s, d2d copy {c['copy_gbps']:.0f} "
            f"GB/s, bf16 matmul {c['matmul_tflops']:.0f} TFLOP/s." if c.get("copy_gbps") else "")
    driver = doc.get("driver") or "driver not recorded"
    return (f"{doc['device']} ({doc['backend']}, {driver}), torch {doc['torch_version']}, cupy-dsa "
            f"{doc.get('cupy_dsa_version') or '?'} at {commit_text(doc)}, {doc['date'][:10]}"
            f"{', quick sizes' if doc['quick'] else ''}.{ceil}")


def readme_recall(doc) -> str:
    """The recall study at its largest context: per format and k, needle resolution, recall vs the exact top-k and
    overlap with the reference numerics' top-k."""
    rows = [r for r in _recall_rows(doc) if not r.get("error")]
    if not rows:
        return "No recall run in this results file."
    ctx = max(r["context_tokens"] for r in rows)
    lines = [f"At {_si(ctx)} tokens ({rows[0]['queries']} needles per format; synthetic keys):", "",
             "| format | k | needle resolution | recall vs exact | overlap with reference |", "|---|---|---|---|---|"]
    for r in rows:
        if r["context_tokens"] == ctx:
            lines.append(f"| {r['format']} | {r['k']} | {_margin(r['resolution'])} | {_pct(r['recall_mean'])} | "
                         f"{_pct(r['ref_overlap_mean'])} |")
    return "\n".join(lines)


README_BLOCKS = {"environment": readme_environment, "recall": readme_recall, "headline": readme_headline, "decode": readme_decode,
                 "verify-extend": readme_verify_extend, "prefill": readme_prefill}


def _serve_block(doc) -> str:
    from .serve import markdown

    return markdown(doc).rstrip("\n")


# blocks rendered from a `bench serve` JSON (the other blocks: from a `bench logits` / `bench all` JSON)
SERVE_README_BLOCKS = {"serve": _serve_block}


def readme_with_results(text: str, doc: dict, blocks: dict | None = None) -> str:
    """``text`` with every ``<!-- results:NAME -->`` ... ``<!-- /results:NAME -->`` block of ``blocks`` (default
    :data:`README_BLOCKS`) re-rendered from ``doc``; blocks of the other results file are left as they are."""
    blocks = README_BLOCKS if blocks is None else blocks
    known = {**README_BLOCKS, **SERVE_README_BLOCKS}

    def render(m):
        name = m["name"]
        if name not in known:
            raise ValueError(f"README block 'results:{name}': expected one of {', '.join(known)}")
        if name not in blocks:
            return m[0]
        return f"{m[1]}{blocks[name](doc)}\n{m[4]}"

    return README_BLOCK.sub(render, text)
