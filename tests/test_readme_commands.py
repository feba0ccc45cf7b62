"""Every `cupy-dsa` / `python -m cupy_dsa...` line of the README's bash blocks, run as written on the CPU (what CI
has), so the README's commands and what it says of them stay true. `--quick` is added to the lines that run the
recall section (its full CPU size takes minutes; on the CPU backend --quick shrinks recall only). Lines that need
a GPU must say so; the README files they rewrite are copies. `cupy-dsa needle` lines (they need a running server)
run against the small OpenAI-compatible server of tests/needle_server.py on 127.0.0.1, their --base-url pointed
at it and their sweep shrunk; a `bench report` line over needle results finds those files made that way."""
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from cupy_dsa.bench import cli, provenance
from needle_server import FakeServer

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
GPU_ONLY = {"variants": "needs a GPU", "rescore": "needs a GPU"}


def readme_command_lines() -> list[str]:
    """The README's command lines (inside ```bash blocks) that start cupy-dsa or python -m cupy_dsa, optionally
    after environment assignments or a `pip install ... &&`."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", README, re.S):
        for line in block.splitlines():
            line = line.split(" #")[0].strip()
            line = line.split("&&")[-1].strip()
            if re.match(r"^(\w+=\S+ )*(cupy-dsa|python -m cupy_dsa)\b", line):
                out.append(line)
    return out


LINES = list(dict.fromkeys(readme_command_lines()))  # `cupy-dsa bench` stands twice


def test_the_readme_has_its_command_lines():
    assert len(LINES) >= 15, LINES
    assert "cupy-dsa bench" in LINES and "python -m cupy_dsa.sglang check --mode bf16" in LINES, LINES


def test_readme_bench_line_names_every_section():
    """`cupy-dsa bench  # ...`: the comment names what the bare command runs."""
    comment = re.search(r"^cupy-dsa bench +# (.*)$", README, re.M)[1]
    named = re.findall(r"[a-z]+", comment.split("(")[0])
    assert named == list(cli.SECTIONS_ALL) and set(named) == set(provenance.SECTIONS), comment


def test_readme_markdown_claim_matches_the_commands():
    """The options paragraph says which commands take --markdown."""
    with_md = {name for name, cmd in cli.bench.commands.items() if any("--markdown" in p.opts for p in cmd.params)}
    assert with_md == {"bytes", "store", "query", "logits", "recall", "all", "report", "variants"}, with_md
    assert ("`bench`, its sections, `report` and `variants` (with `--emulate`) take it, `serve` and `resources` do "
            "not") in " ".join(README.split())


def _against(srv, args):
    """A needle command line pointed at the local test server, with a small sweep."""
    if "--base-url" in args:
        i = args.index("--base-url")
        args = args[:i] + args[i + 2:]
    return args + ["--base-url", srv.url, "--lengths", "256,512", "--depths", "0,1", "--trials", "1"]


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A folder holding copies of README.md and bench/results (what the report lines read and rewrite)."""
    shutil.copy(REPO / "README.md", tmp_path / "README.md")
    shutil.copytree(REPO / "bench" / "results", tmp_path / "bench" / "results")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "100")
    return tmp_path


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the README's lines on the CPU backend (CI's machine)")
@pytest.mark.parametrize("line", LINES)
def test_readme_command_line_runs_on_cpu(line, workdir, monkeypatch):
    words = shlex.split(line)
    env = {}
    while "=" in words[0]:
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    if words[0] != "cupy-dsa":  # the SGLang check imports SGLang: in a process of its own, as an operator runs it
        assert words[:3] == ["python", "-m", "cupy_dsa.sglang"], line
        r = subprocess.run([sys.executable, *words[1:]], env={**os.environ, **env}, capture_output=True,
                           text=True, timeout=600)
        out = r.stdout + r.stderr
        assert "Traceback" not in out, out
        assert r.returncode == 1 and "no CUDA GPU visible" in r.stdout, out   # no GPU here; the rest is checked
        assert r.stdout.rstrip().endswith("problems above; fix them before starting the server"), out
        return
    from cupy_dsa.bench.cli import main

    args = words[1:]
    if args[:1] == ["needle"]:  # a running server's: the local test server stands in, a small sweep
        with FakeServer() as srv:
            args = _against(srv, args)
            res = CliRunner().invoke(main, args)
        assert res.exit_code == 0 and "Traceback" not in res.output, (line, res.output[-3000:])
        assert json.loads((workdir / args[args.index("--json") + 1]).read_text())["label"] == args[
            args.index("--label") + 1]
        return
    needle_files = [a for a in args[2:] if a.startswith("needle-") and a.endswith(".json")] if args[:2] == [
        "bench", "report"] else []
    if needle_files:  # the needle runs the line overlays, made as the README's needle lines make them
        with FakeServer() as srv:
            for name in needle_files:
                made = CliRunner().invoke(main, _against(srv, ["needle", "--label", name[7:-5], "--json", name]))
                assert made.exit_code == 0, made.output
    sub = next((a for a in args[1:] if not a.startswith("-")), None) if args[:1] == ["bench"] else None
    if args[:1] == ["bench"] and sub in (None, "all", "recall"):
        args = args + ["--quick"]
    res = CliRunner().invoke(main, args)
    assert "Traceback" not in res.output, res.output
    if sub in GPU_ONLY:
        assert res.exit_code == 2 and GPU_ONLY[sub] in res.output, res.output
        return
    if sub == "serve" and "--json" in args and (REPO / args[args.index("--json") + 1]).is_file():
        # the reproduction line names the committed H200 run: without a GPU it is refused, the file kept
        assert res.exit_code == 2 and "holds a measured run" in res.output, res.output
        assert (workdir / args[args.index("--json") + 1]).read_text() == (REPO / args[args.index("--json") + 1]).read_text()
        return
    assert res.exit_code == 0, (line, res.output[-3000:])
    if "--readme" in args:  # the committed file is what the committed JSONs render
        target = args[args.index("--readme") + 1]
        assert (workdir / target).read_text() == (REPO / target).read_text(), f"{target} is not what {line} renders"
    for opt in ("--json", "--plot", "--markdown"):
        if opt in args and args[args.index(opt) + 1] != "-":
            assert (workdir / args[args.index(opt) + 1]).stat().st_size > 0, opt
    if "--json" in args:
        doc = json.loads((workdir / args[args.index("--json") + 1]).read_text())
        assert sub not in (None, "all") or all(doc[s] for s in cli.SECTIONS_ALL), doc.keys()
