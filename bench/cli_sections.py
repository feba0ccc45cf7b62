"""The sections of ``cupy-dsa bench``: ``bytes | store | query | logits | recall | all`` (``bench`` alone runs
``all``), the options they share with the ``bench`` group (:func:`common_options`; given to both, the section's value
wins) and :func:`run`, which measures the sections asked for and prints, writes and plots their results. Heavy
modules (torch, rich, the sweeps) are imported inside :func:`run`.
"""

from __future__ import annotations

import time

import click

from . import cli_common as common
from . import output_guard

SECTIONS_ALL = ("bytes", "store", "query", "logits", "recall")
DEFAULTS = {"backend": "auto", "device": None, "quick": False, "json_path": None, "plot_path": None,
            "markdown_path": None, "seed": 0, "gpu_mem_gib": 80.0, "suite": "needle", "force": False}
QUICK_HELP = ("smaller sizes. GPU: every section (ceilings, store, query, logits, recall: 3 contexts x 8 needles). "
              "CPU backend: recall runs 2 contexts x 4 needles instead of 4 x 8 (up to 64K tokens); store and logits always run "
              "their tiny CPU sizes.")


def _renamed_gpu_mem_gb(ctx, param, value):
    """--gpu-mem-gb took GB (1e9 B) where `bench serve --memory-gib` takes GiB: renamed, and refused by its old name
    (a figure in the old unit would be read 7% off)."""
    if value is not None:
        raise click.BadParameter("renamed to --gpu-mem-gib, in GiB (2^30 B) like `bench serve --memory-gib`: "
                                 f"{value} GB is --gpu-mem-gib {_gib(value)}", param_hint="'--gpu-mem-gb'")


def _gib(gb: str) -> str:
    try:
        return f"{float(gb) * 1e9 / 2**30:.4g}"
    except ValueError:
        return "N"


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
                     callback=output_guard.guarded_option(output_guard.JSON),
                     help="write the results as JSON (schema cupy-dsa-bench/2)."),
        click.option("--plot", "plot_path", type=click.Path(dir_okay=False, writable=True), default=None,
                     callback=output_guard.guarded_option(output_guard.PNG), help="write a PNG plot (matplotlib); the name must end in .png. With "
                     "throughput and recall rows, the recall study goes to NAME-recall.png beside it."),
        click.option("--markdown", "markdown_path", type=click.Path(dir_okay=False, writable=True, allow_dash=True),
                     default=None, callback=output_guard.guarded_option(output_guard.MARKDOWN),
                     help=common.MARKDOWN_HELP),
        output_guard.FORCE_OPTION,
        click.option("--seed", type=common.SEED, default=None, help="random seed of the inputs (store, query, logits, recall), 0 to 2^32 - 1. [default: 0]"),
        click.option("--gpu-mem-gib", type=common.FiniteFloatRange(min=0, min_open=True, max=common.MAX_MEMORY),
                     default=None, help="KV memory budget for `bytes` (GiB = 2^30 B, as `bench serve --memory-gib`), "
                     "up to 1e6. [default: 80]"),
        click.option("--gpu-mem-gb", "renamed_gpu_mem_gb", default=None, hidden=True, expose_value=False,
                     callback=_renamed_gpu_mem_gb),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def merged(ctx: click.Context, own: dict) -> dict:
    group = (ctx.parent.params if ctx.parent is not None else {}) or {}
    out = {}
    for k, d in DEFAULTS.items():
        if k in ("quick", "force"):
            out[k] = bool(own.get(k)) or bool(group.get(k))
            continue
        v = own.get(k)
        if v is None:
            v = group.get(k)
        out[k] = d if v is None else v
    return out


def merged_top(opts: dict) -> dict:
    out = {}
    for k, d in DEFAULTS.items():
        v = opts.get(k)
        out[k] = d if v is None else v
    out["quick"] = bool(opts.get("quick"))
    out["force"] = bool(opts.get("force"))
    return out


# options a section takes (for `bench`'s sake) but does nothing with: left out of its --help
UNUSED_BY = {"bytes": ("backend", "device", "quick", "seed"), "store": ("gpu_mem_gib",), "query": ("gpu_mem_gib",),
             "logits": ("gpu_mem_gib",), "recall": ("gpu_mem_gib",)}


def _section_command(name, sections, doc, extra_options=()):
    @click.command(name=name, help=doc)
    @common_options
    @click.pass_context
    def cmd(ctx, **opts):
        run(ctx, sections, merged(ctx, opts))

    for option in reversed(extra_options):
        cmd = option(cmd)
    for param in cmd.params:
        if param.name in UNUSED_BY.get(name, ()):
            param.hidden = True
    cmd.__name__ = f"bench_{name}"
    return cmd


SUITE_OPTION = click.option(
    "--suite", type=click.Choice(["needle", "diverse"], case_sensitive=False), default=None,
    help="needle: needles among near-duplicate clusters with a controlled margin (the competing keys share the "
         "query's rounding); diverse: a top-k boundary contested by diverse keys (AR(1) drift, topic clusters, "
         "outlier channels through the norm weight) and realistic queries, every format with its error budget "
         "(missed with only the key rounded, only the query rounded, both). CPU: small sizes; GPU: 16K and 64K keys, "
         "k 512 and 2048. [default: needle]")


COMMANDS = (
    _section_command("bytes", ("bytes",), "Bytes per index token of each layout, per C4 layer and per full token, "
                     "for DeepSeek-V4-Flash, V4-Pro and V3.2; KV capacity with fp8 vs bf16 index keys. No GPU needed."),
    _section_command("store", ("store",), "store_index_k throughput at N = 1M tokens (bf16 exact / fp4sim, fp8; kv "
                     "fp32 and bf16) against the d2d copy bandwidth measured in the same run."),
    _section_command("query", ("query",), "prepare_index_q (fp4sim bf16 and fp8 query, T = 1, 64, 4096, 16384) "
                     "against the bytes it moves and the read-only stream ceiling measured in the same run."),
    _section_command("logits", ("logits",), "paged_mqa_logits (decode: equal, long-tail and one-long batches, next_n "
                     "1-4, bf16 and fp8 keys, DeepGEMM live when importable, torch gather+bmm baseline) and "
                     "mqa_logits (prefill) against the read-only stream / bf16 matmul rate measured in the same run."),
    _section_command("recall", ("recall",), "Needle suite with a controlled margin and a DeepSeek-V4 reference "
                     "comparison, on synthetic keys through the real store and logits ops: per format and context, "
                     "the needle-in-top-k rate at margins 0.001%..10% over the best distractor (exact fp64 passes "
                     "every needle by construction), the resolution (smallest margin with >= 99% kept), "
                     "recall@512/1024 vs exact fp64 and top-k overlap with the reference numerics (fp4-simulated q "
                     "and keys, fp32 scores). --suite diverse: diverse keys and realistic queries instead, each "
                     "format's share of the exact top-k missed and its error budget.",
                     extra_options=(SUITE_OPTION,)),
    _section_command("all", SECTIONS_ALL, "Run bytes, store, query, logits and recall (the default)."),
)


def run(ctx: click.Context, sections, o: dict) -> dict:
    import torch
    from rich.console import Console

    from . import bytes as bytes_mod
    from . import plots, provenance, report

    out = common.console(stderr=o["markdown_path"] == "-")  # '-': stdout carries only the markdown
    err = Console(stderr=True)
    needs_device = any(s in sections for s in ("store", "query", "logits", "recall"))
    if needs_device:
        dev, backend = common.resolve_device(o["backend"].lower(), o["device"])
    else:  # `bytes` is arithmetic, but a device or backend that cannot be had is still an error (as for `store`)
        if o["device"] is not None or o["backend"].lower() != "auto":
            common.resolve_device(o["backend"].lower(), o["device"])
        dev, backend = torch.device("cpu"), "none"
    quick = bool(o["quick"])  # on CPU the store/logits sizes are tiny either way (see --help)
    seed = int(o["seed"])
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    doc = provenance.new_document(backend=backend,
                                  device_name=common.device_name(dev) if needs_device else "none (arithmetic)",
                                  quick=quick, seed=seed, gpu_mem_gib=float(o["gpu_mem_gib"]))
    doc["sections"] = list(sections)
    doc["driver"] = provenance.driver_version() if dev.type == "cuda" else None
    if not doc["git_commit"]:
        doc["notes"].setdefault("general", []).append(doc["commit_note"])
    _check_outputs(o, doc, sections)
    if backend == "cpu":
        doc["notes"].setdefault("general", []).insert(0, "CPU backend: the torch reference at small sizes; its "
                                                      "timings show that the pipeline runs, they are not "
                                                      "performance figures, and no ratios to ceilings are computed.")
        err.print("[yellow]CPU backend: torch reference at small sizes (timings are not performance figures).[/]")

    if "bytes" in sections:
        doc["bytes"] = bytes_mod.rows(float(o["gpu_mem_gib"]))
        doc["notes"]["bytes"] = bytes_mod.notes()

    if needs_device:
        from . import sweeps, verify_extend

        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        with common.progress(err) as progress:
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
                                 + verify_extend.verify_rows(dev, quick, seed, doc["ceilings"], progress)
                                 + verify_extend.extend_rows(dev, quick, seed, doc["ceilings"], progress))
                doc["notes"]["logits"] = [sweeps.LOGITS_COUNTED, verify_extend.VERIFY_EXTEND_COUNTED]
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
        common.write_markdown(report.markdown_headline(doc), o["markdown_path"])
        if o["markdown_path"] != "-":
            err.print(f"wrote {o['markdown_path']}")
    if o["plot_path"]:
        for written in plots.plot(doc, o["plot_path"]):
            err.print(f"wrote {written}")
    err.print(f"[dim]done in {doc['elapsed_s']:.1f} s[/]")
    return doc


def _check_outputs(o: dict, doc: dict, sections) -> None:
    """Before any measurement: each file the run will write may replace what it holds (bench/output_guard.py); the
    run is known from the document before its rows (its sections, backend, device, --quick)."""
    from . import plots

    stub = dict(doc, recall_diverse=[{}] if "recall" in sections and str(o["suite"]).lower() == "diverse" else [])
    run = output_guard.run_of(stub)
    output_guard.check(o["json_path"], "--json", output_guard.JSON, run, o["force"])
    output_guard.check(o["markdown_path"], "--markdown", output_guard.MARKDOWN, run, o["force"])
    if o["plot_path"]:   # the recall study goes beside the throughput plot, or is the plot of a recall-only run
        only_recall = list(sections) == ["recall"]
        output_guard.check(o["plot_path"], "--plot", output_guard.PNG, output_guard.plot_run(stub, only_recall),
                           o["force"])
        if "recall" in sections and not only_recall:
            output_guard.check(plots.recall_path(o["plot_path"]), "--plot", output_guard.PNG,
                               output_guard.plot_run(stub, True), o["force"])
