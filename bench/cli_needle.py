"""``cupy-dsa needle``: the options of the needle-in-a-haystack run against a running server (lengths, depths,
the request settings) and its console, JSON, markdown and plot output; the run itself is :mod:`.needle`'s.
"""

from __future__ import annotations

import json
import re

import click

from . import cli_common as common


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


@click.command(name="needle")
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
@click.option("--timeout", type=common.FiniteFloatRange(min=0, min_open=True), default=600.0, show_default=True,
              help="seconds per request (a long prefill takes a while).")
@click.option("--retries", type=click.IntRange(min=0), default=2, show_default=True,
              help="retries of a request that timed out, could not connect or got HTTP 408/409/429/5xx.")
@click.option("--concurrency", type=click.IntRange(min=1), default=1, show_default=True,
              help="requests in flight at once (the server batches them; the prompts and their order in the results "
                   "stay the same).")
@click.option("--extra-body", default=None, callback=_extra_body_option, metavar="JSON",
              help="JSON object merged into every request, e.g. '{\"chat_template_kwargs\": {\"thinking\": false}}'.")
@click.option("--residues", is_flag=True, default=False,
              help="also run each prompt at +1, +2 and +3 tokens, so every prompt length mod 4 is covered (the C4 "
                   "compressor folds 4 tokens into one index key), and report recall per residue.")
@click.option("--pad-at", type=click.Choice(("end", "needle")), default="end", show_default=True,
              help="with --residues: where the 1-3 padding tokens go, after the filler (the needle keeps its "
                   "position) or just before the needle (it keeps its distance from the end).")
@click.option("--resume", "resume_path", type=click.Path(exists=True, dir_okay=False), default=None, metavar="JSON",
              help="finish an interrupted run: its file's settings and calibration are used and its finished trials "
                   "kept; only the rest is asked (written to --json, default the same file).")
@click.option("--label", default=None, help="name of this run in tables, plots and overlays, e.g. the index-key "
                                            "mode it was served with (fp8, fp8-cupy, bf16). [default: the model name]")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True, allow_dash=True), default=None,
              callback=common.writable_output, help="write the results as JSON (schema cupy-dsa-needle/1); '-' = stdout.")
@click.option("--markdown", "markdown_path", type=click.Path(dir_okay=False, writable=True, allow_dash=True),
              default=None, callback=common.writable_output, help="write the recall table as markdown; '-' = stdout.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, writable=True), default=None,
              callback=common.png_output, help="PNG: recall against context length.")
def needle_cmd(base_url, model, api_key, lengths, depths, trials, seed, max_tokens, timeout, retries, concurrency,
               extra_body, residues, pad_at, resume_path, label, json_path, markdown_path, plot_path):
    """Needle-in-a-haystack recall of a running OpenAI-compatible server (SGLang's /v1/chat/completions).

    Seeded filler text with one needle fact at each depth, for each context length counted in the server's own
    tokens (calibrated from usage.prompt_tokens before the sweep); greedy answers, --trials needles per cell.
    Prints recall per (length, depth); overlay several runs with `cupy-dsa bench report a.json b.json`."""
    from rich.console import Console

    from . import needle, report

    to_stdout = "-" in (json_path, markdown_path)
    if json_path == "-" and markdown_path == "-":
        raise click.BadParameter("only one of --json and --markdown can be '-' (stdout)", param_hint="'--markdown'")
    out, err = common.console(stderr=to_stdout), Console(stderr=True)
    server = needle.Server(base_url=base_url, api_key=api_key, timeout=timeout, retries=retries, extra_body=extra_body)
    given = dict(lengths=lengths, depths=depths, trials=trials, seed=seed, max_tokens=max_tokens, residues=residues,
                 pad_at=pad_at)
    resume = None
    if resume_path:
        resume, given = _resumed(resume_path, given)
        json_path = json_path or resume_path
    settings = needle.Settings(**given, concurrency=concurrency, label=label or (resume or {}).get("label"))
    if resume:
        done = len(resume["trials"])
        err.print(f"resuming {resume_path}: {done} trial(s) kept")
    try:
        server.connect(model)
        needle.check_lengths_fit(server, settings)
        err.print(f"{server.model} at {base_url}"
                  + (f", context length {server.max_model_len}" if server.max_model_len else ""))
        with common.progress(err) as progress:
            tasks = {"calibrate": progress.add_task("calibrate", total=None),
                     "ask": progress.add_task("needles", total=None, start=False)}

            def tick(kind, advance=1, total=None):
                if kind == "ask" and total is not None:
                    progress.update(tasks["calibrate"], total=progress.tasks[tasks["calibrate"]].completed)
                    progress.update(tasks["ask"], total=total)
                    progress.start_task(tasks["ask"])
                progress.update(tasks[kind], advance=advance)

            doc = needle.run(server, settings, progress=tick, resume=resume)
    except needle.NeedleAborted as e:
        _write_aborted(e, json_path, err)
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
        common.write_markdown(needle.markdown(doc), markdown_path)
    if plot_path:
        needle.plot([doc], plot_path)
        err.print(f"wrote {plot_path}")



def _resumed(resume_path, given):
    """The document to resume and the settings it was run with; an option given on this command line with
    another value is refused (a finished trial only counts under the settings it ran with)."""
    from . import needle

    ctx = click.get_current_context()
    try:
        doc = json.loads(open(resume_path).read())
        settings = needle.resume_settings(doc, resume_path)
    except (OSError, ValueError) as e:
        raise click.BadParameter(f"expected an interrupted `cupy-dsa needle` result: {e}", param_hint="'--resume'") \
            from None
    for name, value in given.items():
        explicit = ctx.get_parameter_source(name) not in (click.core.ParameterSource.DEFAULT, None)
        if explicit and value != settings[name]:
            raise click.BadParameter(f"{value!r} differs from the resumed run's {settings[name]!r} ({resume_path}); "
                                     f"leave it out to resume, or start a new run",
                                     param_hint=f"'--{name.replace('_', '-')}'")
    return doc, settings


def _write_aborted(e, json_path, err):
    """The server failed mid-sweep: keep the finished trials (in --json, else a new needle-partial*.json) with the
    failure, and say how to resume."""
    from pathlib import Path

    from . import needle

    path = json_path if json_path and json_path != "-" else None
    if path is None:
        stem, n = "needle-partial", 0
        while Path(path := f"{stem}{f'-{n}' if n else ''}.json").exists():
            n += 1
    needle.write_json(e.doc, path)
    inc = e.doc["incomplete"]
    raise click.ClickException(f"{e} — kept the {inc['trials_done']} of {inc['trials_total']} trials that finished in "
                               f"{path}; once the server is back, `cupy-dsa needle --base-url ... --resume {path}` asks "
                               f"the rest")
