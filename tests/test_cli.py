"""`cupy-dsa bench` on the CPU backend (CI): every subcommand with --quick, the JSON schema, the PNG and
markdown outputs, click's errors for bad options, and the torch baseline / fp4 helper the bench relies on."""
import io
import json
import re
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from cupy_dsa.bench import bytes as bytes_mod
from cupy_dsa.bench.cli import main
from cupy_dsa.bench.provenance import SCHEMA

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
NUM = (int, float)

ROW_KEYS = {
    "bytes": {"model": str, "layout": str, "assumed": bool, "bytes_per_entry": int, "index_layers": int,
              "index_bytes_per_token": NUM, "main_kv_bytes_per_token": NUM, "total_kv_bytes_per_token": NUM,
              "tokens_fit": int, "tokens_fit_vs_fp8": NUM, "index_share": NUM},
    # on the CPU backend no ceilings are measured, so every ratio to one is None
    "store": {"n_tokens": int, "layout": str, "numerics": str, "kv_dtype": str, "time_us": NUM,
              "tokens_per_s": NUM, "gbps": NUM, "pct_copy": type(None), "error": type(None)},
    "decode": {"batch_name": str, "batch": int, "entries": int, "context": int, "width": int, "next_n": int,
               "layout": str, "q_dtype": str, "time_us": NUM, "plan_us": NUM, "gbps": NUM, "key_gbps": NUM,
               "pct_copy": type(None), "pct_read": type(None), "gkeys_per_s": NUM, "error": type(None)},
    "prefill": {"rows": int, "keys": int, "kv": str, "layout": str, "time_us": NUM, "tflops": NUM,
                "pct_matmul": type(None), "visible_pairs": int, "error": type(None)},
    "recall": {"context_tokens": int, "index_entries": int, "k": int, "format": str, "queries": int,
               "margins": list, "needle_rate": list, "resolution": (float, type(None)), "recall_mean": NUM,
               "recall_min": NUM, "ref_overlap_mean": NUM, "ref_overlap_min": NUM, "trivial": bool,
               "error": type(None)},
}


def _check_rows(rows, keys, what):
    assert rows, f"no {what} rows"
    for r in rows:
        for k, typ in keys.items():
            assert k in r, f"{what} row lacks {k!r}: {r}"
            assert isinstance(r[k], typ), f"{what}.{k} = {r[k]!r} is not {typ}"


def _check_doc(doc, sections):
    assert doc["schema"] == SCHEMA
    for k, typ in (("date", str), ("device", str), ("backend", str), ("quick", bool), ("seed", int),
                   ("ceilings", dict), ("notes", dict), ("targets", dict), ("elapsed_s", NUM)):
        assert isinstance(doc[k], typ), (k, doc[k])
    assert doc["git_commit"] is None or isinstance(doc["git_commit"], str)
    for s in ("bytes", "store", "logits", "recall"):
        assert isinstance(doc[s], list)
        assert bool(doc[s]) == (s in sections), s
    if "store" in sections or "logits" in sections:  # CPU backend: no ceilings, no ratios to them
        assert doc["backend"] == "cpu" and all(v is None for v in doc["ceilings"].values()), doc["ceilings"]
    if "bytes" in sections:
        _check_rows(doc["bytes"], ROW_KEYS["bytes"], "bytes")
    if "store" in sections:
        _check_rows(doc["store"], ROW_KEYS["store"], "store")
    if "logits" in sections:
        _check_rows([r for r in doc["logits"] if r["mode"] == "decode"], ROW_KEYS["decode"], "decode")
        _check_rows([r for r in doc["logits"] if r["mode"] == "prefill"], ROW_KEYS["prefill"], "prefill")
    if "recall" in sections:
        _check_rows(doc["recall"], ROW_KEYS["recall"], "recall")


def _invoke(args):
    res = CliRunner().invoke(main, args, catch_exceptions=False)
    return res


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each subcommand once on the CPU backend with --quick, JSON and PNG written."""
    d = tmp_path_factory.mktemp("bench")
    out = {}
    for sub in ("bytes", "store", "logits", "recall"):
        j, p = d / f"{sub}.json", d / f"{sub}.png"
        args = ["bench", sub, "--backend", "cpu", "--quick", "--json", str(j), "--plot", str(p), "--seed", "7"]
        if sub == "recall":  # options given to the group apply to the subcommand too
            args = ["bench", "--backend", "cpu", "--quick", "--seed", "7", sub, "--json", str(j), "--plot", str(p)]
        res = _invoke(args)
        assert res.exit_code == 0, res.output
        out[sub] = (res, json.loads(j.read_text()), p)
    return out


@pytest.mark.parametrize("sub", ["bytes", "store", "logits", "recall"])
def test_subcommand_cpu_quick(sub, runs):
    res, doc, png = runs[sub]
    _check_doc(doc, (sub,))
    assert doc["backend"] == ("none" if sub == "bytes" else "cpu") and doc["seed"] == 7
    assert png.read_bytes()[:8] == PNG_MAGIC
    title = {"bytes": "Index-key bytes", "store": "store_index_k", "logits": "prefill", "recall": "SYNTHETIC"}[sub]
    assert title in res.output


def test_logits_rows(runs):
    rows = runs["logits"][1]["logits"]
    dec = [r for r in rows if r["mode"] == "decode"]
    assert {r["next_n"] for r in dec} == {1, 2} and {r["layout"] for r in dec} == {"bf16", "fp8"}
    assert any(r["width"] > r["context"] for r in dec) and any(r["entries"] < r["batch"] * r["context"]
                                                               for r in dec)   # a mixed batch, a wide table
    for r in dec:
        assert (r["torch_time_us"] is not None) == (r["batch_name"] == "1 x 256" and r["next_n"] == 1
                                                    and r["q_dtype"] == "fp8"), r
        assert r["deepgemm_us"] is None and r["deepgemm_note"]            # no GPU: the peer is said absent
        if r["layout"] == "fp8":
            assert r["time_vs_fp8"] == 1.0
    assert {r["kv"] for r in rows if r["mode"] == "prefill"} == {"contiguous", "paged"}


def test_recall_exact_scores_pass_every_needle(runs):
    """The needle suite on the CPU backend: by construction exact fp64 scores keep every needle at every
    margin (the run also checks each row's exact margin itself and would have failed the context)."""
    from cupy_dsa.bench import recall

    rows = runs["recall"][1]["recall"]
    assert {r["format"] for r in rows} == set(recall.FORMATS) | {"exact", "reference"}
    assert {r["k"] for r in rows} == set(recall.TOPKS)
    assert any(not r["trivial"] and r["index_entries"] >= 2 * r["k"] for r in rows)
    for r in rows:
        assert r["error"] is None and r["queries"] > 0
        assert r["margins"] == list(recall.MARGINS) and len(r["needle_rate"]) == len(recall.MARGINS)
        assert all(0.0 <= x <= 1.0 for x in r["needle_rate"])
        assert 0.0 <= r["recall_min"] <= r["recall_mean"] <= 1.0
        assert 0.0 <= r["ref_overlap_min"] <= r["ref_overlap_mean"] <= 1.0
        if r["format"] == "exact":
            assert r["needle_rate"] == [1.0] * len(recall.MARGINS), r
            assert r["resolution"] == min(recall.MARGINS) and r["recall_mean"] == 1.0
            assert r["exact_margin_ratio_min"] > 0.99
        if r["format"] == "reference":
            assert r["ref_overlap_mean"] == 1.0
        if r["format"] == "bf16-reference":  # the reference as cupy_dsa stores it: fp32 summation order only
            assert r["ref_overlap_mean"] >= 0.99, r
        if r["trivial"]:
            assert r["recall_mean"] == 1.0 and r["needle_rate"] == [1.0] * len(recall.MARGINS), r
        assert r["outlier_scale"] == recall.OUTLIER_SCALE
        if r["format"] in recall.RESCORE_MULTIPLES:  # the misses account for the recall, their ranks for K'
            kk, kp = min(r["k"], r["index_entries"]), r["k_prime"]
            assert kp == recall.RESCORE_MULTIPLES[r["format"]] * r["k"], r
            assert r["missed_entries"] == round(r["queries"] * kk * (1 - r["recall_mean"])), r
            assert 0 <= r["missed_beyond_k_prime"] <= r["missed_entries"], r
            assert (r["missed_fp8_rank_max"] is None) == (r["missed_entries"] == 0), r
            if r["missed_beyond_k_prime"]:
                assert r["missed_fp8_rank_max"] >= kp, r
            assert kk <= r["fp8_rank_needed_median"] <= r["fp8_rank_needed_max"] <= r["index_entries"], r
            if r["fp8_rank_needed_max"] <= kp:                 # K' held every row's exact top-k
                assert r["missed_beyond_k_prime"] == 0, r
    out = runs["recall"][0].output
    assert "Needle resolution" in out and "DeepSeek-V4 reference" in out and "SYNTHETIC" in out


@pytest.mark.gpu
def test_recall_suite_on_gpu(monkeypatch):
    """The recall suite through the CUDA kernels at a small size: exact keeps every needle, and the
    reference stored as cupy_dsa stores it matches the reference oracle's top-k."""
    from cupy_dsa.bench import recall

    monkeypatch.setattr(recall, "contexts", lambda device, quick: ([16384], 4))
    rows = recall.run(torch.device("cuda"), True, 0)
    assert all(r["error"] is None for r in rows), rows[0]["error"]
    for r in rows:
        if r["format"] == "exact":
            assert r["needle_rate"] == [1.0] * len(recall.MARGINS)
        if r["format"] == "bf16-reference":  # the kernel's rsqrtf may move a key by one fp4 code
            assert r["ref_overlap_mean"] >= 0.95, r
        if r["format"] == "bf16+q-bf16":
            assert r["recall_mean"] >= 0.8, r


def test_rescore_table_only_for_documents_with_rescore_rows(runs):
    from cupy_dsa.bench import report

    doc = runs["recall"][1]
    assert report.rescore_table(doc) is not None and "fp8-rescore" in runs["recall"][0].output
    old = dict(doc, recall=[r for r in doc["recall"] if "k_prime" not in r])   # a document from before the formats
    assert report.rescore_table(old) is None


def test_recall_resolution_definition():
    from cupy_dsa.bench.recall import MARGINS, resolution

    n = len(MARGINS)
    assert resolution([1.0] * n) == MARGINS[0]
    assert resolution([0.5] * (n - 1) + [1.0]) == MARGINS[-1]
    assert resolution([1.0, 0.5] + [0.995] * (n - 2)) == MARGINS[2]   # the rate must hold from there on
    assert resolution([1.0] * (n - 1) + [0.9]) is None


def test_recall_quick_is_honoured_on_cpu():
    from cupy_dsa.bench.recall import contexts

    cpu = torch.device("cpu")
    (quick, nq), (full, nf) = contexts(cpu, True), contexts(cpu, False)
    assert len(quick) * nq < len(full) * nf and max(quick) <= max(full)


def test_all_is_the_default(monkeypatch, tmp_path):
    from cupy_dsa.bench import cli, cli_sections

    seen = []
    monkeypatch.setattr(cli_sections, "run", lambda ctx, sections, o: seen.append((sections, o)))
    for args in (["bench", "--quick", "--backend", "cpu"], ["bench", "all", "--quick", "--backend", "cpu"]):
        assert _invoke(args).exit_code == 0
    assert [s for s, _ in seen] == [cli.SECTIONS_ALL] * 2
    assert all(o["quick"] and o["backend"] == "cpu" and o["seed"] == 0 and o["gpu_mem_gib"] == 80.0
               for _, o in seen)


def test_report_rerenders_json(runs, tmp_path):
    merged = dict(runs["logits"][1])
    for sub in ("bytes", "store", "recall"):
        merged[sub] = runs[sub][1][sub]
    j, png, md = tmp_path / "all.json", tmp_path / "again.png", tmp_path / "h.md"
    j.write_text(json.dumps(merged))
    res = _invoke(["bench", "report", str(j), "--markdown", str(md), "--plot", str(png)])
    assert res.exit_code == 0, res.output
    text = md.read_text()
    assert "| figure |" in text and "recall@512" in text and "prefill" in text and "V4-Flash capacity" in text
    assert png.read_bytes()[:8] == PNG_MAGIC
    res = _invoke(["bench", "report", str(j), "--markdown", "-"])
    assert res.exit_code == 0 and "| figure |" in res.output
    assert "needle resolution, top-512" in res.output and "overlap with the DeepSeek-V4 reference" in res.output


def test_markdown_dash_prints_everywhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = _invoke(["bench", "bytes", "--markdown", "-"])
    assert res.exit_code == 0, res.output
    assert "| V4-Flash capacity, bf16 index keys |" in res.output
    assert not (tmp_path / "-").exists()


@pytest.mark.parametrize("sub", [["bench", "bytes"], ["bench", "report", "JSON"]])
def test_plot_refuses_a_non_png_name(sub, runs, tmp_path):
    args = [a if a != "JSON" else str(tmp_path / "b.json") for a in sub]
    (tmp_path / "b.json").write_text(json.dumps(runs["bytes"][1]))
    res = CliRunner().invoke(main, args + ["--plot", str(tmp_path / "x.jpg")])
    assert res.exit_code == 2 and "ending in .png" in res.output, res.output
    assert not (tmp_path / "x.jpg").exists()


def test_commit_less_run_says_so(runs, tmp_path, monkeypatch):
    from cupy_dsa.bench import plots, provenance, report

    doc = dict(runs["bytes"][1], git_commit=None)
    md = report.markdown_headline(doc)
    assert provenance.NO_COMMIT in md and "`None`" not in md and "unknown" not in md
    plots.plot(doc, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").read_bytes()[:8] == PNG_MAGIC
    monkeypatch.delenv("CUPY_DSA_COMMIT", raising=False)
    monkeypatch.setattr(provenance, "__file__", str(tmp_path / "bench" / "provenance.py"))  # outside any checkout
    assert provenance.git_commit() is None
    j = tmp_path / "b.json"
    res = _invoke(["bench", "bytes", "--json", str(j)])
    assert res.exit_code == 0 and provenance.NO_COMMIT in res.output
    saved = json.loads(j.read_text())
    assert saved["git_commit"] is None and provenance.NO_COMMIT in saved["notes"]["general"]


def _git(cwd, *args):
    subprocess.run(["git", "-C", str(cwd), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True,
                   capture_output=True)


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_commit_of_an_installed_copy_is_unknown(tmp_path, monkeypatch):
    """``pip install .`` into a virtual environment inside the clone: the clone's HEAD says nothing about the
    installed copy (the clone may have moved on), so no commit is recorded and the note says why."""
    from cupy_dsa.bench import provenance

    monkeypatch.delenv("CUPY_DSA_COMMIT", raising=False)
    _git(tmp_path, "init", "-q")
    (tmp_path / ".gitignore").write_text(".venv/\n")
    _git(tmp_path, "add", ".gitignore")
    _git(tmp_path, "commit", "-qm", "x")
    installed = tmp_path / ".venv" / "lib" / "site-packages" / "cupy_dsa" / "bench" / "provenance.py"
    installed.parent.mkdir(parents=True)
    installed.write_text("")
    monkeypatch.setattr(provenance, "__file__", str(installed))
    assert provenance.git_commit() is None
    assert provenance.no_commit_reason() == provenance.INSTALLED_COPY
    assert "installed copy, commit unknown" in provenance.INSTALLED_COPY
    doc = provenance.new_document(backend="none", device_name="x", quick=False, seed=0, gpu_mem_gib=1.0)
    assert doc["git_commit"] is None and provenance.commit_text(doc) == provenance.INSTALLED_COPY


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_commit_of_a_checkout_says_when_it_is_dirty(tmp_path, monkeypatch):
    """Running from a checkout (an editable install): its HEAD, marked dirty while tracked files differ."""
    from cupy_dsa.bench import provenance

    monkeypatch.delenv("CUPY_DSA_COMMIT", raising=False)
    checkout = tmp_path / "clone"
    (checkout / "bench").mkdir(parents=True)
    (checkout / "bench" / "provenance.py").write_text("# v1\n")
    _git(checkout, "init", "-q")
    _git(checkout, "add", "bench/provenance.py")
    _git(checkout, "commit", "-qm", "x")
    monkeypatch.setattr(provenance, "__file__", str(checkout / "bench" / "provenance.py"))
    clean = provenance.git_commit()
    assert clean and len(clean) == 12 and not clean.endswith("-dirty")
    (checkout / "bench" / "provenance.py").write_text("# v2\n")
    assert provenance.git_commit() == clean + "-dirty"
    assert "uncommitted changes" in provenance.commit_text({"git_commit": clean + "-dirty"})


def test_cpu_tables_print_no_ratios(runs):
    for sub in ("store", "logits"):
        out = runs[sub][0].output
        assert "not measured on the CPU backend" in out and "no ratios" in out
        assert "%" not in "".join(ln for ln in out.splitlines() if "│" in ln and ("bf16" in ln or "fp8" in ln)), out
        # nor a timing ratio: a layout "20.96x" another on the torch reference reads as a GPU cost (issue 50)
        rows = [ln for ln in out.splitlines() if "│" in ln and ("bf16" in ln or "fp8" in ln)]
        assert rows and not [ln for ln in rows if re.search(r"\d\.\d+x\b", ln)], out


def test_cpu_runs_evaluate_no_targets(runs):
    """CPU timings are not performance figures: no row carries a target or a verdict, and the headline says
    neither pass nor miss (the paged / contiguous prefill ratio used to flip between runs)."""
    from cupy_dsa.bench import report

    target_keys = ("target_pct_copy", "target_pct_read", "target_us", "target_pct_matmul", "target_vs_contiguous",
                   "target_pct_roofline", "target_vs_deepgemm_rows", "target_vs_deepgemm")
    for sub in ("store", "logits"):
        doc = runs[sub][1]
        for r in doc[sub]:
            assert r.get("verdict") is None and not any(r.get(k) for k in target_keys), r
        md = report.markdown_headline(doc)
        assert "pass" not in md and "miss" not in md, md


def _bench_piped(args, columns=None):
    """``python -m cupy_dsa <args>`` with stdout and stderr piped (as in a log), COLUMNS as given."""
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    if columns is not None:
        env["COLUMNS"] = str(columns)
    r = subprocess.run([sys.executable, "-m", "cupy_dsa", *args], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


@pytest.mark.parametrize("columns", [80, 120, None])
def test_tables_fit_the_width(columns):
    """Piped output honours COLUMNS (else the pipe width); the decode table is split, keeping the row's
    identity in every part, and every column is either shown or named as empty in every row."""
    from cupy_dsa.bench import cli_common, provenance, report

    r = _bench_piped(["bench", "logits", "--backend", "cpu"], columns)
    width = columns or cli_common.PIPE_WIDTH
    assert max(len(ln) for ln in r.stdout.splitlines()) <= width, r.stdout
    text = " ".join(r.stdout.split())
    headers = [str(c.header) for c in report.decode_table(provenance.new_document(
        backend="cpu", device_name="x", quick=True, seed=0, gpu_mem_gib=1.0)).columns]
    assert all(h in text for h in headers), [h for h in headers if h not in text]
    assert "not shown (empty in every row): % read, target, result, DeepGEMM" in text
    if columns == 80:
        assert "(1/2)" in text and "(2/2)" in text, r.stdout
    else:
        assert "(1/2)" not in text


def test_fitted_drops_empty_columns_and_repeats_the_keys():
    from rich.console import Console
    from rich.table import Table

    from cupy_dsa.bench import report

    t = Table(title="t")
    for h in ("case", "a", "empty", "b", "c"):
        t.add_column(h)
    for i in range(3):
        t.add_row(f"case {i}", "x" * 12, "—", "y" * 12, "z" * 12)
    console = Console(width=40, file=io.StringIO())
    parts = report.fitted(console, t, keys=1)
    assert [[str(c.header) for c in p.columns] for p in parts] == [["case", "a", "b"], ["case", "c"]]
    assert parts[-1].caption == "not shown (empty in every row): empty" and parts[0].caption is None
    assert [list(p.columns[0].cells) for p in parts] == [[f"case {i}" for i in range(3)]] * 2
    wide = report.fitted(Console(width=200, file=io.StringIO()), t, keys=1)
    assert len(wide) == 1 and [str(c.header) for c in wide[0].columns] == ["case", "a", "b", "c"]


def test_markdown_dash_keeps_stdout_markdown_only(runs, tmp_path):
    """``--markdown -``: stdout is the markdown alone (to paste or redirect); the tables go to stderr."""
    j = tmp_path / "logits.json"
    j.write_text(json.dumps(runs["logits"][1]))
    for args in (["bench", "logits", "--backend", "cpu", "--markdown", "-"], ["bench", "report", str(j), "--markdown", "-"]):
        r = _bench_piped(args)
        lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
        assert lines[0].startswith("cupy-dsa bench —") and all(ln.startswith("|") for ln in lines[1:]), r.stdout
        assert "paged_mqa_logits, decode" in r.stderr, r.stderr[-2000:]


def test_notes_cite_no_documents(runs):
    """The bench's footnotes state facts; they cite no document (none outside the repository, in particular)."""
    import re

    for _, doc, _ in runs.values():
        for section, notes in doc["notes"].items():
            for n in notes:
                assert not re.search(r"\w\.md\b", n), (section, n)


def test_bytes_figures():
    rows = {(r["model"], r["layout"]): r for r in bytes_mod.rows(50.0)}
    assert {r["bytes_per_entry"] for r in rows.values()} == {132, 68, 256, 264}   # 264: fp8-rescore (fp8 + int8 pages)
    flash8, flash16 = rows[("DeepSeek-V4-Flash", "fp8")], rows[("DeepSeek-V4-Flash", "bf16")]
    assert flash8["index_bytes_per_token_per_layer"] == 33 and flash16["index_bytes_per_token_per_layer"] == 64
    assert flash16["index_bytes_per_token"] == 64 * flash16["index_layers"]
    assert flash8["tokens_fit"] == math.floor(50 * 2**30 / flash8["total_kv_bytes_per_token"])   # GiB
    assert flash16["tokens_fit"] < flash8["tokens_fit"] < rows[("DeepSeek-V4-Flash", "fp4")]["tokens_fit"]
    v32 = rows[("DeepSeek-V3.2", "fp8")]
    assert v32["index_bytes_per_token"] == 61 * 132  # every layer, full token rate
    assert abs(v32["index_share"] - 0.168) < 0.001 and abs(rows[("DeepSeek-V3.2", "bf16")]["index_share"] - 0.281) < 0.001
    assert rows[("DeepSeek-V4-Pro", "bf16")]["assumed"] and not flash16["assumed"]


@pytest.mark.parametrize("args, message", [
    (["bench", "--backend", "tpu"], "Invalid value for '--backend'"),
    (["bench", "store", "--backend", "gpu"], "Invalid value for '--backend'"),
    (["bench", "bytes", "--gpu-mem-gib", "0"], "Invalid value for '--gpu-mem-gib'"),
    (["bench", "bytes", "--gpu-mem-gib", "lots"], "Invalid value for '--gpu-mem-gib'"),
    # issue 50: GB and GiB were two units for one budget (serve's --memory-gib): the old name is refused
    (["bench", "bytes", "--gpu-mem-gb", "80"], "renamed to --gpu-mem-gib, in GiB (2^30 B) like `bench serve "
                                               "--memory-gib`: 80 GB is --gpu-mem-gib 74.51"),
    (["bench", "logits", "--seed", "-1"], "Invalid value for '--seed'"),
    (["bench", "recall", "--device", "gpu0", "--quick"], "Invalid value for '--device'"),
    (["bench", "store", "--backend", "cpu", "--device", "cuda:0"], "Invalid value for '--device'"),
    (["bench", "fast"], "No such command 'fast'"),
    (["bench", "store", "--frobnicate"], "No such option"),
])
def test_bad_options_are_usage_errors(args, message):
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 2, (res.exit_code, res.output, res.exception)
    assert message in res.output and "Traceback" not in res.output


@pytest.mark.parametrize("sub, option, name", [
    (["bench", "store", "--backend", "cpu"], "--json", "x.json"),
    (["bench", "store", "--backend", "cpu"], "--plot", "x.png"),
    (["bench", "store", "--backend", "cpu"], "--markdown", "x.md"),
    (["bench", "report", "JSON"], "--plot", "x.png"),
    (["bench", "report", "JSON"], "--markdown", "x.md"),
    (["bench", "variants"], "--json", "x.json"),
])
def test_unwritable_outputs_are_refused_before_the_work(option, name, sub, tmp_path, monkeypatch, runs):
    """An output path that cannot be written is a usage error naming the option, before anything runs (the
    bench used to run to its end, then fail with a traceback)."""
    from cupy_dsa.bench import cli_sections, report

    ran = []
    monkeypatch.setattr(cli_sections, "run", lambda *a: ran.append(a))
    monkeypatch.setattr(report, "print_all", lambda *a: ran.append(a))
    (tmp_path / "b.json").write_text(json.dumps(runs["bytes"][1]))
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    paths = [not_a_dir / name, not_a_dir / "sub" / name] + ([Path("/proc/sys") / name] if Path("/proc/sys").is_dir() else [])
    for path in paths:
        args = [a if a != "JSON" else str(tmp_path / "b.json") for a in sub] + [option, str(path)]
        res = CliRunner().invoke(main, args)
        assert res.exit_code == 2, (res.exit_code, res.output, res.exception)
        assert f"Invalid value for '{option}'" in res.output and "cannot write" in res.output, res.output
        assert "Traceback" not in res.output and not ran, res.output
    ok = tmp_path / "new" / "dir" / name  # a missing directory is fine (the writer creates it); nothing is left
    assert CliRunner().invoke(main, ["bench", "bytes", option, str(ok)]).exit_code == 0
    assert not (tmp_path / "new").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_cuda_backend_without_gpu_is_a_click_error():
    res = CliRunner().invoke(main, ["bench", "store", "--backend", "cuda", "--quick"])
    assert res.exit_code == 2 and "no CUDA device is available" in res.output


def test_report_rejects_foreign_json(tmp_path):
    p = tmp_path / "x.json"
    p.write_text(json.dumps({"schema": "something-else"}))
    res = CliRunner().invoke(main, ["bench", "report", str(p)])
    assert res.exit_code == 2 and "expected schema" in res.output


def test_python_m_cupy_dsa_bench_bytes():
    out = subprocess.run([sys.executable, "-m", "cupy_dsa", "bench", "bytes", "--gpu-mem-gib", "80"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "V4-Flash" in out.stdout and "80 GiB" in out.stdout and "ASSUMED" in out.stdout


# --------------------------------------------------------------------------------------------------
# what the bench computes besides the ops
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["bf16", "fp8"])
def test_torch_baseline_matches_the_op(layout, seed):
    """The gather+bmm baseline computes the same logits as paged_mqa_logits (bf16-rounded scores)."""
    import cupy_dsa
    from cupy_dsa.bench import sweeps

    g = torch.Generator().manual_seed(seed)
    B, ctx = 2, 200
    batch = sweeps.DecodeBatch("test", [ctx, 77], ctx)
    cache, tables, q, w, lens = sweeps._decode_inputs(torch.device("cpu"), batch, 1, layout, "fp8", 1, g)
    ref = cupy_dsa.paged_mqa_logits(q, cache, w, lens, tables[0], ctx, clean_logits=False)
    got = sweeps.torch_gather_bmm(q, cache, w, lens, tables[0], ctx, layout)
    for b in range(B):
        n = int(lens[b])
        a, e = got[b, :n].double(), ref[b, :n].double()
        rel = ((a - e).norm() / e.norm()).item()
        assert rel < 2e-2, f"row {b}: relative L2 error {rel:.3g}"
        assert torch.all(got[b, n:] == 0)


def test_long_tail_lengths(seed):
    from cupy_dsa.bench import sweeps

    for B in (32, 64, 128):
        lens = sweeps.long_tail(B, seed)
        assert len(lens) == B and min(lens) >= 128 and max(lens) <= 120 * 1024
        assert sum(x >= 116 * 1024 for x in lens) >= max(1, B // 16)        # a few near the maximum
        assert sorted(lens)[B // 2] < 32 * 1024                             # most are short


def test_fp4_simulate_is_nearest_e2m1(seed):
    from cupy_dsa.bench.recall import fp4_simulate

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 128, generator=g) * torch.exp(torch.randn(64, 1, generator=g))
    y = fp4_simulate(x).double().view(-1, 32)
    xb = x.double().view(-1, 32)
    scale = torch.exp2(torch.ceil(torch.log2(xb.abs().amax(-1, keepdim=True).clamp_min(1e-4) / 6)))
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float64)
    cand = torch.sign(xb)[..., None] * grid * scale[..., None]            # every representable value
    best = (cand - xb[..., None]).abs().min(-1).values
    assert torch.allclose((y - xb).abs(), best, rtol=0, atol=1e-12)
    assert torch.equal(y.float().to(torch.bfloat16).double(), y)          # exactly representable in bf16


def test_variants_needs_a_gpu(monkeypatch):
    """`bench variants` times CUDA kernels: without a GPU it says so (exit code 2, no traceback)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    res = _invoke(["bench", "variants", "--quick"])
    assert res.exit_code == 2 and "no CUDA device" in res.output, res.output


@pytest.mark.parametrize("args, option", [
    (["bench", "variants", "--quick"], None),
    (["bench", "variants", "--device", "cuda:1"], "'--device'"),
    (["bench", "variants", "--device", "cpu"], "'--device'"),
    (["bench", "store", "--device", "cuda:1"], "'--device'"),
    (["bench", "store", "--backend", "cuda"], "'--backend'"),
])
def test_no_gpu_errors_name_the_option_given(args, option, monkeypatch):
    """Without a GPU the error names the option that asked for one; `variants` has no --backend to blame."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    if option is None:
        assert "cupy-dsa bench variants times CUDA kernels and needs a GPU" in res.output, res.output
    else:
        assert f"Invalid value for {option}" in res.output, res.output
    if option != "'--backend'":
        assert "--backend" not in res.output, res.output


@pytest.mark.parametrize("arch, message", [
    ("sm_75", "sm_75: the kernels need sm_80 or newer"),
    ("sm_70", "the kernels need sm_80 or newer"),
    ("foo", "expected an arch such as sm_90"),
    ("90", "expected an arch such as sm_90"),
])
def test_resources_refuses_bad_archs_in_one_line(arch, message):
    """Before any compile: no NVRTC log (sm_75 used to print 7,459 lines), no traceback."""
    res = CliRunner().invoke(main, ["bench", "resources", "--arch", "sm_80", "--arch", arch])
    assert res.exit_code == 2 and "Invalid value for '--arch'" in res.output and message in res.output, res.output
    assert len(res.output.splitlines()) <= 4 and "NVRTC failed" not in res.output, res.output


@pytest.mark.gpu
def test_variants_gpu_quick(tmp_path):
    """Every row of a case is a declared config of this GPU, the product one first."""
    j = tmp_path / "v.json"
    res = _invoke(["bench", "variants", "--quick", "--json", str(j)])
    assert res.exit_code == 0, res.output
    rows = json.loads(j.read_text())["rows"]
    assert {r["op"] for r in rows} == {"decode", "prefill"}
    assert sum(r["product"] for r in rows) == len({(r["op"], r["layout"], r.get("B"), r.get("ctx"), r.get("next_n"),
                                                     r.get("q")) for r in rows})


def test_rescore_needs_a_gpu(monkeypatch):
    """`bench rescore` times CUDA kernels: without a GPU it says so (exit code 2, no traceback); bench's own
    options before it are refused."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    res = _invoke(["bench", "rescore", "--quick"])
    assert res.exit_code == 2 and "needs a GPU" in res.output and "Traceback" not in res.output, res.output
    res = _invoke(["bench", "--quick", "rescore"])
    assert res.exit_code == 2 and "not to `bench rescore`" in res.output, res.output


@pytest.mark.gpu
def test_rescore_gpu_quick(tmp_path):
    """One case per phase: every column timed (DeepGEMM's where it imports), the byte counts of the formats, the
    floor of stage 2 + selection against the ceilings measured in the run (a share and a verdict), the JSON
    written."""
    from cupy_dsa.bench import rescore as rescore_bench

    j = tmp_path / "r.json"
    res = _invoke(["bench", "rescore", "--quick", "--json", str(j)])
    assert res.exit_code == 0, res.output
    doc = json.loads(j.read_text())
    rows = doc["rows"]
    assert [r["phase"] for r in rows] == list(rescore_bench.PHASES)
    live = {rescore_bench.TOPK_COLUMNS[k] for k, why in doc["topk"]["status"].items() if why == "live"}
    for r in rows:
        assert set(r["us"]) == set(rescore_bench.COLUMNS)
        timed = [c for c in rescore_bench.COLUMNS if (doc["deepgemm"] == "live" or c not in rescore_bench.DEEPGEMM_COLUMNS)
                 and (c in live or c not in rescore_bench.TOPK_COLUMNS.values())]
        assert all(r["us"][c] > 0 for c in timed), r
        assert r["key_bytes"]["fp8"] < r["key_bytes"]["bf16"]
        fl = r["floor"]
        assert fl["read_gbps"] > 0 and fl["mma_tflops"] > 0 and fl["us"] > 0 and fl["binds"] in ("read", "mma.sync")
        assert 0 < fl["share"][rescore_bench.STAGE2] and fl["verdict"][rescore_bench.STAGE2] in ("pass", "miss")
    assert doc["ceilings"]["mma_sync"]["bf16"] and "Floor of stage 2 + selection" in rescore_bench.markdown(doc)


# --------------------------------------------------------------------------------------------------
# bench serve (CPU: the memory figures; the timings need a GPU)
# --------------------------------------------------------------------------------------------------

def _serve(*args):
    return CliRunner().invoke(main, ["bench", "serve", *args])


def _v4_config(tmp_path, **fields):
    cfg = {"num_hidden_layers": 7, "compress_ratios": [0, 0, 4, 128, 4, 128, 0, 4], "index_topk": 512,
           "index_n_heads": 64, "index_head_dim": 128}
    cfg.update(fields)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def test_serve_cpu_json_memory_figures(tmp_path):
    res = _serve("--model", _v4_config(tmp_path), "--memory-gib", "2", "--json", "-")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output[res.output.index("{"):])
    assert doc["schema"] == "cupy-dsa-serve/1" and doc["measured"] is False and doc["timings"] == []
    assert "no CUDA GPU" in doc["not_measured"]
    assert doc["model"]["index_layers"] == 2  # the ratio-4 layer past num_hidden_layers (MTP) is not counted
    by = {r["layout"]: r for r in doc["memory"]}
    assert by["bf16"]["index_bytes_per_token"] == 2 * 256 / 4
    assert by["fp8"]["index_bytes_per_token"] == 2 * 132 / 4
    assert by["bf16"]["tokens_fit"] == 2 * 2**30 // 128 and by["fp8"]["tokens_fit"] == 2 * 2**30 // 66


def test_serve_builtin_models(tmp_path):
    res = _serve("--model", "v4-flash", "--json", "-")
    doc = json.loads(res.output[res.output.index("{"):])
    # the published V4-Flash config: 43 layers, ratios 0, 0, then 4/128 alternating (21 ratio-4), then the MTP's 0
    assert doc["model"]["n_layers"] == 43 and doc["model"]["index_layers"] == 21 and doc["model"]["assumed"] is None
    flash = tmp_path / "flash.json"
    flash.write_text(json.dumps({"num_hidden_layers": 43, "index_topk": 512,
                                 "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0]}))
    res = _serve("--model", str(flash), "--json", "-")
    assert json.loads(res.output[res.output.index("{"):])["model"]["index_layers"] == 21
    res = _serve("--model", "v4-pro")
    assert res.exit_code == 0 and "ASSUMED" in res.output


def test_serve_case_list():
    from cupy_dsa.bench import serve

    cs = serve.cases(8, (4096, 65536), 3, 2048)
    assert [(c.phase, c.context) for c in cs] == [("verify", 4096), ("verify", 65536),
                                                  ("prefill", 4096), ("prefill", 65536)]
    assert cs[0].new_entries == math.ceil(8 * 3 / 4) and cs[2].new_entries == 512


@pytest.mark.parametrize("args, needle", [
    (["--batch", "0"], "--batch"), (["--next-n", "0"], "--next-n"), (["--next-n", "5"], "--next-n"),
    (["--context", "12x"], "--context"), (["--context", "0"], "--context"), (["--model", "/no/such.json"], "--model"),
    (["--memory-gib", "0"], "--memory-gib"), (["--plot", "x.jpg"], "--plot"),
])
def test_serve_option_errors(args, needle):
    res = _serve(*args)
    assert res.exit_code == 2 and needle in res.output, res.output


@pytest.mark.parametrize("fields, needle", [
    ({"compress_ratios": None}, "compress_ratios"), ({"compress_ratios": [0, 128] * 4}, "no ratio-4"),
    ({"index_head_dim": 64}, "index_head_dim"), ({"index_topk": None}, "index_topk"),
    ({"num_hidden_layers": 99}, "num_hidden_layers"),
])
def test_serve_config_errors(tmp_path, fields, needle):
    res = _serve("--model", _v4_config(tmp_path, **fields))
    assert res.exit_code == 2 and needle in res.output, res.output


def test_serve_bf16_forward_runs_on_the_reference():
    """The GPU path's bf16 and fp8-cupy forwards (store + logits per C4 layer, the plan once) built and run on the
    torch reference at tiny sizes: shapes, out_loc and the routes' arguments are consistent; fp8-cupy stores
    into SGLang's fp8 rows."""
    from cupy_dsa.bench import serve
    from cupy_dsa.layouts import bf16_view

    model = serve.ServeModel("tiny", 5, 2, 512, "test", None)
    dev = torch.device("cpu")
    for case in serve.cases(3, (300,), 1, 16) + serve.cases(2, (260,), 3, 8):
        for layout in ("bf16", "fp8-cupy"):
            g = torch.Generator().manual_seed(0)
            forward = serve._forward(case, layout, model, dev, g, None)
            assert forward.layer_caches == 2 and forward.gathers is None
            forward.run()
    seen = []
    real = serve._layer_caches
    serve._layer_caches = lambda case, layout, *a: seen.append(layout) or real(case, layout, *a)
    try:
        serve._forward(serve.cases(2, (260,), 1, 8)[0], "fp8-cupy", model, dev, torch.Generator(), None)
    finally:
        serve._layer_caches = real
    assert seen == ["fp8"]
    caches, _ = serve._layer_caches(serve.Case("decode", 2, 64, 1, 0), "bf16", 3, dev, torch.Generator())
    assert len(caches) == 3 and all(bf16_view(c).abs().sum() > 0 for c in caches)


def test_serve_markdown_has_fp8_cupy_columns_only_when_measured():
    from cupy_dsa.bench import serve

    row = {"phase": "decode", "batch": 8, "context": 32768, "next_n": 1, "chunk": 0, "bf16_ms": 2.0, "fp8_ms": 1.0,
           "added_ms": 1.0, "ratio": 2.0}
    doc = {"model": {"name": "m", "index_layers": 21}, "device": "gpu", "git_commit": "abc", "timings": [row],
           "memory": [], "measured": True}
    old = serve.markdown(doc)
    assert "fp8-cupy" not in old and "| decode | 8 x 32K | 2.00 ms | 1.00 ms | 1.00 ms | 2.00x |\n" in old
    doc["timings"] = [dict(row, fp8_cupy_ms=1.5, fp8_cupy_ratio=1.5)]
    new = serve.markdown(doc)
    assert "| fp8 keys, cupy_dsa (fp8-cupy) | fp8-cupy / DeepGEMM |" in new
    assert "| decode | 8 x 32K | 2.00 ms | 1.00 ms | 1.00 ms | 2.00x | 1.50 ms | 1.50x |" in new


def test_serve_plot_writes_png(tmp_path):
    from cupy_dsa.bench import serve

    rows = [{"phase": "decode", "context": c, "bf16_ms": 0.1 * c / 4096, "fp8_ms": 0.08 * c / 4096,
             "added_ms": 0.02 * c / 4096} for c in (4096, 16384)]
    doc = {"timings": rows, "next_n": 1, "batch": 8, "model": {"name": "m"}, "device": "gpu"}
    serve.plot(doc, str(tmp_path / "s.png"))
    assert (tmp_path / "s.png").read_bytes()[:8] == PNG_MAGIC


def test_query_section_on_cpu(tmp_path):
    j = tmp_path / "query.json"
    res = _invoke(["bench", "query", "--backend", "cpu", "--json", str(j)])
    assert res.exit_code == 0, res.output
    rows = json.loads(j.read_text())["query"]
    assert {(r["n_tokens"], r["numerics"]) for r in rows} == {(t, n) for t in (1, 64) for n in ("fp4sim", "fp8")}
    assert all(r["error"] is None and r["time_us"] > 0 and r["pct_read"] is None for r in rows)
    assert "prepare_index_q" in res.output
    rerun = _invoke(["bench", "report", str(j)])
    assert rerun.exit_code == 0 and "prepare_index_q" in rerun.output


REPO = Path(__file__).resolve().parents[1]
RESULTS_JSON = REPO / "bench" / "results" / "h200.json"


def test_readme_results_blocks_are_generated_from_the_committed_json():
    """Every figure block of the README and of bench/results/README.md is what `bench report --readme` renders from
    the committed JSON it quotes, with its stale line (a hand edit, a JSON committed without re-rendering, or a
    kernel commit since the last rendering fails here: bench/results/README.md lists the commands to re-render)."""
    from cupy_dsa.bench import readme as readme_mod

    files = {name: (REPO / name).read_text() for name in ("README.md", "bench/results/README.md")}
    bodies = {}
    for name, text in files.items():
        for m in readme_mod.README_BLOCK.finditer(text):
            assert m["name"] not in bodies, f"results:{m['name']} stands twice"
            bodies[m["name"]] = (name, m["body"])
    diverse = RESULTS_JSON.parent / "h200-recall-diverse.json"  # `bench recall --suite diverse`
    assert set(bodies) == (set(readme_mod.README_BLOCKS) | set(readme_mod.SERVE_README_BLOCKS)
                           | set(readme_mod.RESCORE_README_BLOCKS) | set(readme_mod.EMULATE_README_BLOCKS)
                           | set(readme_mod.RECALL_DIVERSE_README_BLOCKS))
    serve = {"serve": readme_mod.SERVE_README_BLOCKS["serve"]}
    bench_blocks = {n: b for n, b in readme_mod.README_BLOCKS.items() if n != "recall"}
    docs = {"h200.json": (json.loads(RESULTS_JSON.read_text()), bench_blocks),
            "h200-recall.json": (json.loads((RESULTS_JSON.parent / "h200-recall.json").read_text()),
                                 {"recall": readme_mod.README_BLOCKS["recall"]}),
            "h200-serve.json": (json.loads((RESULTS_JSON.parent / "h200-serve.json").read_text()), serve),
            "h200-serve-rescore.json": (json.loads((RESULTS_JSON.parent / "h200-serve-rescore.json").read_text()),
                                        {"serve-rescore": readme_mod.SERVE_README_BLOCKS["serve-rescore"]}),
            "h200-serve-query.json": (json.loads((RESULTS_JSON.parent / "h200-serve-query.json").read_text()),
                                      {"serve-query": readme_mod.SERVE_README_BLOCKS["serve-query"]}),
            "h200-serve-query-sm120.json": (json.loads((RESULTS_JSON.parent / "h200-serve-query-sm120.json").read_text()),
                                            {"serve-query-sm120": readme_mod.SERVE_README_BLOCKS["serve-query-sm120"]}),
            "h200-rescore.json": (json.loads((RESULTS_JSON.parent / "h200-rescore.json").read_text()),
                                  readme_mod.RESCORE_README_BLOCKS),
            }
    # the emulation blocks (the sm_120 table and the RTX PRO 6000 model): the newest committed emulation run
    emulation = max(RESULTS_JSON.parent.glob("*-emulate-sm120.json"), key=lambda f: json.loads(f.read_text())["date"])
    docs[emulation.name] = (json.loads(emulation.read_text()), readme_mod.EMULATE_README_BLOCKS)
    docs[diverse.name] = (json.loads(diverse.read_text()), readme_mod.RECALL_DIVERSE_README_BLOCKS)
    for what, (doc, blocks) in docs.items():
        note = readme_mod.stale_note(doc)
        for name, block in blocks.items():
            where, body = bodies[name]
            if note is None:  # no git history to tell: the stale line is not compared
                body, note_here = readme_mod.without_stale_note(body), ""
            else:
                note_here = note
            assert body == block.render(doc) + note_here + "\n", (
                f"{where}: results:{name} is not what {what} renders: cupy-dsa bench report bench/results/{what} "
                f"--readme {where}")


def test_report_readme_rewrites_marked_blocks(tmp_path):
    md = tmp_path / "README.md"
    md.write_text("intro\n<!-- results:headline -->\n- typed by hand: 9.99x\n<!-- /results:headline -->\nend\n")
    res = _invoke(["bench", "report", str(RESULTS_JSON), "--readme", str(md)])
    assert res.exit_code == 0, res.output
    text = md.read_text()
    assert "9.99x" not in text and text.startswith("intro\n<!-- results:headline -->\n- bf16 index keys are 1.94x")
    assert text.endswith("<!-- /results:headline -->\nend\n")
    md.write_text("<!-- results:nonsense -->\n<!-- /results:nonsense -->\n")
    res = CliRunner().invoke(main, ["bench", "report", str(RESULTS_JSON), "--readme", str(md)])
    assert res.exit_code == 2 and "results:nonsense" in res.output and "headline" in res.output


# --------------------------------------------------------------------------------------------------
# bench recall --suite diverse
# --------------------------------------------------------------------------------------------------

def test_recall_suite_diverse_on_cpu(tmp_path):
    """`bench recall --suite diverse` on the CPU backend: every format and oracle at every k, the exact oracle keeps
    its own top-k, the reference format matches the reference oracle, the error budget is consistent (both roundings
    miss at least what one alone does, a format with the exact query's rounding adds none); the default suite stays
    the needle suite; `bench report` and its README block render the rows."""
    from cupy_dsa.bench import readme as readme_mod
    from cupy_dsa.bench import recall_diverse as rd

    j = tmp_path / "diverse.json"
    res = _invoke(["bench", "recall", "--suite", "diverse", "--backend", "cpu", "--quick", "--json", str(j)])
    assert res.exit_code == 0, res.output
    doc = json.loads(j.read_text())
    rows = doc["recall_diverse"]
    assert doc["recall"] == [] and {r["suite"] for r in rows} == {"diverse"}
    assert {r["format"] for r in rows} == set(rd.FORMATS) | set(rd.ORACLES) and {r["k"] for r in rows} == set(rd.TOPKS)
    assert any(not r["trivial"] and r["index_entries"] >= 4 * r["k"] for r in rows)
    by = {(r["format"], r["k"], r["context_tokens"]): r for r in rows}
    for r in rows:
        assert r["error"] is None and r["queries"] == 4, r
        assert 0.0 <= r["recall_min"] <= r["recall_mean"] <= 1.0 and r["missed_share"] == 1 - r["recall_mean"]
        assert r["recall_peaked"] is not None and r["recall_unpeaked"] is not None
        if r["format"] == "exact":
            assert r["recall_mean"] == 1.0, r
        if r["format"] in ("reference", "bf16-reference"):  # the latter: fp32 summation order only
            assert r["ref_overlap_mean"] >= (1.0 if r["format"] == "reference" else 0.99), r
        if r["format"] in rd.ONE_PASS:
            key, query = rd.ONE_PASS[r["format"]]
            assert (r["key"], r["query"]) == (key, query)
            both, k_only, q_only = r["missed_both"], r["missed_key_only"], r["missed_query_only"]
            assert None not in (both, k_only, q_only), r
            # the op's fp32 scores and the fp64 emulation of both roundings select nearly the same keys
            assert abs(both - r["missed_share"]) <= 0.01, r
            twin = by.get((f"{r['format']}+q-bf16", r["k"], r["context_tokens"]), r)  # the same keys, bf16 q
            assert twin["missed_key_only"] == k_only, (r, twin)  # same keys: the same key-only misses
        else:
            assert r["missed_both"] is None
        if r["format"] in rd.RESCORE:
            assert r["key"] == "two-level" and r["k_prime"] == rd.K_PRIME_MULTIPLE * r["k"]
    nontrivial = [r for r in rows if not r["trivial"]]
    # the budget shows the query: with bf16 keys the bf16 query misses no more than the fp8 query on its own side
    for r in nontrivial:
        if r["format"] == "bf16":
            twin = by[("bf16+q-bf16", r["k"], r["context_tokens"])]
            assert twin["missed_query_only"] <= r["missed_query_only"], (r, twin)
    assert "error budget" in res.output and "| bf16+q-bf16 | bf16 | bf16 |" in res.output
    rerun = _invoke(["bench", "report", str(j)])
    assert rerun.exit_code == 0 and "| fp8-rescore-4x-bf16q | two-level | bf16 |" in rerun.output
    md = tmp_path / "README.md"
    md.write_text("x\n<!-- results:recall-diverse -->\nold\n<!-- /results:recall-diverse -->\n")
    res = _invoke(["bench", "report", str(j), "--readme", str(md)])
    assert res.exit_code == 2 and "--allow-cpu-or-quick" in res.output  # a CPU run does not replace H200 figures
    res = _invoke(["bench", "report", str(j), "--readme", str(md), "--allow-cpu-or-quick"])
    assert res.exit_code == 0 and md.read_text() == ("x\n<!-- results:recall-diverse -->\n"
                                                     + readme_mod.RECALL_DIVERSE_README_BLOCKS["recall-diverse"]
                                                     .render(doc) + "\n<!-- /results:recall-diverse -->\n")
    res = _invoke(["bench", "recall", "--suite", "haystack"])
    assert res.exit_code == 2 and "--suite" in res.output


def test_recall_suite_default_is_needle():
    from cupy_dsa.bench import cli, cli_sections

    assert cli_sections.DEFAULTS["suite"] == "needle"
    opt = [p for p in cli.bench.commands["recall"].params if p.name == "suite"]
    assert opt and list(opt[0].type.choices) == ["needle", "diverse"]
    assert not [p for p in cli.bench.commands["all"].params if p.name == "suite"]


def test_recall_diverse_sizes():
    from cupy_dsa.bench.recall_diverse import contexts

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert contexts(cpu, True) == ([8192], 4) and max(contexts(cpu, False)[0]) == 16384
    for quick in (True, False):
        ctxs, rows = contexts(gpu, quick)
        assert min(ctxs) // 4 >= 16384 and rows >= 16   # >= 16K keys on the GPU


@pytest.mark.gpu
def test_recall_suite_diverse_on_gpu(monkeypatch):
    """The diverse suite through the CUDA kernels at 16K keys: the stored reference matches the reference oracle,
    and the one-pass formats' op scores agree with their fp64 emulation."""
    from cupy_dsa.bench import recall_diverse as rd

    monkeypatch.setattr(rd, "contexts", lambda device, quick: ([65536], 8))
    rows = rd.run(torch.device("cuda"), True, 0)
    assert all(r["error"] is None for r in rows), [r["error"] for r in rows if r["error"]][:1]
    for r in rows:
        if r["format"] == "bf16-reference":
            assert r["ref_overlap_mean"] >= 0.95, r
        if r["format"] in rd.ONE_PASS:
            assert abs(r["missed_both"] - r["missed_share"]) <= 0.01, r
