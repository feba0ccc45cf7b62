"""The PNG plots of a results document: the throughput figures in the file asked for and, when the document
also holds recall rows, the recall study in ``<name>-recall.png`` beside it (:func:`plot`)."""

from __future__ import annotations

from pathlib import Path

from .bytes import memory_text
from .output_guard import plot_run, png_metadata
from .readme import plot_caption
from .report import _ok, _recall_rows, _route_pairs, _si, prefill_shape

# --------------------------------------------------------------------------------------------------
# plot
# --------------------------------------------------------------------------------------------------

PLOT_SUFFIX = ".png"


# Served formats (the modes a server runs with their default settings: SGLang's fp8, the plugin's three bf16 modes
# and fp8-rescore at K' = 4x with the bf16 stage-2 query) are drawn last, solid, each in its own colour and marker,
# so that a format with the same figures (bf16+q-bf16 often equals bf16) cannot hide them, and labelled
# "(served)"; the others are thin, dashed or dotted, with hollow markers.
SERVED_FORMATS = ("bf16", "bf16-fp4sim", "bf16-reference", "fp8", "fp8-rescore-4x-bf16q")
# fp8-rescore's smaller K' (2x, 3x) are in the tables and the JSON, not in the plot: one legend of the formats
# that answer "which mode" (it had 15 entries per panel)
PLOT_LEFT_OUT = ("fp8-rescore-2x", "fp8-rescore-3x", "fp8-rescore-2x-bf16q", "fp8-rescore-3x-bf16q")
KEY_LAYOUTS = ("bf16", "fp8")  # the index-key layouts of the logits panels
FORMAT_STYLE = {
    "bf16": dict(color="C0", marker="o", linestyle="-", linewidth=2.4, markersize=6, zorder=5),
    "fp8": dict(color="C1", marker="s", linestyle="-", linewidth=2.0, markersize=5, zorder=4),
    "bf16-reference": dict(color="C6", marker="P", linestyle="-", linewidth=2.0, markersize=7, zorder=4),
    "bf16-fp4sim": dict(color="C3", marker="^", linestyle="-", linewidth=1.6, markersize=6, zorder=4),
    "bf16+q-bf16": dict(color="C2", marker="D", linestyle="--", linewidth=1.0, markersize=7, fillstyle="none"),
    "fp4": dict(color="C4", marker="v", linestyle=":", linewidth=1.0, markersize=5, fillstyle="none"),
    "bf16-fp4sim+q-fp4": dict(color="C5", marker="x", linestyle=":", linewidth=1.0, markersize=5),
    "exact": dict(color="0.3", marker=".", linestyle="-.", linewidth=0.8, markersize=4),
    "fp8-rescore-2x": dict(color="C8", marker="<", linestyle=":", linewidth=1.0, markersize=5),
    "fp8-rescore-3x": dict(color="C8", marker=">", linestyle="--", linewidth=1.0, markersize=5),
    "fp8-rescore-4x": dict(color="C8", marker="*", linestyle="-", linewidth=1.6, markersize=7),
    # stage 2 with the bf16 query (the plugin's default): the same K' markers, hollow, in their own colour
    "fp8-rescore-2x-bf16q": dict(color="C9", marker="<", linestyle=":", linewidth=1.0, markersize=6, fillstyle="none"),
    "fp8-rescore-3x-bf16q": dict(color="C9", marker=">", linestyle="--", linewidth=1.0, markersize=6, fillstyle="none"),
    "fp8-rescore-4x-bf16q": dict(color="C9", marker="*", linestyle="-", linewidth=1.6, markersize=8, fillstyle="none"),
    "reference": dict(color="0.6", marker=".", linestyle="-.", linewidth=0.8, markersize=4),
}


def _plot_order(formats):
    """Served formats last (drawn on top); their legend entries are put first by :func:`_figure_legend`."""
    formats = [f for f in formats if f not in PLOT_LEFT_OUT]
    return [f for f in formats if f not in SERVED_FORMATS] + [f for f in SERVED_FORMATS if f in formats]


def _style(fmt):
    return FORMAT_STYLE.get(fmt, dict(color="0.45", marker="h", linestyle=":", linewidth=1.0))

# Readable at the saved size: no tick label under 8 pt.
RC = {"font.size": 9, "axes.titlesize": 9, "axes.labelsize": 9, "xtick.labelsize": 8, "ytick.labelsize": 8,
      "legend.fontsize": 7.5}
TICK_PT = 8


def _figure_legend(fig, axes):
    """One legend for the recall study's panels (they draw the same formats), served formats first."""
    seen = {}
    for ax in axes:
        for h, label in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(label, h)
    labels = sorted(seen, key=lambda lb: (lb.split(" ")[0] not in SERVED_FORMATS, list(seen).index(lb)))
    if labels:
        fig.legend([seen[lb] for lb in labels], labels, loc="outside right upper", title="format")


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
    ax.set_title(f"needle in top-{k0} vs margin, {_si(ctx)} tokens (synthetic)")
    ax.grid(alpha=0.3)


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
        ax.set_title(f"needle resolution vs context ({styles}; gap = not resolved)")
    else:
        ax.set_ylabel("%")
        ax.set_title((f"recall@k vs exact fp64 ({styles})" if kind == "recall" else
                      f"top-k overlap with DeepSeek-V4 reference numerics ({styles})"))
    ax.grid(alpha=0.3)


def _batch_labels(ax, names, offset=0.0):
    ax.set_xticks([i + offset for i in range(len(names))])
    ax.set_xticklabels([str(s).replace(" + ", "\n+ ") for s in names], fontsize=TICK_PT, rotation=30, ha="right")


def _decode_panel(ax, dec, has_ceiling):
    shapes = list(dict.fromkeys(r.get("batch_name") for r in dec if r["next_n"] == 1 and r["q_dtype"] == "fp8"))
    for j, lay in enumerate(KEY_LAYOUTS):
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
    ax.set_title("decode logits, next_n=1, fp8 q")
    ax.legend()
    ax.grid(alpha=0.3, axis="y")


def _decode_deepgemm_panel(ax, dec):
    shapes = list(dict.fromkeys(r["batch_name"] for r in dec if r.get("vs_deepgemm")))
    for lay in KEY_LAYOUTS[::-1]:
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
    ax.set_title("decode vs DeepGEMM fp8_paged_mqa_logits (1 = parity)")
    ax.grid(alpha=0.3)
    ax.legend()


def _prefill_panel(ax, pre):
    labels = [f"{prefill_shape(r)}\n{r['kv']} {r['layout']}" for r in pre]
    bars = ax.bar(range(len(pre)), [100 * r["pct_matmul"] if r.get("pct_matmul") else r["tflops"] for r in pre],
                  color=[FORMAT_STYLE[r["layout"]]["color"] if r["layout"] in FORMAT_STYLE else "C7" for r in pre])
    vs_dg = any(r.get("vs_deepgemm") for r in pre)
    for b, r in zip(bars, pre):  # each bar says our time / DeepGEMM's where DeepGEMM ran, else our time
        text = (f"{r['vs_deepgemm']:.2f}x DG" if r.get("vs_deepgemm") else
                "" if vs_dg else _time(r["time_us"]))
        ax.annotate(text, (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(pre)))
    ax.set_xticklabels(labels, fontsize=TICK_PT, rotation=30, ha="right")
    has_ceiling = any(r.get("pct_matmul") for r in pre)
    ax.set_ylabel("% of the bf16 matmul (useful FLOPs)" if has_ceiling else "TFLOP/s (no ceiling: CPU backend)")
    ax.set_title("prefill / extend mqa_logits (label: " + ("our time / DeepGEMM fp8)" if vs_dg else "time)"))
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
    ax.set_title("MTP verify and extend vs DeepGEMM (1 = parity)")
    ax.grid(alpha=0.3, axis="y")
    ax.legend()


def _store_panel(ax, doc, has_ceiling):
    rows = [r for r in doc["store"] if not r.get("error")]
    ax.bar(range(len(rows)), [100 * (r["pct_copy"] or 0) if has_ceiling else r["gbps"] for r in rows])
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([f"{r['layout']}\n{r['numerics']}\n{r['kv_dtype']}" for r in rows], fontsize=TICK_PT)
    ax.set_ylabel("% of d2d copy bandwidth" if has_ceiling else "GB/s (no ceiling: CPU backend)")
    ax.set_title("store_index_k")


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
            ax.annotate(_time(at[t]["time_us"]), (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=7)
    ax.set_xticks([i + 0.2 for i in range(len(ts))])
    ax.set_xticklabels([f"T = {_si(t)}" for t in ts], fontsize=TICK_PT)
    ax.set_ylabel("% of the read-only stream" if has_ceiling else "GB/s (no ceiling: CPU backend)")
    ax.set_title("prepare_index_q per C4 layer (label: time)")
    ax.legend()
    ax.grid(alpha=0.3, axis="y")


def _bytes_panel(ax, doc):
    rows = doc["bytes"]
    models = list(dict.fromkeys(r["model"] for r in rows))
    lays = list(dict.fromkeys(r["layout"] for r in rows))
    for j, lay in enumerate(lays):
        ax.bar([i + 0.2 * j for i in range(len(models))],
               [next(r["tokens_fit"] for r in rows if r["model"] == m and r["layout"] == lay) / 1e6 for m in models],
               width=0.2, label=lay, color=_style(lay).get("color"))
    assumed = {r["model"] for r in rows if r.get("assumed")}
    ax.set_xticks([i + 0.1 * (len(lays) - 1) for i in range(len(models))])
    ax.set_xticklabels([m.replace("DeepSeek-", "") + ("\n(assumed)" if m in assumed else "") for m in models],
                       fontsize=TICK_PT)
    ax.set_ylabel(f"M tokens in {memory_text(doc)}")
    ax.set_title("KV capacity by index-key layout" + (" (assumed: layer count not read from a config)"
                                                       if assumed else ""))
    ax.legend()


def _time(us):
    return f"{us / 1e3:.2f} ms" if us >= 1e3 else f"{us:.1f} us"


def recall_path(path: str) -> str:
    """Where :func:`plot` puts the recall study beside the throughput plot ``path``: ``<name>-recall.png``."""
    p = Path(path)
    return str(p.with_name(p.stem + "-recall" + p.suffix))


def panels(doc: dict) -> tuple[list, list]:
    """(throughput panels, recall panels): drawing functions of one axes each."""
    has_ceiling = bool(doc["ceilings"].get("copy_gbps"))
    rec = [r for r in _recall_rows(doc) if r.get("recall_mean") is not None]
    k0 = min((r["k"] for r in rec), default=None)
    dec = _ok(doc, "decode")
    pre = _ok(doc, "prefill")
    recall = [lambda ax, c=c: _needle_panel(ax, rec, k0, c)
              for c in sorted({r["context_tokens"] for r in rec if r["k"] == k0 and not r["trivial"]})]
    if rec:
        recall += [lambda ax, kind=kind: _recall_panel(ax, rec, kind) for kind in ("resolution", "recall", "overlap")]
    perf = []
    if dec:
        perf.append(lambda ax: _decode_panel(ax, dec, has_ceiling))
    if any(r.get("vs_deepgemm") for r in dec):
        perf.append(lambda ax: _decode_deepgemm_panel(ax, dec))
    if pre:
        perf.append(lambda ax: _prefill_panel(ax, pre))
    if any(p[4].get("vs_deepgemm_rows") for p in _route_pairs(doc)):
        perf.append(lambda ax: _routes_deepgemm_panel(ax, doc))
    if any(not r.get("error") for r in doc["store"]):
        perf.append(lambda ax: _store_panel(ax, doc, has_ceiling))
    query = [r for r in doc.get("query", []) if not r.get("error")]
    if query:
        perf.append(lambda ax: _query_panel(ax, query, has_ceiling))
    if doc["bytes"]:
        perf.append(lambda ax: _bytes_panel(ax, doc))
    return perf, recall


def figures(doc: dict, path: str) -> list[tuple[str, object]]:
    """(file, matplotlib figure) of each plot :func:`plot` writes for ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    perf, recall = panels(doc)
    groups = [(path, perf), (recall_path(path), recall)] if perf and recall else [(path, perf or recall)]
    out = []
    for file, group in groups:
        with plt.rc_context(RC):
            ncol = 3 if len(group) > 6 and group is recall else min(2, max(1, len(group)))
            nrow = max(1, (len(group) + ncol - 1) // ncol)
            fig, axes = plt.subplots(nrow, ncol, figsize=(6.4 * ncol, 4.8 * nrow), squeeze=False,
                                     layout="constrained")
            for ax in axes.flat[len(group):]:
                ax.axis("off")
            for ax, draw in zip(axes.flat, group):
                draw(ax)
            if not group:
                axes[0, 0].text(0.5, 0.5, "no data", ha="center")
            if group is recall:
                _figure_legend(fig, axes.flat)
            what = " — recall study" if group is recall and perf else ""
            fig.suptitle(f"cupy-dsa bench{what} — {doc['device']} — {doc['date'][:10]} — "
                         f"{plot_caption(doc)}", fontsize=11)
        out.append((file, fig))
    return out


def plot(doc: dict, path: str) -> list[str]:
    """Write the throughput plot to ``path`` and, when ``doc`` also holds recall rows, the recall study to
    :func:`recall_path` (one figure of every panel was too small to read). Returns the files written."""
    if Path(path).suffix.lower() != PLOT_SUFFIX:
        raise ValueError(f"plot: expected a file name ending in .png (the plot is PNG), got {path!r}")
    import matplotlib.pyplot as plt

    written = []
    perf, recall = panels(doc)
    for file, fig in figures(doc, path):
        Path(file).parent.mkdir(parents=True, exist_ok=True)
        study = bool(recall) and (file != path or not perf)
        # the title in the PNG's metadata too: a test holds it to the JSON it was drawn from; and the run it holds,
        # which the output guard reads before the file is replaced
        fig.savefig(file, dpi=110, format="png", metadata={"Title": fig.get_suptitle(), "Software": "cupy-dsa bench",
                                                           **png_metadata(plot_run(doc, study))})
        plt.close(fig)
        written.append(file)
    return written


def plot_files(doc: dict, path: str) -> list[tuple[str, bool]]:
    """(file, whether it is the recall study) of each plot :func:`plot` writes for ``doc`` at ``path``."""
    perf, recall = panels(doc)
    if perf and recall:
        return [(path, False), (recall_path(path), True)]
    return [(path, bool(recall) and not perf)]
