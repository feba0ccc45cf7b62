"""Result document (JSON schema), rich tables, the markdown headline table and the PNG plot."""

from __future__ import annotations

import datetime as _dt
import json
import os
import subprocess
from pathlib import Path

from rich.table import Table

SCHEMA = "cupy-dsa-bench/1"
SECTIONS = ("bytes", "store", "logits", "recall")


# --------------------------------------------------------------------------------------------------
# document
# --------------------------------------------------------------------------------------------------

def git_commit() -> str | None:
    """Commit of the code that ran: CUPY_DSA_COMMIT (set when the tree was copied without .git), else git."""
    if os.environ.get("CUPY_DSA_COMMIT"):
        return os.environ["CUPY_DSA_COMMIT"]
    try:
        root = Path(__file__).resolve().parents[1]
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                             text=True, timeout=5)
        if out.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except Exception:
        return None


def new_document(*, backend: str, device_name: str, quick: bool, seed: int, gpu_mem_gb: float) -> dict:
    import torch

    import cupy_dsa

    return {
        "schema": SCHEMA,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "cupy_dsa_version": getattr(cupy_dsa, "__version__", None),
        "torch_version": torch.__version__,
        "device": device_name,
        "backend": backend,
        "quick": quick,
        "seed": seed,
        "gpu_mem_gb": gpu_mem_gb,
        "ceilings": {"copy_gbps": None, "matmul_tflops": None, "read_gbps": None, "copy_bytes": None,
                     "matmul_n": None, "l2_bytes": None},
        "targets": {},
        "notes": {s: [] for s in SECTIONS},
        "bytes": [], "store": [], "logits": [], "recall": [],
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
# rich tables
# --------------------------------------------------------------------------------------------------

def ceilings_table(doc) -> Table:
    c = doc["ceilings"]
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
                  f"{r['tokens_per_s'] / 1e9:.2f} G", f"{r['gbps']:.0f}", _pct(r["pct_copy"]),
                  _target_pct(r.get("target_pct_copy")), _verdict(r))
    return t


def decode_table(doc) -> Table:
    t = Table(title="paged_mqa_logits, decode (index entries per request; width = max_context_len)")
    for col in ("batch", "entries", "next_n", "layout", "q", "time", "plan", "key GB/s", "% read", "vs fp8",
                "DeepGEMM", "ours/DG", "DG rel L2", "torch", "speed-up", "mem ours", "target", "result"):
        t.add_column(col, justify="right")
    for r in doc["logits"]:
        if r.get("mode") != "decode":
            continue
        head = (r.get("batch_name", f"{r['batch']} x {_si(r['context'])}"), _si(r.get("entries", 0)),
                str(r["next_n"]), r["layout"], r["q_dtype"])
        if r.get("error"):
            t.add_row(*head, f"[red]{r['error'][:60]}[/]", *[""] * 12)
            continue
        target = _target_pct(r.get("target_pct_read")) if r.get("target_pct_read") else (
            f"<={r['target_us']:g} us" if r.get("target_us") else "—")
        t.add_row(*head, f"{r['time_us']:.1f} us", _f(r.get("plan_us"), "{:.1f} us"),
                  _f(r.get("key_gbps"), "{:.0f}"), _pct(r.get("pct_read")), _f(r.get("time_vs_fp8"), "{:.2f}x"),
                  _f(r.get("deepgemm_us"), "{:.1f} us"), _f(r.get("vs_deepgemm"), "{:.2f}x"),
                  _f(r.get("deepgemm_rel_l2"), "{:.1e}"), _f(r.get("torch_time_us"), "{:.0f} us"),
                  _f(r.get("speedup_vs_torch"), "{:.1f}x"), _f(r.get("peak_extra_mb"), "{:.1f} MB"),
                  target, _verdict(r))
    return t


def prefill_table(doc) -> Table:
    t = Table(title="mqa_logits, prefill (causal: ks = 0, ke = S - T + i + 1)")
    for col in ("T x S", "kv", "layout", "time", "TFLOP/s", "% matmul", "G pairs/s", "mem ours", "target",
                "result"):
        t.add_column(col, justify="right")
    for r in doc["logits"]:
        if r.get("mode") != "prefill":
            continue
        shape = f"{_si(r['rows'])} x {_si(r['keys'])}"
        if r.get("error"):
            t.add_row(shape, r["kv"], r["layout"], f"[red]{r['error'][:60]}[/]", *[""] * 6)
            continue
        t.add_row(shape, r["kv"], r["layout"], f"{r['time_us'] / 1e3:.3f} ms", f"{r['tflops']:.1f}",
                  _pct(r["pct_matmul"]), f"{r['gpairs_per_s']:.1f}", _f(r.get("peak_extra_mb"), "{:.0f} MB"),
                  _target_pct(r.get("target_pct_matmul")), _verdict(r))
    return t


def recall_table(doc) -> Table:
    t = Table(title="Needle in a haystack (synthetic keys): recall@k vs exact fp64 / needle-in-top-k rate")
    rows = doc["recall"]
    ctxs = sorted({r["context_tokens"] for r in rows})
    t.add_column("k")
    t.add_column("format")
    for c in ctxs:
        t.add_column(f"{_si(c)} tok", justify="right")
    for k in sorted({r["k"] for r in rows}):
        for fmt in dict.fromkeys(r["format"] for r in rows):
            cells = []
            for c in ctxs:
                r = next((x for x in rows if x["k"] == k and x["format"] == fmt and x["context_tokens"] == c), None)
                if r is None or r.get("recall_mean") is None:
                    cells.append("[red]err[/]" if (r and r.get("error")) else "—")
                    continue
                cell = f"{100 * r['recall_mean']:.2f}% / {100 * r['needle_in_topk']:.0f}%"
                cells.append(f"[dim]{cell}[/]" if r["trivial"] else cell)
            t.add_row(str(k), fmt, *cells)
    return t


def print_all(console, doc, sections) -> None:
    if any(s in sections for s in ("store", "logits")):
        console.print(ceilings_table(doc))
    if "bytes" in sections and doc["bytes"]:
        console.print(bytes_table(doc))
        for n in doc["notes"]["bytes"]:
            console.print(f"  [dim]- {n}[/]")
    if "store" in sections and doc["store"]:
        console.print(store_table(doc))
        for n in doc["notes"]["store"]:
            console.print(f"  [dim]- {n}[/]")
    if "logits" in sections and doc["logits"]:
        console.print(decode_table(doc))
        console.print(prefill_table(doc))
        for n in doc["notes"]["logits"]:
            console.print(f"  [dim]- {n}[/]")
    if "recall" in sections and doc["recall"]:
        console.print(recall_table(doc))
        for n in doc["notes"]["recall"]:
            console.print(f"  [dim]- {n}[/]")
    errors = [r for s in ("store", "logits", "recall") for r in doc[s] if r.get("error")]
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
        f"{doc['date'][:10]}, commit `{doc['git_commit'] or 'unknown'}`. Ceilings measured in the same run: "
        f"d2d copy {_f(c.get('copy_gbps'), '{:.0f}')} GB/s (read+write), read-only {_f(c.get('read_gbps'), '{:.0f}')} "
        f"GB/s, bf16 matmul {_f(c.get('matmul_tflops'), '{:.0f}')} TFLOP/s.",
        "",
        "| figure | result | ratio | target | |",
        "|---|---|---|---|---|",
    ]
    for r in doc["store"]:
        if r.get("error") or r["kv_dtype"] != "float32":
            continue
        lines.append(f"| store {_si(r['n_tokens'])} tokens, {r['layout']} {r['numerics']} | {r['time_us']:.0f} us, "
                     f"{r['gbps']:.0f} GB/s | {_pct(r['pct_copy'])} of copy | "
                     f"{_target_pct(r.get('target_pct_copy'))} | {_md_verdict(r)} |")
    for r in doc["logits"]:
        if r.get("error"):
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
            lines.append(f"| prefill {_si(r['rows'])} x {_si(r['keys'])}, {r['kv']} {r['layout']} | "
                         f"{r['time_us'] / 1e3:.2f} ms, {r['tflops']:.0f} TFLOP/s | {_pct(r['pct_matmul'])} of matmul | "
                         f"{_target_pct(r.get('target_pct_matmul'))} | {_md_verdict(r)} |")
    rec = [r for r in doc["recall"] if r.get("recall_mean") is not None and not r["trivial"]]
    if rec:
        L = max(r["context_tokens"] for r in rec)
        for k in sorted({r["k"] for r in rec}):
            cells = [f"{r['format']} {100 * r['recall_mean']:.2f}%" for r in rec
                     if r["context_tokens"] == L and r["k"] == k and r["format"] != "exact"]
            needle = [f"{r['format']} {100 * r['needle_in_topk']:.0f}%" for r in rec
                      if r["context_tokens"] == L and r["k"] == k and r["format"] != "exact"]
            lines.append(f"| recall@{k} at {_si(L)} tokens (synthetic) | {', '.join(cells)} | needle: "
                         f"{', '.join(needle)} | — | |")
    for r in doc["bytes"]:
        if r["model"] == "DeepSeek-V4-Flash" and r["layout"] in ("fp8", "bf16"):
            lines.append(f"| V4-Flash capacity, {r['layout']} index keys | {r['tokens_fit'] / 1e6:.2f}M tokens in "
                         f"{r['gpu_mem_gb']:g} GB | {r['tokens_fit_vs_fp8']:.3f}x of fp8 | — | |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------
# plot
# --------------------------------------------------------------------------------------------------

def plot(doc: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = []
    rec = [r for r in doc["recall"] if r.get("recall_mean") is not None]
    if rec:
        panels += [("recall", k) for k in sorted({r["k"] for r in rec})] + [("needle", None)]
    dec = [r for r in doc["logits"] if r.get("mode") == "decode" and not r.get("error")]
    if dec:
        panels.append(("decode", None))
    if any(not r.get("error") for r in doc["store"]):
        panels.append(("store", None))
    if doc["bytes"]:
        panels.append(("bytes", None))
    if not panels:
        panels.append(("empty", None))
    ncol = min(3, len(panels))
    nrow = (len(panels) + ncol - 1) // ncol
    fig, axes = plt.subplots(nrow, ncol, figsize=(5.2 * ncol, 4.0 * nrow), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    for ax, (kind, k) in zip(axes.flat, panels):
        if kind in ("recall", "needle"):
            kk = k if kind == "recall" else min(r["k"] for r in rec)
            for fmt in dict.fromkeys(r["format"] for r in rec):
                pts = sorted((r["context_tokens"], r["recall_mean"] if kind == "recall" else r["needle_in_topk"])
                             for r in rec if r["format"] == fmt and r["k"] == kk)
                ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker="o", label=fmt,
                        linestyle="--" if fmt == "exact" else "-")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("context (raw tokens; index entries = tokens / 4)")
            ax.set_ylabel("%")
            ax.set_title(f"recall@{kk} vs exact fp64 (synthetic keys)" if kind == "recall"
                         else f"needle in top-{kk} (synthetic keys)")
            if kind == "needle":
                ax.set_ylim(-3, 103)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        elif kind == "decode":
            shapes = list(dict.fromkeys(r.get("batch_name") for r in dec if r["next_n"] == 1
                                        and r["q_dtype"] == "fp8"))
            x = range(len(shapes))
            for j, lay in enumerate(("bf16", "fp8")):
                vals = []
                for s in shapes:
                    r = next((r for r in dec if r.get("batch_name") == s and r["next_n"] == 1
                              and r["layout"] == lay and r["q_dtype"] == "fp8"), None)
                    vals.append(100 * r["pct_read"] if r and r.get("pct_read") else 0)
                ax.bar([i + 0.4 * j for i in x], vals, width=0.4, label=f"{lay} keys")
            ax.set_xticks([i + 0.2 for i in x])
            ax.set_xticklabels([str(s).replace(" + ", "\n+ ") for s in shapes], fontsize=6, rotation=30)
            ax.set_ylabel("% of the read-only stream (key bytes)")
            ax.set_title("decode logits, next_n=1")
            ax.legend(fontsize=7)
            ax.grid(alpha=0.3, axis="y")
        elif kind == "store":
            rows = [r for r in doc["store"] if not r.get("error")]
            ax.bar(range(len(rows)), [100 * (r["pct_copy"] or 0) for r in rows])
            ax.set_xticks(range(len(rows)))
            ax.set_xticklabels([f"{r['layout']}\n{r['numerics']}\n{r['kv_dtype']}" for r in rows], fontsize=6)
            ax.set_ylabel("% of d2d copy bandwidth")
            ax.set_title("store_index_k")
        elif kind == "bytes":
            rows = doc["bytes"]
            models = list(dict.fromkeys(r["model"] for r in rows))
            lays = list(dict.fromkeys(r["layout"] for r in rows))
            for j, lay in enumerate(lays):
                ax.bar([i + 0.2 * j for i in range(len(models))],
                       [next(r["tokens_fit"] for r in rows if r["model"] == m and r["layout"] == lay) / 1e6
                        for m in models], width=0.2, label=lay)
            ax.set_xticks([i + 0.3 for i in range(len(models))])
            ax.set_xticklabels([m.replace("DeepSeek-", "") for m in models], fontsize=7)
            ax.set_ylabel(f"M tokens in {doc['gpu_mem_gb']:g} GB")
            ax.set_title("KV capacity by index-key layout")
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "no data", ha="center")
            ax.axis("off")
    fig.suptitle(f"cupy-dsa bench — {doc['device']} — {doc['date'][:10]} — {doc['git_commit'] or ''}", fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)
