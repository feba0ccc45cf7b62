"""The ``cupy-dsa`` command line, and only that: option parsing and checking, dispatch, and the console output of
each command (the measurements live in the modules each command calls). One responsibility, hence one module.

Commands: ``cupy-dsa bench`` (= ``bench all``) and ``bench bytes | store | query | logits | recall | all`` (the
sections), ``bench serve | variants | rescore | resources | report`` (each with its own options), and
``cupy-dsa needle`` (recall of a running server).

The common options (:func:`common_options`) are taken by ``bench`` and by each section; given to both, the
section's value wins. Given to ``bench`` before ``serve``, ``variants``, ``rescore``, ``resources`` or ``report``
(:data:`OWN_OPTIONS`) they are refused (exit status 2), since those commands would ignore them. Every bad value is
a usage error (exit status 2, no traceback) before any work. Heavy modules (torch, rich, the bench's sweeps) are
imported inside the commands, so ``--help`` stays fast.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import tempfile
import time
from pathlib import Path

import click

SECTIONS_ALL = ("bytes", "store", "query", "logits", "recall")
DEFAULTS = {"backend": "auto", "device": None, "quick": False, "json_path": None, "plot_path": None,
            "markdown_path": None, "seed": 0, "gpu_mem_gb": 100.0, "suite": "needle"}


def _png_path(ctx, param, value):
    """--plot: the plot is written as PNG, so the name must say so (no silent PNG bytes in x.jpg)."""
    if value is not None and Path(value).suffix.lower() != ".png":
        raise click.BadParameter(f"expected a file name ending in .png (the plot is written as PNG), got {value!r}")
    return value


def _probe_writable(path: Path) -> None:
    """Raise the OSError that writing ``path`` later would raise (the file is created and removed again, or
    for a missing directory, one is made and removed where the writer would create it)."""
    if path.exists():
        with open(path, "ab"):
            return
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if parent == path.parent:
        with open(path, "xb"):
            pass
        path.unlink()
    else:
        os.rmdir(tempfile.mkdtemp(dir=parent))


def _writable_output(ctx, param, value):
    """--json / --plot / --markdown: checked while the options are parsed, so a run that takes minutes does not
    fail at its end on a path it cannot write ('-' is stdout)."""
    if value is None or value == "-":
        return value
    try:
        _probe_writable(Path(value))
    except OSError as e:
        raise click.BadParameter(f"cannot write {value!r} ({type(e).__name__}: {e.strerror or e})") from None
    return value


def _png_output(ctx, param, value):
    return _writable_output(ctx, param, _png_path(ctx, param, value))


class FiniteFloatRange(click.FloatRange):
    """A FloatRange that also refuses NaN and infinities (click's range lets NaN through every bound)."""

    def convert(self, value, param, ctx):
        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return rv


MAX_MEMORY = 1e6  # GB / GiB: far above any GPU, low enough that token counts stay exact integers
SEED = click.IntRange(0, 2**32 - 1)  # the bench offsets seeds by small counts; torch takes up to 2**64 - 1
MARKDOWN_HELP = "write the compact markdown headline table (what the README quotes) here; '-' prints it to stdout."
QUICK_HELP = ("smaller sizes. GPU: every section (ceilings, store, query, logits, recall: 3 contexts x 8 needles). "
              "CPU backend: recall runs 2 contexts x 4 needles instead of 4 x 8 (up to 64K tokens); store and logits always run "
              "their tiny CPU sizes.")


def common_options(f):
    """The options every bench command accepts (defaults resolved after merging group and subcommand)."""
    opts = [
        click.option("--backend", type=click.Choice(["auto", "cuda", "cpu"], case_sensitive=False), default=None,
                     help="auto = the GPU when torch sees one, else the CPU reference at small sizes (store, query, logits, "
                          "recall; `bytes` only checks it). [default: auto]"),
        click.option("--device", default=None, metavar="DEV",
                     help="torch device for the GPU backend, e.g. cuda:1 (store, query, logits, recall; `bytes` only checks "
                          "it). [default: the current device]"),
        click.option("--quick", is_flag=True, default=False, help=QUICK_HELP),
        click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True), default=None,
                     callback=_writable_output, help="write the results as JSON (schema cupy-dsa-bench/2)."),
        click.option("--plot", "plot_path", type=click.Path(dir_okay=False, writable=True), default=None,
                     callback=_png_output, help="write a PNG plot (matplotlib); the name must end in .png. With "
                     "throughput and recall rows, the recall study goes to NAME-recall.png beside it."),
        click.option("--markdown", "markdown_path", type=click.Path(dir_okay=False, writable=True, allow_dash=True),
                     default=None, callback=_writable_output, help=MARKDOWN_HELP),
        click.option("--seed", type=SEED, default=None, help="random seed of the inputs (store, query, logits, recall), 0 to 2^32 - 1. [default: 0]"),
        click.option("--gpu-mem-gb", type=FiniteFloatRange(min=0, min_open=True, max=MAX_MEMORY), default=None,
                     help="KV memory budget for `bytes` (GB = 1e9 B), up to 1e6. [default: 100]"),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _merged(ctx: click.Context, own: dict) -> dict:
    group = (ctx.parent.params if ctx.parent is not None else {}) or {}
    out = {}
    for k, d in DEFAULTS.items():
        if k == "quick":
            out[k] = bool(own.get(k)) or bool(group.get(k))
            continue
        v = own.get(k)
        if v is None:
            v = group.get(k)
        out[k] = d if v is None else v
    return out


@click.group(name="cupy-dsa", context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="cupy-dsa", prog_name="cupy-dsa")
def main():
    """cupy_dsa: bf16 index keys for the DeepSeek sparse-attention indexer."""


@main.group(name="bench", invoke_without_command=True)
@common_options
@click.pass_context
def bench(ctx, **opts):
    """Bytes/token, throughput and recall of the index-key layouts, side by side.

    Without a subcommand, runs `all` (bytes, store, query, logits, recall)."""
    if ctx.invoked_subcommand in OWN_OPTIONS:
        _refuse_group_options(ctx, ctx.invoked_subcommand)
    if ctx.invoked_subcommand is None:
        _run(ctx, SECTIONS_ALL, _merged_top(opts))


# subcommands that take none of bench's options
OWN_OPTIONS = ("serve", "variants", "rescore", "resources", "report")


def _refuse_group_options(ctx: click.Context, sub: str) -> None:
    """An option given to ``bench`` before one of :data:`OWN_OPTIONS` would be ignored: refused (rc 2) before any
    work, naming where it belongs."""
    given = [p.opts[0] for p in ctx.command.params if ctx.params.get(p.name) not in (None, False)]
    if given:
        raise click.UsageError(
            f"{', '.join(given)} given to `bench` {'applies' if len(given) == 1 else 'apply'} to its sections "
            f"(bytes, store, query, logits, recall, all), not to `bench {sub}`, which takes its own options after "
            f"its name (cupy-dsa bench {sub} --help)",
            ctx=ctx)


def _write_text(path: str, text: str) -> None:
    """A JSON file of a command; its folder is made as every output's is (the path was checked up front)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text)


def _merged_top(opts: dict) -> dict:
    out = {}
    for k, d in DEFAULTS.items():
        v = opts.get(k)
        out[k] = d if v is None else v
    out["quick"] = bool(opts.get("quick"))
    return out


def _subcommand(name, sections, doc, extra_options=()):
    @bench.command(name=name, help=doc)
    @common_options
    @click.pass_context
    def cmd(ctx, **opts):
        _run(ctx, sections, _merged(ctx, opts))

    for option in reversed(extra_options):
        cmd = option(cmd)
    cmd.__name__ = f"bench_{name}"
    return cmd


SUITE_OPTION = click.option(
    "--suite", type=click.Choice(["needle", "diverse"], case_sensitive=False), default=None,
    help="needle: needles among near-duplicate clusters with a controlled margin (the competing keys share the "
         "query's rounding); diverse: a top-k boundary contested by diverse keys (AR(1) drift, topic clusters, "
         "outlier channels through the norm weight) and realistic queries, every format with its error budget "
         "(missed with only the key rounded, only the query rounded, both). CPU: small sizes; GPU: 16K and 64K keys, "
         "k 512 and 2048. [default: needle]")


_subcommand("bytes", ("bytes",), "Bytes per index token of each layout, per C4 layer and per full token, for "
            "DeepSeek-V4-Flash, V4-Pro and V3.2; KV capacity with fp8 vs bf16 index keys. No GPU needed.")
_subcommand("store", ("store",), "store_index_k throughput at N = 1M tokens (bf16 exact / fp4sim, fp8; kv fp32 "
            "and bf16) against the d2d copy bandwidth measured in the same run.")
_subcommand("query", ("query",), "prepare_index_q (fp4sim bf16 and fp8 query, T = 1, 64, 4096, 16384) against "
            "the bytes it moves and the read-only stream ceiling measured in the same run.")
_subcommand("logits", ("logits",), "paged_mqa_logits (decode: equal, long-tail and one-long batches, next_n "
            "1-4, bf16 and fp8 keys, DeepGEMM live when importable, torch gather+bmm baseline) and mqa_logits "
            "(prefill) against the read-only stream / bf16 matmul rate measured in the same run.")
_subcommand("recall", ("recall",), "Needle suite with a controlled margin and a DeepSeek-V4 reference comparison, "
            "on synthetic keys through the real store and logits ops: per format and context, the needle-in-top-k "
            "rate at margins 0.001%..10% over the best distractor (exact fp64 passes every needle by construction), "
            "the resolution (smallest margin with >= 99% kept), recall@512/1024 vs exact fp64 and top-k overlap "
            "with the reference numerics (fp4-simulated q and keys, fp32 scores). --suite diverse: diverse keys and "
            "realistic queries instead, each format's share of the exact top-k missed and its error budget.",
            extra_options=(SUITE_OPTION,))
_subcommand("all", SECTIONS_ALL, "Run bytes, store, query, logits and recall (the default).")


def _counts_option(default: tuple, what: str, lo: int = 1, hi: int | None = None):
    """A repeatable option of comma lists of ints (K/M suffixes: x 1024 / x 2^20), each in [lo, hi]; sorted,
    without repeats; ``default`` when not given."""
    def parse(ctx, param, values):
        out = []
        for value in values:
            for part in str(value).split(","):
                m = re.fullmatch(r"(\d+)([km]?)", part.strip().lower())
                n = int(m.group(1)) * {"": 1, "k": 1024, "m": 2**20}[m.group(2)] if m else None
                if n is None or n < lo or (hi is not None and n > hi):
                    raise click.BadParameter(f"expected {what}, got {value!r}")
                out.append(n)
        return tuple(sorted(set(out))) or default
    return parse


_contexts_option = _counts_option((8192, 32768, 131072), "positive token counts such as 8192,32K,128K")


def _serve_layouts_option(ctx, param, values):
    """--layouts: names of serve.TIMED (comma list or repeated), in TIMED's order; () = all."""
    from . import serve

    known = [name for name, _ in serve.TIMED]
    asked = {part.strip() for value in values for part in str(value).split(",") if part.strip()}
    unknown = sorted(asked - set(known))
    if unknown:
        raise click.BadParameter(f"expected layouts of {', '.join(known)}, got {', '.join(map(repr, unknown))}")
    return tuple(name for name in known if name in asked)


def _serve_queries_option(ctx, param, values):
    """--query: the plugin's query settings (comma list or repeated), fp8 first; () = none (no query rows)."""
    from cupy_dsa.sglang.core import QUERY_CHOICES

    asked = {part.strip().lower() for value in values for part in str(value).split(",") if part.strip()}
    unknown = sorted(asked - set(QUERY_CHOICES))
    if unknown:
        raise click.BadParameter(f"expected queries of {', '.join(QUERY_CHOICES)}, got {', '.join(map(repr, unknown))}")
    return tuple(q for q in QUERY_CHOICES if q in asked)


def _model_option(ctx, param, value):
    from . import serve

    try:
        return serve.resolve_model(value)
    except ValueError as exc:
        raise click.BadParameter(f"expected {' / '.join(serve.BUILTIN)} or a DeepSeek-V4 config.json: {exc}")


def _refuse_replacing_a_measured_run(json_path: str) -> None:
    """Without a GPU `bench serve` measures nothing: its JSON must not replace a file that holds a measured run (the
    README's reproduction line names the committed H200 file)."""
    try:
        old = json.loads(Path(json_path).read_text())
    except (OSError, ValueError):
        return
    if isinstance(old, dict) and old.get("measured"):
        raise click.BadParameter(
            f"{json_path} holds a measured run ({old.get('device') or 'a GPU'}); without a GPU this run measures "
            "nothing and would replace it with the memory figures only: write to another file",
            param_hint="'--json'")


@bench.command(name="serve")
@click.option("--model", default="v4-flash", show_default=True, callback=_model_option,
              help="v4-flash, v4-pro (layer count assumed, see the output) or the path of an HF config.json "
                   "(compress_ratios, num_hidden_layers, index_topk).")
@click.option("--batch", type=click.IntRange(min=1), default=32, show_default=True, help="requests per decode step.")
@click.option("--context", "contexts", multiple=True, callback=_contexts_option,
              help="tokens per request (comma list or repeated; K/M suffixes). [default: 8192,32768,131072]")
@click.option("--next-n", "next_ns", multiple=True, callback=_counts_option((1,), "next_n values 1 to 4 such as 1,2,4",
                                                                             lo=1, hi=4),
              help="rows per request: 1 = plain decode, 2..4 = MTP verify; a comma list (or repeated) times "
                   "each. [default: 1]")
@click.option("--chunk", "chunks", multiple=True, callback=_counts_option((4096,), "token counts of 4 or more such "
                                                                          "as 4096,16K", lo=4),
              help="tokens per prefill chunk; a comma list (or repeated, K suffix) times each. [default: 4096]")
@click.option("--memory-gib", type=FiniteFloatRange(min=0, min_open=True, max=MAX_MEMORY), default=80.0,
              show_default=True, help="index-cache budget for the tokens-that-fit figure (GiB), up to 1e6.")
@click.option("--layouts", "layouts", multiple=True, callback=_serve_layouts_option,
              help="time only these layouts (comma list or repeated) of: bf16, bf16+topk (bf16 + the stock top-k), "
                   "fp8-cupy, fp8 (DeepGEMM on SGLang's route), fp8+topk (fp8 + the stock top-k: SGLang's v2 where "
                   "it runs, else cupy_dsa.paged_topk standing in), fp8-rescore (our stage 1), fp8-rescore-dg "
                   "(DeepGEMM stage 1). [default: all]")
@click.option("--query", "queries", multiple=True, callback=_serve_queries_option,
              help="also time the layouts whose query the plugin's SGLANG_CUPY_DSA_INDEX_Q sets (bf16, fp8-cupy) with "
                   "each of these queries (comma list of fp8, bf16), the query's preparation included. [default: none]")
@click.option("--arch-configs", "configs_of", default=None, metavar="ARCH",
              type=click.Choice(["sm_120"]),   # the archs every arch declares the product configs of
              help="cupy_dsa's logits launch ARCH's product configs, forced on this GPU at its own residency "
                   "(`bench variants --emulate` also holds ARCH's CTAs per SM). [default: this GPU's own]")
@click.option("--device", default=None, metavar="DEV", help="CUDA device, e.g. cuda:1. [default: the current one]")
@click.option("--seed", type=SEED, default=0, show_default=True, help="random seed, 0 to 2^32 - 1.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True, allow_dash=True), default=None,
              callback=_writable_output, help="write the results as JSON (schema cupy-dsa-serve/1); '-' = stdout.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, writable=True), default=None,
              callback=_png_output, help="PNG: ms per step over context, bf16 vs fp8, and the added ms (a row per "
                                          "kind of step).")
def serve_cmd(model, batch, contexts, next_ns, chunks, layouts, queries, configs_of, memory_gib, device, seed,
              json_path, plot_path):
    """Indexer cost of one forward of a DeepSeek-V4 server with bf16 index keys vs SGLang's fp8 (DeepGEMM on the
    route SGLang 0.5.23 takes for the step), and of the fp8-cupy mode (SGLang's fp8 keys on cupy_dsa's kernels): ms
    per decode (verify) step and per prefill chunk over every C4 layer, KV bytes per token and tokens that fit.
    fp8-rescore (two-level keys, its top-k included) against the fp8 and bf16 steps with the stock top-k (SGLang's
    own v2 kernel where it runs, else cupy_dsa.paged_topk standing in for it; each top-k also timed alone). Without
    a GPU it prints the memory figures only."""
    import torch
    from rich.console import Console
    from rich.table import Table

    from . import peers, provenance, report, serve

    out, err = _console(stderr=json_path == "-"), Console(stderr=True)
    dev = None
    if device is not None or torch.cuda.is_available():  # checked before any work
        dev, _ = _resolve_device("cuda", device, has_backend_option=False)
    if dev is None and json_path not in (None, "-"):
        _refuse_replacing_a_measured_run(json_path)
    case_list = serve.cases(batch, contexts, next_ns, chunks)
    model_doc = {"name": model.name, "n_layers": model.n_layers, "index_layers": model.n_c4,
                 "index_topk": model.index_topk, "source": model.source, "assumed": model.assumed}
    doc = {"schema": serve.SCHEMA, **provenance.provenance(), "model": model_doc,
           "batch": batch, "contexts": list(contexts), "next_n": list(next_ns), "chunk": list(chunks),
           "cases": [serve.case_label(c) for c in case_list],
           "memory": serve.memory_rows(model, memory_gib), "timings": [], "device": None,
           "layouts": list(layouts or (name for name, _ in serve.TIMED)),
           "measured": False, "not_measured": None, "deepgemm": None, "notes": [serve.COUNTED]}
    if any(name.startswith("fp8-rescore") for name in doc["layouts"]):
        doc["notes"].append(serve.RESCORE_COUNTED)
    if queries:
        doc["queries"], doc["query_timings"] = list(queries), []
        doc["notes"].append(serve.QUERY_COUNTED)
    if configs_of:
        doc["arch_configs"] = configs_of
        doc["notes"].append(serve.arch_configs_note(configs_of))
    if model.assumed:
        err.print(f"[yellow]{model.name}: {model.assumed}[/]")
    mem = Table(title=f"{model.name}: index cache, {model.n_c4} C4 layers of {model.n_layers} (per raw token: "
                      f"one index entry per {serve.C4_RATIO} tokens in each C4 layer)")
    for col in ("layout", "B/entry", "B per token (all C4 layers)", f"tokens in {memory_gib:g} GiB"):
        mem.add_column(col, justify="right")
    for r in doc["memory"]:
        mem.add_row(r["layout"], str(r["bytes_per_entry"]), f"{r['index_bytes_per_token']:.1f}", f"{r['tokens_fit']:,}")
    out.print(mem)
    from . import roofline

    doc["roofline_model"] = {"gpu": roofline.RTX_PRO_6000.name, "source": roofline.RTX_PRO_6000.source,
                             "rows": roofline.model_rows(case_list, model.n_c4)}
    out.print(roofline.markdown(doc["roofline_model"]["rows"], roofline.RTX_PRO_6000, model.name, model.n_c4),
              markup=False, highlight=False)
    if dev is None:
        doc["not_measured"] = "no CUDA GPU: the ms per step / chunk need one and are not reported"
        out.print(f"[yellow]Not measured: {doc['not_measured']}. Cases asked for (context in raw tokens): "
                  f"{'; '.join(doc['cases'])}.[/]")
    else:
        torch.cuda.set_device(dev)
        doc["device"] = _device_name(dev)
        doc["driver"] = provenance.driver_version()
        dg, reason = peers.deepgemm()
        doc["deepgemm"] = reason or "live"
        if dg is None:
            err.print(f"[yellow]fp8 not measured: {reason}[/]")
        topks = None
        if any(name in serve.WITH_TOPK for name in doc["layouts"]):
            topks = _load_topks(dev, err)
            doc["topk"] = topks.describe()
        with _progress(err) as progress:
            task = progress.add_task("serve", total=len(case_list))
            for c in case_list:
                doc["timings"].append(serve.measure(c, model, dev, dg, seed, reps=10, layouts=layouts or None,
                                                    topks=topks, configs_of=configs_of))
                progress.advance(task)
        doc["measured"] = True
        t = Table(title=f"indexer ms per forward (all {model.n_c4} C4 layers), {doc['device']}; top-k excluded; "
                        f"context in raw tokens (index entries = tokens / {serve.C4_RATIO})")
        for col in ("phase", "batch", "context", "next_n", "chunk", "bf16 ms", "fp8 ms", "added ms", "ratio",
                    "target", "result", "fp8-cupy ms", "fp8-cupy / fp8", "fp8 route", "fp8 gather ms", "error"):
            t.add_column(col, justify="right")
        def f(v, p=3):
            return "-" if v is None else f"{v:.{p}f}"

        for r in doc["timings"]:
            t.add_row(r["phase"], str(r["batch"]), str(r["context"]), str(r["next_n"]), str(r["chunk"] or "-"),
                      f(r["bf16_ms"]), f(r["fp8_ms"]), f(r["added_ms"]), f(r["ratio"], 2),
                      f"<= {r['target_ratio']:.2f}x" if r["target_ratio"] else "-", r["verdict"] or "-",
                      f(r["fp8_cupy_ms"]), f(r["fp8_cupy_ratio"], 2), r["fp8_route"] if dg is not None else "-",
                      f(r["fp8_gather_ms"]), r["error"] or "")
        report.print_fitted(out, t, keys=5)
        if queries:
            with _progress(err) as progress:
                task = progress.add_task("serve --query", total=len(case_list))
                for c in case_list:
                    doc["query_timings"].append(serve.measure_queries(c, model, dev, seed, reps=10, queries=queries,
                                                                      configs_of=configs_of))
                    progress.advance(task)
            out.print("\n".join(serve.query_markdown(doc)), markup=False, highlight=False, soft_wrap=True)
        rescored = [r for r in doc["timings"] if r["fp8_rescore_ms"] is not None or r["fp8_rescore_dg_ms"] is not None]
        if rescored:
            stock = (f"{doc['topk']['stock']}{' (STAND-IN for SGLang v2)' if doc['topk']['stand_in'] else ''}"
                     if doc.get("topk") else "not timed")
            t2 = Table(title=f"fp8-rescore ms per forward (all {model.n_c4} C4 layers), top-k included; + top-k = "
                             f"the step + the stock top-k: {stock}")
            for col in ("phase", "batch", "context", "next_n", "chunk", "fp8 ms", "fp8 + top-k ms", "bf16 + top-k ms",
                        "fp8-rescore ms", "/ (fp8 + top-k)", "/ (bf16 + top-k)", "DG stage 1 ms", "DG / (fp8 + top-k)",
                        "DG / (bf16 + top-k)", "issue-31 targets (DG)"):
                t2.add_column(col, justify="right")
            for r in rescored:
                targets = "; ".join(f"<= {t['target']:.2f}x {t['basis']}: {t['verdict'] or '-'}"
                                    for t in r["targets_31"]) or "-"
                t2.add_row(r["phase"], str(r["batch"]), str(r["context"]), str(r["next_n"]), str(r["chunk"] or "-"),
                           f(r["fp8_ms"]), f(r["fp8_topk_ms"]), f(r["bf16_topk_ms"]), f(r["fp8_rescore_ms"]),
                           f(r["rescore_vs_fp8_topk"], 2), f(r["rescore_vs_bf16_topk"], 2), f(r["fp8_rescore_dg_ms"]),
                           f(r["rescore_dg_vs_fp8_topk"], 2), f(r["rescore_dg_vs_bf16_topk"], 2), targets)
            report.print_fitted(out, t2, keys=5)
        alone = [r for r in doc["timings"] if r["topk_alone_ms"]]
        if alone:
            t3 = Table(title=f"each top-k alone, ms per forward ({model.n_c4} C4 layers over one layer's stock logits)")
            keys = [k for k in peers.TOPK_KEYS if any(k in r["topk_alone_ms"] for r in alone)]
            for col in ("phase", "batch", "context", "next_n", "chunk", *keys):
                t3.add_column(col, justify="right")
            for r in alone:
                t3.add_row(r["phase"], str(r["batch"]), str(r["context"]), str(r["next_n"]), str(r["chunk"] or "-"),
                           *(f(r["topk_alone_ms"].get(k)) for k in keys))
            report.print_fitted(out, t3, keys=5)
        gather_ops = sorted({r["fp8_gather"] for r in doc["timings"] if r["fp8_gather"]})
        if gather_ops:
            doc["notes"].append(f"fp8 non-paged route: keys gathered by {'; '.join(gather_ops)}")
        for r in doc["timings"]:
            for layout, n in r["layer_caches"].items():
                if n < model.n_c4:
                    doc["notes"].append(f"{r['phase']} context {r['context']}, {layout}: only {n} distinct layer "
                                        f"caches fit; the {model.n_c4} C4 layers cycle them")
    for note in doc["notes"]:
        out.print(f"[dim]{note}[/]")
    if json_path:
        text = json.dumps(doc, indent=1)
        if json_path == "-":
            click.echo(text)
        else:
            _write_text(json_path, text)
    if plot_path:
        if doc["measured"]:
            serve.plot(doc, plot_path)
        else:
            err.print("[yellow]--plot: nothing measured (no GPU), no plot written[/]")


@bench.command(name="variants")
@click.option("--device", default=None, metavar="DEV", help="CUDA device, e.g. cuda:1. [default: the current one]")
@click.option("--quick", is_flag=True, default=False, help="two decode cases and a smaller prefill.")
@click.option("--seed", type=SEED, default=0, show_default=True, help="random seed, 0 to 2^32 - 1.")
@click.option("--emulate", "emulate_arch", default=None, metavar="ARCH",
              type=click.Choice(["sm_120"]),   # the archs every arch declares the product configs of
              help="run ARCH's product configs (and their variants) on this GPU held to ARCH's CTAs per SM "
                   "(padded shared memory), against this GPU's natural residency and its own product configs.")
@click.option("--op", "ops", multiple=True, type=click.Choice(["decode", "verify", "prefill", "extend"]),
              help="--emulate: only these cases (repeatable). [default: all four]")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True), default=None,
              callback=_writable_output, help="write the rows as JSON.")
@click.option("--markdown", "markdown_path", type=click.Path(dir_okay=False, writable=True, allow_dash=True),
              default=None, callback=_writable_output, help="--emulate: write the table as markdown (- = stdout).")
def variants_cmd(device, quick, seed, emulate_arch, ops, json_path, markdown_path):
    """Time every declared config (product and experimental) of the decode and prefill logits on this GPU,
    on the same inputs; the product config of each case first (experimental configs run only here and in
    the tests). With --emulate ARCH: ARCH's product configs under ARCH's residency. Needs a CUDA GPU."""
    from rich.table import Table

    from . import report, variants

    if markdown_path and not emulate_arch:
        raise click.BadParameter("the markdown table is written for --emulate runs", param_hint="--markdown")
    if ops and not emulate_arch:
        raise click.BadParameter("cases are picked for --emulate runs", param_hint="--op")
    dev, _ = _resolve_device("cuda", device, has_backend_option=False)
    if emulate_arch:
        err = _console(stderr=True)
        rows, ceilings = variants.emulate_rows(
            dev, emulate_arch, quick, seed, ops=ops,
            progress=lambda r: err.print(f"[dim]{r['op']} {r['case']}: {r['config']}: {r['us_full']:.1f} us[/]"))
        doc = variants.emulate_document(_device_name(dev), emulate_arch, quick, seed, rows, ceilings, ops)
        md = variants.emulate_markdown(doc)
        click.echo(md)
        if json_path:
            _write_text(json_path, json.dumps(doc, indent=1) + "\n")
        if markdown_path:
            click.echo(md, file=click.open_file(markdown_path, "w"))
        return
    from .timing import mma_rates

    ceilings = {"mma_sync": mma_rates(dev, quick)}
    rows = variants.decode_rows(dev, quick, seed) + variants.prefill_rows(dev, quick, seed, ceilings)
    table = Table(title=f"variants on {_device_name(dev)}")
    for col in ("op", "case", "config", "us", "vs product"):
        table.add_column(col)
    for r in rows:
        case = (f"{r['layout']} B={r['B']} ctx={r['ctx']} next_n={r['next_n']}" if r["op"] == "decode"
                else f"q={r['q']} T={r['T']} S={r['S']} ({r['tflops']:.0f} TFLOP/s"
                + (f", {r['pct_mma']:.0f}% of the mma.sync ceiling at {r['mma_ceiling_warps']} warps/SM"
                   if r.get("pct_mma") is not None else "") + ")")
        table.add_row(r["op"], case, ("* " if r["product"] else "  ") + r["config"], f"{r['us']:.1f}",
                      f"{r['vs_product']:.3f}")
    report.print_fitted(_console(), table, keys=2)
    if json_path:
        _write_text(json_path, json.dumps({"device": _device_name(dev), "ceilings": ceilings, "rows": rows}, indent=1))


@bench.command(name="rescore")
@click.option("--device", default=None, metavar="DEV", help="CUDA device, e.g. cuda:1. [default: the current one]")
@click.option("--quick", is_flag=True, default=False,
              help="one case per phase: decode 8 x 64K, verify 8 x 64K next_n 2, extend 8 x 512 after 32K-64K, "
                   "prefill chunk of 4,096 after 32K.")
@click.option("--phase", "phases", multiple=True, type=click.Choice(["decode", "verify", "extend", "prefill"]),
              help="time only these phases (repeatable). [default: all four]")
@click.option("--seed", type=SEED, default=0, show_default=True, help="random seed, 0 to 2^32 - 1.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True), default=None,
              callback=_writable_output, help="write the rows as JSON (schema cupy-dsa-rescore/1; `bench report "
                                               "FILE` prints its markdown table).")
def rescore_cmd(device, quick, phases, seed, json_path):
    """Time the exact top-k of two-level keys (fp8-rescore: fp8 logits, K' = 4 x index_topk candidates rescored
    from the fp8 and int8-residual pages) against the top-k of bf16 keys, of fp8 keys (our logits + the stock top-k)
    and of DeepGEMM's fp8 logits as SGLang calls them (+ the same top-k; when deep_gemm imports), on the same keys:
    decode, MTP verify (next_n 2-4), varlen extend and prefill chunks; stage 1 (logits) and stage 2 + selection
    apart, and the floor of stage 2 + selection (its bytes over the read-only stream, its flops over the bf16
    mma.sync ceiling, both measured in the same run) with the share of it reached; memory per index entry. The
    stock top-k is SGLang's own v2 kernel where it runs here (its v1 and our paged_topk timed beside it), else
    cupy_dsa.paged_topk standing in for it. Needs a CUDA GPU."""
    from rich.table import Table

    from . import peers, provenance, report
    from . import rescore as rescore_bench

    dev, _ = _resolve_device("cuda", device, has_backend_option=False)
    import torch

    torch.cuda.set_device(dev)
    err = _console(stderr=True)
    dg, reason = peers.deepgemm()
    if dg is None:
        err.print(f"[yellow]DeepGEMM columns not measured: {reason}[/]")
    topks = _load_topks(dev, err)
    ceilings = _rescore_ceilings(dev, quick, err)
    doc = {"schema": rescore_bench.SCHEMA, **provenance.provenance(), "device": _device_name(dev),
           "driver": provenance.driver_version(), "quick": quick, "seed": seed,
           "index_topk": rescore_bench.INDEX_TOPK, "k_prime": rescore_bench.K_PRIME, "deepgemm": reason or "live",
           "topk": topks.describe(), "columns": rescore_bench.legend(topks.describe()),
           "memory": rescore_bench.memory_rows(), "phases": list(phases) or list(rescore_bench.PHASES),
           "ceilings": ceilings, "floor_target": dict(rescore_bench.FLOOR_TARGET), "note": rescore_bench.__doc__}
    with _progress(err) as progress:
        doc["rows"] = rescore_bench.rows(dev, quick, seed, dg, reason, progress, phases=phases or None, topks=topks,
                                         ceilings=ceilings)
    cols = rescore_bench._columns_of(doc) if doc["rows"] else list(rescore_bench.COLUMNS)
    table = Table(title=f"top-{rescore_bench.INDEX_TOPK} per query row on {doc['device']} (us per call; x bf16)")
    for col in ("case", "rows") + tuple(cols):
        table.add_column(col)
    for r in doc["rows"]:
        table.add_row(r["case"], str(r["rows"]), *("-" if r["us"][c] is None else
                                                   f"{r['us'][c]:.1f} ({r['vs_bf16'][c]:.2f})" for c in cols))
    report.print_fitted(_console(), table, keys=2)
    report.print_fitted(_console(), _floor_table(doc, rescore_bench), keys=2)
    for r in doc["rows"]:
        for what, why in r["errors"].items():
            if (what not in rescore_bench.DEEPGEMM_COLUMNS or dg is not None) and what not in rescore_bench.SGLANG_COLUMNS:
                err.print(f"[red]{r['case']}: {what}: {why}[/]")
    if json_path:
        _write_text(json_path, json.dumps(doc, indent=1) + "\n")


def _rescore_ceilings(dev, quick, err) -> dict | None:
    """The read-only stream and the register-operand mma.sync ceilings (with the copy and matmul ones), measured
    now for the floor of "stage 2 + selection"; None (the floor then has no time) when they cannot be measured."""
    from . import timing

    try:
        ceilings = timing.measure_ceilings(dev, quick)
    except Exception as exc:  # noqa: BLE001 - the run goes on without a floor in time, and says why
        err.print(f"[yellow]ceilings not measured ({type(exc).__name__}: {str(exc)[:200]}): no floor in time[/]")
        return None
    if not ceilings.get("read_gbps") or not (ceilings.get("mma_sync") or {}).get("bf16"):
        err.print("[yellow]the read-only stream or the bf16 mma.sync ceiling was not measured: no floor in time[/]")
    return ceilings


def _floor_table(doc, rescore_bench):
    """The floor of "stage 2 + selection" per case and the share of it reached (issue 31), as the console shows it."""
    from rich.table import Table

    fl0 = next((r["floor"] for r in doc["rows"] if r["floor"].get("us") is not None), None)
    rates = ("no ceilings measured" if fl0 is None else f"read {fl0['read_gbps']:.0f} GB/s, bf16 mma.sync "
             f"{fl0['mma_tflops']:.0f} TFLOP/s at {fl0['mma_warps_per_sm']} warps/SM")
    table = Table(title=f"floor of stage 2 + selection ({rates}): share reached, target")
    for col in ("case", "rows x entries", "MB", "GFLOP", "floor us", "binds", "target") + rescore_bench.FLOOR_COLUMNS:
        table.add_column(col)
    for r in doc["rows"]:
        fl = r["floor"]
        shares = [("-" if fl["share"][c] is None else f"{100 * fl['share'][c]:.0f}% {fl['verdict'][c]}")
                  for c in rescore_bench.FLOOR_COLUMNS]
        table.add_row(r["case"], f"{fl['entry_rows']:,}", f"{fl['bytes'] / 1e6:.1f}", f"{fl['flops'] / 1e9:.1f}",
                      "-" if fl["us"] is None else f"{fl['us']:.1f}", fl["binds"] or "-", f">= {fl['target']:.0%}",
                      *shares)
    return table


def _load_topks(dev, err):
    """The run's top-k implementations (:func:`peers.topks`): SGLang's v2 and v1 load here (their JIT compiles on
    first use, about a minute); says which stock top-k the run adds, and why SGLang's do not run."""
    from . import peers

    err.print("[dim]loading SGLang's top-k kernels (v2, v1; the first load JIT-compiles them)[/]")
    topks = peers.topks(dev)
    for key, why in topks.status.items():
        if why != "live":
            err.print(f"[yellow]{peers.TOPK_LABELS[key]}: {why}[/]")
    if topks.stand_in:
        err.print(f"[yellow]stock top-k: {peers.stand_in_note(topks.status.get(peers.SGLANG_V2))}[/]")
    else:
        err.print(f"[dim]stock top-k: {topks.stock.label}[/]")
    return topks


def _archs_option(ctx, param, values):
    """--arch: ``sm_NN`` of sm_80 or newer that this NVRTC compiles for (checked here: a bad arch would end
    in thousands of lines of NVRTC errors)."""
    from cupy_dsa import runtime

    archs = []
    for value in values:
        m = re.fullmatch(r"sm_(\d+)", value.strip().lower())
        if not m:
            raise click.BadParameter(f"expected an arch such as sm_90 (sm_{runtime.MIN_ARCH} or newer), got {value!r}")
        cc = int(m.group(1))
        if cc < runtime.MIN_ARCH:
            raise click.BadParameter(f"{value}: the kernels need sm_{runtime.MIN_ARCH} or newer (bf16 tensor-core "
                                     "mma and cp.async)")
        try:
            supported = runtime.cupy_module().cuda.nvrtc.getSupportedArchs()
        except Exception:  # noqa: BLE001 - no CuPy / NVRTC here: the compile says so itself
            supported = None
        if supported and cc not in supported:
            known = ", ".join(f"sm_{a}" for a in supported if a >= runtime.MIN_ARCH)
            raise click.BadParameter(f"{value}: this NVRTC does not compile for it (it does for {known})")
        archs.append(f"sm_{cc}")
    return tuple(archs)


@bench.command(name="resources")
@click.option("--arch", "archs", multiple=True, callback=_archs_option,
              help="target arch, sm_80 or newer (repeatable). [default: sm_80 sm_89 sm_90 sm_100 sm_120]")
def resources_cmd(archs):
    """ptxas's registers / spills / shared memory of every product kernel config per target arch (NVRTC, no
    GPU), and the resident CTAs / warps per SM of the logits configs on each arch, as the README's tables."""
    from cupy_dsa import runtime

    from . import resources

    try:  # before any compile: without the CUDA extra this is the whole message, not a traceback's last line
        runtime.cupy_module()
    except ImportError as exc:
        raise click.ClickException(f"bench resources compiles the kernels with NVRTC through CuPy: {exc}") from None
    click.echo("NVRTC compiles every product config of each arch (minutes on a cold cache); each compile is named "
               "on stderr as it starts.", err=True)
    click.echo(resources.markdown(resources.rows(archs or resources.ARCHS, progress=lambda t: click.echo(t, err=True))))
    click.echo("\nResident CTAs x warps per SM of the logits product configs (bf16 keys, fp8 q; the limit that "
               "binds):\n")
    from cupy_dsa import arch as arch_limits

    click.echo(resources.residency_markdown(resources.residency_rows(
        [a for a in (archs or arch_limits.ARCH_LIMITS) if a in arch_limits.ARCH_LIMITS])))


@bench.command(name="report")
@click.argument("json_files", metavar="JSON_FILE...", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--markdown", "markdown_path", type=click.Path(dir_okay=False, writable=True, allow_dash=True),
              default=None, callback=_writable_output, help=MARKDOWN_HELP)
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, writable=True), default=None,
              callback=_png_output, help="re-draw the PNG plot from the JSON; the name must end in .png.")
@click.option("--readme", "readme_path", type=click.Path(exists=True, dir_okay=False, writable=True), default=None,
              help="rewrite the <!-- results:NAME --> blocks of this markdown file that the JSON holds data for "
                   "(the others are kept; it prints which and why).")
@click.option("--allow-cpu-or-quick", is_flag=True, default=False,
              help="with --readme: accept a CPU-backend or --quick run (refused by default: the README's "
                   "figures are full-size GPU runs).")
def report_cmd(json_files, markdown_path, plot_path, readme_path, allow_cpu_or_quick):
    """Re-print the tables of a saved JSON result (and its markdown headline / plot / README blocks).

    Several `cupy-dsa needle` results overlay: one table and one plot, a column / line per run (--label)."""
    from . import report

    docs = []
    for json_file in json_files:
        try:
            docs.append(json.loads(Path(json_file).read_text()))
        except ValueError as exc:
            raise click.BadParameter(f"{json_file}: not a JSON file: {exc}", param_hint="JSON_FILE")
    same_kind = len({d.get("schema") if isinstance(d, dict) else None for d in docs}) == 1  # else: the mix is refused
    for json_file, doc in zip(json_files, docs) if same_kind else ():  # a valid schema, a broken structure: refused
        problem = report.structure_problem(doc)
        if problem:
            raise click.BadParameter(f"{json_file}: a {doc['schema']} document, but {problem}", param_hint="JSON_FILE")
    try:
        _report(json_files, docs, markdown_path, plot_path, readme_path, allow_cpu_or_quick)
    except (KeyError, TypeError, AttributeError, IndexError, ValueError) as exc:
        # what the structure check does not reach (a row's fields): one message naming the file, no traceback
        raise click.BadParameter(f"{', '.join(json_files)}: a field of the results is missing or of the wrong type "
                                 f"({type(exc).__name__}: {exc})", param_hint="JSON_FILE") from None


def _report(json_files, docs, markdown_path, plot_path, readme_path, allow_cpu_or_quick):
    from . import needle, plots, provenance, readme, report, serve
    from . import rescore as rescore_bench

    if any(needle.is_needle(d) for d in docs):
        if allow_cpu_or_quick:
            raise click.BadParameter("goes with --readme, which needle results do not take",
                                     param_hint="'--allow-cpu-or-quick'")
        _report_needle(json_files, docs, markdown_path, plot_path, readme_path)
        return
    if len(docs) > 1:
        raise click.BadParameter(f"several files overlay only as `cupy-dsa needle` results (schema {needle.SCHEMA!r}); "
                                 f"{json_files[1]} is {docs[1].get('schema') if isinstance(docs[1], dict) else None!r}: "
                                 "give one bench or serve result", param_hint="JSON_FILE")
    json_file, doc = json_files[0], docs[0]
    if rescore_bench.is_rescore(doc):  # a `bench rescore` run: its table, its README block
        _report_rescore(json_file, doc, markdown_path, plot_path, readme_path, allow_cpu_or_quick)
        return
    from . import variants

    if isinstance(doc, dict) and doc.get("schema") == variants.EMULATE_SCHEMA:  # `bench variants --emulate`
        _report_rescore(json_file, doc, markdown_path, plot_path, readme_path, allow_cpu_or_quick,
                        md=variants.emulate_markdown(doc), blocks=readme.EMULATE_README_BLOCKS,
                        what="a `bench variants --emulate` result")
        return
    is_serve = isinstance(doc, dict) and doc.get("schema") == serve.SCHEMA
    if not is_serve and (not isinstance(doc, dict) or doc.get("schema") not in provenance.READABLE_SCHEMAS):
        raise click.BadParameter(f"expected schema {provenance.SCHEMA!r}, {serve.SCHEMA!r}, {rescore_bench.SCHEMA!r} or "
                                 f"{needle.SCHEMA!r}, got "
                                 f"{doc.get('schema') if isinstance(doc, dict) else type(doc).__name__!r}",
                                 param_hint="JSON_FILE")
    if allow_cpu_or_quick and not readme_path:
        raise click.BadParameter("goes with --readme (it accepts a CPU or --quick run for the README's blocks)",
                                 param_hint="'--allow-cpu-or-quick'")
    update = None
    if readme_path:  # decided before anything is printed or written
        try:
            update = readme.readme_update(Path(readme_path).read_text(), doc,
                                          readme.SERVE_README_BLOCKS if is_serve else
                                          {**readme.README_BLOCKS, **readme.RECALL_DIVERSE_README_BLOCKS})
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="'--readme'")
        why = readme.not_gpu_figures(doc)
        if update[1] and why and not allow_cpu_or_quick:
            raise click.BadParameter(
                f"{json_file} is {why}; the README's results blocks quote full-size GPU runs, so it would replace "
                f"them ({', '.join('results:' + n for n in update[1])}). Pass --allow-cpu-or-quick to write them "
                "anyway.", param_hint="'--readme'")
    if is_serve:  # a `bench serve` run: its table, its README block
        if plot_path:
            serve.plot(doc, plot_path)
        if markdown_path:
            _write_markdown(serve.markdown(doc), markdown_path)
        if markdown_path != "-":
            click.echo(serve.markdown(doc))
    else:
        report.print_all(_console(stderr=markdown_path == "-"), doc, [s for s in provenance.SECTIONS if doc.get(s)])
        if markdown_path:
            _write_markdown(report.markdown_headline(doc), markdown_path)
        if plot_path:
            for written in plots.plot(doc, plot_path):
                click.echo(f"wrote {written}", err=True)
    if update is not None:
        _write_readme(readme_path, update, "the JSON holds data for none of its blocks")


def _write_readme(readme_path, update, why_none):
    """Write a `report --readme` update and say which blocks it rewrote and kept, and why."""
    text, rewritten, kept = update
    if rewritten:
        Path(readme_path).write_text(text)
        click.echo(f"{readme_path}: rewrote {', '.join('results:' + n for n in rewritten)}", err=True)
    else:
        click.echo(f"{readme_path}: nothing rewritten ({why_none})", err=True)
    for name, why in kept.items():
        click.echo(f"{readme_path}: kept results:{name} ({why})", err=True)


def _report_rescore(json_file, doc, markdown_path, plot_path, readme_path, allow_cpu_or_quick, md=None, blocks=None,
                    what="a `bench rescore` result"):
    """`bench report` of a `bench rescore` result (or another result of one markdown table: ``md``, ``blocks``): its
    markdown table, and its README block."""
    from . import readme
    from . import rescore as rescore_bench

    blocks = readme.RESCORE_README_BLOCKS if blocks is None else blocks
    if plot_path:
        raise click.BadParameter(f"{what} has no plot", param_hint="'--plot'")
    if allow_cpu_or_quick and not readme_path:
        raise click.BadParameter("goes with --readme (it accepts a CPU or --quick run for the README's blocks)",
                                 param_hint="'--allow-cpu-or-quick'")
    update = None
    if readme_path:
        try:
            update = readme.readme_update(Path(readme_path).read_text(), doc, blocks)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="'--readme'")
        why = readme.not_gpu_figures(doc)
        if update[1] and why and not allow_cpu_or_quick:
            raise click.BadParameter(f"{json_file} is {why}; pass --allow-cpu-or-quick to write "
                                     f"{', '.join('results:' + n for n in blocks)} anyway", param_hint="'--readme'")
    md = rescore_bench.markdown(doc) if md is None else md
    if markdown_path:
        _write_markdown(md, markdown_path)
    if markdown_path != "-":
        click.echo(md)
    if update is not None:
        _write_readme(readme_path, update, f"it has no {', '.join('results:' + n for n in blocks)} block, or the "
                                           "JSON holds no rows for it")


# --------------------------------------------------------------------------------------------------
# needle: recall of a running server
# --------------------------------------------------------------------------------------------------

def _lengths_option(ctx, param, value):
    """--lengths: a comma list of token counts (K / M suffixes), each >= 64."""
    if value is None:
        return None
    out = []
    for part in str(value).split(","):
        m = re.fullmatch(r"(\d+)([km]?)", part.strip().lower())
        n = int(m.group(1)) * {"": 1, "k": 1024, "m": 2**20}[m.group(2)] if m else 0
        if n < 64:
            raise click.BadParameter(f"expected a comma list of token counts of at least 64 such as 4K,16K,64K, "
                                     f"got {part.strip()!r} in {value!r}")
        out.append(n)
    return tuple(sorted(set(out)))


def _depths_option(ctx, param, value):
    """--depths: a comma list of fractions in [0, 1] (or percentages such as 25%) of the filler before the needle."""
    if value is None:
        return None
    out = []
    for part in str(value).split(","):
        p = part.strip()
        try:
            d = float(p[:-1]) / 100 if p.endswith("%") else float(p)
        except ValueError:
            d = float("nan")
        if not 0.0 <= d <= 1.0:
            raise click.BadParameter(f"expected a comma list of depths in [0, 1] (or 0%..100%) such as "
                                     f"0,0.25,0.5,0.75,1, got {p!r} in {value!r}")
        out.append(d)
    return tuple(dict.fromkeys(out))


def _base_url_option(ctx, param, value):
    from . import needle

    try:
        return needle.normalize_base_url(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def _extra_body_option(ctx, param, value):
    if value is None:
        return None
    try:
        body = json.loads(value)
    except ValueError as e:
        raise click.BadParameter(f"expected a JSON object such as '{{\"chat_template_kwargs\": {{\"thinking\": "
                                 f"false}}}}', got {value!r} ({e})") from None
    if not isinstance(body, dict):
        raise click.BadParameter(f"expected a JSON object (fields added to each request), got {value!r}")
    return body


@main.command(name="needle")
@click.option("--base-url", default="http://127.0.0.1:30000/v1", show_default=True, callback=_base_url_option,
              metavar="URL", help="the server's OpenAI-compatible API (a URL without a path gets /v1).")
@click.option("--model", default=None, help="served model name. [default: the only model the server lists]")
@click.option("--api-key", envvar="OPENAI_API_KEY", default="EMPTY", show_default=False,
              help="the server's --api-key, if it was started with one. [default: $OPENAI_API_KEY or EMPTY]")
@click.option("--lengths", default="4K,8K,16K,32K,64K", show_default=True, callback=_lengths_option,
              help="context lengths in the server's tokens (comma list, K/M suffixes).")
@click.option("--depths", default="0,0.25,0.5,0.75,1", show_default=True, callback=_depths_option,
              help="where the needle sits: the fraction of the filler before it (comma list; 0 = start, 1 = end).")
@click.option("--trials", type=click.IntRange(min=1), default=3, show_default=True,
              help="needles per (length, depth) cell, each with its own filler, key and number.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True, help="seed of filler and needles.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=64, show_default=True,
              help="output tokens per answer (raise it for a model that reasons before answering).")
@click.option("--timeout", type=FiniteFloatRange(min=0, min_open=True), default=600.0, show_default=True,
              help="seconds per request (a long prefill takes a while).")
@click.option("--retries", type=click.IntRange(min=0), default=2, show_default=True,
              help="retries of a request that timed out, could not connect or got HTTP 408/409/429/5xx.")
@click.option("--concurrency", type=click.IntRange(min=1), default=1, show_default=True,
              help="requests in flight at once (the server batches them; the prompts and their order in the results "
                   "stay the same).")
@click.option("--extra-body", default=None, callback=_extra_body_option, metavar="JSON",
              help="JSON object merged into every request, e.g. '{\"chat_template_kwargs\": {\"thinking\": false}}'.")
@click.option("--label", default=None, help="name of this run in tables, plots and overlays, e.g. the index-key "
                                            "mode it was served with (fp8, fp8-cupy, bf16). [default: the model name]")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True, allow_dash=True), default=None,
              callback=_writable_output, help="write the results as JSON (schema cupy-dsa-needle/1); '-' = stdout.")
@click.option("--markdown", "markdown_path", type=click.Path(dir_okay=False, writable=True, allow_dash=True),
              default=None, callback=_writable_output, help="write the recall table as markdown; '-' = stdout.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, writable=True), default=None,
              callback=_png_output, help="PNG: recall against context length.")
def needle_cmd(base_url, model, api_key, lengths, depths, trials, seed, max_tokens, timeout, retries, concurrency,
               extra_body, label, json_path, markdown_path, plot_path):
    """Needle-in-a-haystack recall of a running OpenAI-compatible server (SGLang's /v1/chat/completions).

    Seeded filler text with one needle fact at each depth, for each context length counted in the server's own
    tokens (calibrated from usage.prompt_tokens before the sweep); greedy answers, --trials needles per cell.
    Prints recall per (length, depth); overlay several runs with `cupy-dsa bench report a.json b.json`."""
    from rich.console import Console

    from . import needle, report

    to_stdout = "-" in (json_path, markdown_path)
    if json_path == "-" and markdown_path == "-":
        raise click.BadParameter("only one of --json and --markdown can be '-' (stdout)", param_hint="'--markdown'")
    out, err = _console(stderr=to_stdout), Console(stderr=True)
    server = needle.Server(base_url=base_url, api_key=api_key, timeout=timeout, retries=retries, extra_body=extra_body)
    settings = needle.Settings(lengths=lengths, depths=depths, trials=trials, seed=seed, max_tokens=max_tokens,
                               concurrency=concurrency, label=label)
    try:
        server.connect(model)
        needle.check_lengths_fit(server, settings)
        err.print(f"{server.model} at {base_url}"
                  + (f", context length {server.max_model_len}" if server.max_model_len else ""))
        with _progress(err) as progress:
            tasks = {"calibrate": progress.add_task("calibrate", total=None),
                     "ask": progress.add_task("needles", total=len(lengths) * len(depths) * trials, start=False)}

            def tick(kind, advance=1, total=None):
                if kind == "ask" and total is not None:
                    progress.update(tasks["calibrate"], total=progress.tasks[tasks["calibrate"]].completed)
                    progress.start_task(tasks["ask"])
                progress.update(tasks[kind], advance=advance)

            doc = needle.run(server, settings, progress=tick)
    except needle.NeedleError as e:
        if e.option:
            raise click.BadParameter(str(e), param_hint=f"'{e.option}'") from None
        raise click.ClickException(str(e)) from None
    report.print_fitted(out, needle.table(doc))
    for note in doc["notes"]:
        err.print(f"[yellow]{note}[/]")
    if json_path:
        if json_path == "-":
            click.echo(json.dumps(doc, indent=1))
        else:
            needle.write_json(doc, json_path)
            err.print(f"wrote {json_path}")
    if markdown_path:
        _write_markdown(needle.markdown(doc), markdown_path)
    if plot_path:
        needle.plot([doc], plot_path)
        err.print(f"wrote {plot_path}")


def _report_needle(json_files, docs, markdown_path, plot_path, readme_path):
    from . import needle, report

    if readme_path:
        raise click.BadParameter("needle results have no README blocks; use --markdown", param_hint="'--readme'")
    for name, d in zip(json_files, docs):
        try:
            needle.check_document(d, name)
        except ValueError as e:
            raise click.BadParameter(f"{e} (needle results overlay only with other needle results)",
                                     param_hint="JSON_FILE") from None
    labels = [d["label"] for d in docs]
    if len(set(labels)) != len(labels):  # keep columns and legend apart: label i of a repeated name gets its file
        docs = [dict(d, label=f"{d['label']} ({Path(n).name})") if labels.count(d["label"]) > 1 else d
                for n, d in zip(json_files, docs)]
    out = _console(stderr=markdown_path == "-")
    if len(docs) == 1:
        report.print_fitted(out, needle.table(docs[0]))
        md = needle.markdown(docs[0])
    else:
        report.print_fitted(out, needle.overlay_table(docs))
        md = needle.overlay_markdown(docs)
    if markdown_path:
        _write_markdown(md, markdown_path)
    if plot_path:
        needle.plot(docs, plot_path)


def _write_markdown(md: str, path: str) -> None:
    """The headline table to ``path``, or to stdout for '-' (every command treats '-' the same way)."""
    if path == "-":
        click.echo(md, nl=False)
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(md)


# --------------------------------------------------------------------------------------------------
# running
# --------------------------------------------------------------------------------------------------

def _resolve_device(backend: str, device: str | None, *, has_backend_option: bool = True):
    """(torch.device, backend name); click errors for impossible combinations, naming the option that asked
    for what cannot be had (``--device`` or ``--backend``; a command without ``--backend`` needs CUDA
    itself)."""
    import torch

    dev = None
    asked_for_cuda = "'--backend'" if backend == "cuda" and has_backend_option else None
    if device is not None:
        forms = "'cpu', 'cuda', 'cuda:N' or N" if has_backend_option else \
            "a CUDA device: 'cuda', 'cuda:N' or N (the command times CUDA kernels)"
        if not re.fullmatch(r"cpu|cuda(:\d+)?|\d+" if has_backend_option else r"cuda(:\d+)?|\d+", device.strip()):
            raise click.BadParameter(f"expected {forms}, got {device!r}", param_hint="'--device'")
        dev = torch.device(f"cuda:{device}" if device.isdigit() else device.strip())
        if backend == "auto":
            backend = dev.type
        elif backend != dev.type:
            raise click.BadParameter(f"device {device!r} does not match --backend {backend}", param_hint="'--device'")
        if dev.type == "cuda":
            asked_for_cuda = "'--device'"
    if backend == "auto":
        backend = "cuda" if torch.cuda.is_available() else "cpu"
    if backend == "cuda":
        if not torch.cuda.is_available():
            none = "no CUDA device is available (torch.cuda.is_available() is False)"
            if asked_for_cuda == "'--device'":
                raise click.BadParameter(f"{device!r}: {none}", param_hint="'--device'")
            if asked_for_cuda == "'--backend'":
                raise click.BadParameter(f"{none}; use --backend cpu or auto", param_hint="'--backend'")
            ctx = click.get_current_context(silent=True)
            raise click.UsageError(f"{ctx.command_path if ctx else 'this command'} times CUDA kernels and needs a "
                                   f"GPU: {none}")
        if dev is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        elif dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        if dev.index >= torch.cuda.device_count():
            raise click.BadParameter(f"{dev} does not exist ({torch.cuda.device_count()} CUDA device(s))",
                                     param_hint="'--device'")
        return dev, "cuda"
    return torch.device("cpu"), "cpu"


def _device_name(dev) -> str:
    import torch

    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)"


PIPE_WIDTH = 200  # piped output (logs) without COLUMNS: wide, so rows stay whole


def _console(stderr: bool = False):
    """The console the tables go to (stdout, or stderr when stdout carries the markdown): the terminal's width,
    ``COLUMNS`` when set (rich reads it), else :data:`PIPE_WIDTH` for a pipe. Tables fit it
    (``report.fitted``)."""
    from rich.console import Console

    c = Console(stderr=stderr)
    return c if c.is_terminal or os.environ.get("COLUMNS", "").isdigit() else Console(stderr=stderr, width=PIPE_WIDTH)


def _progress(console):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=console, transient=False)


def _run(ctx: click.Context, sections, o: dict) -> dict:
    import torch
    from rich.console import Console

    from . import bytes as bytes_mod
    from . import plots, provenance, report

    out = _console(stderr=o["markdown_path"] == "-")  # '-': stdout carries only the markdown
    err = Console(stderr=True)
    needs_device = any(s in sections for s in ("store", "query", "logits", "recall"))
    if needs_device:
        dev, backend = _resolve_device(o["backend"].lower(), o["device"])
    else:  # `bytes` is arithmetic, but a device or backend that cannot be had is still an error (as for `store`)
        if o["device"] is not None or o["backend"].lower() != "auto":
            _resolve_device(o["backend"].lower(), o["device"])
        dev, backend = torch.device("cpu"), "none"
    quick = bool(o["quick"])  # on CPU the store/logits sizes are tiny either way (see --help)
    seed = int(o["seed"])
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    doc = provenance.new_document(backend=backend,
                                  device_name=_device_name(dev) if needs_device else "none (arithmetic)",
                                  quick=quick, seed=seed, gpu_mem_gb=float(o["gpu_mem_gb"]))
    doc["sections"] = list(sections)
    doc["driver"] = provenance.driver_version() if dev.type == "cuda" else None
    if not doc["git_commit"]:
        doc["notes"].setdefault("general", []).append(doc["commit_note"])
    if backend == "cpu":
        doc["notes"].setdefault("general", []).insert(0, "CPU backend: the torch reference at small sizes; its "
                                                      "timings show that the pipeline runs, they are not "
                                                      "performance figures, and no ratios to ceilings are computed.")
        err.print("[yellow]CPU backend: torch reference at small sizes (timings are not performance figures).[/]")

    if "bytes" in sections:
        doc["bytes"] = bytes_mod.rows(float(o["gpu_mem_gb"]))
        doc["notes"]["bytes"] = bytes_mod.notes()

    if needs_device:
        from . import sweeps

        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        with _progress(err) as progress:
            timed = any(s in sections for s in ("store", "query", "logits"))
            if timed and backend == "cpu":
                doc["targets"] = dict(sweeps.TARGETS)  # ceilings stay None: no ratios on the CPU backend
            elif timed:
                task = progress.add_task("ceilings", total=1)
                from .timing import measure_ceilings

                doc["ceilings"].update(measure_ceilings(dev, quick))
                progress.advance(task)
                doc["targets"] = dict(sweeps.TARGETS)
            if "store" in sections:
                doc["store"] = sweeps.store_rows(dev, quick, seed, doc["ceilings"], progress)
                doc["notes"]["store"] = [sweeps.STORE_COUNTED]
            if "query" in sections:
                doc["query"] = sweeps.query_rows(dev, quick, seed, doc["ceilings"], progress)
                doc["notes"]["query"] = [sweeps.QUERY_COUNTED]
            if "logits" in sections:
                doc["logits"] = (sweeps.decode_rows(dev, quick, seed, doc["ceilings"], progress)
                                 + sweeps.prefill_rows(dev, quick, seed, doc["ceilings"], progress)
                                 + sweeps.verify_rows(dev, quick, seed, doc["ceilings"], progress)
                                 + sweeps.extend_rows(dev, quick, seed, doc["ceilings"], progress))
                doc["notes"]["logits"] = [sweeps.LOGITS_COUNTED, sweeps.VERIFY_EXTEND_COUNTED]
            if "recall" in sections and str(o["suite"]).lower() == "diverse":
                from . import recall_diverse

                doc["recall_diverse"] = recall_diverse.run(dev, quick, seed, progress)
                doc["notes"]["recall_diverse"] = [recall_diverse.NOTE] + [
                    f"{k}: {v}" for k, v in recall_diverse.FORMAT_NOTES.items()]
                if any(r.get("error") for r in doc["recall_diverse"]):
                    err.print("[red]recall (diverse): a context failed (see the 'error' fields)[/]")
            elif "recall" in sections:
                from . import recall

                doc["recall"] = recall.run(dev, quick, seed, progress)
                doc["notes"]["recall"] = [recall.RECALL_NOTE] + [f"{k}: {v}" for k, v in recall.FORMAT_NOTES.items()]
                if any(r.get("error") for r in doc["recall"]):
                    err.print("[red]recall: a context failed (see the 'error' fields)[/]")
    doc["elapsed_s"] = time.perf_counter() - t0

    report.print_all(out, doc, sections)
    if o["json_path"]:
        provenance.write_json(doc, o["json_path"])
        err.print(f"wrote {o['json_path']}")
    if o["markdown_path"]:
        _write_markdown(report.markdown_headline(doc), o["markdown_path"])
        if o["markdown_path"] != "-":
            err.print(f"wrote {o['markdown_path']}")
    if o["plot_path"]:
        for written in plots.plot(doc, o["plot_path"]):
            err.print(f"wrote {written}")
    err.print(f"[dim]done in {doc['elapsed_s']:.1f} s[/]")
    return doc


if __name__ == "__main__":
    main()
