"""``cupy-dsa bench serve``: its options (the model, the cases, the layouts and queries timed) and its console,
JSON and plot output; the measurement is :mod:`.serve`'s. Without a GPU it prints the memory figures only; like
every writer, its files never replace a measured run of another kind (:mod:`.output_guard`).
"""

from __future__ import annotations

import json
import re

import click

from . import cli_common as common
from . import output_guard


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


MAX_BATCH = 4096          # requests per step: far above what a server runs at once on one GPU
MAX_TOKENS = 1 << 30       # a token count past any model's context (the model's own bound is checked after)
_contexts_option = _counts_option((8192, 32768, 131072), "positive token counts such as 8192,32K,128K, at most "
                                  "1G", hi=MAX_TOKENS)


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
    from cupy_dsa.sglang.modes import QUERY_CHOICES

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


def _check_against_the_model(model, contexts, chunks) -> None:
    """A request's context (and a prefill chunk's prefix + chunk) must fit the model's context window."""
    for option, values in (("--context", contexts), ("--chunk", chunks)):
        over = [v for v in values if v > model.max_context]
        if over:
            raise click.BadParameter(f"{', '.join(map(str, over))} tokens: more than {model.name}'s context window "
                                     f"({model.max_context:,} tokens, max_position_embeddings)",
                                     param_hint=f"'{option}'")


@click.command(name="serve")
@click.option("--model", default="v4-flash", show_default=True, callback=_model_option,
              help="v4-flash, v4-pro (layer count assumed, see the output) or the path of an HF config.json "
                   "(compress_ratios, num_hidden_layers, index_topk).")
@click.option("--batch", type=click.IntRange(min=1, max=MAX_BATCH), default=32, show_default=True,
              help=f"requests per decode step, 1 to {MAX_BATCH}.")
@click.option("--context", "contexts", multiple=True, callback=_contexts_option,
              help="tokens per request (comma list or repeated; K/M suffixes). [default: 8192,32768,131072]")
@click.option("--next-n", "next_ns", multiple=True, callback=_counts_option((1,), "next_n values 1 to 4 such as 1,2,4",
                                                                             lo=1, hi=4),
              help="rows per request: 1 = plain decode, 2..4 = MTP verify; a comma list (or repeated) times "
                   "each. [default: 1]")
@click.option("--chunk", "chunks", multiple=True, callback=_counts_option((4096,), "token counts of 4 or more such "
                                                                          "as 4096,16K, at most 1G", lo=4,
                                                                          hi=MAX_TOKENS),
              help="tokens per prefill chunk; a comma list (or repeated, K suffix) times each. [default: 4096]")
@click.option("--memory-gib", type=common.FiniteFloatRange(min=0, min_open=True, max=common.MAX_MEMORY), default=80.0,
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
@click.option("--seed", type=common.SEED, default=0, show_default=True, help="random seed, 0 to 2^32 - 1.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True, allow_dash=True), default=None,
              callback=output_guard.guarded_option(output_guard.JSON),
              help="write the results as JSON (schema cupy-dsa-serve/1); '-' = stdout.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, writable=True), default=None,
              callback=output_guard.guarded_option(output_guard.PNG), help="PNG: ms per step over context, bf16 vs fp8, and the added ms (a row per "
                                          "kind of step).")
@output_guard.FORCE_OPTION
def serve_cmd(model, batch, contexts, next_ns, chunks, layouts, queries, configs_of, memory_gib, device, seed,
              json_path, plot_path, force):
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

    _check_against_the_model(model, contexts, chunks)
    out, err = common.console(stderr=json_path == "-"), Console(stderr=True)
    dev = None
    if device is not None or torch.cuda.is_available():  # checked before any work
        dev, _ = common.resolve_device("cuda", device, has_backend_option=False)
    run = output_guard.run_of({"schema": serve.SCHEMA, "layouts": list(layouts or (name for name, _ in serve.TIMED)),
                               "arch_configs": configs_of, "queries": list(queries), "measured": dev is not None,
                               "device": common.device_name(dev) if dev is not None else None})
    output_guard.check(json_path, "--json", output_guard.JSON, run, force)
    if dev is not None:   # without a GPU nothing is plotted
        output_guard.check(plot_path, "--plot", output_guard.PNG, run, force)
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
        doc["device"] = common.device_name(dev)
        doc["driver"] = provenance.driver_version()
        dg, reason = peers.deepgemm()
        doc["deepgemm"] = reason or "live"
        if dg is None:
            err.print(f"[yellow]fp8 not measured: {reason}[/]")
        topks = None
        if any(name in serve.WITH_TOPK for name in doc["layouts"]):
            topks = common.load_topks(dev, err)
            doc["topk"] = topks.describe()
        with common.progress(err) as progress:
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
            with common.progress(err) as progress:
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
            common.write_text(json_path, text)
    if plot_path:
        if doc["measured"]:
            serve.plot(doc, plot_path)
        else:
            err.print("[yellow]--plot: nothing measured (no GPU), no plot written[/]")
