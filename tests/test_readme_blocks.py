"""`cupy-dsa bench report --readme`: it rewrites only the README blocks the JSON holds data for, says which it
rewrote and kept, and refuses CPU / --quick / unmeasured runs for the README's H200 blocks unless told."""
import copy
import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from cupy_dsa.bench import readme as readme_mod
from cupy_dsa.bench.cli import SECTIONS_ALL, main
from cupy_dsa.bench.provenance import SECTIONS

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
# the README's blocks and bench/results/README.md's, as one text (each block stands in one of them)
README = (REPO / "README.md").read_text() + "\n" + (RESULTS / "README.md").read_text()


def _report(*args):
    return CliRunner().invoke(main, ["bench", "report", *map(str, args)])


def _blocks(text):
    """Block bodies without their stale lines (those follow the run's commit, not its figures)."""
    return {m["name"]: readme_mod.without_stale_note(m["body"]) for m in readme_mod.README_BLOCK.finditer(text)}


def _changed(before, after):
    a, b = _blocks(before), _blocks(after)
    assert a.keys() == b.keys()
    return {n for n in a if a[n] != b[n]}


@pytest.fixture(scope="module")
def cpu_runs(tmp_path_factory):
    """CPU JSONs of `bench query`, `bench bytes` and `bench serve` (what a newcomer without a GPU makes)."""
    d = tmp_path_factory.mktemp("readme")
    out = {}
    for name, args in (("query", ["bench", "query", "--backend", "cpu"]), ("bytes", ["bench", "bytes"]),
                       ("serve", ["bench", "serve"])):
        j = d / f"{name}.json"
        res = CliRunner().invoke(main, args + ["--json", str(j)])
        assert res.exit_code == 0, res.output
        out[name] = j
    return out


def _gpu_query_doc():
    """The committed H200 run plus synthetic query rows (as `bench all` on a GPU now records them); its recall rows
    are the committed `bench recall` run's (the README's recall block quotes that newer run)."""
    doc = json.loads((RESULTS / "h200.json").read_text())
    doc["recall"] = json.loads((RESULTS / "h200-recall.json").read_text())["recall"]
    doc["query"] = [{"n_tokens": t, "numerics": n, "error": None, "time_us": 3.0 + t / 1000 + (n == "fp8"),
                     "bytes_per_token_counted": 33412, "gbps": 123.0 + t / 100, "pct_read": 0.25, "timing": "graph"}
                    for t in (1, 64, 4096, 16384) for n in ("fp4sim", "fp8")]
    return doc


@pytest.mark.parametrize("run", ["query", "bytes", "serve"])
def test_cpu_runs_never_erase_the_h200_blocks(run, cpu_runs, tmp_path):
    md = tmp_path / "README.md"
    md.write_text(README)
    res = _report(cpu_runs[run], "--readme", md)
    assert md.read_text() == README
    if run == "query":  # it holds data for the query block: refused, naming the way to accept it
        assert res.exit_code == 2 and "cpu-backend run" in res.output and "--allow-cpu-or-quick" in res.output, \
            res.output
        assert "results:query" in res.output
    else:  # no data for any block: nothing rewritten, and it says so
        assert res.exit_code == 0, res.output
        assert "nothing rewritten" in res.output and "kept results:" in res.output


def test_cpu_query_run_rewrites_only_its_block_when_told(cpu_runs, tmp_path):
    md = tmp_path / "README.md"
    md.write_text(README)
    res = _report(cpu_runs["query"], "--readme", md, "--allow-cpu-or-quick")
    assert res.exit_code == 0, res.output
    assert _changed(README, md.read_text()) == {"query"}
    assert f"{md}: rewrote results:query" in res.output
    assert "kept results:recall (no recall rows)" in res.output
    assert "kept results:environment (the JSON holds no data for results:recall" in res.output
    body = _blocks(md.read_text())["query"]
    assert "| 64 | fp4sim |" in body and "| 1 | fp8 |" in body and "cpu" in body


def test_gpu_query_rows_render_the_query_block(tmp_path):
    """What the lead's H200 `bench all` JSON does to the README: every block has data; the committed figures
    render as before, the query block gets its rows."""
    j = tmp_path / "gpu.json"
    j.write_text(json.dumps(_gpu_query_doc()))
    md = tmp_path / "README.md"
    md.write_text(README)
    res = _report(j, "--readme", md)
    assert res.exit_code == 0, res.output
    assert _changed(README, md.read_text()) == {"query"}
    # `bench all` runs the needle suite: the diverse suite's block keeps its own run
    assert [ln.split("kept ")[1] for ln in res.output.splitlines() if "kept results:" in ln] == [
        "results:recall-diverse (no diverse recall rows (`cupy-dsa bench recall --suite diverse` makes them))"], res.output
    assert all(f"results:{n}" in res.output.split("rewrote ")[1] for n in readme_mod.README_BLOCKS), res.output
    body = _blocks(md.read_text())["query"]
    assert "NVIDIA H200 (cuda)" in body
    assert body.count("\n| ") == 9 and "| 16K | fp4sim | 19.4 us | 287 | 25.0% |" in body, body
    assert "prepare_index_q, T = 4K, fp8 query" in _report(j, "--markdown", "-").output


def test_quick_and_unmeasured_runs_are_refused(tmp_path):
    doc = _gpu_query_doc()
    doc["quick"] = True
    j = tmp_path / "quick.json"
    j.write_text(json.dumps(doc))
    md = tmp_path / "README.md"
    md.write_text(README)
    res = _report(j, "--readme", md)
    assert res.exit_code == 2 and "--quick run" in res.output and md.read_text() == README, res.output
    serve = json.loads((RESULTS / "h200-serve.json").read_text())
    unmeasured = dict(copy.deepcopy(serve), measured=False, timings=[], not_measured="no CUDA GPU")
    j.write_text(json.dumps(unmeasured))
    res = _report(j, "--readme", md)
    assert res.exit_code == 0 and md.read_text() == README
    assert "kept results:serve (no timings (no CUDA GPU))" in res.output, res.output


def test_allow_flag_goes_with_readme():
    res = _report(RESULTS / "h200.json", "--allow-cpu-or-quick")
    assert res.exit_code == 2 and "--allow-cpu-or-quick" in res.output and "--readme" in res.output


def test_all_runs_every_section():
    assert set(SECTIONS_ALL) == set(SECTIONS) and "query" in SECTIONS_ALL


def test_query_markdown_and_plot_hold_the_rows(tmp_path):
    """`bench query --markdown --plot` writes the rows the console shows (it wrote a bare header and a blank
    'no data' plot)."""
    from cupy_dsa.bench import plots

    md, png = tmp_path / "q.md", tmp_path / "q.png"
    res = CliRunner().invoke(main, ["bench", "query", "--backend", "cpu", "--markdown", str(md), "--plot", str(png)])
    assert res.exit_code == 0, res.output
    rows = [ln for ln in md.read_text().splitlines() if ln.startswith("| prepare_index_q")]
    assert len(rows) == 4 and any("T = 64, fp4sim query" in r for r in rows), md.read_text()
    drawn = []
    orig = plots._query_panel
    try:
        plots._query_panel = lambda ax, rows, has_ceiling: drawn.append(rows) or orig(ax, rows, has_ceiling)
        plots.plot(_gpu_query_doc(), str(tmp_path / "g.png"))
    finally:
        plots._query_panel = orig
    assert len(drawn) == 1 and len(drawn[0]) == 8


def test_driver_is_recorded_for_gpu_runs(monkeypatch):
    """The environment line says the driver of the run (the H200 JSON had none to say)."""
    import subprocess

    from cupy_dsa.bench import provenance

    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, "580.159.04\n", ""))
    assert provenance.driver_version() == "driver 580.159.04"
    doc = dict(json.loads((RESULTS / "h200.json").read_text()), driver=provenance.driver_version())
    assert readme_mod.readme_environment(doc).startswith("NVIDIA H200 (cuda, driver 580.159.04), torch 2.11.0")

    def missing(*a, **k):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(subprocess, "run", missing)
    assert provenance.driver_version() is None


def _model_block(name):
    import re

    m = re.search(rf"<!-- model:{name} -->\n(.*?)<!-- /model:{name} -->", README, re.S)
    assert m, f"no model:{name} block"
    return m[1].strip()


def test_memory_block_is_bench_bytes():
    """The README's memory / PD-bytes table is `bench bytes`' arithmetic, fp8-rescore's 264 B included."""
    from cupy_dsa.bench import bytes as bytes_mod

    assert _model_block("bytes") == bytes_mod.readme_block().strip()
    flash = {r["layout"]: r for r in bytes_mod.rows() if r["model"] == "DeepSeek-V4-Flash"}
    assert flash["fp8-rescore"]["bytes_per_entry"] == 2 * flash["fp8"]["bytes_per_entry"] == 264
    assert round(flash["fp8"]["total_kv_bytes_per_token"]) == 3850 and round(flash["bf16"]["total_kv_bytes_per_token"]) == 4501


def test_rtx_model_runs_the_cost_tables_batch():
    """The RTX PRO 6000 model used batch 32 where the H200 cost table uses 64, and called assumed inputs measured."""
    from cupy_dsa.bench import roofline

    serve = json.loads((RESULTS / "h200-serve.json").read_text())
    assert roofline.README_BATCH == serve["batch"] == 64
    m = re.search(r"<!-- results:model-rtx-pro-6000 -->\n(.*?)<!-- /results:model-rtx-pro-6000 -->",
                  (RESULTS / "README.md").read_text(), re.S)
    assert m, "no results:model-rtx-pro-6000 block"
    assert "decode 64 x 8K" in m[1] and "decode 32 x" not in m[1]
    # issue 33: the published dense rates (spec sheet, 2,617 MHz); third-party measurements named as such
    gpu = roofline.RTX_PRO_6000
    assert (gpu.bf16_flops, gpu.fp8_flops, gpu.dram_bytes_per_s) == (504e12, 1.01e15, 1.792e12)
    assert "spec sheet" in gpu.source and "third parties measured" in gpu.source


def test_a_block_says_when_kernels_changed_after_its_run(monkeypatch, tmp_path):
    """A block rendered from a run that predates a kernel commit carries a stale line naming the run's commit, the
    kernel commits since and their files; a fresh run carries none; where git cannot tell, the line is kept."""
    monkeypatch.setattr(readme_mod, "kernel_changes_since",
                        lambda c: {"aaa": (3, "bbb", ["kernels/mqa_logits.cu"]), "ccc": (0, "", [])}.get(c))
    doc = json.loads((RESULTS / "h200-rescore.json").read_text())
    text = "<!-- results:rescore -->\nold\n<!-- /results:rescore -->\n"
    stale = readme_mod.readme_update(text, dict(doc, git_commit="aaa"), readme_mod.RESCORE_README_BLOCKS)[0]
    assert "**Stale:** measured at `aaa`; 3 later commits changed the kernels (`kernels/mqa_logits.cu`; the last: " \
           "`bbb`)" in stale
    fresh = readme_mod.readme_update(stale, dict(doc, git_commit="ccc"), readme_mod.RESCORE_README_BLOCKS)[0]
    assert "Stale" not in fresh
    unknown = readme_mod.readme_update(stale, dict(doc, git_commit="zzz"), readme_mod.RESCORE_README_BLOCKS)[0]
    assert "**Stale:** measured at `aaa`" in unknown   # no history to tell: the line it had stays
    assert readme_mod.without_stale_note(stale).replace("`aaa`", "`ccc`") == fresh


def test_kernel_history_is_read_from_the_checkout():
    """The committed runs' commits are in this checkout's history (a shallow clone may lack them: None)."""
    doc = json.loads((RESULTS / "h200-emulate-sm120.json").read_text())
    since = readme_mod.kernel_changes_since(doc["git_commit"])
    if since is None:
        pytest.skip("no git history of the run's commit here (not a checkout, or a shallow clone)")
    n, last, files = since
    assert n >= 1 and last and all(f.startswith("kernels/") for f in files)
    assert readme_mod.kernel_changes_since("0" * 12) is None


@pytest.mark.parametrize("run, block", [("h200-serve-query.json", "serve-query"),
                                        ("h200-serve-query-sm120.json", "serve-query-sm120"),
                                        ("h200-serve.json", "serve")])
def test_serve_runs_rewrite_only_their_own_blocks(run, block, tmp_path):
    """A `bench serve --query` run (the bf16 layout alone) does not replace the bf16-vs-fp8 cost table, a run with
    sm_120's configs forced only its own block, and the cost run leaves the query blocks alone: each block of
    "What it costs" is rendered from the one file it names."""
    blanked = readme_mod.README_BLOCK.sub(lambda m: f"{m[1]}old\n{m[4]}" if m["name"].startswith("serve") else m[0],
                                          README)
    md = tmp_path / "README.md"
    md.write_text(blanked)
    res = _report(RESULTS / run, "--readme", md)
    assert res.exit_code == 0, res.output
    assert _changed(blanked, md.read_text()) == {block}, res.output
    assert f"rewrote results:{block}\n" in res.output


def test_recall_diverse_target_line():
    """Issue 32's recall target: bf16 keys + bf16 q keep >= 99.5% of the exact top-k at >= 16K keys, k 512 and
    2048; the committed H200 run passes it, a case under it misses, a run without such cases is not evaluated."""
    from cupy_dsa.bench import recall_diverse as rd

    rows = [r for r in json.loads((RESULTS / "h200-recall-diverse.json").read_text())["recall_diverse"]
            if not r["error"] and not r["trivial"]]
    assert rd.target_line(rows).endswith("over 4 cases: pass.")
    worse = [dict(r, recall_mean=0.99) if r["format"] == rd.TARGET_FORMAT and r["k"] == 2048 else r for r in rows]
    assert rd.target_line(worse).endswith("**miss**.") and "99.00-" in rd.target_line(worse)
    small = [dict(r, index_entries=4096) for r in rows]
    assert "not evaluated" in rd.target_line(small)
    block = readme_mod.RECALL_DIVERSE_README_BLOCKS["recall-diverse"].render(
        json.loads((RESULTS / "h200-recall-diverse.json").read_text()))
    assert "| bf16+q-bf16 | bf16 | bf16 | " in block and "16K keys, k 2048" in block and "64K keys, k 2048" in block
