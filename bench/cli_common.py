"""What the ``cupy-dsa`` commands share: option types and checks (output paths, finite floats, seeds), writing
their JSON and markdown, the console and progress bar their tables and bars go to, the device a command runs on,
and the top-k implementations ``bench serve`` and ``bench rescore`` load. Imports no torch or rich at import time.
"""

from __future__ import annotations

import math
import os
import platform
import re
import tempfile
from pathlib import Path

import click


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


def checked_path(ctx, param, value):
    """A writer's path, checked while the options are parsed, so a run that takes minutes does not fail at its
    end on a path it cannot write ('-' is stdout). A folder that does not exist is made when the file is
    written, and said now (a typo in a folder name should not pass unseen)."""
    if value is None or value == "-":
        return value
    try:
        _probe_writable(Path(value))
    except OSError as e:
        raise click.BadParameter(f"cannot write {value!r} ({type(e).__name__}: {e.strerror or e})") from None
    missing = next((p for p in reversed(Path(value).parents) if not p.exists()), None)
    if missing is not None:
        click.echo(f"{param.opts[0]}: the folder {missing} does not exist; it will be made for {value}", err=True)
    return value


# the file kind each writer option writes (bench/output_guard.py)
WRITER_KINDS = {"json_path": "JSON", "markdown_path": "markdown", "plot_path": "PNG"}


def writable_output(ctx, param, value):
    """--json / --plot / --markdown of a command that does not record its run in its files yet: the path checked
    (:func:`checked_path`), and refused over a file of another kind or a document with results blocks
    (:func:`output_guard.check`, not strict)."""
    from . import output_guard

    value = checked_path(ctx, param, value)
    if param.name in WRITER_KINDS and not isinstance(ctx.command, click.Group):
        output_guard.check(value, param.opts[0], WRITER_KINDS[param.name], None, bool(ctx.params.get("force")),
                           strict=False)
    return value


def png_output(ctx, param, value):
    return writable_output(ctx, param, _png_path(ctx, param, value))


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


def write_text(path: str, text: str) -> None:
    """A JSON file of a command; its folder is made as every output's is (the path was checked up front)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text)


def write_markdown(md: str, path: str) -> None:
    """The headline table to ``path``, or to stdout for '-' (every command treats '-' the same way)."""
    if path == "-":
        click.echo(md, nl=False)
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(md)


def resolve_device(backend: str, device: str | None, *, has_backend_option: bool = True):
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


def device_name(dev) -> str:
    import torch

    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)"


PIPE_WIDTH = 200  # piped output (logs) without COLUMNS: wide, so rows stay whole


def console(stderr: bool = False):
    """The console the tables go to (stdout, or stderr when stdout carries the markdown): the terminal's width,
    ``COLUMNS`` when set (rich reads it), else :data:`PIPE_WIDTH` for a pipe. Tables fit it
    (``report.fitted``)."""
    from rich.console import Console

    c = Console(stderr=stderr)
    return c if c.is_terminal or os.environ.get("COLUMNS", "").isdigit() else Console(stderr=stderr, width=PIPE_WIDTH)


def progress(console):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=console, transient=False)


def load_topks(dev, err):
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

