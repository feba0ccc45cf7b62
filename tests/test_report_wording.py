"""What the rendered results say about their runs (issue 50's minors): a run's -dirty mark kept, each fp8-rescore
recall row's stage-2 query named, one meaning per "vs fp8", an H100 run in H100 words, no raw import error, plots
with their commit and stale mark, the scripts pointing at the README that holds what they cite."""
import json
import re
from pathlib import Path

import pytest

from cupy_dsa.bench import bytes as bytes_mod
from cupy_dsa.bench import plots, provenance, readme, report, serve

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"


def _doc(name):
    return json.loads((RESULTS / name).read_text())


def test_rendering_keeps_the_dirty_mark():
    """h100-serve-query*.json ran at 1e0ee2e with uncommitted changes: a cut at 12 characters dropped '-dirty'."""
    doc = _doc("h100-serve-query.json")
    assert doc["git_commit"] == "1e0ee2ee7643-dirty"
    assert provenance.commit_label(doc) == "1e0ee2ee7643-dirty"
    assert provenance.commit_label({"git_commit": "0123456789abcdef0123"}) == "0123456789ab"
    assert "`1e0ee2ee7643-dirty`" in serve.markdown(doc)


def test_rescore_recall_rows_name_their_stage_2_query():
    doc = _doc("h200-recall.json")
    table = report.rescore_table(dict(doc, notes=doc.get("notes", {})))
    assert table is not None and "stage-2 query" in [c.header for c in table.columns]
    queries = table.columns[[c.header for c in table.columns].index("stage-2 query")]._cells
    assert set(queries) == {"fp8", "bf16"}
    assert report.rescore_query({"format": "fp8-rescore-4x-bf16q"}) == "bf16"
    assert report.rescore_query({"format": "fp8-rescore-4x"}) == "fp8"


def test_vs_fp8_says_which_ratio():
    """'vs fp8' was the tokens-fit ratio (0.855x) in `bench bytes` and the bytes ratio (1.169x) in the README."""
    doc = {"bytes": bytes_mod.rows(), "gpu_mem_gib": 80.0}
    headers = [c.header for c in report.bytes_table(doc).columns]
    assert "tokens fit vs fp8" in headers and "vs fp8" not in headers
    assert "| KV bytes per token vs fp8 |" in bytes_mod.readme_block()
    assert "80 GiB" in report.bytes_table(doc).title
    assert "100 GB" in report.bytes_table({"bytes": [], "gpu_mem_gb": 100.0}).title   # runs before GiB


def test_an_h100_run_renders_in_h100_words():
    doc = _doc("h100-serve-rescore.json")
    text = serve.markdown(doc)
    assert "the H200's stock top-k" not in text and "SGLang's stock top-k on sm_90: H100, H200" in text
    assert "Targets (set for an H200; this run: NVIDIA H100 80GB HBM3, batch 48" in text
    assert "Targets (H200, batch 48" in serve.markdown(_doc("h200-serve-rescore.json"))
    assert "issue 31" not in text and "issue 26" not in text


def test_the_serve_block_prints_no_raw_import_error():
    text = serve.markdown(_doc("h200-serve.json"))
    assert "ModuleNotFoundError" not in text and "was not installed where the bench ran" in text


@pytest.mark.parametrize("which", ["bench", "serve"])
def test_plots_carry_their_commit_and_the_stale_mark(which, tmp_path, monkeypatch):
    from PIL import Image

    monkeypatch.setattr(readme, "kernel_changes_since", lambda c: (3, "bbbbbbbbbbbb", ["kernels/topk.cu"]))
    png = tmp_path / "p.png"
    if which == "bench":
        doc = _doc("h200.json")
        plots.plot(doc, str(png))
    else:
        doc = _doc("h200-serve.json")
        serve.plot(doc, str(png))
    title = Image.open(png).text["Title"]
    assert f"commit {doc['git_commit']}" in title and "STALE: 3 later commits changed the kernels" in title, title
    monkeypatch.setattr(readme, "kernel_changes_since", lambda c: (0, "", []))
    assert "STALE" not in readme.plot_caption(doc)


def test_sglang_gpu_script_points_to_the_readme_that_has_its_section():
    text = (REPO / "scripts" / "run_sglang_gpu.sh").read_text()
    named = re.search(r"them: (\S+), \"([^\"]+)\"", text)
    assert named, "the script names where its wheels' download is described"
    assert f"### {named[2]}" in (REPO / named[1]).read_text(), named.groups()
