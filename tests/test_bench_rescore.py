"""`bench rescore` (decode, verify, extend, prefill; stage 1 and stage 2 apart; DeepGEMM's logits as SGLang calls
them) and `bench serve`'s fp8-rescore layouts (issue 26), on CPU: the ops' torch references and the DeepGEMM
stand-in of test_bench_routes. No timed assertions."""
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from cupy_dsa.bench import peers, readme, serve, timing
from cupy_dsa.bench import rescore as rb
from cupy_dsa.bench.cli import main

from test_bench_routes import (FakeDeepGEMM, FakeSGLangTopK, _serve_doc, _serve_row, _torch_gather,
                               fake_sglang_topk, stand_in_gpu)

K = 1024
REPO = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
# stand-ins for a run's ceilings (GB/s, TFLOP/s by warps per SM): the CPU runs measure none
STAND_IN_CEILINGS = {"read_gbps": 2.0, "copy_gbps": 1.5, "mma_sync": {"bf16": {"4": 2.0, "8": 3.0, "16": 2.5},
                                                                        "e4m3": None}}


def _no_ceilings(dev, quick):
    raise RuntimeError("no GPU here")
GPU = torch.device("cuda")  # only its type is read: the GPU case lists, built without a GPU


# --------------------------------------------------------------------------------------------------
# bench rescore: cases, columns, routes
# --------------------------------------------------------------------------------------------------

def test_rescore_cases_are_the_issue_shapes():
    full = rb.cases(GPU, False)
    labels = [rb.case_label(c) for c in full]
    assert labels[:6] == ["decode 1 x 64K", "decode 8 x 64K", "decode 64 x 64K", "decode 8 x 256K",
                          "decode 64 x 256K", "decode 4 x 1M"]
    verify = [c for c in full if c.phase == "verify"]
    assert {c.next_n for c in verify} == {2, 3, 4} and all(len(set(c.prefixes)) == 1 for c in verify)
    ext, = [c for c in full if c.phase == "extend"]
    assert ext.batch == 8 and ext.chunk == 512 and min(ext.prefixes) == 32 * K and max(ext.prefixes) == 64 * K
    assert rb.case_label(ext) == "extend 8 x 512 after 32K-64K" and ext.rows == 4096
    pre = [(c.chunk, c.prefixes) for c in full if c.phase == "prefill"]
    assert pre == [(4096, (32 * K,)), (4096, (128 * K,)), (16384, (32 * K,)), (16384, (128 * K,))]
    assert all(c.index_topk == 512 and c.k_prime == 2048 for c in full)
    quick = rb.cases(GPU, True)
    assert [c.phase for c in quick] == list(rb.PHASES) and len(quick) == 4
    assert [c.phase for c in rb.cases(CPU, False)] == list(rb.PHASES)


def test_rescore_deepgemm_route_follows_sglang():
    by = {rb.case_label(c): rb.deepgemm_route(c) for c in rb.cases(GPU, False)}
    assert by["prefill chunk of 16,384 after 128K"] == by["prefill chunk of 16,384 after 32K"] == serve.FP8_NONPAGED
    assert by["prefill chunk of 4,096 after 32K"] == serve.FP8_PAGED
    assert by["extend 8 x 512 after 32K-64K"] == serve.FP8_PAGED  # several requests: paged rows
    assert all(r == serve.FP8_PAGED for label, r in by.items() if not label.startswith("prefill"))


def test_rescore_memory_per_entry():
    mem = {m["layout"]: m for m in rb.memory_rows()}
    assert [mem[k]["bytes_per_entry"] for k in ("bf16", "fp8", "fp8-rescore")] == [256, 132, 264]
    assert mem["fp8-rescore"]["vs_bf16"] == 264 / 256 and mem["fp8-rescore"]["verdict"] == "pass"
    assert mem["fp8-rescore"]["target_vs_bf16"] == 1.05 and mem["bf16"]["verdict"] is None


def test_rescore_rows_on_cpu_with_deepgemm_stand_in(monkeypatch):
    """Every column of every phase runs (the references), the DeepGEMM ones with the stand-in and SGLang's top-k
    with its stand-in; without them they say why."""
    fake_sglang_topk(monkeypatch)
    rows = rb.rows(CPU, False, 0, FakeDeepGEMM(), None, topks=peers.topks(CPU), ceilings=STAND_IN_CEILINGS)
    assert [r["phase"] for r in rows] == list(rb.PHASES)
    for r in rows:
        assert r["errors"] == {} and all(r["us"][c] > 0 for c in rb.COLUMNS), r
        assert r["floor"] == rb.with_floor({"us": r["us"]}, rb.case_of(r), STAND_IN_CEILINGS)["floor"]
        assert all(r["floor"]["share"][c] == r["floor"]["us"] / r["us"][c] for c in rb.FLOOR_COLUMNS)
        assert r["vs_fp8_deepgemm"][rb.FP8_DG] == 1.0 and r["us_per_row"][rb.RESCORE] == r["us"][rb.RESCORE] / r["rows"]
        assert all(r["key_bytes"][c] == 0 for c in rb.TOPK_COLUMNS.values())
    fake_sglang_topk(monkeypatch, live=False)
    none = rb.rows(CPU, False, 0, None, "deep_gemm not importable (x)", phases=("verify",), topks=peers.topks(CPU))
    assert len(none) == 1 and none[0]["phase"] == "verify"
    assert all(none[0]["us"][c] is None and "deep_gemm not importable" in none[0]["errors"][c]
               for c in rb.DEEPGEMM_COLUMNS)
    assert all(none[0]["us"][c] is None and "No module named 'sglang'" in none[0]["errors"][c]
               for c in rb.SGLANG_COLUMNS)
    assert all(none[0]["us"][c] > 0 for c in rb.COLUMNS if c not in rb.DEEPGEMM_COLUMNS + rb.SGLANG_COLUMNS)


@pytest.mark.parametrize("phase", rb.PHASES)
def test_rescore_routes_select_the_same_keys(phase, monkeypatch):
    """The whole op on our route (grouped verify, varlen extend), given stage 1, and on DeepGEMM's rows given its
    logits select the same keys; the stock columns' top-k (SGLang's v2, its plan built outside the timed calls) is
    that of the same logits, and every top-k alone selects what the reference does (CPU references)."""
    _torch_gather(monkeypatch)
    monkeypatch.setattr(serve, "NONPAGED_MIN_ROWS", 16)  # the CPU prefill chunk takes SGLang's non-paged route
    fake = fake_sglang_topk(monkeypatch)
    c, = [c for c in rb.cases(CPU, False) if c.phase == phase]
    x = rb._inputs(c, CPU, torch.Generator().manual_seed(1), 1)
    calls = rb._calls(c, x, FakeDeepGEMM(), peers.topks(CPU))
    # the stock binding's, its column's and the v2-candidate columns' (issue 48), all outside the timed calls
    assert fake.calls.count("plan") == 3 and "v2" not in fake.calls
    whole, given, on_rows = (calls[k][0]().raw_indices for k in (rb.RESCORE, rb.STAGE2, rb.RESCORE_DG))
    assert torch.equal(whole, given) and torch.equal(whole, on_rows)
    assert torch.equal(calls[rb.STAGE2_DG][0]().raw_indices, whole)
    assert rb.deepgemm_route(c) == (serve.FP8_NONPAGED if phase == "prefill" else serve.FP8_PAGED)
    ours, stock = calls[rb.FP8][0]().clone(), calls[rb.FP8_DG][0]().clone()
    assert fake.calls[-2:] == ["v2", "v2"] and ours.shape == stock.shape == (c.rows, c.index_topk)
    assert torch.equal(ours.sort(1).values, stock.sort(1).values)  # SGLang's order within a row is its own
    for col in (rb.TOPK_V2, rb.TOPK_V1, rb.TOPK_OURS):  # alone on the stock logits: the stock column's selection
        assert torch.equal(calls[col][0]().sort(1).values, stock.sort(1).values), col
    values = calls[rb.TOPK_TORCH][0]().values
    assert values.shape == (c.rows, c.index_topk)
    # SGLang's v2 picks the candidates (k = K', raw positions): the same selection as cupy_dsa's own
    n_v2 = fake.calls.count("v2")
    for col in rb.V2_CANDIDATE_COLUMNS:
        assert torch.equal(calls[col][0]().raw_indices, whole), col
    assert fake.calls.count("v2") == n_v2 + 2


def test_rescore_cli_options(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for args in (["--phase", "verify", "--phase", "prefill"], ["--quick"]):
        res = CliRunner().invoke(main, ["bench", "rescore", *args])
        assert res.exit_code == 2 and "needs a GPU" in res.output, res.output
    res = CliRunner().invoke(main, ["bench", "rescore", "--phase", "warmup"])
    assert res.exit_code == 2 and "--phase" in res.output
    res = CliRunner().invoke(main, ["bench", "rescore", "--help"])
    assert res.exit_code == 0 and "--phase" in res.output and "--json" in res.output


def test_rescore_cli_on_a_stand_in_gpu(monkeypatch, tmp_path):
    """`bench rescore`'s GPU branch end to end on the CPU stand-in: JSON (schema, memory, columns, rows), table,
    markdown, then `bench report` of it and of the README block."""
    stand_in_gpu(monkeypatch)
    fake_sglang_topk(monkeypatch)
    real = rb.rows
    monkeypatch.setattr(rb, "rows", lambda dev, quick, seed, dg, reason, progress, phases=None, topks=None,
                        ceilings=None: real(CPU, quick, seed, dg, reason, progress, phases, topks, ceilings))
    monkeypatch.setattr(timing, "measure_ceilings", lambda dev, quick: dict(STAND_IN_CEILINGS))
    j, md = tmp_path / "r.json", tmp_path / "r.md"
    res = CliRunner().invoke(main, ["bench", "rescore", "--phase", "decode", "--phase", "extend", "--json", str(j)])
    assert res.exit_code == 0, res.output
    assert "fp8-rescore (DeepGEMM stage 1)" in res.output and "stock top-k: SGLang v2" in res.output
    doc = json.loads(j.read_text())
    assert doc["schema"] == rb.SCHEMA and doc["deepgemm"] == "live" and doc["phases"] == ["decode", "extend"]
    assert [r["phase"] for r in doc["rows"]] == ["decode", "extend"] and set(doc["columns"]) == set(rb.COLUMNS)
    assert doc["topk"]["stock"] == peers.SGLANG_V2 and not doc["topk"]["stand_in"]
    assert set(doc["topk"]["status"].values()) == {"live"} and "SGLang v2" in doc["columns"][rb.FP8_DG] + \
        doc["columns"][rb.BF16]
    assert all(r["us"][c] > 0 for r in doc["rows"] for c in rb.COLUMNS)
    again = CliRunner().invoke(main, ["bench", "report", str(j), "--markdown", str(md)])
    assert again.exit_code == 0, again.output
    text = md.read_text()
    assert "| fp8-rescore / fp8 DeepGEMM |" in text and "fp8-rescore 264 B (1.03x bf16, target <= 1.05x: pass)" in text
    assert "Stock top-k: SGLang v2 (plan_topk_v2 + topk_transform_paged_v2" in text
    assert "| case | top-k SGLang v2 | top-k SGLang v1 | top-k cupy_dsa | top-k torch.topk | cupy_dsa / SGLang v2 |" \
        in text and "torch.topk(index_topk)" not in text.split("Columns:")[1].split("**top-k torch.topk**")[0]
    assert again.output.strip() == text.strip() == rb.markdown(doc).strip()
    # the floor of stage 2 + selection against the run's ceilings (stand-ins here), in the JSON, console and markdown
    assert doc["ceilings"] == STAND_IN_CEILINGS and doc["floor_target"] == rb.FLOOR_TARGET
    for r in doc["rows"]:
        fl = r["floor"]
        assert fl["us"] > 0 and fl["mma_warps_per_sm"] == 8 and fl["read_gbps"] == 2.0
        assert set(fl["verdict"].values()) <= {"pass", "miss"}
        assert fl["share"][rb.STAGE2] == fl["us"] / r["us"][rb.STAGE2]
    assert "floor of stage 2 + selection (read 2 GB/s, bf16 mma.sync 3 TFLOP/s at 8 warps/SM)" in res.output
    assert "read-only stream 2 GB/s, bf16 mma.sync 3 TFLOP/s at 8 warps per SM, both measured in this run" in text
    r0 = doc["rows"][0]
    assert (f"| {r0['case']} | {rb._fmt_count(r0['floor']['entry_rows'])} | " in text
            and f"{100 * r0['floor']['share'][rb.STAGE2]:.0f}%: {r0['floor']['verdict'][rb.STAGE2]}" in text)
    # without SGLang's kernels: cupy_dsa.paged_topk stands in, and the JSON, the legend and the table say so
    fake_sglang_topk(monkeypatch, live=False)
    monkeypatch.setattr(timing, "measure_ceilings", _no_ceilings)  # and no ceilings: the floor has no time
    res = CliRunner().invoke(main, ["bench", "rescore", "--phase", "decode", "--json", str(j)])
    assert res.exit_code == 0, res.output
    assert "ceilings not measured (RuntimeError: no GPU here): no floor in time" in res.output
    doc = json.loads(j.read_text())
    assert doc["ceilings"] is None and all(r["floor"]["us"] is None and r["floor"]["bytes"] > 0 and
                                           set(r["floor"]["verdict"].values()) == {None} for r in doc["rows"])
    assert "this run measured no ceilings (it predates them)" in rb.markdown(doc)
    assert doc["topk"]["stock"] == peers.CUPY_DSA_TOPK and doc["topk"]["stand_in"]
    assert "STANDS IN" in doc["topk"]["stand_in_note"] and "a54fd74" in doc["topk"]["stand_in_note"]
    assert "No module named 'sglang'" in doc["topk"]["status"][peers.SGLANG_V2]
    assert all(r["us"][c] is None for r in doc["rows"] for c in rb.SGLANG_COLUMNS)
    text = rb.markdown(doc)
    assert "Stock top-k: cupy_dsa.paged_topk, STANDING IN for SGLang's v2 top-k" in text
    assert "48 x 24,576: 28 us vs 7.6" in text and "| case | top-k cupy_dsa | top-k torch.topk |" in text
    assert "Not run: top-k SGLang v2: SGLang's v2 top-k not importable" in text
    assert "Not measured:" not in text  # SGLang's columns are named once, above
    readme_md = tmp_path / "README.md"
    readme_md.write_text("x\n<!-- results:rescore -->\nold\n<!-- /results:rescore -->\n")
    res = CliRunner().invoke(main, ["bench", "report", str(j), "--readme", str(readme_md)])
    assert res.exit_code == 0 and "rewrote results:rescore" in res.output, res.output
    assert "| decode 2 x 1K |" in readme_md.read_text() and "old" not in readme_md.read_text()


# --------------------------------------------------------------------------------------------------
# bench rescore: rendering old and new results
# --------------------------------------------------------------------------------------------------

def _new_doc(dg=True):
    us = {c: 10.0 * (i + 1) for i, c in enumerate(rb.COLUMNS)}
    if not dg:
        us.update({c: None for c in rb.DEEPGEMM_COLUMNS})
    row = {"phase": "verify", "case": "verify 64 x 32K, next_n 2", "rows": 128, "us": us, "timing": "cuda-graph",
           "deepgemm_route": serve.FP8_PAGED,
           "errors": {} if dg else {c: "not measured: deep_gemm not importable" for c in rb.DEEPGEMM_COLUMNS}}
    return {"schema": rb.SCHEMA, "device": "H200", "git_commit": "abcdef1234567", "index_topk": 512,
            "deepgemm": "live" if dg else "deep_gemm not importable", "memory": rb.memory_rows(), "rows": [row]}


def test_rescore_markdown_new_and_old_results():
    new = rb.markdown(_new_doc())
    # a run from a checkout with uncommitted changes keeps its mark (a cut at 12 characters dropped it)
    assert "commit `abcdef123456-dirty`" in rb.markdown(dict(_new_doc(), git_commit="abcdef1234567-dirty"))
    assert ("| case | bf16 | fp8 | fp8 DeepGEMM | fp8-rescore | fp8-rescore (DeepGEMM stage 1) | fp8-rescore (DeepGEMM "
            "stage 1, SGLang v2 candidates) | stage 1 |") in new
    # fp8-rescore 40 us over fp8 DeepGEMM 30 us; the DeepGEMM stage-1 variant 50 us, with v2 candidates 60 us; per
    # token 40 / 128
    assert "| verify 64 x 32K, next_n 2 | 10.0 us |" in new and "| 0.31 us | 1.33x | 1.67x | 2.00x |" in new
    no_dg = rb.markdown(_new_doc(dg=False))
    assert "fp8 DeepGEMM" not in no_dg and "DeepGEMM: deep_gemm not importable" in no_dg
    assert "| fp8-rescore / fp8 |" in no_dg and "| 2.00x |" in no_dg  # 40 us over fp8 20 us and "Not measured" not in no_dg
    old = {"device": "NVIDIA H200", "quick": False, "seed": 0, "rows": [
        {"B": 8, "tokens": 65536, "index_entries": 16384, "next_n": 1, "index_topk": 512, "k_prime": 2048,
         "us": {"bf16": 100.0, "fp8": 90.0, "fp8-rescore": 180.0, "rescore stages": 160.0}}]}
    assert rb.is_rescore(old) and rb.is_rescore(_new_doc()) and not rb.is_rescore({"schema": serve.SCHEMA})
    text = rb.markdown(old)
    assert "| decode 8 x 64K | 100.0 us | 90.0 us | 180.0 us | 160.0 us | 22.50 us | 2.00x |" in text
    assert "timing method not recorded" in text
    assert readme.not_gpu_figures(old) is None and readme.not_gpu_figures(dict(old, quick=True))


# --------------------------------------------------------------------------------------------------
# bench rescore: the floor of stage 2 + selection (issue 31)
# --------------------------------------------------------------------------------------------------

def test_rescore_floor_by_hand():
    """Two requests of 2048 and 50 entries, next_n 2, K' = 64: rows see 2047, 2048, 49 and 50 entries, so 64 + 64 +
    49 + 50 = 227 candidates; 227 x 264 B + 4194 logits x 4 B = 76,704 B; 227 x 64 x 128 x 2 = 3,719,168 flops
    (one combined f16 key per candidate; 7,438,336 with the two keys of the runs before issue 48)."""
    c = rb.Case("verify", (8192, 200), next_n=2, index_topk=16)
    assert c.k_prime == 64 and c.visible() == [2047, 2048, 49, 50] and c.entry_rows() == 2 * (2048 + 50)
    fl = rb.floor(c, {"read_gbps": 100.0, "mma_sync": {"bf16": {"4": 5.0, "8": 10.0, "16": 8.0}, "e4m3": None}})
    assert (fl["candidates"], fl["candidate_bytes"], fl["logit_bytes"]) == (227, 59928, 16776)
    assert fl["bytes"] == 76704 and fl["flops"] == 3719168
    assert rb.floor(c, None, rb.OLD_STAGE2_KEYS_PER_CANDIDATE)["flops"] == 7438336
    assert (fl["mma_tflops"], fl["mma_warps_per_sm"]) == (10.0, 8)           # the best residency measured
    assert fl["read_us"] == pytest.approx(0.76704) and fl["mma_us"] == pytest.approx(0.3719168)
    assert fl["us"] == fl["read_us"] and fl["binds"] == "read" and fl["target"] == 0.40
    share, verdict = rb.floor_shares(fl, {rb.STAGE2: 1.5, rb.STAGE2_DG: 2.0})
    assert share[rb.STAGE2] == pytest.approx(0.76704 / 1.5) and verdict[rb.STAGE2] == "pass"      # 51% >= 40%
    assert share[rb.STAGE2_DG] == pytest.approx(0.76704 / 2.0) and verdict[rb.STAGE2_DG] == "miss"  # 38% < 40%
    fast_read = rb.floor(c, {"read_gbps": 1000.0, "mma_sync": {"bf16": {"8": 10.0}}})
    assert fast_read["binds"] == "mma.sync" and fast_read["us"] == pytest.approx(0.3719168)
    for ceilings in (None, {"read_gbps": 100.0}, {"read_gbps": None, "mma_sync": {"bf16": {"8": 10.0}}},
                     {"read_gbps": 100.0, "mma_sync": None}):  # a ceiling missing: no floor in time, no verdict
        fl = rb.floor(c, ceilings)
        assert fl["us"] is None and fl["binds"] is None and fl["bytes"] == 76704
        none = {col: None for col in (rb.STAGE2, rb.STAGE2_DG, rb.STAGE2_V2C)}
        assert rb.floor_shares(fl, {rb.STAGE2: 1.5}) == (none, none)


def test_rescore_floor_targets_by_rows_x_entries():
    """>= 60% from 2^20 rows x index entries (each request's entries x its rows), >= 40% below; the GPU cases."""
    assert rb.Case("decode", (4 * 2**20,)).entry_rows() == 2**20 and rb.floor_target(2**20) == 0.60
    assert rb.floor_target(2**20 - 1) == 0.40
    by = {rb.case_label(c): rb.floor(c, None) for c in rb.cases(GPU, False)}
    assert by["verify 64 x 32K, next_n 2"]["entry_rows"] == 2 * 64 * 8 * K and by["verify 64 x 32K, next_n 2"][
        "target"] == 0.60
    assert [by[f"decode {b}"]["target"] for b in ("1 x 64K", "8 x 64K", "64 x 64K", "8 x 256K", "64 x 256K",
                                                   "4 x 1M")] == [0.40, 0.40, 0.60, 0.40, 0.60, 0.60]
    assert all(fl["target"] == 0.60 for label, fl in by.items() if label.startswith(("prefill", "extend")))
    d = by["decode 64 x 64K"]  # issue 31's figures: 34.6 MB of candidate rows
    assert d["candidate_bytes"] == 64 * 2048 * 264 and d["logit_bytes"] == 64 * 16 * K * 4
    assert d["flops"] == 64 * 2048 * 64 * 128 * 2


@pytest.mark.parametrize("phase", rb.PHASES)
def test_rescore_visible_entries_are_the_timed_rows(phase):
    """The floor counts the entries each row of the timed calls sees (their lens_rows), row by row."""
    c, = [c for c in rb.cases(CPU, False) if c.phase == phase]
    x = rb._inputs(c, CPU, torch.Generator().manual_seed(1), 1)
    assert x.lens_rows.tolist() == c.visible()


def test_rescore_floor_markdown_old_and_new_results():
    """A run without ceilings (the committed run with its ceilings and floors taken out) renders its floor's bytes
    and flops with "—" for the floor, the share and the verdict; the same rows with ceilings render them; the first
    runs' rows (no case) have no floor table."""
    doc = json.loads((REPO / "bench/results/h200-rescore.json").read_text())
    old = {k: v for k, v in doc.items() if k != "ceilings"}
    old["rows"] = [{k: v for k, v in r.items() if k != "floor"} for r in doc["rows"]]
    text = rb.markdown(old)
    assert "this run measured no ceilings (it predates them): no floor in time, no share, no verdict" in text
    dec = next(r for r in old["rows"] if r["case"] == "decode 8 x 64K")
    pre = next(r for r in old["rows"] if r["case"] == "prefill chunk of 4,096 after 32K")
    t, t_dg = rb._fmt_us(rb._us(dec, rb.STAGE2)), rb._fmt_us(rb._us(dec, rb.STAGE2_DG))
    # decode 8 x 64K: 8 rows x 2048 candidates x 264 B + 8 x 16K logits x 4 B = 4.85 MB; 0.5 GFLOP; 40%
    assert f"| decode 8 x 64K | 128K | 4.8 | 0.5 | — | — | >= 40% | {t} | — | {t_dg} | — |" in text
    assert (f"| prefill chunk of 4,096 after 32K | 36.00M | 2357.2 | 274.9 | — | — | >= 60% | "
            f"{rb._fmt_us(rb._us(pre, rb.STAGE2))} | — |") in text
    new = dict(old, ceilings={"read_gbps": 4000.0, "mma_sync": {"bf16": {"8": 600.0}}})
    new["rows"] = [rb.with_floor(dict(r), rb.case_of(r), new["ceilings"], rb.OLD_STAGE2_KEYS_PER_CANDIDATE)
                   for r in old["rows"]]
    text = rb.markdown(new)
    # 4.85 MB / 4 TB/s = 1.21 us (the flops: 0.54 GFLOP / 600 TFLOP/s = 0.89 us), and its share of each time
    share = lambda v: f"{1.2126 / v:.0%}"  # noqa: E731
    assert (f"| decode 8 x 64K | 128K | 4.8 | 0.5 | 1.2 us | read | >= 40% | {t} | "
            f"{share(rb._us(dec, rb.STAGE2))}: miss | {t_dg} | {share(rb._us(dec, rb.STAGE2_DG))}: miss |") in text
    assert "read-only stream 4000 GB/s, bf16 mma.sync 600 TFLOP/s at 8 warps per SM" in text
    # a run with ceilings whose rows predate the floor: computed from the rows' cases when rendered
    assert rb.markdown(dict(old, ceilings=new["ceilings"])) == text
    assert "Floor of stage 2 + selection" not in rb.markdown(_new_doc())


# --------------------------------------------------------------------------------------------------
# bench serve: the fp8-rescore layouts
# --------------------------------------------------------------------------------------------------

def test_serve_rescore_targets():
    assert serve.rescore_target(serve.Case("decode", 64, 8 * K, 1, 0)) == 1.15
    assert serve.rescore_target(serve.Case("verify", 64, 128 * K, 4, 0)) == 1.15
    for chunk, ctx, want in ((4096, 32 * K, 1.2), (16384, 128 * K, 1.2), (4096, 16 * K, None),
                             (8192, 32 * K, None), (16384, 256 * K, None)):
        assert serve.rescore_target(serve.Case("prefill", 1, ctx, 1, chunk)) == want, (chunk, ctx)
    assert serve.rescore_target({"phase": "prefill", "chunk": 4096, "context": 64 * K}) == 1.2


def test_serve_memory_rows_add_fp8_rescore(tmp_path):
    mem = {r["layout"]: r for r in serve.memory_rows(serve.BUILTIN["v4-flash"], 80.0)}
    r = mem["fp8-rescore"]
    assert r["bytes_per_entry"] == 264 and r["index_bytes_per_token"] == 21 * 264 / 4
    assert r["vs_bf16"] == 264 / 256 and r["verdict"] == "pass" and mem["bf16"]["vs_bf16"] == 1.0


def test_serve_rescore_forwards_select_what_the_reference_does(monkeypatch):
    """fp8-rescore's forward (store of hi + lo, rescore op per layer) and its DeepGEMM-stage-1 variant run on the
    references at tiny sizes on every step; fp8+topk is the fp8 step with a top-k per layer."""
    _torch_gather(monkeypatch)
    monkeypatch.setattr(serve, "NONPAGED_MIN_ROWS", 16)
    model = serve.ServeModel("tiny", 5, 2, 66, "test", None)
    for case in serve.cases(2, (256,), (1, 2, 4), (8, 32)):
        for layout in ("fp8+topk", "fp8-rescore", "fp8-rescore-dg"):
            fwd = serve._forward(case, layout, model, CPU, torch.Generator().manual_seed(0), FakeDeepGEMM())
            assert fwd.layer_caches == 2 and fwd.gathers is None
            fwd.run()
    caches, _ = serve._layer_caches(serve.Case("decode", 2, 64, 1, 0), "fp8-rescore", 3, CPU, torch.Generator())
    assert len(caches) == 3 and all(hi.shape == lo.shape and hi.dtype == lo.dtype == torch.uint8 for hi, lo in caches)
    # the store writes hi and lo of the forward's new entries in one launch
    case = serve.Case("decode", 2, 256, 1, 0)
    fwd = serve._forward(case, "fp8-rescore", model, CPU, torch.Generator().manual_seed(0), None)
    fwd.run()


def test_serve_measure_records_rescore_ratios_and_verdicts(monkeypatch):
    _torch_gather(monkeypatch)
    model = serve.ServeModel("tiny", 5, 2, 66, "test", None)
    row = serve.measure(serve.Case("verify", 2, 256, 2, 0), model, CPU, FakeDeepGEMM(), 0, reps=1)
    assert row["error"] is None and row["rescore_target_ratio"] == 1.15
    for v in ("rescore", "rescore_dg"):
        ms = row[f"fp8_{v}_ms"]
        assert row[f"{v}_vs_fp8_topk"] == ms / row["fp8_topk_ms"] and row[f"{v}_vs_fp8"] == ms / row["fp8_ms"]
        assert row[f"{v}_verdict"] == ("pass" if row[f"{v}_vs_fp8_topk"] <= 1.15 else "miss")
    only = serve.measure(serve.Case("decode", 2, 256, 1, 0), model, CPU, None, 0, reps=1, layouts=("fp8-rescore",))
    assert only["fp8_rescore_ms"] > 0 and only["bf16_ms"] is None and only["rescore_vs_fp8_topk"] is None
    assert only["rescore_verdict"] is None and only["fp8_rescore_dg_ms"] is None


def test_serve_layouts_option(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    res = CliRunner().invoke(main, ["bench", "serve", "--layouts", "fp8-rescore,fp8+topk", "--layouts", "fp8",
                                    "--json", "-"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout[res.stdout.index("{"):])
    assert doc["layouts"] == ["fp8", "fp8+topk", "fp8-rescore"] and serve.RESCORE_COUNTED in doc["notes"]
    assert "fp8-rescore" in {r["layout"] for r in doc["memory"]}
    default = json.loads((r := CliRunner().invoke(main, ["bench", "serve", "--json", "-"])).stdout[r.stdout.index("{"):])
    assert default["layouts"] == [name for name, _ in serve.TIMED]
    res = CliRunner().invoke(main, ["bench", "serve", "--layouts", "fp16"])
    assert res.exit_code == 2 and "--layouts" in res.output and "'fp16'" in res.output


def test_serve_markdown_rescore_table_only_for_runs_that_have_it():
    old_rows = [_serve_row("verify", 4, 0, fp8_route=serve.FP8_PAGED, target_ratio=1.2, verdict="miss")]
    old = serve.markdown(_serve_doc(old_rows))
    assert "fp8-rescore" not in old
    new_rows = [dict(old_rows[0], fp8_topk_ms=1.2, fp8_rescore_ms=1.32, rescore_vs_fp8_topk=1.1, rescore_vs_fp8=1.32,
                     fp8_rescore_dg_ms=1.5, rescore_dg_vs_fp8_topk=1.25, rescore_dg_vs_fp8=1.5,
                     rescore_target_ratio=1.15, rescore_verdict="pass", rescore_dg_verdict="miss"),
                _serve_row("prefill", 1, 4096, context=8 * K, fp8_route=serve.FP8_PAGED, fp8_topk_ms=1.1, fp8_rescore_ms=1.0,
                           rescore_vs_fp8_topk=0.91, rescore_vs_fp8=1.0, rescore_target_ratio=None)]
    doc = _serve_doc(new_rows)
    doc["memory"] = serve.memory_rows(serve.BUILTIN["v4-flash"], 80.0)
    new = serve.markdown(doc)
    assert new.startswith(old.split("\n\n")[0])  # the cost table's head as before
    assert ("| verify, next_n 4 | 64 x 32K | 1.00 ms | 1.20 ms | 1.32 ms | 1.10x | 1.32x | 1.50 ms | 1.25x | 1.50x | "
            "<= 1.15x: ours pass, DeepGEMM stage 1 **miss** |") in new
    assert "| prefill chunk of 4,096 | after 8K | 1.00 ms | 1.10 ms | 1.00 ms | 0.91x | 1.00x | — | — | — | — |" in new
    assert "fp8-rescore: 1386 B per token (264 B per entry, 1.03x bf16's; target <= 1.05x: pass)" in new
    assert "torch.topk(index_topk)" in new and "stage1=sglang" in new
    only_ours = serve.markdown(_serve_doc([dict(new_rows[1])]))
    assert "DeepGEMM stage 1" not in only_ours and "| fp8-rescore | / (fp8 + top-k) | / fp8 | target |" in only_ours
    assert "<!--" not in readme._serve_block(doc)


# --------------------------------------------------------------------------------------------------
# bench serve: the stock top-k (issue 31)
# --------------------------------------------------------------------------------------------------

def test_serve_issue31_targets():
    """Issue 31's bounds on fp8-rescore (DeepGEMM stage 1): batch 48 decode / verify at 96K (vs fp8 + top-k and
    bf16 + top-k) and 24K (vs bf16 + top-k), prefill chunks of 8,192 after 96K / 24K."""
    assert serve.targets_31(serve.Case("decode", 48, 96 * K, 1, 0)) == (("fp8+topk", 1.3), ("bf16+topk", 0.75))
    assert serve.targets_31(serve.Case("verify", 48, 96 * K, 3, 0)) == (("fp8+topk", 1.3), ("bf16+topk", 0.75))
    assert serve.targets_31(serve.Case("verify", 48, 24 * K, 3, 0)) == (("bf16+topk", 1.0),)
    assert serve.targets_31(serve.Case("prefill", 1, 96 * K, 1, 8192)) == (("bf16+topk", 0.9),)
    assert serve.targets_31({"phase": "prefill", "batch": 1, "context": 24 * K, "next_n": 1, "chunk": 8192}) == \
        (("bf16+topk", 1.0),)
    for case in (serve.Case("decode", 64, 96 * K, 1, 0), serve.Case("decode", 48, 32 * K, 1, 0),
                 serve.Case("prefill", 1, 96 * K, 1, 4096)):
        assert serve.targets_31(case) == (), case


def test_serve_measure_with_the_stock_topk(monkeypatch):
    """The +topk layouts run the stock top-k (SGLang's v2: its plan once per forward, a selection per C4 layer);
    fp8-rescore's ratios to fp8 + top-k and bf16 + top-k, issue 31's verdicts, and each top-k alone per forward."""
    _torch_gather(monkeypatch)
    fake = fake_sglang_topk(monkeypatch)
    model = serve.ServeModel("tiny", 5, 3, 66, "test", None)
    case = serve.Case("verify", 2, 256, 2, 0)
    monkeypatch.setattr(serve, "TARGETS_31_BATCH", 2)
    monkeypatch.setattr(serve, "TARGETS_31", {("decode", 256): (("fp8+topk", 1e9), ("bf16+topk", 1e-9))})
    row = serve.measure(case, model, CPU, FakeDeepGEMM(), 0, reps=1, topks=peers.topks(CPU))
    assert row["error"] is None and row["stock_topk"] == peers.SGLANG_V2 and row["topk_alone_on"] == "fp8+topk"
    for v in ("rescore", "rescore_dg"):
        ms = row[f"fp8_{v}_ms"]
        assert row[f"{v}_vs_fp8_topk"] == ms / row["fp8_topk_ms"] and row[f"{v}_vs_bf16_topk"] == ms / row["bf16_topk_ms"]
    assert [(t["basis"], t["verdict"]) for t in row["targets_31"]] == [("fp8+topk", "pass"), ("bf16+topk", "miss")]
    assert row["targets_31"][1]["ratio"] == row["fp8_rescore_dg_ms"] / row["bf16_topk_ms"]
    assert set(row["topk_alone_ms"]) == set(peers.TOPK_KEYS) and all(v > 0 for v in row["topk_alone_ms"].values())
    # per forward: one plan, then one selection per C4 layer (timed runs repeat that pattern)
    v2 = [c for c in fake.calls if c in ("plan", "v2")]
    assert v2[:1 + model.n_c4] == ["plan"] + ["v2"] * model.n_c4
    # without SGLang: cupy_dsa's top-k stands in, and the row says so
    fake_sglang_topk(monkeypatch, live=False)
    row = serve.measure(case, model, CPU, FakeDeepGEMM(), 0, reps=1, layouts=("bf16+topk",), topks=peers.topks(CPU))
    assert row["stock_topk"] == peers.CUPY_DSA_TOPK and row["bf16_topk_ms"] > 0 and row["topk_alone_on"] == "bf16+topk"
    assert set(row["topk_alone_ms"]) == {peers.CUPY_DSA_TOPK, peers.TORCH_TOPK}
    assert [t["verdict"] for t in row["targets_31"]] == [None, None]  # fp8-rescore-dg not timed


def test_serve_topk_forwards_select_what_the_reference_does(monkeypatch):
    """bf16+topk and fp8+topk select, per layer, the reference's top-k of that layer's logits with every row's
    own length and page-table row (decode rows, verify rows, a prefill chunk on either fp8 route)."""
    _torch_gather(monkeypatch)
    monkeypatch.setattr(serve, "NONPAGED_MIN_ROWS", 16)
    model = serve.ServeModel("tiny", 5, 2, 66, "test", None)
    picked = []
    op = peers.cupy_dsa_topk()
    spy = peers.TopKOp("spy", "spy", lambda lens, table, k: peers.BoundTopK(
        lambda: None, lambda logits: picked.append((logits, lens, table, op.bind(lens, table, k).select(logits)))))
    for case in serve.cases(2, (256,), (1, 3), (8, 32)):
        for layout in serve.WITH_TOPK:
            picked.clear()
            fwd = serve._forward(case, layout, model, CPU, torch.Generator().manual_seed(0), FakeDeepGEMM(), topk=spy)
            fwd.run()
            assert len(picked) == model.n_c4
            logits, lens, table, sel = picked[0]
            per_request = case.chunk if case.phase == "prefill" else case.next_n
            rows = case.batch * per_request
            assert logits.shape[0] == lens.shape[0] == table.shape[0] == rows and sel.shape == (rows, 66)
            # row j of a request sees its context's entries and one more per 4 new tokens, on the request's pages
            step = (torch.arange(per_request) + 1) // 4
            assert torch.equal(lens, (case.context // 4 + step).repeat(case.batch).to(torch.int32)), (case, layout)
            assert (table.view(case.batch, per_request, -1) == table.view(case.batch, per_request, -1)[:, :1]).all()
            assert lens.max() <= logits.shape[1] <= table.shape[1] * 64 and torch.equal(lens, fwd.topk_rows[0])


def _topk_doc(stand_in=False):
    row = dict(_serve_row("decode", 1, 0, context=96 * K, batch=48), fp8_topk_ms=1.2, bf16_topk_ms=2.0,
               fp8_rescore_ms=2.4, rescore_vs_fp8_topk=2.0, rescore_vs_bf16_topk=1.2, fp8_rescore_dg_ms=1.5,
               rescore_dg_vs_fp8_topk=1.25, rescore_dg_vs_bf16_topk=0.75, rescore_dg_vs_fp8=1.5,
               targets_31=[{"basis": "fp8+topk", "target": 1.3, "ratio": 1.25, "verdict": "pass"},
                           {"basis": "bf16+topk", "target": 0.75, "ratio": 0.75, "verdict": "pass"}],
               topk_alone_ms={"sglang-v2": 0.08, "sglang-v1": 0.2, "cupy_dsa": 0.3, "torch": 1.6},
               topk_alone_on="fp8+topk")
    pre = dict(_serve_row("prefill", 1, 8192, context=24 * K), fp8_topk_ms=30.0, bf16_topk_ms=50.0,
               fp8_rescore_ms=90.0, rescore_vs_fp8_topk=3.0, rescore_vs_bf16_topk=1.8, fp8_rescore_dg_ms=60.0,
               rescore_dg_vs_fp8_topk=2.0, rescore_dg_vs_bf16_topk=1.2,
               targets_31=[{"basis": "bf16+topk", "target": 1.0, "ratio": 1.2, "verdict": "miss"}], topk_alone_ms={})
    doc = _serve_doc([row, pre])
    status = {"sglang-v2": "live", "sglang-v1": "live", "cupy_dsa": "live", "torch": "live"}
    doc["topk"] = {"stock": "sglang-v2", "stock_label": peers.TOPK_LABELS["sglang-v2"], "stand_in": False,
                   "status": status}
    if stand_in:
        why = "SGLang's v2 top-k not importable (x)"
        doc["topk"] = {"stock": "cupy_dsa", "stock_label": "cupy_dsa.paged_topk", "stand_in": True,
                       "status": dict(status, **{"sglang-v2": why, "sglang-v1": why}),
                       "stand_in_note": peers.stand_in_note(why)}
        del row["topk_alone_ms"]["sglang-v2"], row["topk_alone_ms"]["sglang-v1"]
    return doc


def test_serve_markdown_with_the_stock_topk():
    """A run that records its stock top-k: its table (fp8 + top-k, bf16 + top-k, both fp8-rescores' ratios, issue
    31's verdicts) and each top-k alone; a stand-in is named as one, with why and its speed against v2."""
    md = serve.markdown(_topk_doc())
    assert ("| decode | 48 x 96K | 1.00 ms | 1.20 ms | 2.00 ms | 2.40 ms | 2.00x | 1.20x | 1.50 ms | 1.25x | 0.75x | "
            "<= 1.30x fp8 + top-k: pass; <= 0.75x bf16 + top-k: pass |") in md
    assert "| prefill chunk of 8,192 | after 24K |" in md and "<= 1.00x bf16 + top-k: **miss** |" in md
    assert "**top-k** = the stock top-k, SGLang v2 (plan_topk_v2 + topk_transform_paged_v2" in md
    assert "| step | batch x context (tokens) | SGLang v2 | SGLang v1 | cupy_dsa | torch.topk |" in md
    assert "| decode | 48 x 96K | 0.080 ms | 0.200 ms | 0.300 ms | 1.600 ms |" in md and "Top-k not run" not in md
    assert "(21 C4 layers over one layer's logits, the fp8 step's; its plan once)" in md
    assert "issue 26" not in md and "torch.topk(index_topk)" not in md
    assert readme._serve_rescore_block(_topk_doc()).startswith("fp8-rescore, gpu, commit `abc`")
    stand_in = serve.markdown(_topk_doc(stand_in=True))
    assert "a STAND-IN for SGLang's v2 top-k: cupy_dsa.paged_topk STANDS IN" in stand_in
    assert "| step | batch x context (tokens) | cupy_dsa | torch.topk |" in stand_in
    assert "Top-k not run: SGLang v2: SGLang's v2 top-k not importable (x); SGLang v1:" in stand_in
