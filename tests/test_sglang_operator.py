"""Operator UX of the SGLang plugin without SGLang's processes: ``python -m cupy_dsa.sglang check --mode`` (the mode
a server gets from its flag or YAML key) and the PD layout line a server logs at start-up, which names
SGLANG_CUPY_DSA_INDEX_K where SGLang's own mismatch message does not."""
import logging

import pytest
import torch
from click.testing import CliRunner

from cupy_dsa.sglang import check, core, guard, hooks
from cupy_dsa.sglang.__main__ import main

ENV = core.ENV_NAME
SGLANG_MISMATCH = ("KV layout mismatch: prefill server has kv_layout=..., but decode server has kv_layout=... Both "
                   "servers must use the same --dsv4-attn-backend and SGLANG_DSV4_KV_LAYOUT")


@pytest.fixture
def checked(monkeypatch):
    """check.run(flag) as (exit code, {status: [lines]}) with SGLang matching its fingerprint and the GPU part
    stubbed (it records the mode it was asked to self-test)."""
    monkeypatch.setattr(guard, "compatibility_problems", lambda: [])
    monkeypatch.setattr(check, "_gpu_lines", lambda mode: [(check.OK, f"gpu self-test for {mode}")])
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)

    def run(flag=None):
        code, lines = check.run(flag)
        by = {}
        for status, text in lines:
            by.setdefault(status, []).append(text)
        return code, by

    yield run
    core.reset_mode()


@pytest.mark.parametrize("mode", [m for m in core.MODES if m != "fp8"])
def test_check_mode_stands_for_the_flag_or_yaml_key(checked, mode):
    code, lines = checked(mode.upper())
    assert code == 0 and "PROBLEM" not in lines, lines
    assert any(t.startswith(f"{ENV}={mode} (from --cupy-dsa-index-k-dtype {mode}, --mode) -> {mode}: bf16 index keys")
               for t in lines["ok"]), lines
    assert f"gpu self-test for {mode}" in lines["ok"]


def test_check_mode_disagreeing_with_the_variable_is_the_refusal(checked, monkeypatch):
    monkeypatch.setenv(ENV, "fp8")
    code, lines = checked("bf16")
    assert code == 1
    assert any(t.startswith(f"--cupy-dsa-index-k-dtype bf16 (--mode) and {ENV}=fp8 differ: SGLang start-up is "
                            "refused") for t in lines["PROBLEM"]), lines
    monkeypatch.setenv(ENV, "bf16-fp4sim")
    code, lines = checked("BF16-FP4SIM")  # the same mode in both is fine
    assert code == 0 and "PROBLEM" not in lines, lines


def test_check_without_mode_reads_the_variable(checked, monkeypatch):
    monkeypatch.setenv(ENV, "bf16")
    code, lines = checked()
    assert f"{ENV}=bf16 -> bf16: bf16 index keys (exact numerics), SGLang's fp8 query" in lines["ok"], lines


def test_check_prints_the_pd_layout_tag_and_the_variable(checked):
    _, lines = checked("bf16-reference")
    (pd,) = [t for t in lines["note"] if t.startswith("PD layout:")]
    assert "',c4idx:bf16-reference'" in pd and f"must run the same {ENV}" in pd and SGLANG_MISMATCH in pd, pd
    _, lines = checked()
    (pd,) = [t for t in lines["note"] if t.startswith("PD layout:")]
    assert f"{ENV}=fp8 adds nothing to SGLang's KV layout string" in pd, pd


def test_check_command_takes_mode(monkeypatch):
    monkeypatch.setattr(guard, "compatibility_problems", lambda: [])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv(ENV, raising=False)
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
    monkeypatch.setenv(ENV, "bf16-fp4sim")
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
