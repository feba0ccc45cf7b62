"""``python -m cupy_dsa.sglang check``: whether a SGLang server started in this environment gets cupy_dsa's index
keys, and with which query, one ``ok`` / ``PROBLEM`` / ``note`` line per fact, each problem with what to do. Exit code 0 when
everything the server needs holds.

Checks, in order: SGLang's plugin loader finds cupy_dsa (entry point group, ``SGLANG_PLUGINS``), the mode from
``SGLANG_CUPY_DSA_INDEX_K`` or ``--mode`` (what the server flag or its YAML key sets), the query that runs
(``SGLANG_CUPY_DSA_INDEX_Q``) and the CLI flag, the PD
layout tag, the installed SGLang against the hooks' fingerprint, the GPUs and
their archs, and on each GPU the kernels the mode uses (compiled and loaded) and a small store + logits run
against the CPU reference.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os

import torch

from .. import layouts
from . import core
from .modes import CLI_FLAG, ENV_NAME, MODES

ENTRY_POINT_GROUP = "sglang.srt.plugins"
ENTRY_POINT = "cupy_dsa.sglang.plugin:register"
PLUGINS_FILTER = "SGLANG_PLUGINS"
RUN_TESTED_ARCHS = ("sm_90",)                                # H200
# tests/test_compile.py: every declared config on the first five, the product configs (no spill, residency) on all
COMPILE_TESTED_ARCHS = ("sm_80", "sm_86", "sm_89", "sm_100", "sm_103", "sm_120", "sm_121")

OK, PROBLEM, NOTE = "ok", "PROBLEM", "note"


def _loader_lines() -> list[tuple[str, str]]:
    ours = [ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.name == "cupy_dsa"]
    if not ours:
        return [(PROBLEM, f"no cupy_dsa entry point in group {ENTRY_POINT_GROUP}: SGLang's load_plugins() will not "
                          "load cupy_dsa. Install the package (pip install -e . in the cupy_dsa checkout) into "
                          "the Python that runs the server.")]
    lines = []
    if ours[0].value != ENTRY_POINT:
        lines.append((PROBLEM, f"the cupy_dsa entry point is {ours[0].value!r}, expected {ENTRY_POINT!r}: reinstall "
                               "cupy_dsa (a stale install is first on the path)."))
    else:
        lines.append((OK, f"entry point cupy_dsa = {ENTRY_POINT} in group {ENTRY_POINT_GROUP}"))
    allowed = os.environ.get(PLUGINS_FILTER, "")
    names = {x.strip() for x in allowed.split(",") if x.strip()}
    if allowed and "cupy_dsa" not in names:
        lines.append((PROBLEM, f"{PLUGINS_FILTER}={allowed!r} does not list cupy_dsa: SGLang skips it. Add cupy_dsa "
                               f"to {PLUGINS_FILTER}, or unset it."))
    elif allowed:
        lines.append((OK, f"{PLUGINS_FILTER}={allowed!r} lists cupy_dsa"))
    else:
        lines.append((OK, f"{PLUGINS_FILTER} unset: SGLang loads every installed plugin, cupy_dsa included"))
    return lines


def _mode_lines(flag: str | None = None, query_flag: str | None = None) -> tuple[str | None, list[tuple[str, str]]]:
    """(mode, lines); mode None when the variable's value is refused, or disagrees with ``flag`` (the mode the
    server gets from --cupy-dsa-index-k-dtype or its --config YAML key: ``check --mode``). ``query_flag``: the query
    ``check --query`` gave (a refusal then names the flag, not the variable)."""
    from . import hooks

    raw = os.environ.get(ENV_NAME)
    try:
        mode = core.parse_mode(raw)
    except ValueError as e:
        return None, [(PROBLEM, f"{e}. SGLang start-up is refused with this value: set {ENV_NAME} to one of "
                                f"{', '.join(MODES)}.")]

    if flag is not None:
        flag = core.parse_mode(flag)
        if raw and raw.strip() and mode != flag:
            return None, [(PROBLEM, f"{CLI_FLAG} {flag} (--mode) and {ENV_NAME}={raw} differ: SGLang start-up is "
                                    f"refused with both values named. Unset {ENV_NAME} or make the two agree.")]
        if not (raw and raw.strip()):
            raw = flag  # what the flag sets in the launcher before the schedulers start
        mode = flag
    problem = core.settings_problem(mode, f"{core.QUERY_FLAG} {query_flag} (--query)" if query_flag else None)
    if problem:
        return None, [(PROBLEM, f"{problem}. SGLang start-up is refused with this setting.")]
    source = f" (from {CLI_FLAG} {flag}, --mode)" if flag is not None else ""
    rec = core.record(mode)
    if not rec.hooked:
        shown = f"{ENV_NAME}={raw}{source}" if raw and raw.strip() else f"{ENV_NAME} unset"
        lines = [(OK, f"{shown} -> fp8: the switch is off, SGLang runs unchanged with its fp8 "
                      f"index keys (set {ENV_NAME}=bf16 or pass {CLI_FLAG} bf16 to turn it on)")]
    else:
        query = core.query_of(mode, os.environ.get(core.QUERY_ENV))
        text = f"{ENV_NAME}={raw}{source} -> {mode}: {rec.keys} ({rec.bytes_per_entry} B per entry"
        text += f", {rec.key_numerics} key numerics)" if rec.cache_layout == "bf16" else ")"
        text += f"; {core.describe_query(mode, query)}"
        lines = [(OK, text)]
        if rec.two_level:
            lines[0] = (OK, text + f"; {core.rescore_settings_from_env().describe()}; {_candidates_text()}")
            lines += _k_prime_lines(core.rescore_settings_from_env())
        lines += [(OK, _budget_text()), (OK, _nonfinite_text())]
    parser = argparse.ArgumentParser()
    hooks._add_cli_args_hook(None, parser)
    flag = [a for a in parser._actions if CLI_FLAG in a.option_strings]
    if flag and tuple(flag[0].choices) == MODES:
        rule = (f"with {ENV_NAME} set, the flag must name the same mode or start-up is refused" if raw and raw.strip()
                else f"it sets {ENV_NAME} in the launcher before the schedulers start")
        lines.append((OK, f"server flag {CLI_FLAG} {{{','.join(MODES)}}} (also a --config key): {rule}"))
    else:
        lines.append((PROBLEM, f"the {CLI_FLAG} flag hook did not add the flag with choices {MODES}: reinstall cupy_dsa."))
    lines.append((NOTE, core.pd_layout_hint(mode).removeprefix("cupy_dsa: ")))
    return mode, lines


def _candidates_text() -> str:
    """Which select picks fp8-rescore's K' candidates on this machine's GPU (cupy_dsa.sglang.candidates)."""
    from . import candidates

    arch = None
    if torch.cuda.is_available():
        from cupy_dsa import runtime

        arch = runtime.device_arch(torch.cuda.current_device())
    return candidates.check_text(core.rescore_settings_from_env(), arch)


def _budget_text() -> str:
    raw = (os.environ.get(core.LOGITS_BUDGET_ENV) or "").strip()
    mib = core.parse_logits_budget_mib(raw)
    source = f"{core.LOGITS_BUDGET_ENV}={raw}" if raw else f"{core.LOGITS_BUDGET_ENV} unset: {mib}"
    return (f"prefill logits budget: SGLang's row chunks where it plans them (its DeepGEMM route), otherwise at most "
            f"{mib} MiB of fp32 logits per eager chunk ({source})")


def _nonfinite_text() -> str:
    on = core.debug_nonfinite()
    return (f"non-finite index keys are counted at the store; {core.DEBUG_NONFINITE_ENV}="
            + ("1: each new one is logged after its store (a host sync per layer: for debugging)" if on else
               "0 (default): set it to 1 to log them after each store (a host sync per layer)"))


def _k_prime_lines(settings) -> list[tuple[str, str]]:
    """K' as a count against the DeepSeek-V4 models' index_topk (start-up refuses a K' below the served model's;
    ``check`` does not know which model the server loads, so it says which models take the count)."""
    if settings.count is None:
        return []
    needs = ", ".join(f"{name} {topk}" for name, topk in core.MODEL_INDEX_TOPK.items())
    refused = [name for name, topk in core.MODEL_INDEX_TOPK.items() if settings.k_prime_problem(topk)]
    if not refused:
        return [(OK, f"{core.RESCORE_KPRIME_ENV}={settings.count}: at least every DeepSeek-V4 model's index_topk "
                     f"({needs})")]
    status = PROBLEM if len(refused) == len(core.MODEL_INDEX_TOPK) else NOTE
    return [(status, f"{core.RESCORE_KPRIME_ENV}={settings.count}: K' must be at least the model's index_topk "
                     f"({needs}); start-up refuses it with {' and '.join(refused)}. Use a multiple such as 4x (the "
                     f"default), or a count of at least {max(core.MODEL_INDEX_TOPK[n] for n in refused)}")]


def _sglang_lines(mode: str | None) -> list[tuple[str, str]]:
    from . import guard

    try:
        version = guard.sglang_version()
    except Exception as e:  # noqa: BLE001 - not installed, or broken metadata
        return [(PROBLEM, f"SGLang is not importable here ({type(e).__name__}: {e}): pip install "
                          f"sglang=={guard.SUPPORTED_SGLANG[-1]}")]
    problems = guard.compatibility_problems()
    if not problems:
        return [(OK, f"SGLang {version}: every function the hooks wrap, replace or call matches the fingerprint")]
    # with the switch off the server runs SGLang unchanged; turning it on would be refused
    status = NOTE if mode == "fp8" else PROBLEM
    details = "".join(f"\n{'':9}- {p}" for p in problems[1:])
    return [(status, f"{problems[0]} (the hooks were written for SGLang {', '.join(guard.SUPPORTED_SGLANG)}): "
                     f"start-up with cupy_dsa's index-key hooks is refused.{details}\n{'':9}{guard.remedy(problems)} Or run "
                     f"with {ENV_NAME}=fp8 (SGLang unchanged).")]


def _gpu_lines(mode: str | None) -> list[tuple[str, str]]:
    from cupy_dsa import runtime

    if not torch.cuda.is_available():
        return [(PROBLEM, "no CUDA GPU visible: a server cannot run here (check CUDA_VISIBLE_DEVICES and the "
                          "driver, torch.cuda.is_available() is False)")]
    lines = []
    for idx in range(torch.cuda.device_count()):
        name = torch.cuda.get_device_name(idx)
        try:
            arch = runtime.device_arch(idx)
        except RuntimeError as e:  # below runtime.MIN_ARCH: refused by name, as every launch would be
            lines.append((PROBLEM, str(e)))
            continue
        if arch in RUN_TESTED_ARCHS:
            lines.append((OK, f"cuda:{idx} {name} ({arch}): run-tested"))
        elif arch in COMPILE_TESTED_ARCHS:
            lines.append((NOTE, f"cuda:{idx} {name} ({arch}): the kernels are compile-tested only on this arch "
                                "(run-tested: sm_90); the self-test below is the first run"))
        else:
            lines.append((NOTE, f"cuda:{idx} {name} ({arch}): neither run- nor compile-tested "
                                f"(run: {', '.join(RUN_TESTED_ARCHS)}; compile: {', '.join(COMPILE_TESTED_ARCHS)})"))
        hooked = mode is not None and core.record(mode).hooked
        lines += _device_self_test(idx, mode if hooked else "bf16",
                                   core.query_of(mode, os.environ.get(core.QUERY_ENV)) if hooked else "fp8")
    return lines


def _device_self_test(idx: int, mode: str, query: str) -> list[tuple[str, str]]:
    """Warm the mode's kernels for its query on ``cuda:idx``, then store 128 keys and score 2 rows against the CPU
    path."""
    device = torch.device("cuda", idx)
    try:
        query_setting = query if core.record(mode).query_settable else os.environ.get(core.QUERY_ENV)
        with core.env_vars({ENV_NAME: core.parse_mode(mode), core.QUERY_ENV: query_setting}):
            core.ensure_warm(device)
    except Exception as e:  # noqa: BLE001 - a compile or load failure is the finding
        return [(PROBLEM, f"cuda:{idx}: compiling the {mode} kernels ({query} query) failed ({type(e).__name__}: {e})")]
    lines = [(OK, f"cuda:{idx}: the {mode} store and logits kernels ({query} query) compile and load")]
    try:
        worst = self_test(device, mode, query)
    except Exception as e:  # noqa: BLE001 - a launch failure is the finding
        return lines + [(PROBLEM, f"cuda:{idx}: the store + logits self-test failed ({type(e).__name__}: {e})")]
    if worst > SELF_TEST_TOLERANCE:
        return lines + [(PROBLEM, f"cuda:{idx}: store + logits differ from the CPU reference by {worst:.2e} "
                                  f"(relative, limit {SELF_TEST_TOLERANCE:.0e}): do not serve with {mode} here")]
    lines.append((OK, f"cuda:{idx}: store + logits match the CPU reference (worst relative error {worst:.1e})"))
    try:
        counted, planted = nonfinite_self_test(device, mode)
    except Exception as e:  # noqa: BLE001 - a launch failure is the finding
        return lines + [(PROBLEM, f"cuda:{idx}: the non-finite key self-test failed ({type(e).__name__}: {e})")]
    if counted != planted:
        return lines + [(PROBLEM, f"cuda:{idx}: the store counted {counted} non-finite keys of {planted} planted "
                                  f"(NaN / +inf / -inf rows): do not serve with {mode} here")]
    return lines + [(OK, f"cuda:{idx}: the store counts non-finite keys ({counted} of {planted} planted NaN / +-inf "
                         f"rows)")]


def nonfinite_self_test(device: torch.device, mode: str) -> tuple[int, int]:
    """Store 8 keys of the mode's layout on ``device``, three of them with a NaN, a +inf and a -inf in their kv
    row; ``(keys the store counted as non-finite, 3)``. The process's count is restored afterwards."""
    from cupy_dsa import store

    rec = core.record(mode if core.record(mode).hooked else "bf16")
    gen = torch.Generator().manual_seed(1)
    kv = torch.randn(8, 128, generator=gen)
    kv[2, 7], kv[4, 100], kv[7, 0] = float("nan"), float("inf"), float("-inf")
    ang = torch.rand(64, 32, generator=gen) * 6.2831853
    freqs = torch.stack((ang.cos(), ang.sin()), -1).reshape(64, 64)
    cache = torch.zeros(1, layouts.page_bytes(rec.cache_layout), dtype=torch.uint8, device=device)
    lo = torch.zeros_like(cache) if rec.two_level else None
    before = store.nonfinite_keys(device)
    store.store_index_k(kv.to(device), cache, positions=torch.arange(8, device=device) * 4,
                        out_loc=torch.arange(8, device=device), norm_weight=torch.ones(128, device=device),
                        freqs_cis=freqs.to(device), numerics=rec.key_numerics, lo_cache=lo)
    after = store.nonfinite_keys(device)
    store.nonfinite_counter(device).fill_(before)
    return after - before, 3


SELF_TEST_TOLERANCE = 2e-3


def self_test(device: torch.device, mode: str, query: str | None = None) -> float:
    """Store 128 keys (two pages of the mode's cache layout) through a prefill plan, score 2 rows of the mode's q
    (``query``, default the mode's: an fp8 or a bf16 tensor) over them, on ``device`` and on the CPU reference; the
    largest logit difference relative to the row's largest reference logit. Two-level keys: the residual pages are
    stored too, the logits take the fp8 q (stage 1) and the stage-2 scores (from both pages) of every key, with the
    query, are compared as well."""
    import numpy as np

    gen = torch.Generator().manual_seed(0)
    n_pages, n_tok = 2, 128
    kv = torch.randn(n_tok, 128, generator=gen)
    ang = torch.rand(4 * n_tok + 4, 32, generator=gen) * 6.2831853
    freq_cis = torch.polar(torch.ones_like(ang), ang)
    norm_w = torch.rand(128, generator=gen) + 0.5
    rows = np.zeros(n_tok, dtype=[("seq", "<u4"), ("rid", "<u2"), ("blen", "<u2"), ("p0", "<i4"), ("p1", "<i4")])
    rows["seq"], rows["rid"], rows["blen"] = (np.arange(n_tok) + 1) * 4, np.arange(n_tok), 4
    plan = torch.from_numpy(rows.view(np.uint8).reshape(n_tok, 16).copy())
    out_loc = torch.arange(n_tok, dtype=torch.int64)
    rec = core.record(mode)
    query = rec.query if query is None else query
    q_full = torch.randn(2, 64, 128, generator=gen)
    q = q_full.to(torch.float8_e4m3fn if core.logits_q_dtype(mode, query) == "fp8" else torch.bfloat16)
    q2 = q_full.to(torch.float8_e4m3fn if query == "fp8" else torch.bfloat16)  # stage 2's (two-level)
    w = torch.rand(2, 64, generator=gen)
    lens = torch.tensor([70, n_tok], dtype=torch.int32)
    page_table = torch.tensor([[1, 0], [0, 1]], dtype=torch.int32)
    logits, stage2 = [], []
    for dev in (torch.device("cpu"), device):
        cache = torch.zeros(n_pages, layouts.page_bytes(rec.cache_layout), dtype=torch.uint8, device=dev)
        lo = torch.zeros_like(cache) if rec.two_level else None
        core.store_index_k_bf16(kv.to(dev), plan.to(dev), is_decode=False, compress_ratio=4,
                                norm_weight=norm_w.to(dev), norm_eps=1e-6, freq_cis=freq_cis.to(dev),
                                out_loc=out_loc.to(dev), kvcache=cache, mode=mode, lo_cache=lo)
        logits.append(core.paged_logits(q.to(dev), w.to(dev), lens.to(dev), page_table.to(dev), cache, n_tok,
                                        slice(0, 2)).cpu())
        if lo is not None:
            from cupy_dsa.rescore import rescore_candidate_scores

            cand = torch.arange(n_tok, dtype=torch.int32, device=dev).repeat(2, 1)
            stage2.append(rescore_candidate_scores(q2.to(dev).unsqueeze(1), w.to(dev), cache, lo, lens.to(dev),
                                                   page_table.to(dev), cand).cpu())
    worst = 0.0
    for ref, got in (logits, stage2) if stage2 else (logits,):
        for r, n in enumerate(lens.tolist()):
            scale = ref[r, :n].abs().max().item() + 1e-6
            worst = max(worst, (got[r, :n] - ref[r, :n]).abs().max().item() / scale)
    return worst


def run(flag: str | None = None, query: str | None = None) -> tuple[int, list[tuple[str, str]]]:
    """(exit code, lines); ``flag``: the mode set by the server flag or YAML key (``check --mode``); ``query``: the
    query set by ``--cupy-dsa-index-q`` or its YAML key (``check --query``)."""
    lines = _loader_lines()
    raw_query = os.environ.get(core.QUERY_ENV)
    try:
        core.parse_query(raw_query)
    except ValueError as e:   # an invalid variable: the server would refuse it, whatever --query says
        lines.append((PROBLEM, f"{e}. SGLang start-up is refused with this value: set {core.QUERY_ENV} to one of "
                               f"{', '.join(core.QUERY_CHOICES)}, or unset it."))
        with core.env_vars({core.QUERY_ENV: None}):
            lines += _sglang_lines(None) + _gpu_lines(None)
        return 1, lines
    if query is not None and raw_query and raw_query.strip() and core.parse_query(raw_query) != core.parse_query(query):
        lines.append((PROBLEM, f"{core.QUERY_FLAG} {query} (--query) and {core.QUERY_ENV}={raw_query} differ: SGLang "
                               f"start-up is refused with both values named. Unset {core.QUERY_ENV} or make the two "
                               f"agree."))
        mode, mode_lines = None, []
    else:
        # what the flag sets in the launcher before the schedulers start
        with core.env_vars({core.QUERY_ENV: raw_query if query is None else query}):
            mode, mode_lines = _mode_lines(flag, query if query is not None and not (raw_query or "").strip()
                                           else None)
    lines += mode_lines
    lines += _sglang_lines(mode)
    with core.env_vars({core.QUERY_ENV: query if query is not None and mode is not None else raw_query}):
        lines += _gpu_lines(mode)
    return (1 if any(status == PROBLEM for status, _ in lines) else 0), lines


def main(argv: list[str] | None = None, mode: str | None = None, query: str | None = None) -> int:
    code, lines = run(mode, query)
    for status, text in lines:
        print(f"{status:<8} {text}")
    print("cupy_dsa check: " + ("everything a server with cupy_dsa's index keys needs holds" if code == 0 else
                                "problems above; fix them before starting the server"))
    return code
