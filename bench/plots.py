"""The PNG plot of a results document."""

from __future__ import annotations

from pathlib import Path

from .provenance import commit_text
from .report import _ok, _recall_rows, _route_pairs, _si

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


def _query_panel(ax, rows, has_ceiling):
    """prepare_index_q per T: % of the read stream (GPU) or GB/s (CPU), the fp4sim bf16 query next to fp8; each
    bar labelled with its time."""
    ts = sorted({r["n_tokens"] for r in rows})
    for j, numerics in enumerate(("fp4sim", "fp8")):
        at = {r["n_tokens"]: r for r in rows if r["numerics"] == numerics}
        xs = [i + 0.4 * j for i, t in enumerate(ts) if t in at]
        ys = [100 * (at[t].get("pct_read") or 0) if has_ceiling else at[t]["gbps"] for t in ts if t in at]
        bars = ax.bar(xs, ys, width=0.4, label=f"{numerics} query" + (" (bf16-reference)" if numerics == "fp4sim"
                                                                           else ""),
                      color=FORMAT_STYLE["bf16-fp4sim" if numerics == "fp4sim" else "fp8"]["color"])
        for bar, t in zip(bars, [t for t in ts if t in at]):
            us = at[t]["time_us"]
            ax.annotate(f"{us / 1e3:.2f} ms" if us >= 1e3 else f"{us:.1f} us",
                        (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=7)
    ax.set_xticks([i + 0.2 for i in range(len(ts))])
    ax.set_xticklabels([f"T = {_si(t)}" for t in ts], fontsize=8)
    ax.set_ylabel("% of the read-only stream" if has_ceiling else "GB/s (no ceiling: CPU backend)")
    ax.set_title("prepare_index_q per C4 layer (label: time)", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")


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
    query = [r for r in doc.get("query", []) if not r.get("error")]
    if query:
        panels.append(lambda ax: _query_panel(ax, query, has_ceiling))
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
