"""``cupy-dsa bench report``: re-print the tables of saved results (bench sections, serve, rescore, variants
--emulate, one or several needle runs) and write their markdown, plot and README blocks, each refused with a usage
error where the result cannot give it.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from . import cli_common as common
from . import output_guard


@click.command(name="report")
@click.argument("json_files", metavar="JSON_FILE...", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--markdown", "markdown_path", type=click.Path(dir_okay=False, writable=True, allow_dash=True),
              default=None, callback=output_guard.guarded_option(output_guard.MARKDOWN), help=common.MARKDOWN_HELP)
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, writable=True), default=None,
              callback=common.png_output,   # how strict depends on the JSON's kind: checked once it is read
              help="re-draw the PNG plot from the JSON; the name must end in .png.")
@click.option("--readme", "readme_path", type=click.Path(exists=True, dir_okay=False, writable=True), default=None,
              callback=lambda ctx, param, value: _readme_file(ctx, value),
              help="rewrite the <!-- results:NAME --> blocks of this markdown file that the JSON holds data for "
                   "(the others are kept; it prints which and why).")
@click.option("--allow-cpu-or-quick", is_flag=True, default=False,
              help="with --readme: accept a CPU-backend or --quick run (refused by default: the README's "
                   "figures are full-size GPU runs).")
@output_guard.FORCE_OPTION
def report_cmd(json_files, markdown_path, plot_path, readme_path, allow_cpu_or_quick, force):
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
    _check_outputs(docs, markdown_path, plot_path, force)
    try:
        _report(json_files, docs, markdown_path, plot_path, readme_path, allow_cpu_or_quick, force)
    except (KeyError, TypeError, AttributeError, IndexError, ValueError) as exc:
        # what the structure check does not reach (a row's fields): one message naming the file, no traceback
        raise click.BadParameter(f"{', '.join(json_files)}: a field of the results is missing or of the wrong type "
                                 f"({type(exc).__name__}: {exc})", param_hint="JSON_FILE") from None


def _readme_file(ctx, value):
    """--readme: a markdown document with results blocks (never a JSON, a PNG or a table of a run)."""
    output_guard.check(value, "--readme", output_guard.MARKDOWN, None, bool(ctx.params.get("force")), readme=True)
    return value


def _check_outputs(docs, markdown_path, plot_path, force):
    """--markdown and --plot hold the run of the JSON given (several needle runs: their overlay)."""
    from . import plots

    run = output_guard.run_of(docs[0]) if len(docs) == 1 else _needle_run(docs)
    output_guard.check(markdown_path, "--markdown", output_guard.MARKDOWN, run, force)
    if plot_path and len(docs) == 1 and run is not None and run.schema.startswith("cupy-dsa-bench/"):
        try:
            files = plots.plot_files(docs[0], plot_path)
        except (KeyError, TypeError, AttributeError, IndexError, ValueError):
            files = [(plot_path, False)]   # a broken document: refused with its own message after this
        for file, study in files:
            output_guard.check(file, "--plot", output_guard.PNG, output_guard.plot_run(docs[0], study), force)
    else:   # needle plots (bench/needle.py) record no run yet: only a file of another kind is refused
        needle = run is not None and run.schema.startswith("cupy-dsa-needle/")
        output_guard.check(plot_path, "--plot", output_guard.PNG, run, force, strict=not needle)


def _needle_run(docs):
    """The run a markdown table of several needle results holds: their overlay."""
    if len(docs) == 1:
        return output_guard.run_of(docs[0])
    return output_guard.Run("cupy-dsa-needle/1", "overlay of " + ", ".join(
        str(d.get("label")) for d in docs if isinstance(d, dict)), None, False)


def _report(json_files, docs, markdown_path, plot_path, readme_path, allow_cpu_or_quick, force=False):
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
        _report_rescore(json_file, doc, markdown_path, plot_path, readme_path, allow_cpu_or_quick, force=force)
        return
    from . import variants

    if isinstance(doc, dict) and doc.get("schema") == variants.EMULATE_SCHEMA:  # `bench variants --emulate`
        _report_rescore(json_file, doc, markdown_path, plot_path, readme_path, allow_cpu_or_quick, force=force,
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
        if update[1] and why and not (allow_cpu_or_quick or force):
            raise click.BadParameter(
                f"{json_file} is {why}; the README's results blocks quote full-size GPU runs, so it would replace "
                f"them ({', '.join('results:' + n for n in update[1])}). Pass --allow-cpu-or-quick (or --force) to "
                "write them anyway.", param_hint="'--readme'")
    if is_serve:  # a `bench serve` run: its table, its README block
        if plot_path:
            serve.plot(doc, plot_path)
        if markdown_path:
            common.write_markdown(serve.markdown(doc), markdown_path)
        if markdown_path != "-":
            click.echo(serve.markdown(doc))
    else:
        report.print_all(common.console(stderr=markdown_path == "-"), doc, [s for s in provenance.SECTIONS if doc.get(s)])
        if markdown_path:
            common.write_markdown(report.markdown_headline(doc), markdown_path)
        if plot_path:
            for written in plots.plot(doc, plot_path):
                click.echo(f"wrote {written}", err=True)
    if update is not None:
        _write_readme(readme_path, update, "the JSON holds data for none of its blocks")


def _write_readme(readme_path, update, why_none):
    """Write a `report --readme` update and say which blocks it rewrote and kept, and why."""
    text, rewritten, kept = update
    if rewritten and text == Path(readme_path).read_text():
        click.echo(f"{readme_path}: unchanged ({', '.join('results:' + n for n in rewritten)} already render this "
                   "JSON)", err=True)
    elif rewritten:
        Path(readme_path).write_text(text)
        click.echo(f"{readme_path}: rewrote {', '.join('results:' + n for n in rewritten)}", err=True)
    else:
        click.echo(f"{readme_path}: nothing rewritten ({why_none})", err=True)
    for name, why in kept.items():
        click.echo(f"{readme_path}: kept results:{name} ({why})", err=True)


def _report_rescore(json_file, doc, markdown_path, plot_path, readme_path, allow_cpu_or_quick, force=False, md=None,
                    blocks=None,
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
        if update[1] and why and not (allow_cpu_or_quick or force):
            raise click.BadParameter(f"{json_file} is {why}; pass --allow-cpu-or-quick (or --force) to write "
                                     f"{', '.join('results:' + n for n in blocks)} anyway", param_hint="'--readme'")
    md = rescore_bench.markdown(doc) if md is None else md
    if markdown_path:
        common.write_markdown(md, markdown_path)
    if markdown_path != "-":
        click.echo(md)
    if update is not None:
        _write_readme(readme_path, update, f"it has no {', '.join('results:' + n for n in blocks)} block, or the "
                                           "JSON holds no rows for it")


# --------------------------------------------------------------------------------------------------
# needle: recall of a running server
# --------------------------------------------------------------------------------------------------


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
    out = common.console(stderr=markdown_path == "-")
    if len(docs) == 1:
        report.print_fitted(out, needle.table(docs[0]))
        md = needle.markdown(docs[0])
    else:
        report.print_fitted(out, needle.overlay_table(docs))
        md = needle.overlay_markdown(docs)
    for d in docs:   # a residue that loses what the others keep, and a run that did not finish, are said aloud
        for text in needle.flags(d) + ([needle.incomplete_text(d)] if d.get("incomplete") else []):
            out.print(f"[yellow]{d['label']}: {text}[/]", soft_wrap=True)
    if markdown_path:
        common.write_markdown(md, markdown_path)
    if plot_path:
        needle.plot(docs, plot_path)
