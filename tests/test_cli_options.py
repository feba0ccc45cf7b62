"""Option errors of `cupy-dsa bench` are click's (rc 2, the option named, no traceback), decided before any work;
`bench serve` without a GPU names the cases it was asked for; tables say what they count."""
import json

import pytest
import torch
from click.testing import CliRunner

from cupy_dsa.bench import cli, cli_sections
from cupy_dsa.bench.cli import main


def _run(args):
    return CliRunner().invoke(main, args)


def _no_work(monkeypatch):
    """Any measurement, row builder or writer that runs fails the test: the error must come first."""
    def boom(*a, **k):
        raise AssertionError("work started before the option error")

    monkeypatch.setattr(cli_sections, "run", boom)
    from cupy_dsa.bench import resources, serve

    monkeypatch.setattr(serve, "memory_rows", boom)
    monkeypatch.setattr(resources, "rows", boom)


@pytest.mark.parametrize("args, option, words", [
    (["bench", "serve", "--memory-gib", "nan"], "--memory-gib", "not a finite number"),
    (["bench", "serve", "--memory-gib", "inf"], "--memory-gib", "range"),
    (["bench", "serve", "--memory-gib", "-inf"], "--memory-gib", "range"),
    (["bench", "bytes", "--gpu-mem-gib", "nan"], "--gpu-mem-gib", "not a finite number"),
    (["bench", "bytes", "--gpu-mem-gib", "inf"], "--gpu-mem-gib", "range"),
    (["bench", "bytes", "--gpu-mem-gib", "1e300"], "--gpu-mem-gib", "range"),
    (["bench", "--gpu-mem-gib", "nan", "bytes"], "--gpu-mem-gib", "not a finite number"),
    (["bench", "--gpu-mem-gb", "40", "bytes"], "--gpu-mem-gb", "renamed to --gpu-mem-gib"),
    (["bench", "store", "--seed", "99999999999999999999"], "--seed", "range"),
    (["bench", "serve", "--seed", str(2**32)], "--seed", "range"),
    (["bench", "variants", "--seed", str(2**64)], "--seed", "range"),
    (["bench", "serve", "--device", "cpu"], "--device", "expected a CUDA device"),
    (["bench", "serve", "--device", "banana"], "--device", "expected a CUDA device"),
    (["bench", "variants", "--device", "banana"], "--device", "expected a CUDA device"),
])
def test_bad_values_are_click_errors_before_any_work(args, option, words, monkeypatch):
    _no_work(monkeypatch)
    res = _run(args)
    assert res.exit_code == 2, res.output
    assert f"Invalid value for '{option}'" in res.output and words in res.output, res.output
    assert "Traceback" not in res.output


def test_serve_sizes_are_bounded_by_the_model(monkeypatch):
    """`bench serve --batch 99999999999 --context 999999999999999999999K` exited 0 (issue 50): bounds, and the
    model's context window (DeepSeek-V4: 1M tokens, max_position_embeddings)."""
    _no_work(monkeypatch)
    for extra, option, words in ((["--batch", "99999999999"], "--batch", "1<=x<=4096"),
                                 (["--context", "999999999999999999999K"], "--context", "at most 1G"),
                                 (["--context", "2M"], "--context", "DeepSeek-V4-Flash's context window (1,048,576"),
                                 (["--model", "v4-pro", "--chunk", "1025K"], "--chunk", "DeepSeek-V4-Pro's context")):
        res = _run(["bench", "serve", *extra])
        assert res.exit_code == 2 and f"Invalid value for '{option}'" in res.output and words in res.output, res.output


def test_device_wording_is_consistent():
    """A command that times CUDA kernels lists only CUDA forms (it listed 'cpu' as valid, then refused it)."""
    bad = _run(["bench", "serve", "--device", "banana"]).output
    cpu = _run(["bench", "serve", "--device", "cpu"]).output
    assert "'cpu'," not in bad and "'cpu'," not in cpu
    with_backend = _run(["bench", "store", "--device", "banana"]).output
    assert "expected 'cpu', 'cuda', 'cuda:N' or N" in with_backend


@pytest.mark.parametrize("args, given, sub", [
    (["bench", "--json", "g.json", "serve"], "--json", "serve"),
    (["bench", "--json", "x", "--plot", "y.png", "resources"], "--json, --plot", "resources"),
    (["bench", "--quick", "variants"], "--quick", "variants"),
    (["bench", "--seed", "3", "report", "README.md"], "--seed", "report"),
    (["bench", "--backend", "cpu", "--device", "cpu", "serve"], "--backend, --device", "serve"),
])
def test_group_options_before_a_command_that_ignores_them_are_refused(args, given, sub, monkeypatch, tmp_path):
    _no_work(monkeypatch)
    monkeypatch.chdir(tmp_path)
    res = _run(args)
    assert res.exit_code == 2, res.output
    assert f"{given} given to `bench`" in res.output and f"not to `bench {sub}`" in res.output, res.output
    assert not list(tmp_path.iterdir())  # nothing written


def test_group_options_still_reach_the_sections(monkeypatch):
    seen = []
    monkeypatch.setattr(cli_sections, "run", lambda ctx, sections, o: seen.append(o))
    assert _run(["bench", "--seed", "5", "--gpu-mem-gib", "40", "bytes"]).exit_code == 0
    assert seen[0]["seed"] == 5 and seen[0]["gpu_mem_gib"] == 40.0


def test_serve_json_into_a_new_folder(tmp_path, monkeypatch):
    """--json is checked when read; a folder that does not exist yet is made, as for every bench output (it
    failed with a traceback after the run)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    j = tmp_path / "new" / "dir" / "s.json"
    res = _run(["bench", "serve", "--json", str(j)])
    assert res.exit_code == 0, res.output
    assert json.loads(j.read_text())["schema"] == "cupy-dsa-serve/1"


def test_serve_device_without_gpu_is_refused_before_the_tables(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    res = _run(["bench", "serve", "--device", "cuda:0"])
    assert res.exit_code == 2 and "no CUDA device" in res.output, res.output
    assert "index cache" not in res.output  # nothing printed before the error


def test_resources_without_cupy_is_one_message(monkeypatch):
    from cupy_dsa import runtime

    def missing():
        raise ImportError("cupy_dsa needs CuPy for its GPU kernels: install cupy_dsa with its [cu13] extra")

    monkeypatch.setattr(runtime, "cupy_module", missing)
    res = _run(["bench", "resources", "--arch", "sm_90"])
    assert res.exit_code == 1 and "Traceback" not in res.output, res.output
    assert res.output.startswith("Error: bench resources compiles the kernels with NVRTC through CuPy: cupy_dsa "
                                 "needs CuPy"), res.output


def test_serve_on_cpu_names_the_cases_it_did_not_measure(monkeypatch):
    """`--batch 64 --context 64K` without a GPU: the output and the JSON name the asked cases (it printed the
    same as the defaults)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    asked = _run(["bench", "serve", "--batch", "64", "--context", "64K", "--next-n", "2", "--json", "-"])
    default = _run(["bench", "serve"])
    assert asked.exit_code == 0 and default.exit_code == 0
    doc = json.loads(asked.stdout[asked.stdout.index("{"):])
    assert doc["cases"] == ["verify 64 x 64K, next_n 2", "prefill chunk of 4,096 after 64K"]
    assert "verify 64 x 64K, next_n 2; prefill chunk of 4,096 after 64K" in " ".join(asked.output.split())
    assert "decode 32 x 8K; decode 32 x 32K; decode 32 x 128K" in " ".join(default.output.split())
    from cupy_dsa.bench import serve

    assert "Cases asked for: verify 64 x 64K, next_n 2" in serve.markdown(doc)


def test_tables_say_whether_they_count_entries_or_tokens(monkeypatch):
    from cupy_dsa.bench import provenance, report

    decode = report.decode_table(provenance.new_document(backend="cpu", device_name="x", quick=True, seed=0,
                                                         gpu_mem_gib=1.0))
    assert "index entries per request" in decode.title and "`bench serve` counts raw tokens" in decode.title
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = " ".join(_run(["bench", "serve"]).output.split())
    assert "per raw token: one index entry per 4 tokens" in out and "context in raw tokens" in out


def _config(tmp_path, folder="some-folder", **fields):
    cfg = {"num_hidden_layers": 7, "compress_ratios": [0, 0, 4, 128, 4, 128, 0, 4], "index_topk": 512,
           "index_n_heads": 64, "index_head_dim": 128}
    cfg.update(fields)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    path = tmp_path / folder / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.parametrize("fields, words", [
    ({"compress_ratios": [4, 4, 7, -1], "num_hidden_layers": 4}, "7, -1 not one of them"),
    ({"compress_ratios": [0, True, 4]}, "True not one of them"),
    ({"num_hidden_layers": True}, "'num_hidden_layers' (or 'n_layers') an int"),
    ({"num_hidden_layers": 3.0}, "'num_hidden_layers' (or 'n_layers') an int"),
    ({"index_topk": True}, "'index_topk', a positive int"),
    ({"index_head_dim": 128.5}, "index_head_dim = 128"),
    ({"compress_ratios": [0, 128, 0, 128], "num_hidden_layers": 4, "index_topk": None}, "no indexer layer"),
    ({"compress_ratios": [0, 128, 0, 4], "num_hidden_layers": 3}, "no indexer layer"),
])
def test_serve_config_is_checked_field_by_field(tmp_path, fields, words, monkeypatch):
    _no_work(monkeypatch)
    res = _run(["bench", "serve", "--model", _config(tmp_path, **fields)])
    assert res.exit_code == 2 and "Invalid value for '--model'" in res.output, res.output
    assert words in " ".join(res.output.split()), res.output


def test_serve_config_names_the_model_by_its_config(tmp_path, monkeypatch):
    """The title is _name_or_path, else the config's path (it was the parent folder's name)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    path = _config(tmp_path, folder="checkpoints")
    doc = _json_of(["bench", "serve", "--model", path, "--json", "-"])
    assert doc["model"]["name"] == path and doc["model"]["index_layers"] == 2
    named = _config(tmp_path, folder="other", _name_or_path="deepseek-ai/DeepSeek-V4-Flash")
    assert _json_of(["bench", "serve", "--model", named, "--json", "-"])["model"]["name"] == \
        "deepseek-ai/DeepSeek-V4-Flash"


def _json_of(args):
    out = _run(args).stdout
    return json.loads(out[out.index("{"):])


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "0"])
def test_needle_timeout_must_be_finite_and_positive(value):
    res = _run(["needle", "--timeout", value])
    assert res.exit_code == 2 and "Invalid value for '--timeout'" in res.output, res.output
    assert "Traceback" not in res.output


@pytest.mark.parametrize("args, option", [
    (["bench", "--device", "banana", "bytes"], "--device"),
    (["bench", "bytes", "--device", "banana"], "--device"),
])
def test_bytes_refuses_devices_it_cannot_have(args, option, monkeypatch):
    """`bytes` needs no device, but a bad one is an error as it is for `store` (it exited 0)."""
    _no_work_but_run(monkeypatch)
    res = _run(args)
    assert res.exit_code == 2 and f"Invalid value for '{option}'" in res.output, res.output


def test_bytes_refuses_cuda_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for args in (["bench", "--backend", "cuda", "bytes"], ["bench", "bytes", "--device", "cuda:0"]):
        res = _run(args)
        assert res.exit_code == 2 and "no CUDA device is available" in res.output, (args, res.output)
    assert _run(["bench", "bytes", "--backend", "cpu"]).exit_code == 0


def _no_work_but_run(monkeypatch):
    from cupy_dsa.bench import bytes as bytes_mod

    def boom(*a, **k):
        raise AssertionError("work started before the option error")

    monkeypatch.setattr(bytes_mod, "rows", boom)


def test_serve_without_a_gpu_does_not_replace_a_measured_run(monkeypatch, tmp_path):
    """The README's reproduction line names the committed H200 file: on a CPU machine it is refused (it replaced
    the file with a memory-only JSON, rc 0); a file without a measured run may be written."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    measured = tmp_path / "h200-serve.json"
    measured.write_text(json.dumps({"schema": "cupy-dsa-serve/1", "measured": True, "device": "NVIDIA H200"}))
    before = measured.read_text()
    res = _run(["bench", "serve", "--json", str(measured)])
    assert res.exit_code == 2 and "Invalid value for '--json'" in res.output and "holds a measured run" in res.output
    assert measured.read_text() == before
    fresh = tmp_path / "cpu-serve.json"
    assert _run(["bench", "serve", "--json", str(fresh)]).exit_code == 0
    assert _run(["bench", "serve", "--json", str(fresh)]).exit_code == 0   # its own memory-only run: rewritten
    assert json.loads(fresh.read_text())["measured"] is False


def _all_commands(group=cli.main, path=()):
    import click

    for name, cmd in group.commands.items():
        yield path + (name,), cmd
        if isinstance(cmd, click.Group):
            yield from _all_commands(cmd, path + (name,))


def test_defaults_are_shown_in_one_style():
    """Every option's default reads `[default: X]`, as click's show_default writes it (some said `[X]` or
    `(default: X)`)."""
    import re

    for path, cmd in _all_commands():
        for p in cmd.params:
            text = getattr(p, "help", None) or ""
            tail = re.search(r"\[([^\]]*)\]\s*$", text)
            assert not tail or tail[1].startswith("default: "), (path, p.name, p.help)
            assert "(default: " not in text, (path, p.name, p.help)


def test_help_is_fast_and_imports_no_torch():
    """The CLI imports its heavy modules inside the commands: `import cupy_dsa` and --help load no torch."""
    import subprocess
    import sys

    code = "import sys, cupy_dsa.bench.cli; assert 'torch' not in sys.modules and 'rich' not in sys.modules"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_python_m_cupy_dsa_from_a_checkout_without_the_install(tmp_path):
    """From the checkout's root the source tree shadows an installed copy, which has cupy_dsa/bench while the
    checkout has bench/ beside cupy_dsa/: `python -m cupy_dsa --help` must find the checkout's bench."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    code = ("import sys, runpy; sys.meta_path[:] = [f for f in sys.meta_path if 'Editable' not in "
            "getattr(f, '__name__', type(f).__name__)]; sys.path.insert(0, sys.argv[1]); "
            "sys.argv = ['cupy_dsa', '--help']; runpy.run_module('cupy_dsa', run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", code, str(root)], capture_output=True, text=True, timeout=120,
                       cwd=root)
    assert r.returncode == 0 and "bench" in r.stdout and "needle" in r.stdout, r.stdout + r.stderr


def test_resources_says_what_it_compiles_as_it_goes(monkeypatch):
    """`bench resources` printed nothing for minutes while NVRTC compiled: it names each compile on stderr."""
    from cupy_dsa.bench import resources

    seen = []

    def rows(archs, progress=None):
        progress(f"compiling mqa_logits.cu for {archs[0]} (24 product configs)")
        seen.append(archs)
        return []

    monkeypatch.setattr(resources, "rows", rows)
    monkeypatch.setattr(resources, "markdown", lambda rs: "| table |")
    res = _run(["bench", "resources", "--arch", "sm_90"])
    assert res.exit_code == 0, res.output
    assert "minutes on a cold cache" in res.output and "compiling mqa_logits.cu for sm_90" in res.output
    assert seen == [("sm_90",)]


def _results(name):
    from pathlib import Path

    return json.loads((Path(__file__).resolve().parents[1] / "bench" / "results" / name).read_text())


@pytest.mark.parametrize("base, change, words", [
    ("h200.json", {"bytes": [{"bogus": True}]}, "a field of the results is missing"),
    ("h200.json", {"logits": "x"}, "'logits' is str 'x', expected a list of objects"),
    ("h200-rescore.json", {"memory": [1, 2, 3]}, "'memory' is list [1, 2, 3], expected a list of objects"),
    ("h200-serve.json", {"timings": "garbage"}, "'timings' is str 'garbage'"),
    ("h200-serve.json", {"batch": "x"}, "'batch' is str 'x', expected an integer"),
    ("h200-serve.json", {"model": None}, "it has no 'model' field"),
    (None, {"schema": "cupy-dsa-needle/1", "label": "x", "server": {}, "cells": []}, "it has no 'settings' field"),
])
def test_report_refuses_a_broken_structure(base, change, words, tmp_path):
    """A JSON of a valid schema with a broken structure: exit status 2 naming the file and the field (it ended in
    a traceback, or rendered `batch: "x"` silently)."""
    doc = dict(_results(base) if base else {}, **change)
    j = tmp_path / "broken.json"
    j.write_text(json.dumps(doc))
    res = _run(["bench", "report", str(j)])
    assert res.exit_code == 2 and words in res.output and str(j) in " ".join(res.output.split()), res.output
    assert "Traceback" not in res.output


@pytest.mark.parametrize("section, unused", [("bytes", ("--backend", "--device", "--quick", "--seed")),
                                             ("store", ("--gpu-mem-gib",)), ("recall", ("--gpu-mem-gib",))])
def test_section_help_lists_only_options_it_uses(section, unused):
    """`bench bytes --help` listed options that do nothing for it (issue 50); `bench --help` keeps them all."""
    text = _run(["bench", section, "--help"]).output
    assert not [o for o in unused if f"{o} " in text], text
    assert all(f"{o} " in _run(["bench", "--help"]).output for o in unused)
