"""The SGLang 0.5.23 plugin (cupy_dsa.sglang) against SGLang's real classes, on CPU (CI).

Fresh processes, one per scenario, started together, run ``tests/sglang_checks`` (each hook-installing scenario
needs its own process: SGLang's HookRegistry cannot be undone) and report one result per check; every check is one
test here. Needs sglang 0.5.23 installed with ``--no-deps`` plus tests/requirements-cpu.txt: skipped without it,
failed without it when ``CI`` is set. The plugin without SGLang: test_sglang_settings.py, test_sglang_forward.py,
test_sglang_check.py; on a GPU: test_sglang_gpu.py.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from cupy_dsa.sglang import core
from sglang_plugin_env import ENV, ROOT, child_env as _child_env

CHECKS_SCRIPT = ROOT / "tests" / "sglang_checks"
HAS_SGLANG = importlib.util.find_spec("sglang") is not None

# Every check each scenario of tests/sglang_checks reports (test_every_check_is_listed keeps this honest).
CHECKS = {
    "on": [
        "hooks_applied", "env_field", "bytes_per_token_on", "pool_pages_on", "store_decode_plan",
        "store_prefill_plan", "store_via_sglang_call_site", "store_fp4sim", "indexer_recall_bf16_vs_fp8",
        "indexer_extend_varlen_path", "indexer_verify_grouped_path", "indexer_reference_mode_matches_the_reference_oracle",
        "indexer_logits_budget_chunks_equal_unchunked", "indexer_small_rows_and_padding",
        "indexer_hisparse_and_capturer", "pd_layout_mismatch_refused",
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


def _require_sglang():
    if HAS_SGLANG:
        return
    msg = ("sglang is not installed: pip install -r tests/requirements-cpu.txt && "
           "pip install --no-deps sglang==0.5.23")
    if os.environ.get("CI"):
        pytest.fail(msg)
    pytest.skip(msg)




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
