"""`cupy-dsa needle` end to end against a small OpenAI-compatible server on 127.0.0.1 (stdlib http.server in a
thread; nothing leaves the machine), its JSON / markdown / plot, the `bench report` overlay, the error paths
(unreachable server, HTTP errors and retries, timeouts, wrong model, context beyond the server's limit, API
key) and the prompt / calibration helpers. The server and its reading rule: tests/needle_server.py."""
import json
import math
import re
import socket

import pytest
from click.testing import CliRunner

from cupy_dsa.bench import needle
from cupy_dsa.bench.cli import main
from needle_server import FakeServer

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _invoke(args):
    return CliRunner().invoke(main, args, catch_exceptions=False)


def _run_needle(url, tmp_path, name, *extra):
    j, md, png = tmp_path / f"{name}.json", tmp_path / f"{name}.md", tmp_path / f"{name}.png"
    res = _invoke(["needle", "--base-url", url, "--json", str(j), "--markdown", str(md), "--plot", str(png),
                   "--retries", "0", "--timeout", "30", *extra])
    return res, j, md, png


LENGTHS = (256, 512, 1024, 2048)


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """The same sweep against a server that reads its last 300 tokens and one that reads its last 1200."""
    d = tmp_path_factory.mktemp("needle")
    out = {}
    for label, window in (("fp8", 300), ("bf16", 1200)):
        with FakeServer(window=window) as srv:
            res, j, md, png = _run_needle(srv.url, d, label, "--lengths", ",".join(map(str, LENGTHS)),
                                          "--depths", "0,0.5,1", "--trials", "2", "--label", label,
                                          "--extra-body", '{"chat_template_kwargs": {"thinking": false}}')
            assert res.exit_code == 0, res.output
            out[label] = (res, json.loads(j.read_text()), j, md, png, srv.requests)
    return out


def test_run_document_and_outputs(two_runs):
    res, doc, _, md, png, _ = two_runs["fp8"]
    assert doc["schema"] == needle.SCHEMA and doc["label"] == "fp8"
    assert doc["server"]["model"] == "fake-dsv4" and doc["server"]["max_model_len"] == 1 << 20
    assert doc["settings"]["lengths"] == list(LENGTHS) and doc["settings"]["depths"] == [0.0, 0.5, 1.0]
    assert len(doc["trials"]) == len(LENGTHS) * 3 * 2 and len(doc["cells"]) == len(LENGTHS) * 3
    assert png.read_bytes()[:8] == PNG_MAGIC
    text = md.read_text()
    assert "| depth | 256 | 512 | 1K | 2K |" in text and "| all |" in text
    assert "needle recall" in res.output and "2K" in res.output


def test_lengths_are_the_servers_tokens(two_runs):
    """Every prompt the sweep sent is within the calibration tolerance of its length in the server's count
    (trials differ from the calibrated trial 0 by their own sentences: up to one sentence more)."""
    _, doc, *_ = two_runs["fp8"]
    tpw = doc["calibration"]["tokens_per_word"]
    assert 1.0 < tpw < 1.5   # words plus the full stop of each ~10-word sentence
    for cal in doc["calibration"]["lengths"]:
        assert abs(cal["prompt_tokens"] - cal["length"]) <= needle.tolerance(cal["length"]), cal
    for t in doc["trials"]:
        assert abs(t["prompt_tokens"] - t["length"]) <= needle.tolerance(t["length"]) + 16, t


def test_recall_follows_the_servers_reading_window(two_runs):
    """Window 300: every needle of a 256-token prompt is found; in 2K prompts only the needles near the end."""
    _, doc, *_ = two_runs["fp8"]
    cell = {(c["length"], c["depth"]): c for c in doc["cells"]}
    assert all(cell[(256, d)]["recall"] == 1.0 for d in (0.0, 0.5, 1.0))
    assert cell[(2048, 1.0)]["recall"] == 1.0
    assert cell[(2048, 0.0)]["recall"] == 0.0 and cell[(2048, 0.5)]["recall"] == 0.0
    per = needle.length_recall(doc)
    rates = [per[L][0] / per[L][1] for L in LENGTHS]
    assert rates == sorted(rates, reverse=True) and rates[0] == 1.0 and rates[-1] < 0.5, rates
    for t in doc["trials"]:  # each found answer names its own trial's number
        assert t["found"] == (t["needle"] in t["answer"])
    _, wide, *_ = two_runs["bf16"]
    assert needle.length_recall(wide)[1024] == (6, 6)  # the wider reader finds every 1K needle


def test_requests_are_greedy_and_carry_extra_body(two_runs):
    *_, requests = two_runs["fp8"]
    asks = [r for r in requests if r["max_tokens"] != needle.CAL_MAX_TOKENS]
    assert len(asks) == len(LENGTHS) * 3 * 2
    for r in requests:
        assert r["temperature"] == 0.0 and r["model"] == "fake-dsv4"
        assert r["chat_template_kwargs"] == {"thinking": False}


def test_runs_are_deterministic(two_runs):
    """Same seed, same prompts: the two servers were sent identical haystacks."""
    a, b = two_runs["fp8"][5], two_runs["bf16"][5]
    assert [r["messages"] for r in a] == [r["messages"] for r in b]


def test_report_overlays_runs(two_runs, tmp_path):
    ja, jb = two_runs["fp8"][2], two_runs["bf16"][2]
    png = tmp_path / "overlay.png"
    res = _invoke(["bench", "report", str(ja), str(jb), "--plot", str(png), "--markdown", "-"])
    assert res.exit_code == 0, res.output
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert "| length | fp8 | bf16 |" in res.output
    row = next(line for line in res.output.splitlines() if line.startswith("| 2K |"))
    fp8_cell, bf16_cell = [c.strip() for c in row.strip("|").split("|")[1:]]
    assert fp8_cell != bf16_cell  # the wider reader keeps more of the 2K needles
    one = _invoke(["bench", "report", str(ja)])
    assert one.exit_code == 0 and "depth" in one.output and "needle recall" in one.output, one.output


def test_report_refuses_mixed_documents(two_runs, tmp_path):
    other = tmp_path / "bench.json"
    other.write_text(json.dumps({"schema": "cupy-dsa-bench/2"}))
    res = _invoke(["bench", "report", str(two_runs["fp8"][2]), str(other)])
    assert res.exit_code == 2 and "needle" in res.output and "Traceback" not in res.output, res.output
    res = _invoke(["bench", "report", str(two_runs["fp8"][2]), "--readme", str(other)])
    assert res.exit_code == 2 and "--readme" in res.output, res.output


def test_repeated_labels_stay_apart(two_runs, tmp_path):
    j = two_runs["fp8"][2]
    copy = tmp_path / "again.json"
    copy.write_text(j.read_text())
    res = _invoke(["bench", "report", str(j), str(copy), "--markdown", "-"])
    assert res.exit_code == 0 and f"fp8 ({j.name})" in res.output and "fp8 (again.json)" in res.output, res.output


# --------------------------------------------------------------------------------------------------
# error paths
# --------------------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_server(tmp_path):
    res, *_ = _run_needle(f"http://127.0.0.1:{_free_port()}", tmp_path, "x", "--lengths", "512")
    assert res.exit_code == 1 and "cannot reach the server" in res.output and "--base-url" in res.output, res.output
    assert "Traceback" not in res.output


def test_wrong_model_is_named(tmp_path):
    with FakeServer() as srv:
        res, *_ = _run_needle(srv.url, tmp_path, "x", "--lengths", "512", "--model", "deepseek-v4")
    assert res.exit_code == 2 and "'deepseek-v4' is not served" in res.output and "fake-dsv4" in res.output, res.output
    assert "--model" in res.output


def test_wrong_model_without_a_listing(tmp_path):
    """A server without /v1/models: the chat endpoint's 404 names the model."""
    with FakeServer(list_models=False) as srv:
        res, *_ = _run_needle(srv.url, tmp_path, "x", "--lengths", "512", "--model", "nope")
        assert res.exit_code == 2 and "does not serve that model" in res.output and "nope" in res.output, res.output
        res, *_ = _run_needle(srv.url, tmp_path, "x", "--lengths", "512")
        assert res.exit_code == 2 and "check --base-url" in res.output and "pass --model" in res.output, res.output


def test_several_models_need_a_choice(tmp_path):
    with FakeServer(models=("a", "b")) as srv:
        res, *_ = _run_needle(srv.url, tmp_path, "x", "--lengths", "512")
        assert res.exit_code == 2 and "serves 2 models" in res.output and "--model" in res.output, res.output
        res, *_ = _run_needle(srv.url, tmp_path, "x", "--lengths", "256", "--depths", "1", "--trials", "1",
                              "--model", "b")
        assert res.exit_code == 0, res.output


def test_lengths_beyond_the_listed_context(tmp_path):
    with FakeServer(max_model_len=1000) as srv:
        res, *_ = _run_needle(srv.url, tmp_path, "x", "--lengths", "512,2K")
        assert srv.requests == []  # refused before any prompt was sent
    assert res.exit_code == 2 and "--lengths" in res.output and "2048" in res.output and "1000" in res.output, res.output


def test_lengths_beyond_an_unlisted_context(tmp_path):
    """No max_model_len in the listing: the server's own 400 is reported, naming --lengths."""
    with FakeServer(max_model_len=1000, list_max_len=False) as srv:
        res, *_ = _run_needle(srv.url, tmp_path, "x", "--lengths", "512,2K")
    assert res.exit_code == 2 and "too long" in res.output and "longer than the model's context length" in res.output
    assert "--lengths" in res.output and "Traceback" not in res.output, res.output


def test_http_errors_are_retried(tmp_path):
    with FakeServer(fail=2) as srv:
        res, *_ = _run_needle(srv.url, tmp_path, "x", "--lengths", "256", "--depths", "0.5", "--trials", "1",
                              "--retries", "2")
        assert res.exit_code == 0, res.output
        assert srv.fail == 0 and len(srv.requests) >= 3 + 2   # two failed attempts, then the run
    with FakeServer(fail=100) as srv:
        res, *_ = _run_needle(srv.url, tmp_path, "x", "--lengths", "256", "--retries", "1")
        assert len(srv.requests) == 2  # one request, one retry
    assert res.exit_code == 1 and "HTTP 500" in res.output and "hiccup" in res.output, res.output


def test_client_errors_are_not_retried(tmp_path):
    with FakeServer(fail=100, fail_status=422) as srv:
        res, *_ = _run_needle(srv.url, tmp_path, "x", "--lengths", "256", "--retries", "3")
        assert len(srv.requests) == 1
    assert res.exit_code == 1 and "HTTP 422" in res.output, res.output


def test_timeouts(tmp_path):
    with FakeServer(delay=1.5) as srv:
        res = _invoke(["needle", "--base-url", srv.url, "--lengths", "256", "--timeout", "0.3", "--retries", "1"])
        assert len(srv.requests) == 2
    assert res.exit_code == 1 and "within --timeout 0.3 s" in res.output and "2 attempts" in res.output, res.output


def test_api_key(tmp_path):
    with FakeServer(api_key="sekrit") as srv:
        res, *_ = _run_needle(srv.url, tmp_path, "x", "--lengths", "256")
        assert res.exit_code == 2 and "--api-key" in res.output, res.output
        res, *_ = _run_needle(srv.url, tmp_path, "x", "--lengths", "256", "--depths", "0", "--trials", "1",
                              "--api-key", "sekrit")
        assert res.exit_code == 0, res.output


def test_answers_cut_off_by_max_tokens_are_named(tmp_path):
    """A model that reasons before answering: with --max-tokens below its reasoning every needle is missed and
    the run says why; with room for the answer it finds them."""
    with FakeServer(reasons=100) as srv:
        res, j, *_ = _run_needle(srv.url, tmp_path, "x", "--lengths", "256", "--depths", "1", "--trials", "2",
                                 "--max-tokens", "64")
        doc = json.loads(j.read_text())
        assert res.exit_code == 0 and doc["cells"][0]["found"] == 0, res.output
        assert all(t["finish_reason"] == "length" for t in doc["trials"])
        assert "2 of 2 answers stopped at --max-tokens 64" in res.output and doc["notes"], res.output
        res, j, *_ = _run_needle(srv.url, tmp_path, "y", "--lengths", "256", "--depths", "1", "--trials", "2",
                                 "--max-tokens", "200")
        doc = json.loads(j.read_text())
        assert doc["cells"][0]["found"] == 2 and doc["notes"] == [] and "--max-tokens" not in res.output, res.output


def test_answers_without_usage(tmp_path):
    with FakeServer(usage=False) as srv:
        res, *_ = _run_needle(srv.url, tmp_path, "x", "--lengths", "256")
    assert res.exit_code == 1 and "usage.prompt_tokens" in res.output, res.output


def test_lengths_shorter_than_the_prompt(tmp_path):
    with FakeServer() as srv:
        res, *_ = _run_needle(srv.url, tmp_path, "x", "--lengths", "64")
    assert res.exit_code == 2 and "shorter than the prompt without filler" in res.output, res.output


@pytest.mark.parametrize("args, hint, message", [
    (["--lengths", "4x"], "--lengths", "token counts"),
    (["--lengths", "32"], "--lengths", "at least 64"),
    (["--depths", "1.5"], "--depths", "in [0, 1]"),
    (["--depths", "half"], "--depths", "in [0, 1]"),
    (["--base-url", "ftp://host/v1"], "--base-url", "http(s) URL"),
    (["--base-url", "http://host:port/v1"], "--base-url", "numeric port"),
    (["--extra-body", "[1]"], "--extra-body", "JSON object"),
    (["--extra-body", "{"], "--extra-body", "JSON object"),
    (["--trials", "0"], "--trials", "0"),
    (["--timeout", "0"], "--timeout", "0"),
    (["--plot", "x.jpg"], "--plot", ".png"),
    (["--json", "-", "--markdown", "-"], "--markdown", "only one of"),
])
def test_option_errors(args, hint, message):
    res = _invoke(["needle", *args])
    assert res.exit_code == 2 and hint in res.output and message in res.output, res.output
    assert "Traceback" not in res.output


def test_concurrency_gives_the_same_result(tmp_path):
    docs = []
    for conc in ("1", "4"):
        with FakeServer(window=300) as srv:
            res, j, *_ = _run_needle(srv.url, tmp_path, f"c{conc}", "--lengths", "256,1K", "--depths", "0,1",
                                     "--trials", "2", "--concurrency", conc)
            assert res.exit_code == 0, res.output
            docs.append(json.loads(j.read_text()))
    strip = [[{k: v for k, v in t.items()} for t in d["trials"]] for d in docs]
    assert strip[0] == strip[1] and docs[0]["cells"] == docs[1]["cells"]


# --------------------------------------------------------------------------------------------------
# prompt and calibration helpers
# --------------------------------------------------------------------------------------------------

def test_haystack_places_one_needle_at_its_depth():
    for depth in (0.0, 0.5, 1.0):
        text, nd = needle.haystack(3, 1, 400, depth)
        body = text.split("\n\n")[1]
        sentences = re.findall(r"[^.]+\.", body)
        at = [i for i, s in enumerate(sentences) if nd.value in s]
        assert len(at) == 1 and re.findall(r"\d+", text) == [nd.value]
        assert at[0] == round(depth * (len(sentences) - 1)), (depth, at, len(sentences))
        assert text.endswith(nd.question)
    assert needle.haystack(3, 1, 400, 0.5) == needle.haystack(3, 1, 400, 0.5)
    assert needle.haystack(3, 1, 400, 0.5)[1] != needle.haystack(3, 2, 400, 0.5)[1]
    with pytest.raises(ValueError, match="depth"):
        needle.haystack(0, 0, 10, 1.5)


def test_found_reads_grouped_digits():
    nd = needle.Needle("the amber kite", "4817203")
    assert needle.found("4,817,203", nd) and needle.found("It is 4 817 203.", nd) and needle.found("4817203", nd)
    assert not needle.found("481720", nd) and not needle.found("", nd) and not needle.found(None, nd)


def test_calibration_reaches_each_length():
    """A server whose count is 57 tokens of template plus 1.37 per filler word (rounded per sentence)."""
    def measure(words):
        text, _ = needle.haystack(0, 0, words, 0.5)
        return 57 + math.ceil(1.37 * len(text.split()))

    cal = needle.calibrate(measure, (300, 1000, 5000, 40000))
    assert abs(cal["tokens_per_word"] - 1.37) < 0.05
    for L, v in cal["lengths"].items():
        assert abs(v["prompt_tokens"] - L) <= needle.tolerance(L), (L, v)
        assert v["prompt_tokens"] == measure(v["words"])
    assert cal["requests"] <= 2 + 4 * 3
    with pytest.raises(needle.NeedleError, match="shorter than the prompt") as e:
        needle.calibrate(measure, (100,))
    assert e.value.option == "--lengths"


def test_calibration_refuses_a_flat_count():
    with pytest.raises(needle.NeedleError, match="does not grow"):
        needle.calibrate(lambda words: 500, (1000,))


@pytest.mark.parametrize("url, expected", [("http://h:1", "http://h:1/v1"), ("http://h:1/", "http://h:1/v1"),
                                           ("https://h/api/v1/", "https://h/api/v1"), (" http://h:2/v1 ", "http://h:2/v1")])
def test_base_url(url, expected):
    assert needle.normalize_base_url(url) == expected


def test_the_stand_in_server_runs_on_its_own(tmp_path):
    """`python tests/needle_server.py` is the documented way to try `cupy-dsa needle` without a server."""
    import subprocess
    import sys
    import urllib.request
    from pathlib import Path

    script = Path(__file__).with_name("needle_server.py")
    proc = subprocess.Popen([sys.executable, str(script), "--port", "0", "--window", "200"], stdout=subprocess.PIPE,
                            text=True)
    try:
        line = proc.stdout.readline()
        url = line.split(" at ")[1].split(" ")[0]
        models = json.loads(urllib.request.urlopen(url + "/models", timeout=10).read())
        assert models["data"][0]["id"] == "fake-dsv4" and "last 200 tokens" in line
        res = _invoke(["needle", "--base-url", url, "--lengths", "256,512", "--depths", "0,1", "--trials", "1",
                       "--json", str(tmp_path / "n.json")])
        assert res.exit_code == 0, res.output
    finally:
        proc.terminate()
        proc.wait(10)


# --------------------------------------------------------------------------------------------------
# --residues: every prompt length mod 4, and the flag for a residue that loses what the others keep
# --------------------------------------------------------------------------------------------------

RESIDUE_ARGS = ("--lengths", "256,512", "--depths", "0.5,1", "--trials", "2", "--residues")


@pytest.mark.parametrize("pad_at", ["end", "needle"])
def test_residues_cover_every_length_mod_4(tmp_path, pad_at):
    """Each prompt runs at +0..+3 tokens, confirmed by the server's own count, so every residue has recall; a
    clean server keeps the same needles at every residue and nothing is flagged."""
    with FakeServer(window=5000) as srv:
        res, j, md, _ = _run_needle(srv.url, tmp_path, pad_at, *RESIDUE_ARGS, "--pad-at", pad_at)
    assert res.exit_code == 0, res.output
    doc = json.loads(j.read_text())
    assert doc["settings"]["residues"] is True and doc["settings"]["pad_at"] == pad_at
    assert len(doc["trials"]) == 2 * 2 * 2 * 4
    groups = {}
    for t in doc["trials"]:
        groups.setdefault((t["length"], t["depth"], t["trial"]), {})[t["offset"]] = t["prompt_tokens"]
        assert t["residue"] == t["prompt_tokens"] % 4
    for g in groups.values():   # the padded copies are exactly +1, +2, +3 of the server's count
        assert [g[o] - g[0] for o in range(4)] == [0, 1, 2, 3]
    assert [r["trials"] for r in doc["residues"]] == [8, 8, 8, 8]
    assert all(r["recall"] == 1.0 and r["lost_alone"] == 0 for r in doc["residues"])
    assert needle.flags(doc) == [] and needle.RESIDUE_FLAG_TEXT not in res.output
    assert "len mod 4 = 3" in res.output and "| len mod 4 = 0 |" in md.read_text()
    report = _invoke(["bench", "report", str(j), "--markdown", "-"])
    assert report.exit_code == 0 and needle.RESIDUE_FLAG_TEXT not in report.output, report.output


@pytest.mark.parametrize("pad_at", ["end", "needle"])
def test_residue_defect_is_flagged(tmp_path, pad_at):
    """The stand-in server answers the last digit wrong at length 3 mod 4: the run, its markdown and `bench
    report` (alone and overlaid) name that residue with the flag, and only that one."""
    with FakeServer(window=5000, residue_defect=3) as srv:
        res, j, md, _ = _run_needle(srv.url, tmp_path, f"bad-{pad_at}", *RESIDUE_ARGS, "--pad-at", pad_at,
                                    "--label", "defect")
    assert res.exit_code == 0, res.output
    doc = json.loads(j.read_text())
    by_residue = {r["residue"]: r for r in doc["residues"]}
    assert by_residue[3]["recall"] == 0.0 and by_residue[3]["lost_alone"] == 8
    assert all(by_residue[r]["recall"] == 1.0 for r in (0, 1, 2))
    flagged = [f["residue"] for f in needle.residue_flags(doc["residues"])]
    assert flagged == [3]
    flat = " ".join(res.output.split())
    assert "prompt length 3 mod 4 lost 8" in flat and needle.RESIDUE_FLAG_TEXT in flat, res.output
    assert needle.RESIDUE_FLAG_TEXT in md.read_text()
    report = _invoke(["bench", "report", str(j), "--markdown", "-"])
    assert report.exit_code == 0 and "| len mod 4 = 3 | 0.00 (0/4) | 0.00 (0/4) |" in report.output, report.output
    assert needle.RESIDUE_FLAG_TEXT in " ".join(report.output.split())
    with FakeServer(window=5000) as srv:
        _, clean, *_ = _run_needle(srv.url, tmp_path, f"clean-{pad_at}", *RESIDUE_ARGS, "--pad-at", pad_at,
                                   "--label", "clean")
    overlay = _invoke(["bench", "report", str(clean), str(j), "--markdown", "-"])
    text = " ".join(overlay.output.split())
    assert overlay.exit_code == 0 and f"defect: prompt length 3 mod 4" in text and "clean: prompt" not in text, text


def test_residue_flag_needs_a_residue_that_loses_alone():
    """Misses shared by every residue (a needle the model does not find) and one odd miss are not flagged."""
    def rows(missed_by):   # missed_by: per prompt, the residues that miss it
        out = []
        for p, missed in enumerate(missed_by):
            out += [{"length": 256, "depth": 0.5, "trial": p, "offset": r, "residue": r, "prompt_tokens": 256 + r,
                     "found": r not in missed} for r in range(4)]
        return out
    assert needle.residue_flags(rows([{0, 1, 2, 3}] * 5)) == []          # lost everywhere: not the residue
    assert needle.residue_flags(rows([{2}, set(), set()])) == []           # one odd miss: noise
    assert [f["residue"] for f in needle.residue_flags(rows([{2}, {2}, set()]))] == [2]
    assert needle.residue_flags(rows([{2}, {2}, {1}, {1}])) == []         # two residues alike: not one residue's


def test_padding_the_server_does_not_count_one_by_one_is_refused():
    with pytest.raises(needle.NeedleError, match="no padding the server counts") as e:
        needle.calibrate_pad(lambda unit, pad: 100 + 2 * pad, "end")
    assert e.value.option == "--pad-at"
    assert needle.calibrate_pad(lambda unit, pad: 100 + (pad if unit == " ok" else 0), "end") == " ok"


def test_residue_options_are_checked():
    res = _invoke(["needle", "--residues", "--pad-at", "middle"])
    assert res.exit_code == 2 and "--pad-at" in res.output and "'end'" in res.output, res.output


# --------------------------------------------------------------------------------------------------
# a server that dies mid-sweep: the finished trials are kept with the failure, and the run resumes
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("concurrency", ["1", "3"])
def test_a_server_dying_mid_sweep_keeps_the_finished_trials_and_resumes(tmp_path, concurrency):
    args = ("--lengths", "256,512", "--depths", "0,1", "--trials", "2", "--concurrency", concurrency)
    with FakeServer(window=300) as srv:
        full, jf, *_ = _run_needle(srv.url, tmp_path, "full", *args)
        assert full.exit_code == 0, full.output
        calibration = len(srv.requests) - 8
        srv.requests.clear()
        srv.die_after = calibration + 3
        res, j, *_ = _run_needle(srv.url, tmp_path, "partial", *args)
        flat = " ".join(res.output.split())
        assert res.exit_code == 1 and "HTTP 503" in flat and "--resume" in flat and str(j) in flat, res.output
        partial = json.loads(j.read_text())
        done = partial["incomplete"]["trials_done"]
        assert partial["incomplete"]["trials_total"] == 8 and 3 <= done < 8 and len(partial["trials"]) == done
        assert "503" in partial["incomplete"]["error"]
        report = _invoke(["bench", "report", str(j), "--markdown", "-"])
        assert report.exit_code == 0 and f"{done} of 8 trials finished" in " ".join(report.output.split())
        srv.die_after = None
        srv.requests.clear()
        res = _invoke(["needle", "--base-url", srv.url, "--resume", str(j), "--retries", "0"])
        assert res.exit_code == 0, res.output
        assert len(srv.requests) == 8 - done   # no calibration, no finished trial asked again
    resumed, first = json.loads(j.read_text()), json.loads(jf.read_text())
    assert "incomplete" not in resumed and resumed["cells"] == first["cells"]
    assert [t["answer"] for t in resumed["trials"]] == [t["answer"] for t in first["trials"]]


def test_a_server_dying_without_json_writes_a_partial_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["needle", "--lengths", "256", "--depths", "0,1", "--trials", "3", "--retries", "0"]
    with FakeServer(window=300) as srv:
        assert _invoke([*args, "--base-url", srv.url]).exit_code == 0
        srv.die_after = len(srv.requests) - 6 + 2   # calibration and two trials
        srv.requests.clear()
        res = _invoke([*args, "--base-url", srv.url])
    assert res.exit_code == 1 and "needle-partial.json" in res.output, res.output
    assert json.loads((tmp_path / "needle-partial.json").read_text())["incomplete"]["trials_done"] >= 1


def test_resume_refuses_other_settings_and_other_files(tmp_path):
    with FakeServer(window=300) as srv:
        assert _run_needle(srv.url, tmp_path, "p", "--lengths", "256", "--depths", "0,1", "--trials", "2")[0].exit_code == 0
        srv.die_after = len(srv.requests) - 4 + 1
        srv.requests.clear()
        res, j, *_ = _run_needle(srv.url, tmp_path, "p", "--lengths", "256", "--depths", "0,1", "--trials", "2")
        assert res.exit_code == 1, res.output
        res = _invoke(["needle", "--base-url", srv.url, "--resume", str(j), "--trials", "3"])
        assert res.exit_code == 2 and "--trials" in res.output and "resumed run" in res.output, res.output
        other = tmp_path / "other.json"
        other.write_text(json.dumps({"schema": "cupy-dsa-bench/2"}))
        res = _invoke(["needle", "--base-url", srv.url, "--resume", str(other)])
        assert res.exit_code == 2 and "--resume" in res.output and "Traceback" not in res.output, res.output
