"""The README an operator reads (issue 50): at most 320 lines; what it is, then an exact table of what ran where (one
line per part of the stack, its latest run, commit, GPU and what passed), turn it on / check / off, a "Which mode"
table whose cost and fidelity figures and advice are rendered from the committed results, the needle and memory
sections, a glossary of the jargon it uses; no issue numbers a reader cannot see; every relative link resolves."""
import json
import re
from pathlib import Path

import pytest

from cupy_dsa.bench import readme as readme_mod
from cupy_dsa.bench import which_mode

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
DOCS = ["README.md", "bench/results/README.md", "bench/results/notes-rescore.md", "bench/results/notes-mma-sync.md"]


def _section(text, heading):
    start = text.index(f"\n{heading}\n")
    level = heading.split(" ")[0]
    end = re.search(rf"\n#{{1,{len(level)}}} ", text[start + 1:])
    return text[start: start + 1 + end.start()] if end else text[start:]


def test_readme_is_at_most_320_lines_with_the_operator_sections():
    assert len(README.splitlines()) <= 320
    for heading in ("## What ran where", "### Turn it on, check it, turn it off", "### Which mode", "## Needle",
                    "## Memory", "## What it costs", "## Glossary", "## Set up"):
        assert f"\n{heading}\n" in README, heading
    intro = README.split("\n\n")[1]   # what it is and why: three sentences
    assert len(re.findall(r"[.!?](\s|$)", intro)) == 3, intro


def test_run_table_is_one_exact_line_per_part():
    table = [ln for ln in _section(README, "## What ran where").splitlines() if ln.startswith("| ")]
    head, rows = table[0], table[1:]
    assert head == "| part of the stack | latest run | commit | where | what passed |"
    assert len(rows) >= 6 and all(ln.count(" | ") == 4 for ln in rows), rows
    for row in rows:   # one run per line: at most two commits (it held eight in one cell)
        commit = row.split(" | ")[2]
        assert len(re.findall(r"`[0-9a-f]{7,12}`", commit)) <= 2, row
    assert "No GPU run used torch 2.14.1" in " ".join(README.split())
    assert "[bench/results/README.md](bench/results/README.md#run-history)" in README


def test_the_history_records_every_run_the_table_names():
    """Each commit of the run table has its line in bench/results/README.md's run history, with where it is
    recorded (9162311's H100 test counts were in the README and a commit message only)."""
    history = _section((REPO / "bench/results/README.md").read_text(), "## Run history")
    table = [ln for ln in _section(README, "## What ran where").splitlines() if ln.startswith("| ")][1:]
    commits = {c for row in table for c in re.findall(r"`([0-9a-f]{7})", row.split(" | ")[2])}
    results = {json.loads(p.read_text()).get("git_commit", "")[:7] for p in (REPO / "bench/results").glob("*.json")}
    for c in commits - results:
        assert f"`{c}" in history, c
    assert "| `9162311` | H100 |" in history and "598 passed, 1 failed" in history


def test_glossary_defines_the_jargon_and_no_issue_is_cited():
    glossary = _section(README, "## Glossary")
    for term in ("C4", "K'", "MTP", "PD", "HiCache / L3", "DP attention", "TileLang", "DeepGEMM", "wgmma",
                 "mma.sync ceiling", "residency", "roofline", "needle resolution", "fp4sim", "QAT", "index_topk"):
        assert term in glossary, term
    assert not re.search(r"\bissues? \d+", README), re.findall(r".{40}\bissues? \d+.{20}", README)


def test_which_mode_block_is_what_the_committed_results_render():
    m = which_mode.BLOCK.search(README)
    assert m, "no model:modes block"
    committed = README[m.end(1):m.start(2)].rstrip("\n")
    assert readme_mod.without_stale_note(committed) == readme_mod.without_stale_note(which_mode.render()), \
        "re-render it: python -m cupy_dsa.bench.which_mode README.md"
    head = committed.splitlines()[0]
    assert "cost" in head and "fidelity" in head


def test_mode_advice_follows_the_figures(tmp_path):
    """The advice is ranked from the figures, not typed: with bf16's step made cheaper than fp8's in a copy of the
    results, it names bf16 as the cheapest ("bf16 is the mode to serve with when cost matters" stood beside figures
    where fp8 was cheapest)."""
    for name in which_mode.SOURCES.values():
        (tmp_path / name).write_text((REPO / "bench/results" / name).read_text())
    assert "The cheapest mode is `fp8`, the switch off" in which_mode.render(tmp_path)
    for key, field in (("serve", "bf16_ms"), ("rescore", "bf16_topk_ms")):
        path = tmp_path / which_mode.SOURCES[key]
        doc = json.loads(path.read_text())
        for r in doc["timings"]:
            if r.get(field) is not None:
                r[field] = r[field] / 10
        path.write_text(json.dumps(doc))
    text = which_mode.render(tmp_path)
    assert "The cheapest mode is `bf16` which keeps 95.5%" in text, text


def _anchors(text):
    out = set()
    for heading in re.findall(r"^#+ (.*)$", text, re.M):   # GitHub's: lower case, punctuation dropped, - for spaces
        out.add(re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-"))
    return out


@pytest.mark.parametrize("doc", DOCS)
def test_relative_links_resolve(doc):
    """bench/results/README.md linked ../README.md (no such file) and a renamed anchor."""
    path = REPO / doc
    bad = []
    for link in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
        if re.match(r"[a-z]+:", link):
            continue
        target, _, anchor = link.partition("#")
        file = (path.parent / target).resolve() if target else path
        if not file.exists():
            bad.append(f"{link}: no file")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file.read_text()):
            bad.append(f"{link}: no heading")
    assert not bad, bad
