"""``python -m cupy_dsa.sglang check`` (cupy_dsa.sglang.check) and the PD layout line of start-up, on CPU with
SGLang's fingerprint check stubbed; its self-test on a GPU (``@pytest.mark.gpu``)."""
from __future__ import annotations

import pytest
import torch

from cupy_dsa import layouts
from cupy_dsa.sglang import core
from sglang_plugin_env import ENV


@pytest.fixture
def self_check(monkeypatch):
    """The check with SGLang matching its fingerprint and no GPU, unless a test says otherwise; returns
    run() as (exit code, {status: [lines]})."""
    from cupy_dsa.sglang import check, guard

    monkeypatch.setattr(guard, "compatibility_problems", lambda: [])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in (ENV, "SGLANG_PLUGINS", core.QUERY_ENV) + core.RESCORE_ENVS:
        monkeypatch.delenv(name, raising=False)

    def run(flag=None, query=None):
        code, lines = check.run(flag, query)
        by_status = {}
        for status, text in lines:
            by_status.setdefault(status, []).append(text)
        return code, by_status

    yield run
    core.reset_mode()


def test_check_switch_off(self_check):
    code, lines = self_check()
    assert any(f"{ENV} unset -> fp8: the switch is off" in t for t in lines["ok"]), lines
    assert any("entry point cupy_dsa = cupy_dsa.sglang.plugin:register" in t for t in lines["ok"]), lines
    assert any(t.startswith("server flag --cupy-dsa-index-k-dtype {fp8,bf16,bf16-fp4sim,bf16-reference,fp8-cupy,"
                            "fp8-rescore}") for t in lines["ok"])
    assert lines["PROBLEM"] == [p for p in lines["PROBLEM"] if p.startswith("no CUDA GPU visible")] != [], lines
    assert code == 1


def test_check_bf16_on_everything_holds(self_check, monkeypatch):
    from cupy_dsa.sglang import check

    monkeypatch.setenv(ENV, "BF16")
    monkeypatch.setenv("SGLANG_PLUGINS", "other, cupy_dsa")
    monkeypatch.setattr(check, "_gpu_lines", lambda mode: [(check.OK, f"gpu checked for {mode}")])
    code, lines = self_check()
    assert "PROBLEM" not in lines and code == 0, lines
    assert f"{ENV}=BF16 -> bf16: bf16 C4 index keys (256 B per entry, exact key numerics); query: SGLang's fused fp8 q " \
           f"(one scale per token and head, in the head weights) ({core.QUERY_ENV} unset: the mode's default)" \
           in lines["ok"], lines
    assert any("the flag must name the same mode or start-up is refused" in t for t in lines["ok"]), lines
    assert "gpu checked for bf16" in lines["ok"]


def test_check_names_the_logits_budget_and_the_nonfinite_setting(self_check, monkeypatch):
    from cupy_dsa.sglang import check

    monkeypatch.setenv(ENV, "bf16")
    monkeypatch.setattr(check, "_gpu_lines", lambda mode: [])
    for name in core.HOOKED_SETTING_ENVS:
        monkeypatch.delenv(name, raising=False)
    _, lines = self_check()
    assert (f"prefill logits budget: SGLang's row chunks where it plans them (its DeepGEMM route), otherwise at most "
            f"2048 MiB of fp32 logits per eager chunk ({core.LOGITS_BUDGET_ENV} unset: 2048)") in lines["ok"], lines
    assert any(t.startswith("non-finite index keys are counted at the store; SGLANG_CUPY_DSA_DEBUG_NONFINITE=0")
               for t in lines["ok"]), lines
    monkeypatch.setenv(core.LOGITS_BUDGET_ENV, "512")
    monkeypatch.setenv(core.DEBUG_NONFINITE_ENV, "1")
    _, lines = self_check()
    assert any("at most 512 MiB" in t and f"{core.LOGITS_BUDGET_ENV}=512" in t for t in lines["ok"]), lines
    assert any(f"{core.DEBUG_NONFINITE_ENV}=1: each new one is logged" in t for t in lines["ok"]), lines
    monkeypatch.setenv(core.LOGITS_BUDGET_ENV, "lots")
    code, lines = self_check()
    assert code == 1 and any(t.startswith(f"{core.LOGITS_BUDGET_ENV}='lots': expected a whole number of MiB")
                             for t in lines["PROBLEM"]), lines


def test_check_self_test_runs_each_mode_on_cpu(monkeypatch):
    """The self-test's store and logits in every mode's cache layout and query (CPU on both sides: the code path
    a GPU runs, with a zero difference)."""
    from cupy_dsa.sglang import check

    seen = []
    real = core.store_index_k_bf16
    monkeypatch.setattr(core, "store_index_k_bf16", lambda *a, **k: seen.append(k["kvcache"].shape[1]) or real(*a, **k))
    expect = []
    for mode in core.MODES[1:]:
        rec = core.record(mode)
        for query in rec.query_choices:
            assert check.self_test(torch.device("cpu"), mode, query) == 0.0, (mode, query)
            expect += [layouts.page_bytes(rec.cache_layout)] * 2
    assert seen == expect and len(expect) == 18


def test_check_fp8_cupy_mode_line(self_check, monkeypatch):
    from cupy_dsa.sglang import check

    monkeypatch.setenv(ENV, "fp8-cupy")
    monkeypatch.setattr(check, "_gpu_lines", lambda mode: [(check.OK, f"gpu checked for {mode}")])
    code, lines = self_check()
    assert code == 0 and "gpu checked for fp8-cupy" in lines["ok"], lines
    (line,) = [t for t in lines["ok"] if t.startswith(f"{ENV}=fp8-cupy -> fp8-cupy: SGLang's fp8 C4 index keys on "
                                                      "cupy_dsa's store and kernels (132 B per entry)")]
    assert f"query: SGLang's fused fp8 q (one scale per token and head, in the head weights) ({core.QUERY_ENV} " \
           "unset: the mode's default)" in line, line
    code, lines = self_check(query="BF16")  # what --cupy-dsa-index-q or its YAML key sets
    assert code == 0 and any(f"query: the rotated q rounded to bf16 once (the head weights without a q scale) "
                             f"({core.QUERY_ENV}=bf16)" in t for t in lines["ok"]), lines
    monkeypatch.setenv(core.QUERY_ENV, "fp8")
    code, lines = self_check(query="bf16")
    assert code == 1 and any(f"--cupy-dsa-index-q bf16 (--query) and {core.QUERY_ENV}=fp8 differ" in t
                             for t in lines["PROBLEM"]), lines
    monkeypatch.setenv(ENV, "bf16-reference")
    code, lines = self_check()
    assert code == 1 and any(f"{core.QUERY_ENV}='fp8' set with {ENV}=bf16-reference" in t
                             for t in lines["PROBLEM"]), lines


def test_check_fp8_rescore_mode_line(self_check, monkeypatch):
    from cupy_dsa.sglang import check

    monkeypatch.setenv(ENV, "fp8-rescore")
    monkeypatch.setenv(core.RESCORE_STAGE1_ENV, "cupy")
    monkeypatch.setenv(core.RESCORE_KPRIME_ENV, "3x")
    monkeypatch.setattr(check, "_gpu_lines", lambda mode: [(check.OK, f"gpu checked for {mode}")])
    code, lines = self_check()
    assert code == 0 and "gpu checked for fp8-rescore" in lines["ok"], lines
    (line,) = [t for t in lines["ok"] if t.startswith(f"{ENV}=fp8-rescore -> fp8-rescore: two-level C4 index keys")]
    assert "int8 residual pages) and a rescored top-k (264 B per entry)" in line, line
    assert "stage 1 = cupy_dsa's fp8-key kernels" in line, line
    assert "stage 2 with the rotated q rounded to bf16 once" in line, line
    assert "K' = 3x index_topk" in line, line
    monkeypatch.setenv(core.RESCORE_KPRIME_ENV, "none")
    code, lines = self_check()
    assert code == 1 and any(f"{core.RESCORE_KPRIME_ENV}='none'" in t for t in lines["PROBLEM"]), lines
    monkeypatch.setenv(ENV, "bf16")  # a rescore setting with another mode: the refusal
    code, lines = self_check()
    assert code == 1 and any("apply to fp8-rescore only" in t for t in lines["PROBLEM"]), lines


def test_check_gpu_below_the_minimum_arch_is_a_problem(self_check, monkeypatch):
    # the runtime refuses the GPU by name: the check reports it instead of failing, and runs no self-test
    from cupy_dsa import runtime
    from cupy_dsa.sglang import check

    monkeypatch.setenv(ENV, "bf16")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "Tesla T4")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (7, 5))
    monkeypatch.setattr(runtime, "_ARCHS", {})
    monkeypatch.setattr(check, "_device_self_test", lambda *a: pytest.fail("self-test on an sm_75 GPU"))
    code, lines = self_check()
    assert code == 1
    assert any(t.startswith("cuda:0 (Tesla T4) is sm_75; cupy_dsa's kernels need sm_80 or newer")
               for t in lines["PROBLEM"]), lines


def test_check_bad_mode_and_plugin_filter(self_check, monkeypatch):
    monkeypatch.setenv(ENV, "bf17")
    monkeypatch.setenv("SGLANG_PLUGINS", "other")
    code, lines = self_check()
    assert any(t.startswith(f"{ENV}='bf17': expected one of fp8, bf16, bf16-fp4sim") and "start-up is refused" in t
               for t in lines["PROBLEM"]), lines
    assert any(t.startswith("SGLANG_PLUGINS='other' does not list cupy_dsa") for t in lines["PROBLEM"]), lines
    assert code == 1


def test_check_fingerprint_mismatch(self_check, monkeypatch):
    from cupy_dsa.sglang import check, guard

    problems = ["found SGLang 0.5.23, but its code differs from the release the hooks were written for",
                "sglang.x.f: source differs from SGLang 0.5.23's (sha256 1, expected 2)"]
    monkeypatch.setattr(guard, "compatibility_problems", lambda: problems)
    monkeypatch.setattr(check, "_gpu_lines", lambda mode: [])
    monkeypatch.setenv(ENV, "bf16")
    code, lines = self_check()
    (line,) = lines["PROBLEM"]
    assert line.startswith(problems[0]) and "- sglang.x.f: source differs" in line, line
    assert "pip install sglang==0.5.23" in line and f"{ENV}=fp8" in line, line
    assert code == 1
    monkeypatch.setenv(ENV, "fp8")
    core.reset_mode()
    code, lines = self_check()
    assert "PROBLEM" not in lines and any(t.startswith(problems[0]) for t in lines["note"]) and code == 0, lines


def test_check_command_prints_lines_and_exit_code(self_check):
    from click.testing import CliRunner

    from cupy_dsa.sglang.__main__ import main

    res = CliRunner().invoke(main, ["check"])
    assert res.exit_code == 1, res.output
    assert "PROBLEM  no CUDA GPU visible: a server cannot run here" in res.output, res.output
    assert res.output.rstrip().endswith("problems above; fix them before starting the server"), res.output


# check --mode (the mode a server gets from its flag or YAML key) and the PD layout line of start-up, which names
# SGLANG_CUPY_DSA_INDEX_K where SGLang's own mismatch message does not

SGLANG_MISMATCH = ("KV layout mismatch: prefill server has kv_layout=..., but decode server has kv_layout=... Both "
                   "servers must use the same --dsv4-attn-backend and SGLANG_DSV4_KV_LAYOUT")


@pytest.fixture
def gpu_stub(monkeypatch):
    """The check's GPU part records the mode it was asked to self-test."""
    from cupy_dsa.sglang import check

    monkeypatch.setattr(check, "_gpu_lines", lambda mode: [(check.OK, f"gpu self-test for {mode}")])


@pytest.mark.parametrize("mode", [m for m in core.MODES if m != "fp8"])
def test_check_mode_stands_for_the_flag_or_yaml_key(self_check, gpu_stub, mode):
    code, lines = self_check(mode.upper())
    assert code == 0 and "PROBLEM" not in lines, lines
    keys = f"{core.record(mode).keys} ({core.record(mode).bytes_per_entry} B per entry"
    assert any(t.startswith(f"{ENV}={mode} (from --cupy-dsa-index-k-dtype {mode}, --mode) -> {mode}: {keys}")
               for t in lines["ok"]), lines
    assert f"gpu self-test for {mode}" in lines["ok"]


def test_check_mode_disagreeing_with_the_variable_is_the_refusal(self_check, gpu_stub, monkeypatch):
    monkeypatch.setenv(ENV, "fp8")
    code, lines = self_check("bf16")
    assert code == 1
    assert any(t.startswith(f"--cupy-dsa-index-k-dtype bf16 (--mode) and {ENV}=fp8 differ: SGLang start-up is "
                            "refused") for t in lines["PROBLEM"]), lines
    monkeypatch.setenv(ENV, "bf16-fp4sim")
    code, lines = self_check("BF16-FP4SIM")  # the same mode in both is fine
    assert code == 0 and "PROBLEM" not in lines, lines


def test_check_without_mode_reads_the_variable(self_check, monkeypatch):
    monkeypatch.setenv(ENV, "bf16")
    code, lines = self_check()
    assert any(t.startswith(f"{ENV}=bf16 -> bf16: bf16 C4 index keys (256 B per entry, exact key numerics); query: "
                            "SGLang's fused fp8 q") for t in lines["ok"]), lines


def test_check_prints_the_pd_layout_tag_and_the_variable(self_check):
    _, lines = self_check("bf16-reference")
    (pd,) = [t for t in lines["note"] if t.startswith("PD layout:")]
    assert "',c4idx:bf16-reference'" in pd and f"must run the same {ENV}" in pd and SGLANG_MISMATCH in pd, pd
    _, lines = self_check()
    (pd,) = [t for t in lines["note"] if t.startswith("PD layout:")]
    assert f"{ENV}=fp8 adds nothing to SGLang's KV layout string" in pd, pd


def test_check_command_takes_mode(self_check, monkeypatch):
    from click.testing import CliRunner

    from cupy_dsa.sglang import check
    from cupy_dsa.sglang.__main__ import main

    seen = []
    monkeypatch.setattr(check, "_gpu_lines", lambda mode: seen.append(mode) or [])
    res = CliRunner().invoke(main, ["check", "--mode", "bf16-fp4sim"])
    core.reset_mode()
    assert res.exit_code == 0, res.output
    assert seen == ["bf16-fp4sim"] and "(from --cupy-dsa-index-k-dtype bf16-fp4sim, --mode)" in res.output
    res = CliRunner().invoke(main, ["check", "--mode", "int8"])
    assert res.exit_code == 2 and "Invalid value for '--mode'" in res.output and "bf16-reference" in res.output


def test_startup_logs_the_pd_layout_tag_with_the_variable(monkeypatch, caplog):
    """register() with the switch on logs the tag and names SGLANG_CUPY_DSA_INDEX_K next to SGLang's message
    (the installs themselves stubbed: SGLang's hook registry is exercised in tests/sglang_checks)."""
    import logging

    from cupy_dsa.sglang import hooks

    monkeypatch.setenv(ENV, "bf16-fp4sim")
    monkeypatch.setenv(core.QUERY_ENV, "bf16")
    core.reset_mode()
    monkeypatch.setattr(hooks, "require_compatible_sglang", lambda mode: None)
    monkeypatch.setattr(hooks, "_install", lambda entries, resolution: None)
    monkeypatch.setattr(hooks, "register_env_field", lambda: None)
    monkeypatch.setattr(hooks, "sglang_version", lambda: "0.5.23")
    monkeypatch.setattr(hooks, "_registered_always", False)
    monkeypatch.setattr(hooks, "_registered_switched", False)
    monkeypatch.setattr(hooks, "_always_entries", lambda: [])
    monkeypatch.setattr(hooks, "_switched_entries", lambda: [])
    try:
        with caplog.at_level(logging.INFO, logger=hooks.logger.name):
            hooks.register()
    finally:
        core.reset_mode()
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "appends ',c4idx:bf16-fp4sim' to SGLang's KV layout string" in text, text
    assert f"must run the same {ENV}" in text and "SGLANG_DSV4_KV_LAYOUT" in text, text
    # which query runs
    assert (f"bf16-fp4sim: query: the rotated q rounded to bf16 once (the head weights without a q scale) "
            f"({core.QUERY_ENV}=bf16)") in text, text


@pytest.mark.gpu
def test_gpu_check_self_test():
    from cupy_dsa.sglang import check

    for mode in ("bf16", "bf16-fp4sim", "bf16-reference", "fp8-cupy", "fp8-rescore"):
        for query in core.record(mode).query_choices:
            assert check.self_test(torch.device("cuda"), mode, query) <= check.SELF_TEST_TOLERANCE, (mode, query)
    code, lines = check.run()
    assert any("store + logits match the CPU reference" in t for s, t in lines if s == check.OK), lines


# --------------------------------------------------------------------------------------------------
# issue 50: K' counts per model, a renamed setting, an invalid query variable, a --query refusal
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kprime, status, words", [
    ("100", "PROBLEM", "start-up refuses it with DeepSeek-V4-Flash and DeepSeek-V4-Pro"),
    ("512", "note", "start-up refuses it with DeepSeek-V4-Pro. Use a multiple such as 4x (the default), or a count "
                    "of at least 1024"),
    ("1024", "ok", "at least every DeepSeek-V4 model's index_topk (DeepSeek-V4-Flash 512, DeepSeek-V4-Pro 1024)"),
])
def test_check_says_what_k_prime_each_model_needs(self_check, monkeypatch, kprime, status, words):
    """`check` said ok for a K' below index_topk, which start-up refuses; it cannot know the model the server
    loads, so it names what each DeepSeek-V4 model needs (V4-Flash 512, V4-Pro 1024)."""
    from cupy_dsa.sglang import check

    monkeypatch.setenv(ENV, "fp8-rescore")
    monkeypatch.setenv(core.RESCORE_KPRIME_ENV, kprime)
    monkeypatch.setattr(check, "_gpu_lines", lambda mode: [])
    code, lines = self_check()
    assert any(f"{core.RESCORE_KPRIME_ENV}={kprime}: " in t and words in t for t in lines.get(status, [])), lines
    assert code == (1 if status == "PROBLEM" else 0), lines


@pytest.mark.parametrize("mode", ["fp8", "fp8-rescore", "bf16"])
def test_renamed_rescore_query_variable_is_refused_naming_the_new_one(self_check, monkeypatch, mode):
    """SGLANG_CUPY_DSA_RESCORE_Q was silently ignored after its rename (=fp8 ran stage 2 with the bf16 query)."""
    monkeypatch.setenv(ENV, mode)
    monkeypatch.setenv("SGLANG_CUPY_DSA_RESCORE_Q", "fp8")
    assert "SGLANG_CUPY_DSA_RESCORE_Q='fp8' was renamed" in core.settings_problem(mode)
    assert f"set {core.QUERY_ENV}=fp8 (or the server flag {core.QUERY_FLAG} fp8)" in core.settings_problem(mode)
    code, lines = self_check()
    assert code == 1 and any("SGLANG_CUPY_DSA_RESCORE_Q='fp8' was renamed" in t for t in lines["PROBLEM"]), lines


def test_invalid_query_variable_is_a_problem_line_not_a_traceback(self_check, monkeypatch):
    monkeypatch.setenv(core.QUERY_ENV, "fp16")
    code, lines = self_check(flag="bf16", query="bf16")
    assert code == 1 and any(t.startswith(f"{core.QUERY_ENV}='fp16': expected one of fp8, bf16") and
                             "SGLang start-up is refused" in t for t in lines["PROBLEM"]), lines


def test_query_flag_refusal_names_the_flag(self_check):
    """`check --mode fp8 --query bf16` blamed SGLANG_CUPY_DSA_INDEX_Q, which was not set."""
    code, lines = self_check(flag="fp8", query="bf16")
    problem = next(t for t in lines["PROBLEM"] if "set with" in t)
    assert problem.startswith(f"{core.QUERY_FLAG} bf16 (--query) set with {ENV}=fp8") and code == 1, problem
    assert f"Drop {core.QUERY_FLAG}" in problem and core.QUERY_ENV not in problem.split(". ")[1], problem
