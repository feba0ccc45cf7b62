"""The plugin's SGLang-free glue (cupy_dsa.sglang.core) without SGLang, on CPU: the entry point, the modes and
their settings (switch, query, fp8-rescore's stage 1 and K'), and the kernels a server warms up."""
from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import types

import pytest
import torch

from cupy_dsa import layouts
from cupy_dsa.sglang import core
from sglang_plugin_env import ENV, ROOT, child_env as _child_env


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
        stage2 = {q: rescore.RESCORE.select(("stage2", q), arch).expr for q in (0, 1)}
        assert exprs[core.RESCORE_SOURCE] == [e for e in rescore.product_instantiations(arch) if e != stage2[0]]
        assert stage2[1] in exprs[core.RESCORE_SOURCE]
        assert set(exprs[core.RESCORE_SOURCE]) <= set(launch.product_expressions(arch)[core.RESCORE_SOURCE])
        sg = core.warm_expressions(arch, mode="fp8-rescore", next_ns=(1, 2), stage1="sglang", query="fp8")
        assert core.LOGITS_SOURCE not in sg and sg[core.RESCORE_SOURCE] == exprs[core.RESCORE_SOURCE]
        assert core.QUERY_SOURCE not in exprs
        # a bf16 stage-2 q: stage 2's bf16-q instantiation instead of the fp8-q one, and the query prep that makes
        # that q (bf16 numerics, bf16 weights_proj output); the rest unchanged
        bq = core.warm_expressions(arch, mode="fp8-rescore", next_ns=(1, 2), stage1="cupy")  # default: bf16
        assert bq[core.RESCORE_SOURCE] == [e for e in rescore.product_instantiations(arch) if e != stage2[1]]
        assert bq[core.QUERY_SOURCE] == query.product_instantiations(numerics=("bf16",))
        assert {f: e for f, e in bq.items() if f not in (core.RESCORE_SOURCE, core.QUERY_SOURCE)} == \
            {f: e for f, e in exprs.items() if f != core.RESCORE_SOURCE}
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
