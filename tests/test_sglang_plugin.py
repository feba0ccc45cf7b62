"""The SGLang 0.5.23 plugin (cupy_dsa.sglang).

CPU (CI): fresh processes, one per scenario, started together, run ``tests/sglang_checks`` against SGLang's real
classes (each hook-installing scenario needs its own process: SGLang's HookRegistry cannot be undone) and
report one result per check; every check is one test here. Needs sglang 0.5.23 installed with ``--no-deps``
plus tests/requirements-cpu.txt: skipped without it, failed without it when ``CI`` is set.

GPU (``@pytest.mark.gpu``, no SGLang on the machine): the plugin's SGLang-free glue (cupy_dsa.sglang.core)
with tensors shaped as SGLang builds them: plan-native store from DecodePlan / CompressPlan rows, paged and
prefill logits, a torch top-k; eager and inside ``torch.cuda.graph``, against the CPU path.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from cupy_dsa import layouts
from cupy_dsa.sglang import core

ROOT = Path(__file__).resolve().parents[1]
CHECKS_SCRIPT = ROOT / "tests" / "sglang_checks"
HAS_SGLANG = importlib.util.find_spec("sglang") is not None
ENV = core.ENV_NAME

# Every check each scenario of tests/sglang_checks reports (test_every_check_is_listed keeps this honest).
CHECKS = {
    "on": [
        "hooks_applied", "env_field", "bytes_per_token_on", "pool_pages_on", "store_decode_plan",
        "store_prefill_plan", "store_via_sglang_call_site", "store_fp4sim", "indexer_recall_bf16_vs_fp8",
        "indexer_extend_varlen_path", "indexer_verify_grouped_path", "indexer_reference_mode_matches_the_reference_oracle",
        "indexer_small_rows_and_padding", "indexer_hisparse_and_capturer", "pd_layout_mismatch_refused",
        "hicache_guards", "resolution_accepts_without_env_writes", "resolution_refuses_fp4_indexer",
        "resolution_refuses_megakernel", "resolution_refuses_npu_xpu", "resolution_refuses_hip_and_hooks_raise_on_hip",
        "resolution_refuses_invalid_value", "resolution_checks_version_when_flag_turns_switch_on",
        "fingerprint_matches_installed", "store_refuses_unrecognised_calls", "store_fp8_cache_goes_to_sglang_unchanged",
        "indexer_off_calls_sglang_original", "switch_read_once_per_process",
    ],
    "off": ["entry_point_loaded", "sglang_unchanged", "resolution_off_is_noop", "cli_flag_sets_switch",
            "cli_flag_disagreeing_with_env_refused", "refusal_after_cli_flag_names_the_hooks_in_place",
            "yaml_config_sets_switch"],
    "excluded": ["allow_list_respected"],
    "refusals": ["refuses_other_version", "refuses_source_fingerprint_mismatch", "refuses_signature_mismatch",
                 "hook_failure_undoes_applied_hooks", "hook_failing_after_its_patch_counts_only_earlier_hooks",
                 "resolution_hook_failure_undoes_hooks",
                 "invalid_value_direct_load_plugins", "invalid_value_engine", "invalid_value_ray_worker_hook",
                 "invalid_rescore_setting_refused_before_patching",
                 "switch_off_hook_failure_leaves_sglang_unchanged", "registers_after_refusals"],
    "fp8cupy": ["hooks_applied_fp8cupy", "pool_and_budget_are_sglangs", "store_fp8_decode_plan_matches_sglang",
                "store_fp8_prefill_plan_matches_sglang", "store_fp8_via_sglang_call_site", "store_fp8cupy_strictness",
                "indexer_topk_matches_sglang_fp8_decode", "indexer_topk_matches_sglang_fp8_extend_and_verify",
                "indexer_fp8cupy_small_rows_and_padding", "indexer_fp8cupy_refuses_a_bf16_pool",
                "pd_layout_and_hicache_fp8cupy", "resolution_fp8cupy", "flag_and_yaml_key_take_fp8cupy",
                "check_command_describes_fp8cupy"],
    "rescore": ["hooks_applied_rescore", "budget_counts_264_bytes", "pool_keeps_sglangs_fp8_buffer_and_adds_lo_pages",
                "pd_registers_the_lo_pages", "store_two_level_decode_plan", "store_two_level_prefill_plan",
                "store_two_level_one_launch_via_sglang_call_site", "store_rescore_strictness",
                "indexer_decode_matches_reference_both_stage1", "indexer_routes_match_reference",
                "indexer_bf16_stage2_query_reaches_stage2",
                "indexer_exact_topk_where_unambiguous", "indexer_small_rows_padding_and_kprime_cap",
                "indexer_rescore_refuses_pools_without_lo", "indexer_rescore_refuses_a_tbo_micro_batch",
                "indexer_rescore_hisparse_and_capturer",
                "pd_layout_pairs_only_with_fp8_rescore", "hicache_carries_lo_pages_in_its_namespace",
                "hicache_backup_and_load_carry_lo_pages",
                "resolution_rescore_refusals", "settings_refused_before_anything_is_patched",
                "flags_and_yaml_keys_take_rescore", "check_command_describes_rescore"],
    "query": ["registered_with_the_bf16_query", "every_mode_and_query_through_sglang_forward",
              "query_flag_yaml_key_and_refusals", "check_command_names_the_query"],
}
SCENARIO_ENV = {
    "on": {ENV: "bf16", "SGLANG_PLUGINS": "cupy_dsa", "SGLANG_FP8_PAGED_MQA_LOGITS_TORCH": "1",
           "SGLANG_OPT_USE_TOPK_V2": "0"},
    "off": {},
    "excluded": {ENV: "bf16", "SGLANG_PLUGINS": "someone_else"},
    "refusals": {ENV: "bf16", "SGLANG_PLUGINS": "cupy_dsa"},
    # SGLang's own fp8 forward (the baseline of the top-k checks) runs its torch fp8 logits on CPU
    "fp8cupy": {ENV: "fp8-cupy", "SGLANG_PLUGINS": "cupy_dsa", "SGLANG_FP8_PAGED_MQA_LOGITS_TORCH": "1",
                "SGLANG_OPT_USE_TOPK_V2": "0"},
    # stage 1 from SGLang's own call runs its torch fp8 logits on CPU
    "rescore": {ENV: "fp8-rescore", "SGLANG_PLUGINS": "cupy_dsa", "SGLANG_FP8_PAGED_MQA_LOGITS_TORCH": "1",
                "SGLANG_OPT_USE_TOPK_V2": "0"},
    # the bf16 query at start-up; every mode and query inside
    "query": {ENV: "bf16", core.QUERY_ENV: "bf16", "SGLANG_PLUGINS": "cupy_dsa", "SGLANG_FP8_PAGED_MQA_LOGITS_TORCH": "1",
              "SGLANG_OPT_USE_TOPK_V2": "0"},
}
_CLEARED = (ENV, "SGLANG_PLUGINS", "SGLANG_PLATFORM", "SGLANG_OPT_DSV4_NONPAGED_INDEXER",
            "SGLANG_OPT_DSV4_NONPAGED_INDEXER_MIN_QUERY_TOKENS", "SGLANG_FP8_PAGED_MQA_LOGITS_TORCH",
            "SGLANG_OPT_USE_TOPK_V2", core.QUERY_ENV) + core.RESCORE_ENVS


def _require_sglang():
    if HAS_SGLANG:
        return
    msg = ("sglang is not installed: pip install -r tests/requirements-cpu.txt && "
           "pip install --no-deps sglang==0.5.23")
    if os.environ.get("CI"):
        pytest.fail(msg)
    pytest.skip(msg)


def _child_env(extra, seed):
    env = {k: v for k, v in os.environ.items() if k not in _CLEARED}
    env.update(extra)
    env["CUPY_DSA_SEED"] = str(seed)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


_SCENARIO_RESULTS: dict = {}
_BACKGROUND: dict = {}  # name -> (Popen, its result once collected): started with the scenarios, in parallel
_REFUSAL = "Refusing to start"
_STUB_PRELUDE = "import sys; sys.path.insert(0, 'scripts'); import _sglang_env; _sglang_env.install(); "
# SGLang without one of its dependencies: every torchvision import fails as it does where none is installed
_NO_TORCHVISION = (
    "import importlib.abc, sys\n"
    "class NoTorchvision(importlib.abc.MetaPathFinder):\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name.split('.')[0] == 'torchvision':\n"
    "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
    "sys.meta_path.insert(0, NoTorchvision())\n"
    "from sglang.srt.plugins import load_plugins\n"
    "load_plugins()\n")


def _background_commands():
    launcher = (_STUB_PRELUDE + "import runpy; sys.argv = ['sglang.launch_server', '--model-path', 'dummy']; "
                "runpy.run_module('sglang.launch_server', run_name='__main__', alter_sys=True)")
    return {
        # python -m sglang.launch_server with an invalid switch
        "launcher_invalid": ([sys.executable, "-c", launcher], {ENV: "bf8"}),
        # scripts/gpu_sglang_path.py in its CPU dry mode
        "gpu_script_dry": ([sys.executable, str(ROOT / "scripts" / "gpu_sglang_path.py"), "--device", "cpu"], {}),
        "missing_dependency": ([sys.executable, "-c", _NO_TORCHVISION], {ENV: "bf16", "SGLANG_PLUGINS": "cupy_dsa"}),
    }


def _background(name):
    """(returncode, stdout, stderr) of a background process started by _scenarios()."""
    _scenarios()
    proc, result = _BACKGROUND[name]
    if result is None:
        try:
            out, err = proc.communicate(timeout=900)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        result = (proc.returncode, out, err)
        _BACKGROUND[name] = (proc, result)
    return result


def _scenarios() -> dict:
    """Run the scenario processes concurrently, once per session;
    {scenario: {"results": ..., "info": ..., "seed": int} | {"crash": str, "seed": int}}."""
    if _SCENARIO_RESULTS:
        return _SCENARIO_RESULTS
    seed = int(os.environ.get("CUPY_DSA_SEED", torch.seed() % (2**31)))
    for name, (cmd, extra) in _background_commands().items():
        _BACKGROUND[name] = (subprocess.Popen(cmd, cwd=ROOT, env=_child_env(extra, 0), stdout=subprocess.PIPE,
                                              stderr=subprocess.PIPE, text=True), None)
    procs = {name: subprocess.Popen([sys.executable, str(CHECKS_SCRIPT), name], cwd=ROOT,
                                    env=_child_env(SCENARIO_ENV[name], seed), stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
             for name in CHECKS}
    for name, proc in procs.items():
        try:
            stdout, stderr = proc.communicate(timeout=900)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        line = next((ln for ln in reversed(stdout.splitlines()) if ln.startswith("RESULTS_JSON:")), None)
        if line is None:
            res = {"crash": f"rc={proc.returncode}\n{stderr[-6000:]}"}
        else:
            res = json.loads(line[len("RESULTS_JSON:"):])
        res["seed"] = seed
        _SCENARIO_RESULTS[name] = res
    return _SCENARIO_RESULTS


@pytest.mark.sglang
@pytest.mark.parametrize("scenario,check", [(s, c) for s, cs in CHECKS.items() for c in cs])
def test_sglang_check(scenario, check):
    _require_sglang()
    res = _scenarios()[scenario]
    if "crash" in res:
        pytest.fail(f"scenario {scenario!r} crashed (seed {res['seed']}):\n{res['crash']}")
    entry = res["results"].get(check)
    assert entry is not None, f"check {check!r} did not run in scenario {scenario!r}"
    info = {k: v for k, v in res.get("info", {}).items() if k.startswith("recall")}
    assert entry["ok"], f"seed {res['seed']} {info}\n{entry['error']}"


@pytest.mark.sglang
def test_every_check_is_listed():
    _require_sglang()
    for name, res in _scenarios().items():
        if "crash" not in res:
            assert sorted(res["results"]) == sorted(CHECKS[name]), name


@pytest.mark.sglang
def test_readme_quotes_sglang_pd_mismatch_message():
    """The README shows the message SGLang's own PD handshake gives an fp8 decode peer of a bf16 prefill peer
    (recorded by the "on" scenario's pd_layout_mismatch_refused), which names SGLANG_DSV4_KV_LAYOUT, not ours."""
    _require_sglang()
    res = _scenarios()["on"]
    msg = res.get("info", {}).get("pd_mismatch")
    assert msg, res.get("crash") or res["results"].get("pd_layout_mismatch_refused")
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert " ".join(msg.split()) in readme, msg


@pytest.mark.sglang
def test_launcher_refuses_invalid_value():
    """``python -m sglang.launch_server`` (load_plugins() first thing): an invalid switch stops it with our
    message, not SGLang's "Failed to execute general plugin" and an fp8 server."""
    _require_sglang()
    rc, _, err = _background("launcher_invalid")
    assert rc == 1, (rc, err[-3000:])
    assert f"{ENV}='bf8'" in err and _REFUSAL in err, err[-3000:]
    assert "Failed to execute general plugin" not in err


@pytest.mark.sglang
def test_missing_dependency_of_sglang_is_named():
    """SGLang without torchvision, switch on: the refusal names the import that failed and what to install,
    not a fallback AttributeError of the module path nor "its code differs"."""
    _require_sglang()
    rc, _, err = _background("missing_dependency")
    lines = [ln for ln in err.splitlines() if ln.startswith(("cupy_dsa", "  - ", "Nothing"))]
    msg = "\n".join(lines)
    assert rc == 1 and _REFUSAL.lower() in msg, (rc, err[-3000:])
    assert "No module named 'torchvision'" in msg and "pip install torchvision" in msg, msg
    assert "raised while importing sglang.srt.mem_cache.deepseek_v4_memory_pool" in msg, msg
    assert "do not import in this environment" in msg and "Nothing was patched" in msg, msg
    assert "AttributeError" not in msg and "code differs" not in msg and "Install a supported SGLang" not in msg, msg


@pytest.mark.sglang
@pytest.mark.slow
def test_other_sglang_version_refuses_cleanly(tmp_path):
    """A real SGLang 0.5.22 (``pip install --no-deps --target``, layered before the installed 0.5.23):
    load_plugins() with the switch on stops with the version refusal and patches nothing."""
    _require_sglang()
    target = tmp_path / "sglang-0.5.22"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile",
                          "--disable-pip-version-check", "--target", str(target), "sglang==0.5.22"],
                         capture_output=True, text=True, timeout=600)
    if pip.returncode != 0:
        msg = f"pip install sglang==0.5.22 failed:\n{pip.stderr[-2000:]}"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    env = _child_env({ENV: "bf16"}, 0)
    env["PYTHONPATH"] = os.pathsep.join([str(target), env["PYTHONPATH"]])
    r = subprocess.run([sys.executable, str(CHECKS_SCRIPT), "refuse_installed"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env=env)
    print(r.stderr.splitlines()[-3:] if r.stderr else "")
    assert r.returncode == 1, (r.returncode, r.stdout[-2000:], r.stderr[-3000:])
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("cupy_dsa")]
    assert lines and "found SGLang 0.5.22" in lines[0] and "written for SGLang 0.5.23" in lines[0], r.stderr[-3000:]
    assert "Nothing was patched" in r.stderr and f"unset {ENV}" in r.stderr
    assert "Failed to execute general plugin" not in r.stderr and "Applied" not in r.stderr


@pytest.mark.sglang
def test_gpu_sglang_path_dry_mode():
    """scripts/gpu_sglang_path.py (SGLang's pool, plans, metadata, store call site and forward_c4_indexer with
    cupy_dsa's ops) in its CPU dry mode: the code the H200 runs, with the CPU backends on both sides."""
    _require_sglang()
    rc, out, err = _background("gpu_script_dry")
    last = out.strip().splitlines()[-1] if out.strip() else ""
    assert rc == 0 and last.startswith("SGLANG GPU PATH: PASS"), f"{out[-4000:]}\n{err[-3000:]}"
    assert "11 phases" in last and "bf16-reference" in last and "bf16 query" in last and "fp8-cupy" in last \
        and "fp8-rescore" in last, last


# --------------------------------------------------------------------------------------------------
# Without SGLang
# --------------------------------------------------------------------------------------------------

def test_entry_point_declared():
    eps = importlib.metadata.entry_points(group="sglang.srt.plugins")
    ours = [ep for ep in eps if ep.name == "cupy_dsa"]
    assert len(ours) == 1 and ours[0].value == "cupy_dsa.sglang.plugin:register", list(eps)
    from cupy_dsa.sglang import plugin

    assert ours[0].load() is plugin.register


def test_plugin_import_is_lazy():
    code = ("import sys, cupy_dsa.sglang.plugin, cupy_dsa.sglang.core; "
            "bad = [m for m in ('sglang', 'cupy') if m in sys.modules]; assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       env=_child_env({}, 0))
    assert r.returncode == 0, r.stderr[-3000:]


def test_switch_values(monkeypatch):
    for value, mode in ((None, "fp8"), ("", "fp8"), ("fp8", "fp8"), ("BF16", "bf16"), (" bf16-fp4sim ", "bf16-fp4sim")):
        if value is None:
            monkeypatch.delenv(ENV, raising=False)
        else:
            monkeypatch.setenv(ENV, value)
        core.reset_mode()
        assert core.index_k_mode() == mode
    monkeypatch.setenv(ENV, "int8")
    core.reset_mode()
    with pytest.raises(ValueError, match="bf16-fp4sim"):
        core.index_k_mode()
    core.reset_mode()
    assert core.numerics_of("bf16-fp4sim") == "fp4sim" and core.numerics_of("bf16") == "exact"


def test_fp8_cupy_mode_keeps_sglangs_format(monkeypatch):
    """fp8-cupy: a value of the switch (any case), SGLang's fp8 rows and query, exact numerics, its own PD tag;
    the index-cache helpers tell the two row formats from SGLang's other caches."""
    monkeypatch.setenv(ENV, " FP8-Cupy ")
    core.reset_mode()
    assert core.index_k_mode() == "fp8-cupy" and core.enabled()
    core.reset_mode()
    assert [core.cache_layout(m) for m in core.MODES] == ["fp8", "bf16", "bf16", "bf16", "fp8", "fp8"]
    assert core.numerics_of("fp8-cupy") == "exact" and core.record("fp8-cupy").query == "fp8"
    assert core.pd_layout_tag("fp8-cupy") == ",c4idx:fp8-cupy"
    assert "cupy_dsa" in core.describe("fp8-cupy") and core.describe("bf16") == "bf16 C4 index keys"
    with pytest.raises(ValueError, match="fp8-cupy: SGLang's fp8 C4 index keys on cupy_dsa's store and kernels"):
        core.parse_mode("fp8cupy")
    u8 = torch.uint8
    assert core.index_cache_layout(torch.zeros(2, layouts.FP8_PAGE_BYTES, dtype=u8)) == "fp8"
    assert core.index_cache_layout(torch.zeros(2, layouts.BF16_PAGE_BYTES, dtype=u8)) == "bf16"
    for other in (torch.zeros(2, 64 * 584, dtype=u8), torch.zeros(2, 4352, dtype=u8),
                  torch.zeros(2, layouts.FP8_PAGE_BYTES, dtype=torch.int8), torch.zeros(2, 64, 1, 132, dtype=u8), None):
        assert core.index_cache_layout(other) is None, other


def test_fp8_rescore_mode_and_settings(monkeypatch):
    """fp8-rescore: a value of the switch, SGLang's fp8 rows in its pool plus residual pages (264 B per entry), its own
    PD tag; stage 1 and K' from their variables, read once per process, invalid values named."""
    monkeypatch.setenv(ENV, "FP8-Rescore")
    for name in core.RESCORE_ENVS:
        monkeypatch.delenv(name, raising=False)
    core.reset_mode()
    try:
        assert core.index_k_mode() == "fp8-rescore" and core.enabled() and core.is_two_level("fp8-rescore")
        assert core.cache_layout("fp8-rescore") == "fp8" and core.numerics_of("fp8-rescore") == "exact"
        assert core.pd_layout_tag("fp8-rescore") == ",c4idx:fp8-rescore"
        assert core.index_query() == core.record("fp8-rescore").query == "bf16"  # its stage-2 query by default
        assert [core.index_bytes_per_entry(m) for m in core.MODES] == [132, 256, 256, 256, 132, 264]
        assert "int8 residual pages" in core.describe("fp8-rescore")
        assert not any(core.is_two_level(m) for m in core.MODES[:-1])
        settings = core.rescore_settings()
        assert settings == ("sglang", 4, None) and settings.k_prime(512) == 2048 and settings.k_prime(1024) == 4096
        assert "stage 1 = SGLang's own fp8 logits call" in settings.describe() and "K' = 4x index_topk" in settings.describe()
        assert "stage 2 with the rotated q rounded to bf16 once" in core.describe_query("fp8-rescore", "bf16")
        monkeypatch.setenv(core.RESCORE_KPRIME_ENV, "1500")
        assert core.rescore_settings().k_prime(512) == 2048, "the settings were re-read without reset_mode"
        core.reset_mode()
        assert core.rescore_settings().k_prime(512) == 1500
        with pytest.raises(ValueError, match="at least index_topk \\(2048\\)"):
            core.rescore_settings().k_prime(2048)
        for value, expect in (("2x", (2, None)), (" 3X ", (3, None)), ("4096", (None, 4096)), (None, (4, None))):
            assert core.parse_k_prime(value) == expect, value
        for bad in ("0x", "x", "-1", "2.5x", "4y", "1e3"):
            with pytest.raises(ValueError, match=core.RESCORE_KPRIME_ENV):
                core.parse_k_prime(bad)
        assert core.parse_stage1(" CUPY ") == "cupy" and core.parse_stage1(None) == "sglang"
        with pytest.raises(ValueError, match="expected one of sglang, cupy"):
            core.parse_stage1("deepgemm")
        monkeypatch.setenv(core.QUERY_ENV, " FP8 ")
        core.reset_mode()
        assert core.rescore_settings() == ("sglang", None, 1500), core.rescore_settings()
        assert core.index_query() == "fp8"
        assert "stage 2 with SGLang's fused fp8 q" in core.describe_query("fp8-rescore", "fp8")
        monkeypatch.setenv(core.QUERY_ENV, "fp4")
        assert f"{core.QUERY_ENV}='fp4'" in core.settings_problem("fp8-rescore")
        monkeypatch.setenv(core.QUERY_ENV, "bf16")
        assert core.settings_problem("fp8-rescore") is None
        monkeypatch.setenv(core.RESCORE_STAGE1_ENV, "tilelang")
        assert "'tilelang'" in core.settings_problem("fp8-rescore")
        assert "apply to fp8-rescore only" in core.settings_problem("bf16")
        monkeypatch.delenv(core.QUERY_ENV)
        assert "apply to fp8-rescore only" in core.settings_problem("fp8")  # the switch off refuses them too
        with pytest.raises(ValueError, match="fp8-rescore: two-level C4 index keys"):
            core.parse_mode("fp8rescore")
    finally:
        core.reset_mode()


def test_lo_cache_registry():
    """The lo pages are found from their fp8 rows (or a view at the same address) while those rows are alive."""
    hi = torch.zeros(3, layouts.FP8_PAGE_BYTES, dtype=torch.uint8)
    lo = torch.zeros_like(hi)
    core.register_lo_cache(hi, lo)
    assert core.lo_cache_of(hi) is lo and core.lo_cache_of(hi[:]) is lo
    assert core.lo_cache_of(torch.zeros_like(hi)) is None
    with pytest.raises(ValueError, match="do not match"):
        core.register_lo_cache(hi, torch.zeros(2, layouts.FP8_PAGE_BYTES, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="no residual \\(lo\\) pages"):
        core.require_lo_cache(torch.zeros_like(hi), "a test")
    ptr = hi.data_ptr()
    del hi
    assert all(entry[0]() is None for key, entry in core._LO_PAGES.items() if key[1] == ptr)


def test_warm_expressions_fp8_rescore():
    """fp8-rescore warms the two-level store (both pages in one launch), the rescoring kernels of stage 2's q (fp8 or
    bf16, the default), and its own fp8-key logits only when cupy_dsa computes stage 1."""
    from cupy_dsa import launch, logits, query, rescore, store

    for arch in ("sm_80", "sm_90", "sm_120"):
        exprs = core.warm_expressions(arch, mode="fp8-rescore", next_ns=(1, 2), stage1="cupy", query="fp8")
        assert exprs[core.STORE_SOURCE] == store.product_instantiations(
            layouts=("two-level",), numerics=("exact",), in_dtypes=(torch.bfloat16,), sources=("decode", "prefill"))
        assert exprs[core.LOGITS_SOURCE] == logits.product_instantiations(arch, q_fp8=(1,), next_ns=(1, 2),
                                                                          layouts=("fp8",))
        assert exprs[core.RESCORE_SOURCE] == [e for e in rescore.product_instantiations()
                                              if e != "rescore_topk_kernel<0>"]
        assert set(exprs[core.RESCORE_SOURCE]) <= set(launch.product_expressions(arch)[core.RESCORE_SOURCE])
        sg = core.warm_expressions(arch, mode="fp8-rescore", next_ns=(1, 2), stage1="sglang", query="fp8")
        assert core.LOGITS_SOURCE not in sg and sg[core.RESCORE_SOURCE] == exprs[core.RESCORE_SOURCE]
        assert core.QUERY_SOURCE not in exprs
        # a bf16 stage-2 q: stage 2's bf16-q instantiation instead of the fp8-q one, and the query prep that makes
        # that q (bf16 numerics, bf16 weights_proj output); the rest unchanged
        bq = core.warm_expressions(arch, mode="fp8-rescore", next_ns=(1, 2), stage1="cupy")  # default: bf16
        assert bq[core.RESCORE_SOURCE] == [e for e in rescore.product_instantiations() if e != "rescore_topk_kernel<1>"]
        assert bq[core.QUERY_SOURCE] == query.product_instantiations(numerics=("bf16",))
        assert {f: e for f, e in bq.items() if f not in (core.RESCORE_SOURCE, core.QUERY_SOURCE)} == \
            {f: e for f, e in exprs.items() if f != core.RESCORE_SOURCE}


def test_rescore_routes_share_the_forward_plans(monkeypatch):
    """The rescoring routes on CPU (the references): decode rows, grouped verify and varlen extend give the
    reference's selection; the schedules and a chunk's request offsets are built by the first layer only."""
    import cupy_dsa
    from cupy_dsa.rescore import rescore_topk_reference, store_two_level_reference

    g = torch.Generator().manual_seed(3)
    P, n = 24, 2
    hi = torch.zeros(P, layouts.FP8_PAGE_BYTES, dtype=torch.uint8)
    lo = torch.zeros_like(hi)
    store_two_level_reference(torch.randn(P * 64, 128, generator=g), hi, lo, torch.arange(P * 64))
    lens = torch.tensor([300, 301, 700, 701, 1200, 1201], dtype=torch.int32)
    R = lens.shape[0]
    q = torch.randn(R, 64, 128, generator=g).to(torch.float8_e4m3fn)
    w = torch.rand(R, 64, generator=g)
    pt = torch.stack([torch.randperm(P, generator=g)[:20] for _ in range(R // n)]).to(torch.int32).repeat_interleave(n, 0)
    ref = rescore_topk_reference(q.unsqueeze(1), w, hi, lo, lens, pt, 256, 512)
    built = []
    for name in ("paged_mqa_logits_plan", "mqa_logits_plan"):
        real = getattr(cupy_dsa, name)
        monkeypatch.setattr(cupy_dsa, name, lambda *a, _real=real, _name=name, **k: built.append(_name) or _real(*a, **k))
    md = types.SimpleNamespace(compressed_seq_lens=lens)
    cu_rows, bt = core.extend_requests(torch.tensor([2, 2, 2], dtype=torch.int32), pt, R)
    for layer in (1, 3):
        plans = core.ForwardPlans.for_layer(md, lens, layer)
        rows = [core.rescore_rows(q, w, lens, pt, hi, lo, r, 256, 512, plans) for r in core.row_chunks(R, 4, 1280, False)]
        verify = core.rescore_verify(q, w, lens, pt, hi, lo, n, slice(0, R), 256, 512, plans)
        ext = [core.rescore_extend(q, w, lens, cu_rows, bt, hi, lo, r, 256, 512, plans)
               for r in core.row_chunks(R, 3, 1280, False)]  # chunks split request 1 (rows 2-3)
        for what, outs in (("rows", rows), ("verify", [verify]), ("extend", ext)):
            raw = torch.cat([o.raw_indices for o in outs])
            page = torch.cat([o.page_indices for o in outs])
            for r in range(R):
                assert set(raw[r].tolist()) == set(ref.raw_indices[r].tolist()), (what, layer, r)
                assert set(page[r].tolist()) == set(ref.page_indices[r].tolist()), (what, layer, r)
    # one forward (two layers): 2 row chunks + 1 verify schedule + 2 varlen chunk plans, each built once
    assert sorted(built) == sorted(["paged_mqa_logits_plan"] * 3 + ["mqa_logits_plan"] * 2), built
    cu, _ = plans.items[("rescore-varlen", 3, 6)]
    assert cu.tolist() == [0, 0, 1, 3], "chunk rows [3, 6): request 1 owns row 3, request 2 rows 4-5"
    with pytest.raises(ValueError, match="whole requests"):
        core.rescore_verify(q, w, lens, pt, hi, lo, n, slice(0, 3), 256, 512)


def test_warm_expressions_fp8_cupy():
    """fp8-cupy warms the fp8-layout store (exact numerics) and the fp8-key logits, nothing of the bf16 layout."""
    from cupy_dsa import launch, logits, store

    for arch in ("sm_80", "sm_90", "sm_120"):
        exprs = core.warm_expressions(arch, mode="fp8-cupy", next_ns=(1, 2), kv_dtypes=(torch.bfloat16,))
        assert exprs[core.STORE_SOURCE] == store.product_instantiations(
            layouts=("fp8",), numerics=("exact",), in_dtypes=(torch.bfloat16,), sources=("decode", "prefill"))
        assert exprs[core.LOGITS_SOURCE] == logits.product_instantiations(arch, q_fp8=(1,), next_ns=(1, 2),
                                                                          layouts=("fp8",))
        assert not set(exprs[core.LOGITS_SOURCE]) & set(core.warm_expressions(arch, mode="bf16")[core.LOGITS_SOURCE]
                                                        ) - {e for e in exprs[core.LOGITS_SOURCE] if "plan" in e}
        assert set(exprs[core.STORE_SOURCE]) <= set(launch.product_expressions(arch)[core.STORE_SOURCE])
        assert core.QUERY_SOURCE not in exprs


def test_mode_records():
    """One frozen record per mode; what each mode's helpers answer comes from it."""
    import dataclasses

    assert core.MODES == ("fp8", "bf16", "bf16-fp4sim", "bf16-reference", "fp8-cupy", "fp8-rescore")
    table = {m: (r.key_format, r.key_numerics, r.query, r.query_settable, r.scoring)
             for m, r in core.MODE_RECORDS.items()}
    assert table == {"fp8": ("fp8", "exact", "fp8", False, "sglang"),
                     "bf16": ("bf16", "exact", "fp8", True, "one-pass"),
                     "bf16-fp4sim": ("bf16", "fp4sim", "fp8", True, "one-pass"),
                     "bf16-reference": ("bf16", "fp4sim", "fp4sim", False, "one-pass"),
                     "fp8-cupy": ("fp8", "exact", "fp8", True, "one-pass"),
                     "fp8-rescore": ("two-level", "exact", "bf16", True, "two-level")}
    with pytest.raises(dataclasses.FrozenInstanceError):
        core.record("bf16").query = "bf16"
    assert [m for m in core.MODES if core.record(m).hooked] == list(core.MODES[1:])
    assert [core.record(m).bytes_per_entry for m in core.MODES] == [132, 256, 256, 256, 132, 264]


def test_mode_table_is_rendered_from_the_records():
    table = core.mode_table().splitlines()
    assert len(table) == 2 + len(core.MODES)
    assert table[3] == ("| `bf16` | bf16 C4 index keys | 256 | exact | `fp8` by default, or `bf16` | one-pass |")
    assert table[5] == ("| `bf16-reference` | bf16 C4 index keys holding FP4-rounded values, DeepSeek-V4's reference "
                        "query | 256 | fp4sim | `fp4sim` (fixed) | one-pass |")
    assert table[7].startswith("| `fp8-rescore` | two-level") and "| 264 | exact | `bf16` by default, or `fp8` |" \
        in table[7]


def test_query_setting(monkeypatch):
    """SGLANG_CUPY_DSA_INDEX_Q: fp8 or bf16 (any case), for bf16, bf16-fp4sim, fp8-cupy and fp8-rescore (its stage 2);
    unset: the mode's default; refused by name with fp8 (the switch off) and bf16-reference (its query is fixed), and
    an invalid value refused with every mode."""
    settable = [m for m in core.MODES if core.record(m).query_settable]
    assert settable == ["bf16", "bf16-fp4sim", "fp8-cupy", "fp8-rescore"]
    for mode in core.MODES:
        assert core.query_of(mode, None) == core.query_of(mode, "  ") == core.record(mode).query
        for value in ("fp8", " BF16 "):
            if mode in settable:
                assert core.query_of(mode, value) == value.strip().lower()
            else:
                with pytest.raises(ValueError, match=f"{core.QUERY_ENV}='{value}' set with {ENV}={mode}"):
                    core.query_of(mode, value)
        with pytest.raises(ValueError, match=f"{core.QUERY_ENV}='fp16': expected one of fp8, bf16"):
            core.query_of(mode, "fp16")
    for name in core.RESCORE_ENVS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(ENV, "fp8-cupy")
    monkeypatch.setenv(core.QUERY_ENV, "bf16")
    core.reset_mode()
    try:
        assert core.index_query() == "bf16" and core.settings_problem("fp8-cupy") is None
        monkeypatch.setenv(core.QUERY_ENV, "fp8")
        assert core.index_query() == "bf16", "the query was re-read without reset_mode"
        core.reset_mode()
        assert core.index_query() == "fp8"
        for mode, why in (("fp8", "the switch is off"), ("bf16-reference", "its query (fp4sim) is part of the mode")):
            problem = core.settings_problem(mode)
            assert f"{core.QUERY_ENV}='fp8' set with {ENV}={mode}: {why}" in problem, problem
        assert "query: the rotated q rounded to bf16 once" in core.describe_query("bf16", "bf16")
        assert "PD tag" not in core.pd_layout_hint("bf16") and f"{core.QUERY_ENV} may differ" in \
            core.pd_layout_hint("bf16")
    finally:
        core.reset_mode()


def test_warm_expressions_follow_the_query():
    """A bf16 query: the one-pass modes warm the bf16-q logits of their layout and the bf16 query prep (one launch);
    fp8-rescore keeps its fp8-q stage 1 and swaps stage 2's instantiation; fixed-query modes take no other query."""
    from cupy_dsa import logits, query

    for arch in ("sm_90", "sm_120"):
        for mode in ("bf16", "bf16-fp4sim", "fp8-cupy"):
            rec = core.record(mode)
            fp8 = core.warm_expressions(arch, mode=mode, next_ns=(1, 3))
            bf16 = core.warm_expressions(arch, mode=mode, query="bf16", next_ns=(1, 3))
            assert bf16[core.STORE_SOURCE] == fp8[core.STORE_SOURCE] and core.QUERY_SOURCE not in fp8
            assert bf16[core.LOGITS_SOURCE] == logits.product_instantiations(arch, q_fp8=(0,), next_ns=(1, 3),
                                                                             layouts=(rec.cache_layout,))
            assert fp8[core.LOGITS_SOURCE] == logits.product_instantiations(arch, q_fp8=(1,), next_ns=(1, 3),
                                                                            layouts=(rec.cache_layout,))
            assert bf16[core.QUERY_SOURCE] == query.product_instantiations(numerics=("bf16",))
        ref = core.warm_expressions(arch, mode="bf16-reference")
        assert ref[core.QUERY_SOURCE] == query.product_instantiations(numerics=("fp4sim",))
        assert ref[core.LOGITS_SOURCE] == logits.product_instantiations(arch, q_fp8=(0,), layouts=("bf16",))
        r8 = core.warm_expressions(arch, mode="fp8-rescore", query="fp8", stage1="cupy")
        r16 = core.warm_expressions(arch, mode="fp8-rescore", query="bf16", stage1="cupy")
        assert r8[core.LOGITS_SOURCE] == r16[core.LOGITS_SOURCE]  # stage 1: SGLang's fp8 q either way
        for mode, other in (("bf16-reference", "bf16"), ("bf16-reference", "fp8"), ("fp8", "bf16")):
            with pytest.raises(ValueError, match=f"{mode} does not take the query '{other}'"):
                core.warm_expressions(arch, mode=mode, query=other)


def test_switch_is_cached_until_reset(monkeypatch):
    monkeypatch.setenv(ENV, "bf16")
    core.reset_mode()
    assert core.index_k_mode() == "bf16"
    monkeypatch.setenv(ENV, "fp8")
    assert core.index_k_mode() == "bf16" and core.enabled()
    assert core.set_mode("BF16-FP4SIM") == "bf16-fp4sim" and os.environ[ENV] == "bf16-fp4sim"
    assert core.index_k_mode() == "bf16-fp4sim"
    core.reset_mode()


def test_startup_refused_is_not_an_exception():
    # SGLang's load_plugins() logs and swallows Exception; a refusal must stop start-up
    e = core.StartupRefused("no")
    assert isinstance(e, SystemExit) and not isinstance(e, Exception) and str(e) == "no"


# --------------------------------------------------------------------------------------------------
# Warm-up selection: what one server launches
# --------------------------------------------------------------------------------------------------

def _fake_logits_product(calls):
    from cupy_dsa import launch

    def product_instantiations(arch, *, q_fp8, next_ns, layouts):
        calls.append((arch, q_fp8, next_ns, layouts))
        return launch.product_expressions(arch)[core.LOGITS_SOURCE][: len(next_ns)]

    return product_instantiations


def test_warm_expressions_selects_the_server_variants(monkeypatch):
    import cupy_dsa.logits
    from cupy_dsa import launch, store

    calls = []
    monkeypatch.setattr(cupy_dsa.logits, "product_instantiations", _fake_logits_product(calls))
    exprs = core.warm_expressions("sm_90", mode="bf16", next_ns=(2, 1, 2))
    assert calls == [("sm_90", (1,), (1, 2), ("bf16",))]
    assert set(exprs) == {core.STORE_SOURCE, core.LOGITS_SOURCE}
    declared = launch.product_expressions("sm_90")
    # store: bf16 layout, exact numerics, V4 keys with Hadamard, bf16 kv, decode and prefill plan rows only
    assert exprs[core.STORE_SOURCE] == ["store_index_k<0, 0, 0, true, __nv_bfloat16, 1>",
                                        "store_index_k<0, 0, 0, true, __nv_bfloat16, 2>"]
    assert set(exprs[core.STORE_SOURCE]) <= set(declared[core.STORE_SOURCE])
    fp4 = core.warm_expressions("sm_80", mode="bf16-fp4sim", kv_dtypes=(torch.float32, torch.bfloat16))
    assert fp4[core.STORE_SOURCE] == store.product_instantiations(
        numerics=("fp4sim",), in_dtypes=(torch.float32, torch.bfloat16), sources=("decode", "prefill"))
    assert len(fp4[core.STORE_SOURCE]) == 4 and all("<0, 1, 0, true," in e for e in fp4[core.STORE_SOURCE])
    assert len(declared[core.STORE_SOURCE]) == 96  # the rest compiles on first use


def test_warm_expressions_with_logits_product():
    """cupy_dsa.logits.product_instantiations itself: the plan kernel, one decode kernel per next_n for the
    arch, the paged prefill tile; a small part of the product set."""
    from cupy_dsa import launch, logits

    if not hasattr(logits, "product_instantiations"):
        pytest.skip("cupy_dsa.logits.product_instantiations not in this checkout")
    for arch in ("sm_80", "sm_90", "sm_120"):
        product = launch.product_expressions(arch)[core.LOGITS_SOURCE]
        one = core.warm_expressions(arch, mode="bf16")[core.LOGITS_SOURCE]
        two = core.warm_expressions(arch, mode="bf16", next_ns=(1, 2))[core.LOGITS_SOURCE]
        assert set(one) < set(two) <= set(product) and len(two) < len(product) // 3, (arch, two)
        assert two == logits.product_instantiations(arch, q_fp8=(1,), next_ns=(1, 2), layouts=("bf16",))


def test_warm_expressions_rejects_undeclared(monkeypatch):
    import cupy_dsa.logits

    monkeypatch.setattr(cupy_dsa.logits, "product_instantiations", lambda arch, **kw: ["mqa_logits_kernel<9>"],
                        raising=False)
    with pytest.raises(RuntimeError, match="does not declare"):
        core.warm_expressions("sm_90", mode="bf16")


def test_server_next_ns():
    ns = types.SimpleNamespace
    assert core.server_next_ns(None) == (1,)
    assert core.server_next_ns(ns(speculative_algorithm=None, speculative_num_draft_tokens=None)) == (1,)
    assert core.server_next_ns(ns(speculative_algorithm="EAGLE", speculative_num_draft_tokens=2)) == (1, 2)
    assert core.server_next_ns(ns(speculative_algorithm="NEXTN", speculative_num_draft_tokens=4)) == (1, 4)


def test_ensure_warm_compiles_only_the_selection(monkeypatch):
    """ensure_warm hands runtime.warm_up_expressions exactly the selection, once per (device, config)."""
    import cupy_dsa.logits
    from cupy_dsa import runtime

    monkeypatch.setattr(cupy_dsa.logits, "product_instantiations", _fake_logits_product([]))
    monkeypatch.setattr(runtime, "device_arch", lambda idx: "sm_90")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    seen = []
    monkeypatch.setattr(runtime, "warm_up_expressions", lambda idx, exprs: seen.append((idx, exprs)) or 3)
    monkeypatch.setattr(core, "_WARMED", set())
    monkeypatch.setattr(core, "_WARM_CONFIG", dict(core._WARM_CONFIG))
    monkeypatch.setenv(ENV, "bf16")
    core.reset_mode()
    core.configure_warm(next_ns=(1, 2), kv_dtypes=(torch.bfloat16,))
    core.ensure_warm(torch.device("cuda", 0))
    core.ensure_warm(torch.device("cuda", 0))
    assert len(seen) == 1 and seen[0][0] == 0
    assert seen[0][1] == core.warm_expressions("sm_90", mode="bf16", next_ns=(1, 2))
    monkeypatch.setenv(core.QUERY_ENV, "bf16")  # another query: its own selection, warmed once too
    core.reset_mode()
    core.ensure_warm(torch.device("cuda", 0))
    core.ensure_warm(torch.device("cuda", 0))
    assert len(seen) == 2 and seen[1][1] == core.warm_expressions("sm_90", mode="bf16", query="bf16", next_ns=(1, 2))
    core.reset_mode()


def test_warm_up_hook_takes_the_server_arguments(monkeypatch):
    """BEFORE ModelRunner.init_cuda_graphs: next_n from the speculative settings, kv dtype from the model."""
    from cupy_dsa.sglang import hooks

    seen = []
    monkeypatch.setattr(core, "_WARM_CONFIG", dict(core._WARM_CONFIG))
    monkeypatch.setattr(core, "ensure_warm", lambda device: seen.append((device, dict(core._WARM_CONFIG))))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setenv(ENV, "bf16")
    core.reset_mode()
    runner = types.SimpleNamespace(device="cuda", dtype=torch.bfloat16, server_args=types.SimpleNamespace(
        speculative_algorithm="EAGLE", speculative_num_draft_tokens=3))
    assert hooks._warm_up_hook(runner) is None
    assert seen == [(torch.device("cuda", 3), {"next_ns": (1, 3), "kv_dtypes": (torch.bfloat16,)})]
    monkeypatch.setenv(ENV, "fp8")
    core.reset_mode()
    hooks._warm_up_hook(runner)
    assert len(seen) == 1, "warmed with the switch off"
    core.reset_mode()


def test_warm_up_expressions_compiles_one_program_per_file(monkeypatch):
    """runtime.warm_up_expressions: one RawModule per file with exactly the expressions not yet loaded."""
    from cupy_dsa import runtime

    modules = []

    class Fn:
        def compile(self):
            pass

    class RawModule:
        def __init__(self, code, options, name_expressions):
            modules.append(list(name_expressions))

        def get_function(self, expr):
            return Fn()

    class Device:
        def __init__(self, idx):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

    fake_cp = types.SimpleNamespace(RawModule=RawModule, cuda=types.SimpleNamespace(Device=Device))
    monkeypatch.setattr(runtime, "cupy_module", lambda: fake_cp)
    monkeypatch.setattr(runtime, "device_arch", lambda idx: "sm_90")
    monkeypatch.setattr(runtime, "_FUNCTIONS", {})
    from cupy_dsa import launch

    declared = launch.product_expressions("sm_90")["store_index_k.cu"]
    store_exprs = declared[:3]
    assert runtime.warm_up_expressions(7, {"store_index_k.cu": store_exprs}) == 3
    assert modules == [store_exprs]
    assert runtime.warm_up_expressions(7, {"store_index_k.cu": store_exprs[:2] + store_exprs[:1]}) == 2
    assert len(modules) == 1, "already-loaded expressions were compiled again"
    assert all((7, "store_index_k.cu", e) in runtime._FUNCTIONS for e in store_exprs)
    # a first use through the launch layer loads the source's other product configs in one program,
    # keeping the loaded kernels
    loaded = {e: runtime._FUNCTIONS[(7, "store_index_k.cu", e)] for e in store_exprs}
    monkeypatch.setattr(launch, "_LOADED", {})
    launch._load_source(7, "store_index_k.cu")
    assert modules[-1] == declared[3:]
    assert all(runtime._FUNCTIONS[(7, "store_index_k.cu", e)] is f for e, f in loaded.items())
    runtime.get_function("store_index_k.cu", declared[-1], 7)
    assert len(modules) == 2, "a loaded expression was compiled again"


def test_forward_plans_built_once_per_forward(monkeypatch):
    import cupy_dsa

    calls = []
    real = cupy_dsa.paged_mqa_logits_plan

    def plan(lens, next_n):
        calls.append((lens.clone(), next_n))
        return real(lens, next_n)

    monkeypatch.setattr(cupy_dsa, "paged_mqa_logits_plan", plan)
    md = types.SimpleNamespace(compressed_seq_lens=torch.tensor([300, 64, 900], dtype=torch.int32))
    q = torch.randn(3, 64, 128).to(torch.float8_e4m3fn)
    w, pt = torch.rand(3, 64), torch.arange(45, dtype=torch.int32).view(3, 15)
    cache = torch.zeros(48, layouts.BF16_PAGE_BYTES, dtype=torch.uint8)
    seen = []
    real_logits = cupy_dsa.paged_mqa_logits
    monkeypatch.setattr(cupy_dsa, "paged_mqa_logits", lambda *a, **k: seen.append(k.get("plan")) or real_logits(*a, **k))
    for layer in (1, 3, 5):  # one forward: the first C4 layer builds the schedules, the others reuse them
        plans = core.ForwardPlans.for_layer(md, md.compressed_seq_lens, layer)
        for r in core.row_chunks(3, 2, 960, False):
            core.paged_logits(q, w, md.compressed_seq_lens, pt, cache, 960, r, plans)
    assert len(calls) == 2 and [c[0].tolist() for c in calls] == [[300, 64], [900]]
    assert len(seen) == 6 and seen[0] is seen[2] is seen[4] and seen[1] is seen[3] is seen[5]
    assert seen[0].tolist() == [0, 5, 6]  # pages per request, cumulated (int64 [B + 1])
    core.ForwardPlans.for_layer(md, md.compressed_seq_lens, 1)  # layer 1 again: a new pass (forward, capture)
    plans = core.ForwardPlans.for_layer(md, md.compressed_seq_lens, 1)
    core.paged_logits(q, w, md.compressed_seq_lens, pt, cache, 960, slice(0, 3), plans)
    assert len(calls) == 3
    md.compressed_seq_lens.add_(1)  # written in place (graph replay buffers): rebuilt
    plans = core.ForwardPlans.for_layer(md, md.compressed_seq_lens, 2)
    core.paged_logits(q, w, md.compressed_seq_lens, pt, cache, 960, slice(0, 3), plans)
    assert len(calls) == 4 and calls[-1][0].tolist() == [301, 65, 901]
    assert core.ForwardPlans.for_layer(types.SimpleNamespace(), md.compressed_seq_lens, 1) is not None
    assert core.ForwardPlans.for_layer(object(), md.compressed_seq_lens, 1) is None  # nowhere to keep them


def test_verify_and_extend_plans(monkeypatch):
    """The grouped verify plan is next_n-wide 2-D lengths (one per request); the varlen plan one per chunk."""
    import cupy_dsa

    n, B = 2, 3
    lens = torch.tensor([300, 301, 64, 64, 899, 900], dtype=torch.int32)
    md = types.SimpleNamespace(compressed_seq_lens=lens)
    q = torch.randn(B * n, 64, 128).to(torch.float8_e4m3fn)
    w = torch.rand(B * n, 64)
    pt = torch.arange(45, dtype=torch.int32).view(3, 15).repeat_interleave(n, 0)
    cache = torch.zeros(48, layouts.BF16_PAGE_BYTES, dtype=torch.uint8)
    seen = []
    real_logits = cupy_dsa.paged_mqa_logits

    def spy(q_, kv, w_, lens_, bt, width, **k):
        seen.append((tuple(q_.shape), lens_.tolist(), bt.tolist(), k["plan"].tolist()))
        return real_logits(q_, kv, w_, lens_, bt, width, **k)

    monkeypatch.setattr(cupy_dsa, "paged_mqa_logits", spy)
    plans = core.ForwardPlans.for_layer(md, lens, 1)
    out = core.verify_logits(q, w, lens, pt, cache, 960, n, slice(0, B * n), plans)
    assert out.shape == (B * n, 960)
    assert seen == [((B, n, 64, 128), [[300, 301], [64, 64], [899, 900]], pt[::n].tolist(), [0, 5, 6, 21])]
    with pytest.raises(ValueError, match="whole requests"):
        core.verify_logits(q, w, lens, pt, cache, 960, n, slice(0, 3), plans)
    # extend: requests from extend_seq_lens, each its first row's page-table row; the plan once per chunk
    cu_rows, bt = core.extend_requests(torch.tensor([2, 3, 1], dtype=torch.int32), pt, 6)
    assert cu_rows.tolist() == [0, 2, 5, 6] and bt.tolist() == [pt[0].tolist(), pt[2].tolist(), pt[5].tolist()]
    built = []
    real_plan = cupy_dsa.mqa_logits_plan
    monkeypatch.setattr(cupy_dsa, "mqa_logits_plan", lambda c, rows: built.append(rows) or real_plan(c, rows=rows))
    ks, ke = torch.zeros(6, dtype=torch.int32), lens
    for _ in range(2):
        for r in core.row_chunks(6, 4, 960, False):
            core.extend_logits(q, w, ks, ke, cu_rows, bt, cache, r, plans)
    assert built == [(0, 4), (4, 6)]


def test_rope_table_is_a_view():
    ang = torch.rand(16, 32)
    fc = torch.polar(torch.ones_like(ang), ang)
    t = core.rope_table(fc)
    assert t.shape == (16, 64) and t.dtype == torch.float32 and t.data_ptr() == fc.data_ptr()
    assert torch.allclose(t[:, 0::2], torch.cos(ang))
    assert torch.allclose(t[:, 1::2], torch.sin(ang))


def test_row_chunks():
    assert core.row_chunks(10, None, 64, False) == [slice(0, 10)]
    assert core.row_chunks(10, 4, 64, False) == [slice(0, 4), slice(4, 8), slice(8, 10)]
    width = 1 << 20
    rows = core.MAX_EAGER_LOGITS_BYTES // (width * 4)
    chunks = core.row_chunks(3 * rows, None, width, False)
    assert len(chunks) == 3 and all(c.stop - c.start == rows for c in chunks)
    assert core.row_chunks(3 * rows, None, width, True) == [slice(0, 3 * rows)]  # never split a capture
    chunks = core.row_chunks(3 * rows, None, width, False, multiple=3)  # whole verify requests of 3 rows
    assert all((c.stop - c.start) % 3 == 0 for c in chunks) and chunks[-1].stop == 3 * rows


def test_topk_page_indices(seed):
    R, pages, k = 4, 6, 64
    logits = torch.randn(R, pages * 64)
    lens = torch.tensor([10, 64, 65, 384], dtype=torch.int32)
    pt = torch.stack([torch.randperm(50)[:pages] for _ in range(R)]).to(torch.int32)
    page_idx, raw = core.topk_page_indices(logits, lens, pt, k)
    for r in range(R):
        n = int(lens[r])
        got = sorted(x for x in raw[r].tolist() if x >= 0)
        exp = sorted(range(n)) if n <= k else sorted(logits[r, :n].double().topk(k).indices.tolist())
        assert got == exp, f"row {r} (seed {seed})"
        for i, g in zip(raw[r].tolist(), page_idx[r].tolist()):
            assert g == (-1 if i < 0 else int(pt[r, i // 64]) * 64 + i % 64)


# --------------------------------------------------------------------------------------------------
# GPU: the plugin's path with SGLang-shaped tensors, eager and captured, against the CPU path
# --------------------------------------------------------------------------------------------------

def _decode_plan(seq_lens):
    """DecodePlan rows (uint8 [B, 16]): u32 seq_len, i32 write_loc, i32 read_page_0, i32 read_page_1."""
    a = np.zeros((len(seq_lens), 4), dtype="<i4")
    a[:, 0] = np.asarray(seq_lens, dtype=np.uint32).view(np.int32)
    return torch.from_numpy(a.view(np.uint8).reshape(len(seq_lens), 16).copy())


def _compress_plan(seq_lens, ragged_ids):
    """CompressPlan rows (uint8 [N, 16]): u32 seq_len (0xFFFFFFFF invalid), u16 ragged_id, u16 buffer_len, 2 x i32."""
    n = len(seq_lens)
    a = np.zeros(n, dtype=[("seq", "<u4"), ("rid", "<u2"), ("blen", "<u2"), ("p0", "<i4"), ("p1", "<i4")])
    a["seq"], a["rid"], a["blen"] = seq_lens, ragged_ids, 4
    return torch.from_numpy(a.view(np.uint8).reshape(n, 16).copy())


def _ulp_diff(a, b):
    """bf16 distance in units of the larger value's ulp (2^-7 relative); values within 1e-6 of each other
    count as equal (an fp32 rounding difference may flip the sign of a value next to zero)."""
    a, b = a.float(), b.float()
    ulp = torch.maximum(a.abs(), b.abs()) * 2.0 ** -7
    d = (a - b).abs()
    return torch.where(d <= 1e-6, torch.zeros_like(d), d / ulp.clamp_min(1e-30)).ceil()


def _cmp_logits(name, got, ref, lens, tol=2e-3):
    bad, worst = 0, 0.0
    for r in range(ref.shape[0]):
        n = int(lens[r])
        g, e = got[r, :n].double().cpu(), ref[r, :n].double()
        err = (g - e).abs()
        lim = tol * (e.abs().max().item() + 1e-6)
        bad += int((err > lim).sum())
        worst = max(worst, err.max().item() / max(lim, 1e-30) if n else 0.0)
    assert bad == 0, f"{name}: {bad} logits outside tolerance (worst {worst:.2f}x the limit)"


def _recall(a, b):
    sa, sb = set(a.tolist()) - {-1}, set(b.tolist()) - {-1}
    return len(sa & sb) / max(len(sb), 1)


@pytest.mark.gpu
def test_gpu_plugin_path_eager_and_graph(seed):
    dev = torch.device("cuda")
    n_pages, topk, max_pos = 48, 512, 16384
    n_slots = n_pages * 64
    # SGLang's buffers: page rows uint8 [P, 16384] (zeros), complex64 rope table, fp32 norm weight
    cache_cpu = torch.zeros(n_pages, layouts.BF16_PAGE_BYTES, dtype=torch.uint8)
    ang = torch.rand(max_pos, 32) * 6.2831853
    freq_cis = torch.polar(torch.ones_like(ang), ang)
    norm_w = torch.rand(128) + 0.5

    # 1. prefill store of every slot 64..n_slots-1 through a CompressPlan (position = seq_len - 4)
    n_tok = n_slots - 64
    kv = torch.randn(n_tok, 128)
    seq = (torch.arange(n_tok) + 1) * 4
    seq_np = seq.numpy().astype(np.uint32)
    seq_np[7] = 0xFFFFFFFF  # an invalid entry must be skipped
    ragged = torch.randperm(n_tok).numpy().astype(np.uint16)
    out_loc = torch.empty(n_tok, dtype=torch.int64)
    out_loc[torch.from_numpy(ragged.astype(np.int64))] = torch.arange(64, n_slots)
    plan_c = _compress_plan(seq_np, ragged)
    store_kw = dict(is_decode=False, compress_ratio=4, norm_eps=1e-6, mode="bf16")
    core.store_index_k_bf16(kv, plan_c, norm_weight=norm_w, freq_cis=freq_cis, out_loc=out_loc, kvcache=cache_cpu,
                            **store_kw)
    cache_gpu = torch.zeros_like(cache_cpu, device=dev)
    core.store_index_k_bf16(kv.to(dev), plan_c.to(dev), norm_weight=norm_w.to(dev), freq_cis=freq_cis.to(dev),
                            out_loc=out_loc.to(dev), kvcache=cache_gpu, **store_kw)
    torch.cuda.synchronize()
    d = _ulp_diff(cache_gpu.cpu().view(torch.bfloat16), cache_cpu.view(torch.bfloat16))
    assert int(d.max()) <= 1, f"prefill store: max {int(d.max())} bf16 ulp from the CPU path, {int((d > 0).sum())} differ"
    skipped = int(out_loc[int(ragged[7])])
    assert not cache_gpu.view(-1, 256)[skipped].any(), "the invalid plan entry was written"

    # 2. decode rows (SGLang's shapes): q fp8 [R,64,128], weights fp32 [R,64], lens int32 [R], page_table [R,max_pages]
    R, max_pages = 6, 40
    # SGLang slices the page table out of a wider per-request buffer: row stride > max_pages, stride(1) == 1
    pt_full = torch.stack([torch.randperm(n_pages) for _ in range(R)]).to(torch.int32)
    pt = pt_full[:, :max_pages]
    lens = torch.tensor([1, 300, 512, 513, 1800, max_pages * 64], dtype=torch.int32)
    q = torch.randn(R, 64, 128).to(torch.float8_e4m3fn)
    w = torch.rand(R, 64)
    width = max_pages * 64
    ref = torch.cat([core.paged_logits(q, w, lens, pt, cache_cpu, width, r) for r in core.row_chunks(R, 4, width, False)])
    gq, gw, gl, gpt = q.to(dev), w.to(dev), lens.to(dev), pt_full.to(dev)[:, :max_pages]
    assert gpt.stride() == (n_pages, 1)
    got = torch.cat([core.paged_logits(gq, gw, gl, gpt, cache_gpu, width, r) for r in core.row_chunks(R, 4, width, False)])
    assert got.shape == (R, width) and got.dtype == torch.float32
    _cmp_logits("paged (eager)", got, ref, lens)
    ref_idx, ref_raw = core.topk_page_indices(ref, lens, pt, topk)
    got_idx, got_raw = core.topk_page_indices(got, gl, gpt, topk)
    rec = [_recall(got_raw[r].cpu(), ref_raw[r]) for r in range(R)]
    assert min(rec) >= 0.99, f"paged top-{topk} overlap with the CPU path per row: {rec}"

    # 3. a multi-request extend (ks = 0, ke = causal compressed length), the plugin's varlen route: 3 requests
    # of 30 / 1 / 33 rows with their page-table rows, in row chunks of 24 (one straddles two requests)
    T = 64
    ke = torch.linspace(600, max_pages * 64, T).to(torch.int32)
    ks = torch.zeros(T, dtype=torch.int32)
    qp = torch.randn(T, 64, 128).to(torch.float8_e4m3fn)
    wp = torch.rand(T, 64)
    row_pt = pt[torch.tensor([0] * 30 + [1] + [2] * 33)]
    cu, bt = core.extend_requests(torch.tensor([30, 1, 33], dtype=torch.int32), row_pt, T)
    gcu, gbt = core.extend_requests(torch.tensor([30, 1, 33], dtype=torch.int32, device=dev), row_pt.to(dev), T)
    refp = torch.cat([core.extend_logits(qp, wp, ks, ke, cu, bt, cache_cpu, r) for r in core.row_chunks(T, 24, width, False)])
    gotp = torch.cat([core.extend_logits(qp.to(dev), wp.to(dev), ks.to(dev), ke.to(dev), gcu, gbt, cache_gpu, r)
                      for r in core.row_chunks(T, 24, width, False)])
    _cmp_logits("extend (varlen)", gotp, refp, ke)
    # 3b. target verify, 3 requests x 2 draft rows grouped as next_n 2 (one page-table row per request)
    vl = torch.tensor([900, 901, 64, 64, 2500, 2501], dtype=torch.int32)
    vpt = pt[torch.tensor([0, 0, 1, 1, 2, 2])]
    qv, wv = torch.randn(6, 64, 128).to(torch.float8_e4m3fn), torch.rand(6, 64)
    refv = core.verify_logits(qv, wv, vl, vpt, cache_cpu, width, 2, slice(0, 6))
    gotv = core.verify_logits(qv.to(dev), wv.to(dev), vl.to(dev), vpt.to(dev), cache_gpu, width, 2, slice(0, 6))
    _cmp_logits("verify (grouped)", gotv, refv, vl)

    # 4. CUDA graph: decode store + paged logits + top-k captured, replayed on new inputs
    B = R
    dec_kv = torch.randn(B, 128, device=dev)
    dec_seq = torch.tensor([8, 9, 12, 400, 4000, 8001], dtype=torch.int64)  # 9 and 8001 are not boundaries
    dec_plan = _decode_plan(dec_seq.numpy()).to(dev)
    dec_loc = torch.tensor([3, 4, 5, 6, 7, 8], dtype=torch.int64, device=dev)  # page 0 slots, unused above
    out_idx = torch.full((R, topk), -1, dtype=torch.int32, device=dev)
    out_raw = torch.full((R, topk), -1, dtype=torch.int32, device=dev)
    g_norm, g_fc = norm_w.to(dev), freq_cis.to(dev)

    def step():
        core.store_index_k_bf16(dec_kv, dec_plan, is_decode=True, compress_ratio=4, norm_weight=g_norm, norm_eps=1e-6,
                                freq_cis=g_fc, out_loc=dec_loc, kvcache=cache_gpu, mode="bf16")
        logits = core.paged_logits(gq, gw, gl, gpt, cache_gpu, width, slice(0, R))
        i, r = core.topk_page_indices(logits, gl, gpt, topk)
        out_idx.copy_(i)
        out_raw.copy_(r)

    core.ensure_warm(dev)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    # new inputs in place, then replay
    new_kv = torch.randn(B, 128)
    new_q = torch.randn(R, 64, 128).to(torch.float8_e4m3fn)
    dec_kv.copy_(new_kv.to(dev))
    gq.copy_(new_q.to(dev))
    graph.replay()
    torch.cuda.synchronize()
    # CPU path on the same new inputs
    dec_cpu = cache_gpu.cpu().clone()
    dec_cpu.view(-1, 256)[:9] = 0
    core.store_index_k_bf16(new_kv, dec_plan.cpu(), is_decode=True, compress_ratio=4, norm_weight=norm_w, norm_eps=1e-6,
                            freq_cis=freq_cis, out_loc=dec_loc.cpu(), kvcache=dec_cpu, mode="bf16")
    d = _ulp_diff(cache_gpu.cpu().view(torch.bfloat16), dec_cpu.view(torch.bfloat16))
    assert int(d.max()) <= 1, f"decode store (graph): max {int(d.max())} bf16 ulp from the CPU path"
    written = sorted(int(i) for i in (cache_gpu.view(-1, 256)[:9] != 0).any(1).nonzero().flatten().cpu())
    assert written == [3, 5, 6, 7], f"decode store (graph) wrote slots {written}, expected [3, 5, 6, 7]"
    ref2 = core.paged_logits(new_q, w, lens, pt, dec_cpu, width, slice(0, R))
    _, ref2_raw = core.topk_page_indices(ref2, lens, pt, topk)
    rec = [_recall(out_raw[r].cpu(), ref2_raw[r]) for r in range(R)]
    assert min(rec) >= 0.99, f"graph replay top-{topk} overlap with the CPU path per row: {rec}"
    exp_idx = torch.where(out_raw.long() >= 0, gpt.long().gather(1, out_raw.long().clamp(min=0) // 64) * 64
                          + out_raw.long() % 64, -1)
    assert torch.equal(out_idx.long(), exp_idx), "page indices are not the slot transform of the raw indices"


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["bf16", "fp8-cupy", "fp8-rescore"])
def test_gpu_bf16_query_path_graph(seed, monkeypatch, mode):
    """SGLANG_CUPY_DSA_INDEX_Q=bf16 on the plugin's path: warm-up compiles the bf16 query's instantiations, then one
    decode step and one grouped verify step (next_n 2) of two C4 layers, each preparing its query from the layer's
    projections (core.project_query + core.prepare_query, one launch) and scoring with it (the logits, or fp8-rescore's
    stage 2 beside SGLang's fp8 q), are captured in one CUDA graph and replayed on new projections; query, logits and
    top-k against the CPU path."""
    import cupy_dsa
    from cupy_dsa import runtime
    from cupy_dsa.query import prepare_index_q_reference

    dev = torch.device("cuda")
    monkeypatch.setenv(ENV, mode)
    monkeypatch.setenv(core.QUERY_ENV, "bf16")
    for name in core.RESCORE_ENVS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(core.RESCORE_STAGE1_ENV, "cupy")
    core.reset_mode()
    rec = core.record(mode)
    n_pages, topk, max_pos, R, max_pages = 40, 512, 8192, 6, 40
    width = max_pages * 64
    ang = torch.rand(max_pos, 32) * 6.2831853
    freq_cis = torch.polar(torch.ones_like(ang), ang)
    norm_w = torch.rand(128) + 0.5
    n_tok = n_pages * 64 - 64
    kv = torch.randn(n_tok, 128)
    seq = ((torch.arange(n_tok) + 1) * 4).numpy().astype(np.uint32)
    plan = _compress_plan(seq, np.arange(n_tok).astype(np.uint16))
    out_loc = torch.arange(64, n_pages * 64, dtype=torch.int64)
    caches = {}
    for d in (torch.device("cpu"), dev):
        cache = torch.zeros(n_pages, layouts.page_bytes(rec.cache_layout), dtype=torch.uint8, device=d)
        lo = torch.zeros_like(cache) if rec.two_level else None
        core.store_index_k_bf16(kv.to(d), plan.to(d), is_decode=False, compress_ratio=4, norm_weight=norm_w.to(d),
                                norm_eps=1e-6, freq_cis=freq_cis.to(d), out_loc=out_loc.to(d), kvcache=cache, mode=mode,
                                lo_cache=lo)
        caches[d.type] = (cache, lo)
    pt = torch.stack([torch.randperm(n_pages) for _ in range(R)]).to(torch.int32)[:, :max_pages]
    lens = torch.tensor([1, 700, 1500, 1501, 2300, 2301], dtype=torch.int32)   # rows 2-3 and 4-5: a verify request each
    vpt = pt[torch.tensor([0, 1, 2, 2, 4, 4])]
    positions = torch.arange(R)
    ws = 128 ** -0.5 * 64 ** -0.5
    on = {d.type: (freq_cis.to(d), positions.to(d), torch.zeros(R, 16, device=d)) for d in (torch.device("cpu"), dev)}

    def step(d, q_raw, w_raw, lens_d, pt_d, vpt_d, out):
        """Everything on ``d`` already: no host-to-device copy while a graph is captured."""
        cache, lo = caches[d.type]
        fc, pos, x = on[d.type]
        layer = types.SimpleNamespace(n_local_heads=64, head_dim=128, freqs_cis=fc, weight_scale=ws,
                                      compute_weights=lambda x, skip_scale=False: w_raw,
                                      wq_b=lambda a: (q_raw.view(q_raw.shape[0], -1), None))
        for i in range(2):  # two C4 layers
            q_proj, w_proj = core.project_query(layer, x, x)
            q_b, w_b = core.prepare_query(q_proj, w_proj, layer, pos, "bf16")
            w_b = w_b.squeeze(2)
            if rec.two_level:
                q8, w8 = cupy_dsa.prepare_index_q(q_proj, w_proj, freqs_cis=core.rope_table(fc), positions=pos,
                                                  weight_scale=ws, numerics="fp8")
                res = core.rescore_rows(q8, w8, lens_d, pt_d, cache, lo, slice(0, R), topk, 4 * topk,
                                        q_rescore=q_b, weights_rescore=w_b)
                raw = res.raw_indices
                vraw = core.rescore_verify(q8, w8, lens_d, vpt_d, cache, lo, 2, slice(2, 6), topk, 4 * topk,
                                           q_rescore=q_b, weights_rescore=w_b).raw_indices
            else:
                logits = core.paged_logits(q_b, w_b, lens_d, pt_d, cache, width, slice(0, R))
                _, raw = core.topk_page_indices(logits, lens_d, pt_d, topk)
                vlog = core.verify_logits(q_b, w_b, lens_d, vpt_d, cache, width, 2, slice(2, 6))
                _, vraw = core.topk_page_indices(vlog, lens_d[2:6], vpt_d[2:6], topk)
                out["logits"].copy_(logits)
            out["q"].copy_(q_b)
            out["raw"].copy_(raw)
            out["vraw"].copy_(vraw)

    def buffers(d):
        return {"q": torch.zeros(R, 64, 128, dtype=torch.bfloat16, device=d),
                "logits": torch.zeros(R, width, device=d), "raw": torch.zeros(R, topk, dtype=torch.int32, device=d),
                "vraw": torch.zeros(4, topk, dtype=torch.int32, device=d)}

    core.configure_warm(next_ns=(1, 2))
    core.ensure_warm(dev)
    warmed = core.warm_expressions(runtime.device_arch(dev.index or 0), mode=mode, query="bf16", next_ns=(1, 2),
                                   stage1="cupy")
    assert core.QUERY_SOURCE in warmed and any("prepare_index_q<2," in e for e in warmed[core.QUERY_SOURCE])
    q_raw = torch.zeros(R, 64, 128, dtype=torch.bfloat16, device=dev)
    w_raw = torch.zeros(R, 64, dtype=torch.bfloat16, device=dev)
    g_lens, g_pt, g_vpt = lens.to(dev), pt.to(dev), vpt.to(dev)
    out = buffers(dev)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step(dev, q_raw, w_raw, g_lens, g_pt, g_vpt, out)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(dev, q_raw, w_raw, g_lens, g_pt, g_vpt, out)
    for replay in range(2):
        new_q = (2 * torch.randn(R, 64, 128)).bfloat16()
        new_w = torch.rand(R, 64).bfloat16()
        q_raw.copy_(new_q.to(dev))
        w_raw.copy_(new_w.to(dev))
        graph.replay()
        torch.cuda.synchronize()
        ref = buffers(torch.device("cpu"))
        step(torch.device("cpu"), new_q, new_w, lens, pt, vpt, ref)
        want_q, _ = prepare_index_q_reference(new_q, new_w, freqs_cis=core.rope_table(freq_cis), positions=positions,
                                              weight_scale=ws, numerics="bf16")
        assert torch.equal(ref["q"], want_q)
        assert torch.equal(out["q"].cpu(), want_q), f"replay {replay}: the bf16 query differs from its reference"
        if not rec.two_level:
            _cmp_logits(f"{mode}, bf16 q, replay {replay}", out["logits"], ref["logits"], lens)
        for name, got, want in (("decode", out["raw"], ref["raw"]), ("verify", out["vraw"], ref["vraw"])):
            overlap = [_recall(got[r].cpu(), want[r]) for r in range(got.shape[0])]
            assert min(overlap) >= 0.99, f"{mode}, bf16 q, replay {replay}, {name}: top-k overlap {overlap}"
    core.reset_mode()


@pytest.mark.gpu
def test_gpu_rescore_path_eager_and_graph(seed):
    """fp8-rescore's glue on the device with SGLang-shaped tensors: the two-page store from a CompressPlan, the three
    rescoring routes (decode rows, grouped verify, varlen extend in two chunks) with the forward's plans and with
    caller logits standing in for SGLang's call, against the CPU path; then a decode step (store + rescored top-k of
    two layers sharing the plans) captured in a CUDA graph and replayed with new lengths."""
    from cupy_dsa.rescore import lo_views, two_level_dequant_reference

    dev = torch.device("cuda")
    n_pages, topk, kprime, max_pos = 48, 512, 1024, 16384
    n_slots = n_pages * 64
    ang = torch.rand(max_pos, 32) * 6.2831853
    freq_cis = torch.polar(torch.ones_like(ang), ang)
    norm_w = torch.rand(128) + 0.5
    caches = {}
    for d in (torch.device("cpu"), dev):
        caches[d.type] = (torch.zeros(n_pages, layouts.FP8_PAGE_BYTES, dtype=torch.uint8, device=d),
                          torch.zeros(n_pages, layouts.FP8_PAGE_BYTES, dtype=torch.uint8, device=d))
    n_tok = n_slots - 64
    kv = torch.randn(n_tok, 128)
    seq_np = ((np.arange(n_tok) + 1) * 4).astype(np.uint32)
    ragged = torch.randperm(n_tok).numpy().astype(np.uint16)
    out_loc = torch.empty(n_tok, dtype=torch.int64)
    out_loc[torch.from_numpy(ragged.astype(np.int64))] = torch.arange(64, n_slots)
    plan_c = _compress_plan(seq_np, ragged)
    for d, (hi, lo) in caches.items():
        core.store_index_k_bf16(kv.to(hi.device), plan_c.to(hi.device), is_decode=False, compress_ratio=4,
                                norm_weight=norm_w.to(hi.device), norm_eps=1e-6, freq_cis=freq_cis.to(hi.device),
                                out_loc=out_loc.to(hi.device), kvcache=hi, mode="fp8-rescore", lo_cache=lo)
    torch.cuda.synchronize()

    def keys(hi, lo):
        codes, scales = lo_views(lo.cpu())
        h = hi.cpu()
        return two_level_dequant_reference(h[:, :8192].reshape(-1, 128), h[:, 8192:].contiguous().view(torch.float32)
                                           .reshape(-1), codes.reshape(-1, 128), scales.reshape(-1))

    k_dev, k_cpu = keys(*caches["cuda"])[64:], keys(*caches["cpu"])[64:]
    err = ((k_dev - k_cpu).abs().amax(1) / k_cpu.abs().amax(1)).max().item()
    assert err <= 1e-3, f"two-page store: keys {err:.2e} from the CPU path"
    hi_c, lo_c = caches["cpu"]
    hi_g, lo_g = caches["cuda"]

    R, n, max_pages = 6, 2, 40
    pt = torch.stack([torch.randperm(n_pages)[:max_pages] for _ in range(R // n)]).to(torch.int32).repeat_interleave(n, 0)
    lens = torch.tensor([1, 2, 1500, 1501, max_pages * 64 - 1, max_pages * 64], dtype=torch.int32)
    q = torch.randn(R, 64, 128).to(torch.float8_e4m3fn)
    w = torch.rand(R, 64)
    width = max_pages * 64

    def overlap(name, got, ref):
        rec = [_recall(got.raw_indices[r].cpu(), ref.raw_indices[r]) for r in range(R)]
        assert min(rec) >= 0.99, f"{name}: top-{topk} overlap with the CPU path per row: {rec}"
        raw = got.raw_indices.long().cpu()
        exp = torch.where(raw >= 0, pt.long().gather(1, raw.clamp(min=0) // 64) * 64 + raw % 64, -1)
        assert torch.equal(got.page_indices.long().cpu(), exp), f"{name}: not SGLang's slot transform"

    gq, gw, gl, gpt = q.to(dev), w.to(dev), lens.to(dev), pt.to(dev)
    md_c, md_g = types.SimpleNamespace(compressed_seq_lens=lens), types.SimpleNamespace(compressed_seq_lens=gl)
    plans_c, plans_g = core.ForwardPlans.for_layer(md_c, lens, 1), core.ForwardPlans.for_layer(md_g, gl, 1)
    full = slice(0, R)
    ref = core.rescore_rows(q, w, lens, pt, hi_c, lo_c, full, topk, kprime, plans_c)
    overlap("rows", core.rescore_rows(gq, gw, gl, gpt, hi_g, lo_g, full, topk, kprime, plans_g), ref)
    overlap("verify", core.rescore_verify(gq, gw, gl, gpt, hi_g, lo_g, n, full, topk, kprime, plans_g), ref)
    cu, bt = core.extend_requests(torch.tensor([n] * (R // n), dtype=torch.int32, device=dev), gpt, R)
    parts = [core.rescore_extend(gq, gw, gl, cu, bt, hi_g, lo_g, r, topk, kprime, plans_g)
             for r in core.row_chunks(R, 3, width, False)]
    overlap("extend", types.SimpleNamespace(raw_indices=torch.cat([p.raw_indices for p in parts]),
                                            page_indices=torch.cat([p.page_indices for p in parts])), ref)
    logits = core.paged_logits(gq, gw, gl, gpt, hi_g, width, full)  # unmasked fp8 logits, as SGLang's call returns
    overlap("caller logits", core.rescore_rows(gq, gw, gl, gpt, hi_g, lo_g, full, topk, kprime, stage1_logits=logits),
            ref)

    # a decode step captured once: store (decode plan) + two C4 layers of rescored top-k, replayed on new lengths
    dec_kv = torch.zeros(R, 128, device=dev)
    dec_plan = torch.zeros(R, 16, dtype=torch.uint8, device=dev)
    dec_loc = torch.zeros(R, dtype=torch.int64, device=dev)
    out_idx = torch.full((R, topk), -1, dtype=torch.int32, device=dev)
    out_raw = torch.full_like(out_idx, -1)
    g_norm, g_fc = norm_w.to(dev), freq_cis.to(dev)
    holder = types.SimpleNamespace(compressed_seq_lens=gl)

    def step():
        core.store_index_k_bf16(dec_kv, dec_plan, is_decode=True, compress_ratio=4, norm_weight=g_norm, norm_eps=1e-6,
                                freq_cis=g_fc, out_loc=dec_loc, kvcache=hi_g, mode="fp8-rescore", lo_cache=lo_g)
        for layer in (0, 1):
            plans = core.ForwardPlans.for_layer(holder, gl, layer)
            res = core.rescore_rows(gq, gw, gl, gpt, hi_g, lo_g, full, topk, kprime, plans)
            out_idx.copy_(res.page_indices)
            out_raw.copy_(res.raw_indices)

    core.ensure_warm(dev)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for replay in range(2):
        new_lens = torch.randint(1, width + 1, (R,), dtype=torch.int32)
        new_q = torch.randn(R, 64, 128).to(torch.float8_e4m3fn)
        new_kv = torch.randn(R, 128)
        seq = [int(x) * 4 for x in new_lens]  # compression boundaries; the even rows write (one row per request)
        loc = torch.tensor([int(pt[r, (int(new_lens[r]) - 1) // 64]) * 64 + (int(new_lens[r]) - 1) % 64
                            if r % 2 == 0 else -1 for r in range(R)], dtype=torch.int64)
        for t, v in ((gl, new_lens), (gq, new_q), (dec_kv, new_kv), (dec_plan, _decode_plan(seq)), (dec_loc, loc)):
            t.copy_(v.to(dev))
        graph.replay()
        torch.cuda.synchronize()
        core.store_index_k_bf16(new_kv, _decode_plan(seq), is_decode=True, compress_ratio=4, norm_weight=norm_w,
                                norm_eps=1e-6, freq_cis=freq_cis, out_loc=loc, kvcache=hi_c, mode="fp8-rescore",
                                lo_cache=lo_c)
        ref = core.rescore_rows(new_q, w, new_lens, pt, hi_c, lo_c, full, topk, kprime)
        overlap(f"graph replay {replay + 1}", types.SimpleNamespace(raw_indices=out_raw, page_indices=out_idx), ref)


# --------------------------------------------------------------------------------------------------
# python -m cupy_dsa.sglang check
# --------------------------------------------------------------------------------------------------

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
