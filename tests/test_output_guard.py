"""One guard for every writer (bench/output_guard.py): in every command, --json, --markdown, --plot and --readme
never replace a measured GPU run with a CPU run or a run of another kind, never put JSON, markdown or PNG over a file
of another kind, and --force writes anyway and says so. Each refusal is a usage error (rc 2) naming the option,
before any work, and leaves the file as it was."""
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from cupy_dsa.bench import cli_common, cli_sections, output_guard
from cupy_dsa.bench.cli import main

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
SECTION_COMMANDS = [["bench"], ["bench", "bytes"], ["bench", "store"], ["bench", "query"], ["bench", "logits"],
                    ["bench", "recall"], ["bench", "all"]]
OPTION_KIND = {"--json": output_guard.JSON, "--markdown": output_guard.MARKDOWN, "--plot": output_guard.PNG}


def _run(args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture
def files(tmp_path):
    """Copies of the committed files of each kind: the README (markdown with results blocks), a measured H200 run
    of each kind that records its run (JSON, PNG), a committed document (a markdown file git tracks), and files no
    cupy-dsa command wrote."""
    out = {"readme": tmp_path / "README.md", "json": tmp_path / "h200.json", "png": tmp_path / "h200.png",
           "serve_json": tmp_path / "h200-serve.json", "rescore_json": tmp_path / "h200-rescore.json",
           "emulate_json": tmp_path / "h100-emulate-sm120.json", "md": tmp_path / "repo" / "notes.md",
           "notes": tmp_path / "notes.md", "foreign_json": tmp_path / "foreign.json", "photo": tmp_path / "photo.png"}
    shutil.copy(REPO / "README.md", out["readme"])
    for name in ("json", "png", "serve_json", "rescore_json", "emulate_json"):
        shutil.copy(RESULTS / out[name].name, out[name])
    out["md"].parent.mkdir()
    out["md"].write_text("# notes\n\nA committed document.\n")
    subprocess.run(["git", "init", "-q", str(out["md"].parent)], check=True)
    subprocess.run(["git", "-C", str(out["md"].parent), "add", "notes.md"], check=True)
    out["notes"].write_text("# my notes\n\nhand-written, no cupy-dsa command wrote this.\n")
    out["foreign_json"].write_text(json.dumps({"some": "thing"}))
    out["photo"].write_bytes(output_guard.PNG_MAGIC + b"\0\0\0\0IEND\xaeB`\x82")
    return out


def _no_measurement(monkeypatch):
    """The refusal comes before any measurement: a section that starts fails the test."""
    from cupy_dsa.bench import bytes as bytes_mod, recall, sweeps

    def boom(*a, **k):
        raise AssertionError("work started before the guard refused")

    for mod, name in ((sweeps, "store_rows"), (sweeps, "query_rows"), (sweeps, "decode_rows"), (recall, "run"),
                      (bytes_mod, "rows")):
        monkeypatch.setattr(mod, name, boom)


def _refused(res, option, path, before, *words):
    assert res.exit_code == 2, (res.exit_code, res.output)
    assert f"Invalid value for '{option}'" in res.output and "Traceback" not in res.output, res.output
    assert all(w in " ".join(res.output.split()) for w in words), res.output
    assert path.read_bytes() == before, f"{path} was changed"


# which committed file each option of the sections may never replace from a CPU run (a markdown table records no
# run: a committed document stands in), and another kind of file
OVER_A_MEASURED_RUN = {"--json": "json", "--markdown": "md", "--plot": "png"}
OVER_ANOTHER_KIND = {"--json": ("readme", "holds markdown, not JSON"), "--markdown": ("png", "holds PNG, not markdown"),
                     "--plot": ("photo", "a PNG no cupy-dsa command wrote")}


@pytest.mark.parametrize("option", list(OPTION_KIND))
@pytest.mark.parametrize("command", SECTION_COMMANDS, ids=lambda c: " ".join(c))
def test_sections_never_replace_a_measured_run_from_the_cpu(command, option, files, monkeypatch):
    _no_measurement(monkeypatch)
    target = files[OVER_A_MEASURED_RUN[option]]
    before = target.read_bytes()
    words = {"--json": ["holds", "NVIDIA H200"], "--plot": ["holds a measured run on NVIDIA H200"],
             "--markdown": ["a committed document (git tracks it)"]}[option]
    _refused(_run(command + ["--backend", "cpu", option, target]), option, target, before, *words,
             "or pass --force")


@pytest.mark.parametrize("option", list(OPTION_KIND))
@pytest.mark.parametrize("command", SECTION_COMMANDS, ids=lambda c: " ".join(c))
def test_sections_never_write_over_a_file_of_another_kind(command, option, files, monkeypatch):
    _no_measurement(monkeypatch)
    name, words = OVER_ANOTHER_KIND[option]
    before = files[name].read_bytes()
    _refused(_run(command + [option, files[name]]), option, files[name], before, words)


def test_the_group_option_is_checked_with_the_sections_force(files, monkeypatch):
    """An option given to `bench` and --force to the section: the merged options decide (the section's run)."""
    before = files["json"].read_bytes()
    _refused(_run(["bench", "--json", files["json"], "bytes"]), "--json", files["json"], before, "holds")
    res = _run(["bench", "--json", files["json"], "bytes", "--force"])
    assert res.exit_code == 0, res.output
    assert "--force: --json" in res.output and "measured run on NVIDIA H200" in res.output
    assert json.loads(files["json"].read_text())["sections"] == ["bytes"]


@pytest.mark.parametrize("option", list(OPTION_KIND))
def test_force_replaces_and_says_what(option, files):
    target = files[OVER_A_MEASURED_RUN[option]]
    res = _run(["bench", "bytes", option, target, "--force"])
    assert res.exit_code == 0, res.output
    assert f"--force: {option} {target} is written although it holds" in " ".join(res.output.split()), res.output
    if option != "--markdown":
        assert output_guard.read_existing(target).run.gpu is None   # the CPU run it now holds, recorded
    else:
        assert "| V4-Flash" in target.read_text() or "DeepSeek-V4-Flash" in target.read_text()


@pytest.mark.parametrize("option", list(OPTION_KIND))
def test_a_run_replaces_its_own_kind(option, tmp_path):
    """A file the same kind of run wrote is rewritten without --force (a CPU run over a CPU run of the command)."""
    path = tmp_path / ("out" + {"--json": ".json", "--markdown": ".md", "--plot": ".png"}[option])
    for _ in range(2):
        res = _run(["bench", "bytes", option, path])
        assert res.exit_code == 0 and "--force" not in res.output, res.output
    old = output_guard.read_existing(path)
    assert old.kind == OPTION_KIND[option], old
    if option == "--markdown":   # a table is the console's markdown exactly: it records no run
        assert path.read_text() in _run(["bench", "bytes", "--markdown", "-"]).output
        return
    assert old.run == output_guard.Run("cupy-dsa-bench/2", "sections bytes", None, False), old
    # another section's run is another kind of run
    res = _run(["bench", "recall", "--quick", option, path])
    assert res.exit_code == 2 and "sections bytes" in res.output and "this is" in res.output, res.output


def test_missing_folders_are_said(tmp_path):
    path = tmp_path / "new" / "dir" / "x.json"
    res = _run(["bench", "bytes", "--json", path])
    assert res.exit_code == 0 and path.is_file(), res.output
    assert f"the folder {tmp_path / 'new'} does not exist; it will be made" in " ".join(res.output.split())


# --------------------------------------------------------------------------------------------------
# bench serve
# --------------------------------------------------------------------------------------------------

def test_serve_json_never_replaces_the_measured_run_or_a_readme(files, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    before = files["serve_json"].read_bytes()
    _refused(_run(["bench", "serve", "--json", files["serve_json"]]), "--json", files["serve_json"], before,
             "holds a measured run on NVIDIA H200")
    before = files["readme"].read_bytes()
    _refused(_run(["bench", "serve", "--json", files["readme"]]), "--json", files["readme"], before,
             "holds markdown, not JSON")
    # another kind of serve run (--query's) over the CPU run of the default layouts
    cpu = files["readme"].with_name("cpu-serve.json")
    assert _run(["bench", "serve", "--json", cpu]).exit_code == 0
    res = _run(["bench", "serve", "--query", "bf16", "--json", cpu])
    assert res.exit_code == 2 and "queries bf16" in res.output, res.output
    res = _run(["bench", "serve", "--json", files["serve_json"], "--force"])
    assert res.exit_code == 0 and "--force: --json" in res.output, res.output


def test_serve_plot_never_writes_over_another_kind(files, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    before = files["photo"].read_bytes()
    _refused(_run(["bench", "serve", "--plot", files["photo"]]), "--plot", files["photo"], before,
             "a PNG no cupy-dsa command wrote")


def test_serve_plot_over_a_json_named_png(files, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    fake = files["json"].with_name("data.png")
    shutil.copy(files["json"], fake)
    before = fake.read_bytes()
    _refused(_run(["bench", "serve", "--plot", fake]), "--plot", fake, before, "holds JSON, not PNG")


# --------------------------------------------------------------------------------------------------
# bench variants, bench rescore (GPU commands: the device is stubbed; the guard refuses before any timing)
# --------------------------------------------------------------------------------------------------

@pytest.fixture
def fake_gpu(monkeypatch):
    from cupy_dsa.bench import rescore, variants

    def boom(*a, **k):
        raise AssertionError("work started before the guard refused")

    monkeypatch.setattr(cli_common, "resolve_device", lambda *a, **k: (torch.device("cpu"), "cuda"))
    monkeypatch.setattr(cli_common, "device_name", lambda dev: "NVIDIA H100 80GB HBM3")
    for mod, name in ((variants, "emulate_rows"), (variants, "decode_rows"), (rescore, "rows")):
        monkeypatch.setattr(mod, name, boom)
    monkeypatch.setattr(torch.cuda, "set_device", lambda dev: None)
    from cupy_dsa.bench import peers

    monkeypatch.setattr(peers, "deepgemm", boom)


def test_variants_json_and_markdown(files, fake_gpu):
    emulated = files["emulate_json"]   # an H100 emulation: a --quick run on the same GPU may not replace it
    before = emulated.read_bytes()
    _refused(_run(["bench", "variants", "--emulate", "sm_120", "--quick", "--json", emulated]), "--json", emulated,
             before, "holds a measured run on NVIDIA H100", "--quick")
    _refused(_run(["bench", "variants", "--json", emulated]), "--json", emulated, before, "cupy-dsa-variants/1")
    before = files["readme"].read_bytes()
    _refused(_run(["bench", "variants", "--emulate", "sm_120", "--markdown", files["readme"]]), "--markdown",
             files["readme"], before, "results blocks")
    before = files["md"].read_bytes()
    _refused(_run(["bench", "variants", "--emulate", "sm_120", "--markdown", files["md"]]), "--markdown",
             files["md"], before, "a committed document")


def test_rescore_json(files, fake_gpu):
    measured = files["rescore_json"]   # the H200's: an H100 run is another GPU's
    before = measured.read_bytes()
    _refused(_run(["bench", "rescore", "--json", measured]), "--json", measured, before,
             "holds a measured run on NVIDIA H200", "on NVIDIA H100")
    before = files["notes"].read_bytes()
    _refused(_run(["bench", "rescore", "--json", files["notes"]]), "--json", files["notes"], before,
             "holds markdown, not JSON")


# --------------------------------------------------------------------------------------------------
# bench report
# --------------------------------------------------------------------------------------------------

def test_report_markdown_and_plot_hold_the_json_s_run(files, tmp_path):
    cpu = tmp_path / "cpu-bytes.json"
    assert _run(["bench", "bytes", "--json", cpu]).exit_code == 0
    for option, name in (("--markdown", "md"), ("--plot", "png")):
        before = files[name].read_bytes()
        _refused(_run(["bench", "report", cpu, option, files[name]]), option, files[name], before, "holds")
    before = files["readme"].read_bytes()
    _refused(_run(["bench", "report", files["json"], "--markdown", files["readme"]]), "--markdown",
             files["readme"], before, "results blocks")
    # the JSON's run re-rendered over its own plot and table: allowed
    png, md = tmp_path / "h200.png", tmp_path / "h200.md"
    for _ in range(2):
        res = _run(["bench", "report", files["json"], "--markdown", md, "--plot", png])
        assert res.exit_code == 0 and "--force" not in res.output, res.output
    assert output_guard.read_existing(png).run == output_guard.run_of(json.loads(files["json"].read_text()))


def test_report_readme_takes_only_a_document_with_blocks(files):
    for name, words in (("json", "holds JSON, not markdown"), ("notes", "no <!-- results:NAME --> blocks"),
                        ("png", "holds PNG, not markdown")):
        before = files[name].read_bytes()
        _refused(_run(["bench", "report", files["serve_json"], "--readme", files[name]]), "--readme", files[name],
                 before, words)


def test_report_readme_says_unchanged_when_nothing_changed(files, tmp_path):
    results_readme = tmp_path / "results-README.md"   # where the serve block stands
    shutil.copy(RESULTS / "README.md", results_readme)
    res = _run(["bench", "report", files["serve_json"], "--readme", results_readme])
    assert res.exit_code == 0, res.output
    assert "unchanged (results:serve already render this JSON)" in res.output and "rewrote" not in res.output


def test_report_readme_force_stands_for_allow_cpu_or_quick(files, tmp_path):
    cpu = tmp_path / "q.json"
    assert _run(["bench", "query", "--backend", "cpu", "--json", cpu]).exit_code == 0
    results_readme = tmp_path / "results-README.md"   # where the query block stands
    shutil.copy(RESULTS / "README.md", results_readme)
    before = results_readme.read_bytes()
    _refused(_run(["bench", "report", cpu, "--readme", results_readme]), "--readme", results_readme, before,
             "--allow-cpu-or-quick (or --force)")
    res = _run(["bench", "report", cpu, "--readme", results_readme, "--force"])
    assert res.exit_code == 0 and "rewrote results:query" in res.output, res.output


# --------------------------------------------------------------------------------------------------
# cupy-dsa needle: its writers refuse a file of another kind (it does not record its run in them yet)
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("option, name, words", [("--json", "readme", "holds markdown, not JSON"),
                                                 ("--markdown", "readme", "results blocks"),
                                                 ("--markdown", "json", "holds JSON, not markdown"),
                                                 ("--plot", "json", "ending in .png")])
def test_needle_writers_refuse_another_kind(option, name, words, files):
    before = files[name].read_bytes()
    _refused(_run(["needle", "--base-url", "http://127.0.0.1:9/v1", option, files[name]]), option, files[name],
             before, words)


def test_run_of_every_committed_result():
    """Every committed result says what run it holds, and the GPU it was measured on."""
    for path in RESULTS.glob("*.json"):
        run = output_guard.run_of(json.loads(path.read_text()))
        assert run is not None and run.gpu and run.gpu.startswith("NVIDIA H"), (path.name, run)
    for path in RESULTS.glob("*.png"):   # re-drawn since plots record their run
        assert output_guard.read_existing(path).run.gpu == "NVIDIA H200", path.name


def test_a_plot_drawn_before_plots_recorded_their_run_is_replaced_only_by_a_gpu_run(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    legacy = tmp_path / "old.png"
    fig = plt.figure(figsize=(1, 1))
    fig.savefig(legacy, format="png", metadata={"Software": "cupy-dsa bench"})   # as plots were saved before
    plt.close(fig)
    old = output_guard.read_existing(legacy)
    assert old.kind == output_guard.PNG and old.run is None and "records no run" in old.what
    gpu = output_guard.Run("cupy-dsa-bench/2", "sections bytes", "NVIDIA H200", False)
    cpu = output_guard.Run("cupy-dsa-bench/2", "sections bytes", None, False)
    assert output_guard.why_not(old, output_guard.PNG, gpu) is None
    assert "only a measured GPU run replaces it" in output_guard.why_not(old, output_guard.PNG, cpu)


def test_a_serve_run_from_before_layouts_were_recorded():
    """h200-serve.json recorded no layouts: a GPU serve run of any layouts with the same configs replaces it on the
    same GPU; a --query run or another GPU's does not."""
    old = output_guard.read_existing(RESULTS / "h200-serve.json")
    assert old.run.what.startswith(f"layouts {output_guard.ANY_LAYOUTS};")
    same = output_guard.Run("cupy-dsa-serve/1", "layouts bf16,fp8-cupy,fp8; this GPU's configs", "NVIDIA H200", False)
    assert output_guard.why_not(old, output_guard.JSON, same) is None
    query = output_guard.Run(same.schema, "layouts bf16; this GPU's configs; queries fp8,bf16", "NVIDIA H200", False)
    h100 = output_guard.Run(same.schema, same.what, "NVIDIA H100 80GB HBM3", False)
    assert "queries fp8,bf16" in output_guard.why_not(old, output_guard.JSON, query)
    assert "NVIDIA H100" in output_guard.why_not(old, output_guard.JSON, h100)


def test_a_needle_overlay_plot_is_redrawn(tmp_path):
    """`bench report needle-*.json --plot needle.png` twice: needle plots record no run yet, so the second drawing
    replaces the first (a PNG of unknown origin is refused only where the plot records its run)."""
    from needle_server import FakeServer

    with FakeServer() as srv:
        for label in ("a", "b"):
            res = _run(["needle", "--base-url", srv.url, "--lengths", "256", "--depths", "0", "--trials", "1",
                        "--label", label, "--json", tmp_path / f"{label}.json"])
            assert res.exit_code == 0, res.output
    png = tmp_path / "needle.png"
    for _ in range(2):
        res = _run(["bench", "report", tmp_path / "a.json", tmp_path / "b.json", "--plot", png])
        assert res.exit_code == 0, res.output
    readme = tmp_path / "README.md"
    shutil.copy(REPO / "README.md", readme)
    before = readme.read_bytes()
    _refused(_run(["bench", "report", tmp_path / "a.json", "--markdown", readme]), "--markdown", readme, before,
             "results blocks")
