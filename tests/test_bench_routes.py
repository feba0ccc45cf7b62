"""The bench's SGLang routes (issue 23): `bench logits` verify at next_n 2-4 with its targets, the fresh-prompt
prefill rows with the ranges SGLang passes, and `bench serve`'s fp8 step on SGLang 0.5.23's route (the non-paged
gather + fp8_mqa_logits for a long single-request chunk, paged rows otherwise). On CPU: the ops' torch references
and a stand-in for DeepGEMM that computes its calls simply and records them."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import cupy_dsa
from cupy_dsa.bench import peers, readme, serve, sweeps, verify_extend
from cupy_dsa.bench.cli import main
from cupy_dsa.layouts import fp8_views

REPO = Path(__file__).resolve().parents[1]
K = 1024
CPU = torch.device("cpu")


class FakeDeepGEMM:
    """The DeepGEMM calls the bench makes, on CPU: the paged logits by cupy_dsa's reference, fp8_mqa_logits by a
    plain formula (keys times their scale, relu, weights, summed over heads); every call recorded."""

    def __init__(self):
        self.calls = []

    def get_num_sms(self):
        return 4

    def get_paged_mqa_logits_metadata(self, lens, block, n_sms):
        self.calls.append(("schedule", lens.shape))
        return torch.zeros(n_sms + 1, 2, dtype=torch.int32)

    def fp8_paged_mqa_logits(self, q, pages, weights, lens, block_table, meta, width, clean_logits):
        out = cupy_dsa.paged_mqa_logits_reference(q, pages, weights, lens, block_table, width)
        self.calls.append(("paged", out))
        return out

    def fp8_mqa_logits(self, q, kv, weights, ks, ke, clean_logits=True, max_seqlen_k=0):
        k = kv[0].float() * kv[1][:, None]
        full = (torch.einsum("thd,sd->ths", q.float(), k).relu() * weights[:, :, None]).sum(1)
        col = torch.arange(full.shape[1])[None, :]
        full = full.masked_fill((col < ks[:, None]) | (col >= ke[:, None]), -math.inf)
        out = torch.full((q.shape[0], max_seqlen_k), -math.inf) if max_seqlen_k else full
        if max_seqlen_k:  # compressed: column c of row t holds key ks[t] + c
            for t in range(q.shape[0]):
                n = min(max_seqlen_k, full.shape[1] - int(ks[t]))
                out[t, :n] = full[t, int(ks[t]):int(ks[t]) + n]
        self.calls.append(("nonpaged", dict(kv=kv, ks=ks.clone(), ke=ke.clone(), clean_logits=clean_logits,
                                            max_seqlen_k=max_seqlen_k, out=out)))
        return out


class FakeSGLangTopK:
    """SGLang 0.5.23's DeepSeek-V4 top-k entry points (sglang.kernels.ops.attention.dsv4.topk) on CPU, with its
    signatures: the selection by cupy_dsa's reference, each row's selected slots reversed (SGLang's order is
    unspecified), -1 past them; every call recorded."""

    def __init__(self, wrong=False):
        self.calls = []
        self.wrong = wrong  # select the k smallest instead: a kernel the loader's check must refuse

    def _select(self, scores, seq_lens, page_tables, out, page_size, out_raw=None):
        """``page_tables`` None (v2's raw mode): raw positions into ``out``; ``out_raw``: them too."""
        raw_only = page_tables is None
        if raw_only:  # positions are the page indices of an identity table
            page_tables = torch.arange(-(-scores.shape[1] // 64), dtype=torch.int32).expand(scores.shape[0], -1)
        assert page_size == 64 and scores.dtype == torch.float32 and seq_lens.dtype == page_tables.dtype == torch.int32
        assert scores.shape[0] == seq_lens.shape[0] == page_tables.shape[0] == out.shape[0]
        res = cupy_dsa.paged_topk_reference(-scores if self.wrong else scores, seq_lens, page_tables, out.shape[1],
                                            raw_indices=True)
        for sel in (res.page_indices, res.raw_indices):
            for r in range(sel.shape[0]):
                n = int((sel[r] >= 0).sum())
                sel[r, :n] = sel[r, :n].flip(0)
        out.copy_(res.raw_indices if raw_only else res.page_indices)
        if out_raw is not None:
            out_raw.copy_(res.raw_indices)

    def topk_transform_paged(self, scores, seq_lens, page_tables, out_page_indices, page_size, out_raw_indices=None):
        self.calls.append("v1")
        self._select(scores, seq_lens, page_tables, out_page_indices, page_size, out_raw_indices)

    def plan_topk_v2(self, seq_lens, static_threshold=-1, *, out=None):
        self.calls.append("plan")
        assert out.shape == (seq_lens.shape[0] + 1, 2) and out.dtype == torch.int32
        return out

    def topk_transform_paged_v2(self, scores, seq_lens, page_tables, out_page_indices, page_size, metadata,
                                out_raw_indices=None):
        self.calls.append("v2")
        assert metadata.shape == (seq_lens.shape[0] + 1, 2)
        self._select(scores, seq_lens, page_tables, out_page_indices, page_size, out_raw_indices)


def fake_sglang_topk(monkeypatch, live=True):
    """SGLang's v2 and v1 top-k as :func:`peers.sglang_topk` returns them, on :class:`FakeSGLangTopK`
    (``live=False``: both report why they do not run, as on a GPU without SGLang). Returns the fake."""
    fake = FakeSGLangTopK()

    def loader(version, device=None):
        key = {"v1": peers.SGLANG_V1, "v2": peers.SGLANG_V2}[version]
        if not live:
            return None, f"SGLang's {version} top-k not importable (ModuleNotFoundError: No module named 'sglang')"
        return peers.TopKOp(key, peers.TOPK_LABELS[key], peers._sglang_bind(fake, key), fake), None

    monkeypatch.setattr(peers, "sglang_topk", loader)
    return fake


def _torch_gather(monkeypatch):
    """SGLang's gather is a Triton kernel (a GPU, or Triton's interpreter: test below); the forwards here use the
    torch one."""
    monkeypatch.setattr(peers, "fp8_gather", lambda: ((lambda row, n: lambda c: peers.torch_fp8_gather(c, row, n)),
                                                      "torch gather (test)"))


def stand_in_gpu(monkeypatch):
    """A command's GPU branch on this CPU: torch says a CUDA device is there, DeepGEMM is the stand-in above, the
    gather is torch's (the command's measurement is pointed at the CPU by the caller)."""
    from cupy_dsa.bench import cli_common, provenance

    _torch_gather(monkeypatch)
    for name, value in (("is_available", lambda: True), ("current_device", lambda: 0), ("device_count", lambda: 1),
                        ("set_device", lambda dev: None)):
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(cli_common, "device_name", lambda dev: "stand-in GPU")
    monkeypatch.setattr(provenance, "driver_version", lambda: None)
    monkeypatch.setattr(peers, "deepgemm", lambda: (FakeDeepGEMM(), None))


# --------------------------------------------------------------------------------------------------
# bench logits: verify
# --------------------------------------------------------------------------------------------------

def test_verify_batches_are_the_issue_shapes_at_next_n_2_3_4():
    gpu = torch.device("cuda")  # only its type is read: the GPU batches, built without a GPU
    full = verify_extend.verify_batches(gpu, False, 0)
    names = list(dict.fromkeys(b.name for b in full))
    assert names == ["64 x 32K", "128 x 8K", "48 long-tail", "16 x 128K", "256 x 2K"]
    assert [(b.name, b.next_n) for b in full] == [(n, k) for n in names for k in (2, 3, 4)]
    entries = {b.name: b.entries for b in full}
    assert entries["64 x 32K"] == entries["16 x 128K"] == 2 * 2**20 and entries["128 x 8K"] == 2**20
    assert entries["256 x 2K"] == 2**19 and len(next(b for b in full if b.name == "48 long-tail").lens) == 48
    quick = verify_extend.verify_batches(gpu, True, 0)
    assert {("64 x 32K", n) for n in (2, 3, 4)} <= {(b.name, b.next_n) for b in quick}
    assert {b.next_n for b in verify_extend.verify_batches(CPU, False, 0)} == {2, 3, 4}


@pytest.mark.parametrize("n, shares, vs_dg, verdict", [
    (2, {"pct_read": 0.86, "pct_roofline": 0.5}, 1.39, "pass"),
    (2, {"pct_read": 0.84, "pct_roofline": 0.9}, 1.0, "miss"),      # n 2 is held to the read stream
    (2, {"pct_read": 0.9, "pct_roofline": 0.9}, 1.41, "miss"),
    (3, {"pct_read": 0.2, "pct_roofline": 0.81}, 0.89, "pass"),
    (3, {"pct_read": 0.9, "pct_roofline": 0.79}, 0.5, "miss"),      # n 3 is held to the roofline
    (3, {"pct_read": 0.9, "pct_roofline": 0.9}, 0.91, "miss"),
    (4, {"pct_read": 0.2, "pct_roofline": 0.8}, 1.1, "pass"),
    (4, {"pct_read": 0.2, "pct_roofline": 0.8}, 1.11, "miss"),
    (4, {"pct_read": 0.2, "pct_roofline": 0.8}, None, "pass"),      # DeepGEMM absent: the share alone
])
def test_verify_targets(n, shares, vs_dg, verdict):
    row = {"route": "grouped", "entries": 2**20, "next_n": n, "vs_deepgemm_rows": vs_dg, **shares}
    out = verify_extend._verify_targets(dict(row), on_gpu=True)
    assert out["verdict"] == verdict, out
    assert out["target_vs_deepgemm_rows"] == {2: 1.4, 3: 0.9, 4: 1.1}[n]
    assert (out["target_pct_read"], out["target_pct_roofline"]) == ((0.85, None) if n == 2 else (None, 0.80))
    for other in (dict(row, route="rows"), dict(row, entries=2**20 - 1)):
        assert verify_extend._verify_targets(other, on_gpu=True)["verdict"] is None
    assert verify_extend._verify_targets(dict(row), on_gpu=False)["verdict"] is None


# --------------------------------------------------------------------------------------------------
# bench logits: a fresh prompt
# --------------------------------------------------------------------------------------------------

def test_sgl_topk_ranges_empty_the_rows_topk_fills():
    ks = torch.tensor([0, 0, 0, 5, 5], dtype=torch.int32)
    ke = torch.tensor([3, 4, 5, 9, 10], dtype=torch.int32)
    ks2, ke2 = sweeps._sgl_topk_ranges(ks, ke, 4)
    assert ks2.tolist() == ks.tolist() and ke2.tolist() == [0, 0, 5, 5, 10]  # more than 4 keys keep their range


def test_fresh_prompt_rows_on_cpu():
    """T rows over T keys, row i sees [0, i + 1), rows with <= index_topk keys empty (the CPU size shrinks
    index_topk with the prompt); no target off a GPU; the GPU sizes are 8K and 16K rows at V4-Flash's 512."""
    rows = [r for r in sweeps.prefill_rows(CPU, False, 0, {}) if r.get("prompt") == "fresh"]
    (T, topk), = sweeps.sizes(CPU, False).fresh
    assert [(r["rows"], r["keys"], r["kv"]) for r in rows] == [(T, T, "contiguous"), (T, T, "paged")]
    for r in rows:
        assert r["error"] is None and r["index_topk"] == topk and r["empty_rows"] == topk
        assert r["visible_pairs"] == sum(i + 1 for i in range(T) if i + 1 > topk)
        assert "empty range" in r["note"] and r["verdict"] is None and r["target_pct_matmul"] is None
        assert r["deepgemm_us"] is None and r["deepgemm_note"] == "no GPU"
    gpu = sweeps.sizes(torch.device("cuda"), False).fresh
    assert gpu == [(8192, 512), (16384, 512)] and sweeps.FRESH_PROMPT_TOPK == serve.BUILTIN["v4-flash"].index_topk


@pytest.mark.parametrize("fields, verdict", [
    ({"pct_matmul": 0.71, "vs_deepgemm": 1.5}, "pass"),
    ({"pct_matmul": 0.69, "vs_deepgemm": 1.5}, "miss"),
    ({"pct_matmul": 0.71, "vs_deepgemm": 1.61}, "miss"),
    ({"pct_matmul": 0.71, "vs_deepgemm": 1.5, "vs_contiguous": 1.06, "target_vs_contiguous": 1.05}, "miss"),
    ({"pct_matmul": 0.71, "vs_deepgemm": None}, "pass"),
])
def test_fresh_prompt_verdict(fields, verdict):
    row = {"target_pct_matmul": 0.70, "target_vs_deepgemm": 1.6, **fields}
    assert sweeps._fresh_prompt_verdict(row) == verdict


def test_deepgemm_prefill_passes_sglangs_arguments():
    dg = FakeDeepGEMM()
    q = torch.randn(8, 64, 128).to(torch.float8_e4m3fn)
    keys = (0.3 * torch.randn(70, 128)).to(torch.bfloat16)
    w = torch.rand(8, 64)
    ks = torch.zeros(8, dtype=torch.int32)
    ke = torch.arange(63, 71, dtype=torch.int32)
    peers.deepgemm_prefill(dg, q, keys, w, ks, ke)()
    peers.deepgemm_prefill(dg, q, keys, w, ks, ke, clean_logits=False, max_seqlen_k=128)()
    (_, first), (_, second) = dg.calls
    assert first["clean_logits"] is True and first["max_seqlen_k"] == 0 and first["out"].shape == (8, 70)
    assert second["clean_logits"] is False and second["max_seqlen_k"] == 128 and second["out"].shape == (8, 128)
    k, s = first["kv"]  # bf16 keys quantized per token: e4m3 values and an fp32 scale
    assert k.dtype == torch.float8_e4m3fn and s.shape == (70,)
    assert torch.allclose(k.float() * s[:, None], keys.float(), rtol=0.07, atol=1e-3)
    pair = (k, s)  # an already gathered fp8 pair goes through as it is
    peers.deepgemm_prefill(dg, q, pair, w, ks, ke)()
    assert dg.calls[-1][1]["kv"][0] is k


# --------------------------------------------------------------------------------------------------
# the fp8 gather of SGLang's non-paged route
# --------------------------------------------------------------------------------------------------

def test_torch_fp8_gather_reads_the_requests_keys_in_order():
    g = torch.Generator().manual_seed(1)
    cache = sweeps._random_cache(9, "fp8", CPU, g)
    row = torch.randperm(9, generator=g).to(torch.int32)[:7]
    k, s = peers.torch_fp8_gather(cache, row, 400)
    values, scales = fp8_views(cache)
    assert k.dtype == torch.float8_e4m3fn and k.shape == (400, 128) and s.shape == (400,)
    assert torch.equal(k.view(torch.uint8), values[row.long()].reshape(-1, 128)[:400])
    assert torch.equal(s, scales[row.long()].reshape(-1)[:400])


def test_sglangs_gather_matches_the_torch_gather():
    """SGLang's own gather (a Triton kernel) in Triton's CPU interpreter: the arguments the bench passes make it
    return what the torch gather returns."""
    pytest.importorskip("triton")
    code = ("import torch\n"
            "from cupy_dsa.bench import peers, sweeps\n"
            "bind, what = peers.fp8_gather()\n"
            "assert what.startswith(\"SGLang's GetKAndS\"), what\n"
            "g = torch.Generator().manual_seed(2)\n"
            "cache = sweeps._random_cache(9, 'fp8', torch.device('cpu'), g)\n"
            "row = torch.randperm(9, generator=g).to(torch.int32)[:7]\n"
            "for n in (1, 64, 65, 400, 448):\n"
            "    k, s = bind(row, n)(cache)\n"
            "    k2, s2 = peers.torch_fp8_gather(cache, row, n)\n"
            "    assert torch.equal(k.view(torch.uint8), k2.view(torch.uint8)) and torch.equal(s, s2), n\n"
            "print('ok')\n")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(
        [str(REPO), str(REPO / "scripts"), os.environ.get("PYTHONPATH", "")]))
    probe = subprocess.run([sys.executable, "-c", "import sglang.kernels.ops.kvcache.dsa_index_k_cache"],
                           capture_output=True, text=True, env=env, timeout=300)
    if probe.returncode:
        pytest.skip(f"SGLang's gather does not import here: {probe.stderr.strip().splitlines()[-1:]}")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_fp8_gather_says_what_gathers(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_sglang(name, *a, **k):
        if name.startswith("sglang"):
            raise ModuleNotFoundError("No module named 'sglang'")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_sglang)
    bind, what = peers.fp8_gather()
    assert what.startswith("torch gather (SGLang's GetKAndS not importable: ModuleNotFoundError"), what
    cache = sweeps._random_cache(2, "fp8", CPU, torch.Generator().manual_seed(0))
    k, s = bind(torch.tensor([1, 0], dtype=torch.int32), 70)(cache)
    assert k.shape == (70, 128) and s.shape == (70,)


# --------------------------------------------------------------------------------------------------
# bench serve: the fp8 step on SGLang's route
# --------------------------------------------------------------------------------------------------

def test_fp8_route_follows_sglangs_condition():
    steps = serve.cases(64, (8 * K, 128 * K), (1, 2, 4), (4096, 8191, 8192, 16384))
    routes = {(c.phase, c.next_n, c.chunk): serve.fp8_route(c) for c in steps}
    assert routes[("prefill", 1, 16384)] == routes[("prefill", 1, 8192)] == serve.FP8_NONPAGED
    assert routes[("prefill", 1, 8191)] == routes[("prefill", 1, 4096)] == serve.FP8_PAGED
    assert all(r == serve.FP8_PAGED for (phase, _, _), r in routes.items() if phase != "prefill")
    assert serve.fp8_route(serve.Case("prefill", 2, 8 * K, 1, 16384)) == serve.FP8_PAGED  # batch 1 only
    assert serve.NONPAGED_MIN_ROWS == 8192


def _fp8_forward(monkeypatch, min_rows):
    """The fp8 forward of one small prefill chunk with the non-paged threshold at ``min_rows``: DeepGEMM's calls
    and their outputs."""
    _torch_gather(monkeypatch)
    monkeypatch.setattr(serve, "NONPAGED_MIN_ROWS", min_rows)
    model = serve.ServeModel("tiny", 5, 2, 66, "test", None)   # index_topk 66: rows seeing <= 66 entries empty
    case = serve.Case("prefill", 1, 256, 1, 32)                 # 64 entries of prefix, rows see 64 + (j + 1) // 4
    dg = FakeDeepGEMM()
    fwd = serve._forward(case, "fp8", model, CPU, torch.Generator().manual_seed(3), dg)
    dg.calls.clear()  # what one forward calls, without the set-up
    fwd.run()
    return case, fwd, dg


def test_serve_fp8_prefill_non_paged_equals_paged_rows(monkeypatch):
    """A chunk on the non-paged route (threshold lowered to the test's size): the schedule once, then per C4
    layer the gather and fp8_mqa_logits with SGLang's arguments; its logits equal the paged rows' on the same
    inputs wherever a row's range is not emptied."""
    case, fwd, dg = _fp8_forward(monkeypatch, 16)
    assert serve.fp8_route(case) == serve.FP8_NONPAGED and fwd.gather_op == "torch gather (test)"
    assert [c[0] for c in dg.calls] == ["schedule", "nonpaged", "nonpaged"] and fwd.gathers is not None
    call = dg.calls[1][1]
    lens = 64 + (torch.arange(32) + 1) // 4
    n_keys = (256 + 32) // 4
    assert call["clean_logits"] is False and call["max_seqlen_k"] == math.ceil(n_keys / 64) * 64
    assert call["kv"][0].shape == (n_keys, 128) and call["ks"].tolist() == [0] * 32
    assert call["ke"].tolist() == [int(x) if x > 66 else 0 for x in lens]
    nonpaged = [c[1]["out"] for c in dg.calls[1:]]
    _, fwd_p, dg_p = _fp8_forward(monkeypatch, 10**9)
    assert [c[0] for c in dg_p.calls] == ["schedule", "paged", "paged"] and fwd_p.gathers is None
    for out_np, (_, out_p) in zip(nonpaged, dg_p.calls[1:]):
        for t in range(32):
            if lens[t] > 66:
                torch.testing.assert_close(out_np[t, :lens[t]], out_p[t, :lens[t]], rtol=1e-4, atol=1e-6)
            else:
                assert torch.isinf(out_np[t]).all()  # an empty range: nothing read


def test_serve_measure_on_cpu_records_route_gather_and_target(monkeypatch):
    _torch_gather(monkeypatch)
    monkeypatch.setattr(serve, "NONPAGED_MIN_ROWS", 16)
    model = serve.ServeModel("tiny", 5, 2, 66, "test", None)
    pre = serve.measure(serve.Case("prefill", 1, 256, 1, 32), model, CPU, FakeDeepGEMM(), 0, reps=1)
    assert pre["error"] is None and pre["fp8_route"] == serve.FP8_NONPAGED and pre["fp8_ms"] > 0
    assert pre["fp8_gather"] == "torch gather (test)" and pre["fp8_gather_ms"] > 0 and pre["verdict"] is None
    verify = serve.Case("verify", 2, 256, 2, 0)
    for target, verdict in ((1e9, "pass"), (1e-9, "miss")):
        monkeypatch.setattr(serve, "TARGETS", {(2, 2, 256): target})
        row = serve.measure(verify, model, CPU, FakeDeepGEMM(), 0, reps=1)
        assert row["error"] is None and row["fp8_route"] == serve.FP8_PAGED and row["fp8_gather"] is None
        assert row["target_ratio"] == target and row["verdict"] == verdict
    monkeypatch.undo()  # the H200 targets: batch 64, verify n 4 at 32K and 128K tokens, n 2 at 16K
    assert serve.TARGETS == {(64, 4, 32 * K): 1.2, (64, 4, 128 * K): 1.2, (64, 2, 16 * K): 1.5}


def _serve_row(phase, next_n, chunk, context=32 * K, **extra):
    row = {"phase": phase, "batch": 1 if phase == "prefill" else 64, "context": context, "next_n": next_n,
           "chunk": chunk, "bf16_ms": 2.0, "fp8_ms": 1.0, "added_ms": 1.0, "ratio": 2.0}
    row.update(extra)
    return row


def _serve_doc(rows):
    return {"model": {"name": "m", "index_layers": 21}, "device": "gpu", "git_commit": "abc", "timings": rows,
            "memory": [], "measured": True}


def test_serve_markdown_shows_routes_and_targets_of_runs_that_have_them():
    old = serve.markdown(_serve_doc([_serve_row("decode", 1, 0)]))
    assert "fp8 route" not in old and "target" not in old and "DeepGEMM as SGLang calls it." in old
    rows = [_serve_row("verify", 4, 0, fp8_route=serve.FP8_PAGED, target_ratio=1.2, verdict="miss"),
            _serve_row("prefill", 1, 16384, fp8_route=serve.FP8_NONPAGED, fp8_gather="torch gather (x)",
                       fp8_gather_ms=0.25, target_ratio=None)]
    new = serve.markdown(_serve_doc(rows))
    assert "| fp8 route | target |\n|---|---|---|---|---|---|---|---|\n" in new
    assert "| verify, next_n 4 | 64 x 32K | 2.00 ms | 1.00 ms | 1.00 ms | 2.00x | paged rows | <= 1.20x: **miss** |" in new
    assert ("| prefill chunk of 16,384 | after 32K | 2.00 ms | 1.00 ms | 1.00 ms | 2.00x | non-paged gather + "
            "fp8_mqa_logits (its gathers: 0.25 ms) | — |") in new
    assert "route SGLang 0.5.23 takes for the step" in new and "key gather: torch gather (x)." in new


def test_readme_serve_block_names_the_steps_a_run_lacks():
    committed = json.loads((REPO / "bench" / "results" / "h200-serve.json").read_text())
    block = readme._serve_block(committed)
    assert "Not measured yet" not in block, block   # the committed run times every step the block shows
    every = [_serve_row("decode", 1, 0), _serve_row("verify", 2, 0), _serve_row("verify", 4, 0),
             _serve_row("prefill", 1, 4096), _serve_row("prefill", 1, 16384)]
    assert "Not measured yet" not in readme._serve_block(_serve_doc(every))
    assert "Not measured yet: prefill chunk of 16,384 (" in readme._serve_block(_serve_doc(every[:4]))


def test_serve_cli_takes_several_next_n_and_chunks(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    res = CliRunner().invoke(main, ["bench", "serve", "--batch", "64", "--context", "16K,32K", "--next-n", "4,1",
                                    "--next-n", "2", "--chunk", "4096,16K", "--json", "-"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout[res.stdout.index("{"):])
    assert doc["next_n"] == [1, 2, 4] and doc["chunk"] == [4096, 16384]
    assert doc["cases"] == [f"{step} 64 x {c}{tail}" for step, tail in (("decode", ""), ("verify", ", next_n 2"),
                                                                        ("verify", ", next_n 4"))
                            for c in ("16K", "32K")] + [f"prefill chunk of {n} after {c}" for n in ("4,096", "16,384")
                                                        for c in ("16K", "32K")]
    for bad in (["--next-n", "1,5"], ["--next-n", "0"], ["--next-n", "2x"], ["--chunk", "2"], ["--chunk", "4K,y"]):
        res = CliRunner().invoke(main, ["bench", "serve", *bad])
        assert res.exit_code == 2 and bad[0] in res.output, (bad, res.output)


def test_readme_serve_command_times_every_step_the_block_shows(monkeypatch):
    """The README's `bench serve` line is one run that times every step its cost block shows, and the targets'
    batch, next_n and contexts."""
    import re
    import shlex

    line, = re.findall(r"^cupy-dsa bench serve --.*$", (REPO / "README.md").read_text(), re.M)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = shlex.split(line)[1:]
    args[args.index("--json") + 1] = "-"
    args = args[:args.index("--plot")]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout[res.stdout.index("{"):])
    steps = serve.cases(doc["batch"], doc["contexts"], doc["next_n"], doc["chunk"])
    assert set(readme.README_SERVE_STEPS) <= {serve.step_label(c) for c in steps}
    assert set(serve.TARGETS) <= {(c.batch, c.next_n, c.context) for c in steps if c.phase == "verify"}
    assert any(serve.fp8_route(c) == serve.FP8_NONPAGED for c in steps)


def test_serve_cli_on_a_gpu_records_routes_targets_and_the_gather(monkeypatch, tmp_path):
    """`bench serve`'s GPU branch end to end, its GPU stood in for by the CPU (the ops' references, DeepGEMM's
    stand-in, the torch gather) at a test model's size: the rows, table, notes and markdown carry the fp8 route of
    every step, the gather of the non-paged one, and the verdict where a target matches."""
    stand_in_gpu(monkeypatch)
    monkeypatch.setattr(serve, "NONPAGED_MIN_ROWS", 16)
    monkeypatch.setattr(serve, "TARGETS", {(2, 2, 256): 1e9})
    fake_topk = fake_sglang_topk(monkeypatch)
    real = serve.measure
    monkeypatch.setattr(serve, "measure", lambda case, model, dev, dg, seed, reps, **kw: real(case, model, CPU, dg,
                                                                                               seed, 1, **kw))
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"num_hidden_layers": 3, "compress_ratios": [4, 0, 4], "index_topk": 66}))
    res = CliRunner().invoke(main, ["bench", "serve", "--model", str(cfg), "--batch", "2", "--context", "256",
                                    "--next-n", "1,2", "--chunk", "8,32", "--json", "-"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout[res.stdout.index("{"):])
    by_step = {serve.step_label(r): r for r in doc["timings"]}
    assert list(by_step) == ["decode", "verify, next_n 2", "prefill chunk of 8", "prefill chunk of 32"]
    assert all(r["error"] is None and r["bf16_ms"] and r["fp8_ms"] for r in doc["timings"]), doc["timings"]
    assert [r["fp8_route"] for r in by_step.values()] == [serve.FP8_PAGED] * 3 + [serve.FP8_NONPAGED]
    assert by_step["prefill chunk of 32"]["fp8_gather"] == "torch gather (test)"
    assert [r["verdict"] for r in by_step.values()] == [None, "pass", None, None]
    assert "fp8 non-paged route: keys gathered by torch gather (test)" in doc["notes"]
    md = serve.markdown(doc)
    assert "| fp8 route | target |" in md and "| verify, next_n 2 | 2 x 256 |" in md and "<= 1000000000.00x: pass" in md
    # fp8-rescore on every step, both stage 1s, against fp8 + top-k and bf16 + top-k (SGLang's v2 top-k, its
    # plan once per forward); issue 26's bounds still recorded; each top-k alone
    assert all(r["fp8_topk_ms"] and r["bf16_topk_ms"] and r["fp8_rescore_ms"] and r["fp8_rescore_dg_ms"]
               for r in doc["timings"])
    assert doc["topk"]["stock"] == peers.SGLANG_V2 and not doc["topk"]["stand_in"]
    assert all(r["stock_topk"] == peers.SGLANG_V2 and set(r["topk_alone_ms"]) == set(peers.TOPK_KEYS)
               and r["topk_alone_on"] == "fp8+topk" for r in doc["timings"])
    assert {"plan", "v2", "v1"} <= set(fake_topk.calls)
    assert [r["rescore_target_ratio"] for r in by_step.values()] == [1.15, 1.15, None, None]
    assert "| fp8-rescore | / (fp8 + top-k) | / (bf16 + top-k) | fp8-rescore, DG stage 1 |" in md
    assert "**top-k** = the stock top-k, SGLang v2 (plan_topk_v2 + topk_transform_paged_v2" in md
    assert "fp8-rescore ms per forward" in res.output and "each top-k alone" in res.output
    assert "fp8 route" in res.stderr or "fp8 route" in res.output


def test_serve_query_axis_times_both_queries_with_their_preparation(monkeypatch):
    """`bench serve --query`: the layouts whose query the plugin sets (read from the modes' records: bf16, fp8-cupy)
    run with each query, each C4 layer preparing it (prepare_index_q with that numerics) before its logits, which get
    that query; the row keeps ms per layout and query and the bf16 / fp8 ratio; the CLI records the queries."""
    from cupy_dsa.sglang import core

    assert serve.QUERY_LAYOUTS == ("bf16", "fp8-cupy")
    assert all(core.record(name).query_settable and core.record(name).scoring == "one-pass"
               for name in serve.QUERY_LAYOUTS)
    model = serve.ServeModel("tiny", 5, 2, 66, "test", None)
    preps, dtypes = [], []
    real_prep, real_paged, real_varlen = cupy_dsa.prepare_index_q, cupy_dsa.paged_mqa_logits, cupy_dsa.mqa_logits
    monkeypatch.setattr(cupy_dsa, "prepare_index_q", lambda *a, **k: preps.append(k["numerics"]) or real_prep(*a, **k))
    monkeypatch.setattr(cupy_dsa, "paged_mqa_logits", lambda q, *a, **k: dtypes.append(q.dtype) or real_paged(q, *a, **k))
    monkeypatch.setattr(cupy_dsa, "mqa_logits", lambda q, *a, **k: dtypes.append(q.dtype) or real_varlen(q, *a, **k))
    for case in serve.cases(2, (256,), (1, 3), (8,)):
        for layout in serve.QUERY_LAYOUTS:
            for query, dtype in (("fp8", torch.float8_e4m3fn), ("bf16", torch.bfloat16)):
                preps.clear()
                dtypes.clear()
                fwd = serve._forward(case, layout, model, CPU, torch.Generator().manual_seed(0), None, query=query)
                fwd.run()
                assert preps == [query] * model.n_c4 and dtypes == [dtype] * model.n_c4, (case, layout, query)
    row = serve.measure_queries(serve.Case("verify", 2, 256, 2, 0), model, CPU, 0, reps=1)
    assert row["error"] is None and set(row["ms"]) == set(serve.QUERY_LAYOUTS), row
    for layout, per in row["ms"].items():
        assert set(per) == {"fp8", "bf16"} and row["bf16_q_vs_fp8_q"][layout] == per["bf16"] / per["fp8"]
    md = "\n".join(serve.query_markdown({"query_timings": [row], "device": "cpu", "git_commit": "abc"}))
    assert "| bf16, fp8 q | bf16, bf16 q | fp8-cupy, fp8 q | fp8-cupy, bf16 q | bf16: bf16 q / fp8 q |" in md, md
    assert serve.query_markdown({"timings": []}) == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    res = CliRunner().invoke(main, ["bench", "serve", "--query", "BF16,fp8", "--json", "-"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout[res.stdout.index("{"):])
    assert doc["queries"] == ["fp8", "bf16"] and doc["query_timings"] == [] and serve.QUERY_COUNTED in doc["notes"]
    res = CliRunner().invoke(main, ["bench", "serve", "--query", "fp16"])
    assert res.exit_code == 2 and "--query" in res.output and "'fp16'" in res.output


def test_serve_arch_configs_launch_the_targets_product_configs(monkeypatch):
    """`bench serve --arch-configs sm_120` (issue 32's cost target "with sm_120's configs forced"): within
    Family.selecting_for every decode / prefill problem gets sm_120's product config on the H200's arch and the
    H200's own outside; a target whose config is not declared on the running arch is refused, nesting too; both
    measures time inside it; the CLI takes only the archs every arch declares, records the target and its note,
    and the tables say so."""
    from cupy_dsa import heuristics as H

    for family in (H.DECODE, H.PREFILL):
        own = {p: family.select(p, "sm_90") for p in family.problems}
        target = {p: family.select(p, "sm_120") for p in family.problems}
        assert own != target
        with family.selecting_for("sm_120"):
            assert {p: family.select(p, "sm_90") for p in family.problems} == target
            with pytest.raises(RuntimeError, match="already forced"):
                with family.selecting_for("sm_120"):
                    pass
        assert {p: family.select(p, "sm_90") for p in family.problems} == own
    with H.DECODE.selecting_for("sm_90"):   # the wgmma kernel is declared on sm_90 only
        with pytest.raises(ValueError, match="not declared on sm_120"):
            H.DECODE.select(("bf16", 1, 1), "sm_120")
    entered = []
    real = serve.arch_configs
    monkeypatch.setattr(serve, "arch_configs", lambda target: entered.append(target) or real(target))
    model = serve.ServeModel("tiny", 5, 2, 66, "test", None)
    case = serve.Case("verify", 2, 256, 2, 0)
    row = serve.measure_queries(case, model, CPU, 0, reps=1, configs_of="sm_120")
    assert row["error"] is None and entered == ["sm_120"] * 4, (row, entered)
    entered.clear()
    row = serve.measure(case, model, CPU, None, 0, reps=1, layouts=("bf16",), configs_of="sm_120")
    assert row["error"] is None and row["bf16_ms"] is not None and entered == ["sm_120"], (row, entered)
    md = "\n".join(serve.query_markdown({"query_timings": [row | {"ms": {}, "bf16_q_vs_fp8_q": {}}], "device": "gpu",
                                         "git_commit": "abc", "arch_configs": "sm_120"}))
    assert "The query (gpu, sm_120's product configs forced, commit `abc`)" in md, md
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    res = CliRunner().invoke(main, ["bench", "serve", "--arch-configs", "sm_120", "--json", "-"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout[res.stdout.index("{"):])
    assert doc["arch_configs"] == "sm_120" and serve.arch_configs_note("sm_120") in doc["notes"]
    res = CliRunner().invoke(main, ["bench", "serve", "--arch-configs", "sm_90"])
    assert res.exit_code == 2 and "--arch-configs" in res.output and "'sm_90'" in res.output, res.output


def test_serve_query_target_line():
    """Issue 32's cost target per layout: the span of bf16 q / fp8 q, pass at <= 1.05x, else the steps over it."""
    def row(phase, context, **ratios):
        return {"phase": phase, "batch": 8, "context": context, "next_n": 3 if phase == "verify" else 1,
                "chunk": 4096 if phase == "prefill" else 0, "bf16_q_vs_fp8_q": ratios}

    rows = [row("decode", 32768, bf16=0.98, **{"fp8-cupy": 1.02}), row("verify", 32768, bf16=1.05, **{"fp8-cupy": 1.2}),
            row("prefill", 32768, bf16=1.01)]
    line = serve.query_target_line(rows, serve.QUERY_LAYOUTS)
    assert line == ("Target (issue 32): bf16 q <= 1.05x fp8 q on every step kind: bf16 0.980-1.050x: pass; fp8-cupy "
                    "1.020-1.200x: **miss** (verify, next_n 3 at 8 x 32K: 1.200x)."), line
    assert "not evaluated" in serve.query_target_line([row("decode", 32768)], serve.QUERY_LAYOUTS)


# --------------------------------------------------------------------------------------------------
# the stock top-k (issue 31): SGLang's own kernels where they run, else cupy_dsa's standing in
# --------------------------------------------------------------------------------------------------

def test_sglang_topk_says_why_it_cannot_run_on_cpu(monkeypatch):
    """On a CPU (CI), SGLang's top-k reports a clean reason before importing anything; the run's top-k is then
    cupy_dsa's, named as SGLang v2's stand-in with its measured speed against v2."""
    monkeypatch.setattr(peers, "_SGLANG_TOPK", {})
    for version in ("v1", "v2"):
        op, why = peers.sglang_topk(version, CPU)
        assert op is None and why == f"SGLang's {version} top-k not run: it is a CUDA kernel and this run has no CUDA device"
    with pytest.raises(ValueError, match="version: expected 'v1' or 'v2', got 'v3'"):
        peers.sglang_topk("v3", CPU)
    t = peers.topks(CPU)
    assert t.stand_in and t.stock.key == peers.CUPY_DSA_TOPK and list(t.ops) == [peers.CUPY_DSA_TOPK, peers.TORCH_TOPK]
    d = t.describe()
    assert d["stock"] == "cupy_dsa" and d["stand_in"] and "no CUDA device" in d["status"]["sglang-v2"]
    assert "STANDS IN for SGLang's v2 top-k" in d["stand_in_note"] and "48 x 65,536: 102 us vs 13" in d["stand_in_note"]
    assert json.loads(json.dumps(d)) == d


def test_sglang_topk_import_failure_is_a_reason(monkeypatch):
    """A GPU machine whose SGLang does not import: the reason names the error; nothing is retried per call."""
    monkeypatch.setattr(peers, "_SGLANG_TOPK", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(peers, "_install_kernel_stubs", lambda: [])
    tried = []

    def no_sglang(name):
        tried.append(name)
        raise ModuleNotFoundError("No module named 'sglang'")

    monkeypatch.setattr(peers.importlib, "import_module", no_sglang)
    for _ in range(2):
        op, why = peers.sglang_topk("v2", "cuda:0")
        assert op is None and why == ("SGLang's v2 top-k not importable (ModuleNotFoundError: No module named "
                                      "'sglang')")
    assert tried == [peers.SGLANG_TOPK_MODULE]


def test_sglang_topk_binding_and_check():
    """The bindings call SGLang's entry points as SGLang's indexer does (page size 64, v2's plan buffer of
    rows + 1, filled once per forward); the loader's check accepts a kernel that selects the reference's keys
    in any order and refuses one that does not."""
    fake = FakeSGLangTopK()
    v2 = peers.TopKOp(peers.SGLANG_V2, "v2", peers._sglang_bind(fake, peers.SGLANG_V2))
    v1 = peers.TopKOp(peers.SGLANG_V1, "v1", peers._sglang_bind(fake, peers.SGLANG_V1))
    peers._self_check(v2, CPU)
    peers._self_check(v1, CPU)
    assert fake.calls == ["plan", "v2", "v1"]
    bad = peers.TopKOp(peers.SGLANG_V2, "v2", peers._sglang_bind(FakeSGLangTopK(wrong=True), peers.SGLANG_V2))
    with pytest.raises(RuntimeError, match="selects .* slots that differ from the reference"):
        peers._self_check(bad, CPU)
    lens = torch.tensor([3, 200], dtype=torch.int32)
    table = torch.arange(8, dtype=torch.int32).view(2, 4)
    with pytest.raises(ValueError, match="index_topk: SGLang v1's top-k takes at most 1024, got 2048"):
        v1.bind(lens, table, 2048)
    b = v2.bind(lens, table, 16)
    b.plan()
    out = b.select(torch.randn(2, 256))
    assert out.dtype == torch.int32 and out.shape == (2, 16) and out[0, 3:].eq(-1).all()
    assert sorted(out[0, :3].tolist()) == [0, 1, 2] and out[1].ge(4 * 64).all()  # row 1: its own pages


def test_sglang_topk_entry_points_take_what_the_bench_passes():
    """SGLang 0.5.23's top-k module (imported on the CPU, nothing compiled) has the entry points the bench calls,
    with the parameters in the order it passes them."""
    import inspect

    pytest.importorskip("sglang")
    mod = __import__(peers.SGLANG_TOPK_MODULE, fromlist=["x"])
    params = {name: list(inspect.signature(getattr(mod, name)).parameters)
              for name in ("topk_transform_paged", "plan_topk_v2", "topk_transform_paged_v2")}
    assert params["topk_transform_paged"][:5] == ["scores", "seq_lens", "page_tables", "out_page_indices", "page_size"]
    assert params["plan_topk_v2"][0] == "seq_lens" and "out" in params["plan_topk_v2"]
    assert params["topk_transform_paged_v2"][:6] == ["scores", "seq_lens", "page_tables", "out_page_indices",
                                                     "page_size", "metadata"]


def test_kernel_stubs_leave_deep_gemm_alone():
    """Before SGLang's import the bench stubs only the kernel packages SGLang imports but the top-k does not
    need (never deep_gemm, whose columns must run the real one or say why not); SGLang's top-k module then
    imports (a fresh process: the stubs are process-wide)."""
    pytest.importorskip("sglang")
    code = ("from cupy_dsa.bench import peers; print(sorted(peers._install_kernel_stubs())); "
            "import importlib; importlib.import_module(peers.SGLANG_TOPK_MODULE)\n"
            "try:\n import deep_gemm; print(not deep_gemm.__version__.endswith('cupy_dsa_stub'))\n"
            "except ImportError:\n print(True)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    stubbed, real_or_none = out.stdout.strip().splitlines()[-2:]
    assert set(eval(stubbed)) <= {"sgl_kernel", "flash_mla", "flashinfer"} and real_or_none == "True"
