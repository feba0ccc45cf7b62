"""One guard for every file a command writes (``--json``, ``--markdown``, ``--plot``, ``--readme``).

The committed results are measured GPU runs, and the README quotes them: a CPU run, a ``--quick`` run, a run on
another GPU or of another command must not replace one silently, and no writer may put JSON, markdown or PNG bytes
over a file of another kind (``bench serve --json README.md`` turned the README into JSON). So every file a command
writes records what run it holds (:class:`Run`): JSON in its own fields, a PNG in a text chunk of its metadata. Before any work, :func:`check` reads the file that is
there and refuses (a usage error naming the option) when it holds another kind of file, a file no cupy-dsa command
wrote, or a run the new one may not replace; ``--force`` writes anyway and says what it replaces.

A markdown table is written exactly as the console prints it (the tests compare the two), so it records no run: a
markdown file is replaced unless it is a committed document (git tracks it) or holds results blocks (``bench
report --readme`` rewrites those). No result the READMEs render is a markdown file.
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import click

JSON, MARKDOWN, PNG = "JSON", "markdown", "PNG"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PNG_RUN_KEY = "cupy-dsa run"          # the PNG text chunk holding the run record
README_BLOCK_MARK = re.compile(r"<!-- (results|model):[a-z0-9-]+ -->")
FORCE_HELP = ("write --json / --markdown / --plot even over a file of another kind or over a run this one may not "
              "replace (a measured GPU run, a run of another command or GPU); says what it replaced.")


@dataclass(frozen=True)
class Run:
    """What a results file holds: the command's schema, what the run covered (sections, layouts, configs), the GPU
    it measured on (None: nothing measured on a GPU: the CPU backend, arithmetic, no GPU) and whether it was
    ``--quick``."""
    schema: str
    what: str
    gpu: str | None
    quick: bool

    def describe(self) -> str:
        where = f"a measured run on {self.gpu}" if self.gpu else "a run that measured nothing on a GPU"
        return f"{where} ({self.schema}, {self.what}{', --quick' if self.quick else ''})"

    def record(self) -> str:
        return json.dumps({"schema": self.schema, "what": self.what, "gpu": self.gpu, "quick": self.quick},
                          sort_keys=True)


ANY_LAYOUTS = "(not recorded)"


def _same_what(old: str, new: str) -> bool:
    """Whether two runs covered the same: equal, or ``old`` recorded no layouts and the rest agrees."""
    if old == new:
        return True
    prefix = f"layouts {ANY_LAYOUTS};"
    return old.startswith(prefix) and new.startswith("layouts ") and old[len(prefix):] == new[new.find(";") + 1:]


def run_of(doc: dict) -> Run | None:
    """The run a results document (or the stub a command builds before it measures) holds; None for a document no
    cupy-dsa command wrote."""
    if not isinstance(doc, dict) or not isinstance(doc.get("schema"), str):
        return None
    schema = doc["schema"]
    quick = bool(doc.get("quick"))
    if schema.startswith("cupy-dsa-bench/"):
        sections = doc.get("sections") or [s for s in ("bytes", "store", "query", "logits", "recall") if doc.get(s)]
        what = "sections " + ",".join(sections) + (" (diverse suite)" if doc.get("recall_diverse") else "")
        return Run(schema, what, doc.get("device") if doc.get("backend") == "cuda" else None, quick)
    if schema.startswith("cupy-dsa-serve/"):
        # a run from before --layouts recorded none: any layouts may replace it (ANY_LAYOUTS), its other settings not
        layouts = ",".join(doc["layouts"]) if doc.get("layouts") else ANY_LAYOUTS
        what = (f"layouts {layouts}; "
                f"{doc.get('arch_configs') or 'this GPU'}'s configs"
                + (f"; queries {','.join(doc['queries'])}" if doc.get("queries") else ""))
        return Run(schema, what, doc.get("device") if doc.get("measured") else None, False)
    if schema.startswith("cupy-dsa-emulate/"):
        return Run(schema, f"emulating {doc.get('target')}", doc.get("device"), quick)
    if schema.startswith(("cupy-dsa-rescore/", "cupy-dsa-variants/")):
        return Run(schema, schema.split("-")[-1].split("/")[0], doc.get("device"), quick)
    if schema.startswith("cupy-dsa-split-invariance/"):   # scripts/gpu_split_invariance.py (a --device cpu dry run: no GPU)
        return Run(schema, "split invariance", doc.get("device") if doc.get("measured") else None, False)
    if schema.startswith("cupy-dsa-needle/"):   # a server's recall: what it holds is its label's run
        return Run(schema, f"label {doc.get('label')}", None, False)
    return None


RECALL_STUDY = "recall study"


def plot_run(doc: dict, recall_study: bool) -> Run | None:
    """The run a plot of ``doc`` holds: the recall study (drawn from a `bench recall` run or beside the throughput
    plot of a `bench all` run) is one kind of plot whatever run it came from; the throughput plot is its run's."""
    run = run_of(doc)
    return Run(run.schema, RECALL_STUDY, run.gpu, run.quick) if run is not None and recall_study else run


def _run_from_record(text: str) -> Run | None:
    try:
        r = json.loads(text)
        return Run(str(r["schema"]), str(r["what"]), r["gpu"], bool(r["quick"]))
    except (ValueError, KeyError, TypeError):
        return None


def _png_text(data: bytes) -> dict[str, str]:
    """The tEXt chunks of a PNG (matplotlib writes its metadata there)."""
    out, pos = {}, len(PNG_MAGIC)
    while pos + 8 <= len(data):
        size = int.from_bytes(data[pos:pos + 4], "big")
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + size]
        if kind == b"tEXt" and b"\0" in body:
            key, value = body.split(b"\0", 1)
            out[key.decode("latin-1")] = value.decode("latin-1")
        if kind == b"IEND":
            break
        pos += 12 + size
    return out


MARKDOWN_TABLE = "a markdown file"


def _tracked(path: Path) -> bool:
    """Whether git tracks ``path`` (False where there is no git or no checkout)."""
    try:
        r = subprocess.run(["git", "-C", str(path.resolve().parent), "ls-files", "--error-unmatch", path.name],
                           capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return False
    return r.returncode == 0


@dataclass(frozen=True)
class Existing:
    """A file that is there: its kind (JSON / markdown / PNG / other), the run it records (None: none), and, when
    it records none, what it is."""
    kind: str
    run: Run | None
    what: str


def read_existing(path: Path) -> Existing | None:
    """What ``path`` holds, or None when there is no file."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:      # unreadable: the write would fail too; the path check reports it
        return Existing("other", None, f"an unreadable file ({exc.strerror or exc})")
    if data.startswith(PNG_MAGIC):
        text = _png_text(data)
        if PNG_RUN_KEY in text:
            return Existing(PNG, _run_from_record(text[PNG_RUN_KEY]), "a cupy-dsa plot")
        legacy = text.get("Software") == "cupy-dsa bench" or "cupy-dsa" in text.get("Title", "")
        return Existing(PNG, None, "a cupy-dsa plot that records no run (drawn before plots recorded theirs)"
                        if legacy else "a PNG no cupy-dsa command wrote")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return Existing("other", None, "a binary file that is neither JSON, markdown nor PNG")
    if not text.strip():
        return Existing("empty", None, "an empty file")
    try:
        doc = json.loads(text)
    except ValueError:
        if README_BLOCK_MARK.search(text):
            return Existing(MARKDOWN, None, "a document with rendered results blocks (bench report --readme "
                                            "updates those)")
        if _tracked(path):
            return Existing(MARKDOWN, None, "a committed document (git tracks it)")
        return Existing(MARKDOWN, None, MARKDOWN_TABLE)
    run = run_of(doc)
    return Existing(JSON, run, "a cupy-dsa result" if run else "a JSON file no cupy-dsa command wrote")


def why_not(old: Existing, kind: str, new: Run | None, *, strict: bool = True, readme: bool = False) -> str | None:
    """Why a ``kind`` file of run ``new`` may not replace ``old`` (None: it may). ``new`` None: the run is not
    known yet (checked again once it is). ``strict`` False (a writer that records no run yet): only a file of
    another kind, or a document with results blocks, is refused. ``readme``: the file is ``--readme``'s, a document
    whose results blocks are rewritten in place (the blocks check their runs themselves)."""
    if old.kind == "empty":
        return None
    if old.kind != kind:
        return f"it holds {old.what if old.kind == 'other' else old.kind}, not {kind}"
    if readme:
        return None if old.what.startswith("a document with rendered results blocks") else \
            f"it holds {old.what}, which has no <!-- results:NAME --> blocks to rewrite"
    if old.run is None:
        if old.what.startswith("a cupy-dsa plot that records no run"):   # the committed plots before this guard
            return None if new is None or new.gpu else f"it holds {old.what}; only a measured GPU run replaces it"
        if old.what == MARKDOWN_TABLE or (not strict and not old.what.startswith("a document with rendered")):
            return None
        return f"it holds {old.what}"
    if new is None:
        return None
    if old.run.schema != new.schema or not _same_what(old.run.what, new.what):
        return f"it holds {old.run.describe()}; this is {new.describe()}"
    if old.run.gpu and (new.gpu != old.run.gpu or (new.quick and not old.run.quick)):
        return f"it holds {old.run.describe()}; this is {new.describe()}"
    return None


def check(path: str | None, option: str, kind: str, run: Run | None, force: bool, *, strict: bool = True,
          readme: bool = False) -> None:
    """Refuse (a usage error naming ``option``) to write a ``kind`` file of ``run`` at ``path`` over what is there
    (see :func:`why_not`), unless ``force``: then say what it replaces. '-' (stdout) and None pass."""
    if path in (None, "-"):
        return
    old = read_existing(Path(path))
    if old is None:
        return
    why = why_not(old, kind, run, strict=strict, readme=readme)
    if why is None:
        return
    ctx = click.get_current_context(silent=True)
    if force:   # said once per command, though the path is checked when parsed and again once the run is known
        said = ctx.find_root().meta.setdefault("output_guard_said", set()) if ctx is not None else set()
        if (option, path, why) not in said:
            said.add((option, path, why))
            click.echo(f"--force: {option} {path} is written although {why}", err=True)
        return
    has_force = ctx is not None and any("--force" in p.opts for p in ctx.command.params)
    raise click.BadParameter(f"{path}: {why}. Write to another file"
                             + (", or pass --force to replace it" if has_force else ""), param_hint=f"'{option}'")


def guarded_option(kind: str):
    """The click callback of a writer option: the path checked (writable, and :func:`check` against a file of
    another kind or one no cupy-dsa command wrote) while the options are parsed, before any work; the run is
    checked again once the command knows it. On the ``bench`` group, the section checks (its options merge)."""
    def callback(ctx, param, value):
        from .cli_common import _png_path, checked_path

        value = checked_path(ctx, param, _png_path(ctx, param, value) if kind == PNG else value)
        if not isinstance(ctx.command, click.Group):
            check(value, param.opts[0], kind, None, bool(ctx.params.get("force")))
        return value
    return callback


FORCE_OPTION = click.option("--force", is_flag=True, default=False, is_eager=True, help=FORCE_HELP)


def png_metadata(run: Run | None) -> dict[str, str]:
    return {PNG_RUN_KEY: run.record()} if run is not None else {}
