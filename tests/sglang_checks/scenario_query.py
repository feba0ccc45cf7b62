"""Scenario "query": SGLANG_CUPY_DSA_INDEX_K=bf16, SGLANG_CUPY_DSA_INDEX_Q=bf16, SGLANG_PLUGINS=cupy_dsa: the query
setting through SGLang's real classes.

* every mode x every query it takes, through SGLang's ``forward_c4_indexer`` (hooked) on decode rows, a varlen extend
  and a grouped verify (fp8-rescore: decode): a query cupy_dsa prepares (bf16, or bf16-reference's FP4-simulated one)
  comes from the layer's own projections (``weights_proj`` without its scale, then ``wq_b``), reaches the logits op
  (or fp8-rescore's stage 2) as exactly the query its reference prep makes, and the top-k equals the reference's top-k
  with that query over the mode's keys; the fp8 query is SGLang's (its prepare, no projection of ours);
* the query does not change the pages: PD tag and HiCache namespace are the key format's;
* the flag and the ``--config`` key set it; a value disagreeing with the variable, one a mode does not take (fp8, the
  switch off; bf16-reference) and an invalid one are refused.
"""
from __future__ import annotations

import contextlib
import os
import types

import torch

from cupy_dsa.sglang import core, hooks

from checks_indexer import _indexer_setup, one_attention_cp_rank, spied_logits_routes
from harness import (ENV, INFO, assert_argparse_rejects, assert_check_command_says, assert_refused, check,
                     every_hook_in_place, forward_cases, hicache_model_name, load, mode_env, server_args_from_yaml)
from scenario_rescore import sglang_fused_q_on_cpu

Q = core.QUERY_ENV


def query_env(value):
    """The query setting for a block (None: unset; read once per process: the cache is reset on entry and exit)."""
    return core.env_vars({Q: value})


def query_setup(mode, lens, groups=None, seed=7, max_pos=4096):
    """The mode's pool holding one set of keys (FP4-rounded for fp4sim numerics), an indexer layer with SGLang's
    projections (wq_b's and weights_proj's bf16 outputs, the RoPE table, weight_scale; ``ns.projections`` records the
    calls) and the queries the references make from them: ``ns.queries[name] = (q [rows, 64, 128], weights
    [rows, 64])`` for fp8 (SGLang's fused kernel's math), bf16 and fp4sim."""
    from cupy_dsa import fp4sim_reference
    from cupy_dsa.query import prepare_index_q_reference

    rec = core.record(mode)
    rows = len(lens)
    g = torch.Generator().manual_seed(seed)
    q_raw = (2 * torch.randn(rows, 64, 128, generator=g)).bfloat16()
    w_raw = torch.rand(rows, 64, generator=g).bfloat16()
    keys = torch.randn(2560, 128, generator=g)
    if rec.key_numerics == "fp4sim":
        keys = fp4sim_reference(keys).float()
    angles = torch.outer(torch.arange(max_pos, dtype=torch.float64), 1.6e5 ** (-torch.arange(32) / 32.0))
    freqs_cis = torch.polar(torch.ones_like(angles), angles).to(torch.complex64)
    weight_scale = 128 ** -0.5 * 64 ** -0.5
    table, positions = core.rope_table(freqs_cis), torch.arange(rows)
    queries = {n: prepare_index_q_reference(q_raw, w_raw, freqs_cis=table, positions=positions,
                                            weight_scale=weight_scale, numerics=n) for n in ("fp8", "bf16", "fp4sim")}
    projections = []
    layer = types.SimpleNamespace(
        layer_id=0, use_fp4_indexer=False, index_topk=512, n_local_heads=64, head_dim=128, freqs_cis=freqs_cis,
        weight_scale=weight_scale, compressor=None,
        compute_weights=lambda x, skip_scale=False: projections.append(("weights_proj", skip_scale)) or w_raw,
        wq_b=lambda a: projections.append(("wq_b",)) or (q_raw.reshape(rows, -1), None))
    q8, w8 = queries["fp8"]
    with mode_env("bf16"):  # the bf16 pool of the shared set-up is sized as in a bf16 mode
        out = _indexer_setup(lens=lens, groups=groups, keys=keys, q=q8, w=w8, layer=layer, two_level=rec.two_level)
    if rec.two_level:
        ns = out
    else:
        run, _, bf16_pool, fp8_pool, _ = out
        ns = types.SimpleNamespace(run=run, pool=bf16_pool if rec.cache_layout == "bf16" else fp8_pool)
    ns.queries, ns.projections, ns.lens, ns.topk, ns.mode = queries, projections, list(lens), 512, mode
    return ns


def _sets(t):
    return [{int(i) for i in row.tolist() if i >= 0} for row in t]


def reference_sets(ns, query, page_table):
    """Each row's top-k with ``query`` over the mode's keys by the references: the logits op on CPU (the torch
    reference) and a plain top-k, or fp8-rescore's reference (stage 1 with SGLang's fp8 q, stage 2 with ``query``)."""
    import cupy_dsa
    from cupy_dsa.rescore import rescore_topk_reference

    lens = torch.tensor(ns.lens, dtype=torch.int32)
    q, w = ns.queries[query]
    if core.record(ns.mode).two_level:
        q8, w8 = ns.queries["fp8"]
        extra = dict(q_rescore=q, weights_rescore=w) if query != "fp8" else {}
        ref = rescore_topk_reference(q8.unsqueeze(1), w8, ns.pool.index_k_with_scale_buffer[0],
                                     ns.pool.index_k_lo_buffer[0], lens, page_table, ns.topk, None, **extra)
        return _sets(ref.raw_indices)
    cache = ns.pool.index_k_with_scale_buffer[0]
    width = page_table.shape[1] * 64
    logits = cupy_dsa.paged_mqa_logits(q.unsqueeze(1), cache, w, lens, page_table, width, clean_logits=False)
    _, raw = core.topk_page_indices(logits, lens, page_table, ns.topk)
    return _sets(raw)


def scenario_query():
    load()

    @check
    def registered_with_the_bf16_query():
        every_hook_in_place()
        assert core.index_k_mode() == "bf16" and core.index_query() == "bf16", (core.index_k_mode(), core.index_query())
        # the query does not change the pages: the tag and the namespace are bf16's, with either query
        for value in ("bf16", "fp8"):
            with query_env(value):
                assert hooks._pd_kv_layout_hook("v4") == "v4,c4idx:bf16"
                assert hicache_model_name() == "deepseek-ai/DeepSeek-V4_c4idx-bf16"

    @check
    def every_mode_and_query_through_sglang_forward():
        cases = forward_cases("paged_logits", "extend_logits", "verify_logits")
        ran = []
        for mode in core.MODES[1:]:
            rec = core.record(mode)
            for query in rec.query_choices:
                for what, fmode, batch, setup, route in cases[:1] if rec.two_level else cases:
                    ns = query_setup(mode, **setup)
                    fused = []
                    with mode_env(mode), query_env(query if rec.query_settable else None), \
                            contextlib.ExitStack() as stack:
                        if rec.two_level:
                            stack.enter_context(core.env_vars({core.RESCORE_STAGE1_ENV: "cupy"}))
                            from scenario_rescore import spied_rescore
                            spies = stack.enter_context(spied_rescore(f"in {mode}"))
                        else:
                            calls = stack.enter_context(spied_logits_routes(f"in {mode}"))
                        stack.enter_context(one_attention_cp_rank())
                        stack.enter_context(sglang_fused_q_on_cpu(fused))
                        assert core.index_query() == query, (mode, query, core.index_query())
                        md, page_table = ns.run(ns.pool, fmode, batch)
                    tag = f"{mode}, {query} query, {what}"
                    q_exp, w_exp = ns.queries[query]
                    if query == "fp8":
                        # SGLang's prepare (the set-up's stand-in returns SGLang's fp8 q): no projection of ours
                        assert ns.projections == [] and fused == [], (tag, ns.projections)
                    else:
                        assert [p[0] for p in ns.projections] == ["weights_proj", "wq_b"], (tag, ns.projections)
                        assert ns.projections[0][1] is True, f"{tag}: weights_proj's output must come unscaled"
                        assert len(fused) == (1 if rec.two_level else 0), (tag, len(fused))
                    if rec.two_level:
                        (q2, w2), = spies.stage2
                        if query == "fp8":
                            assert q2 is None and w2 is None, f"{tag}: a stage-2 query was passed"
                        else:
                            assert torch.equal(q2, q_exp) and torch.equal(w2, w_exp), f"{tag}: stage 2's query"
                    else:
                        assert [r for r, _ in calls] == [route], (tag, [r for r, _ in calls])
                        q_in, w_in = calls[0][1][0], calls[0][1][1]
                        assert q_in.dtype == q_exp.dtype and torch.equal(q_in.view(torch.uint8), q_exp.view(torch.uint8)), \
                            f"{tag}: the logits op did not get the {query} query ({q_in.dtype})"
                        assert torch.equal(w_in, w_exp), f"{tag}: the logits op did not get the query's weights"
                    got, want = _sets(md.c4_sparse_raw_indices), reference_sets(ns, query, page_table)
                    bad = [r for r, (a, b) in enumerate(zip(got, want)) if a != b]
                    assert not bad, f"{tag}: rows {bad} differ from the reference's top-k with that query"
                    ran.append(tag)
        INFO["query_cases"] = ran
        assert len(ran) == 3 * (2 + 2 + 1 + 2) + 2, ran

    @check
    def query_flag_yaml_key_and_refusals():
        from sglang.srt.arg_groups.resolution_hooks import run_hook
        from sglang.srt.server_args import ServerArgs, prepare_server_args

        from cupy_dsa.sglang.core import StartupRefused

        with mode_env(None), query_env(None):
            prepare_server_args(["--model-path", "dummy", "--cupy-dsa-index-k-dtype", "fp8-cupy",
                                 "--cupy-dsa-index-q", "BF16"])
            assert os.environ.get(ENV) == "fp8-cupy" and os.environ.get(Q) == "bf16" and core.index_query() == "bf16"
        with mode_env(None), query_env(None):
            server_args_from_yaml("model-path: dummy\ncupy-dsa-index-k-dtype: bf16-fp4sim\ncupy-dsa-index-q: bf16\n")
            assert os.environ.get(ENV) == "bf16-fp4sim" and core.index_query() == "bf16"
        with mode_env(None), query_env(None):
            assert_argparse_rejects(["--cupy-dsa-index-q", "fp16"])  # argparse's choices
        with mode_env("bf16"), query_env("fp8"):
            assert_refused(lambda: prepare_server_args(["--model-path", "dummy", "--cupy-dsa-index-q", "bf16"]),
                           ("--cupy-dsa-index-q bf16", f"{Q}='fp8'"), "the flag silently overrode the variable",
                           error=StartupRefused)

        def resolve():
            def handle_model_specific_adjustments(server_args):
                pass

            run_hook(handle_model_specific_adjustments, ServerArgs(model_path="dummy"))

        # the launcher's resolution step: a query a mode does not take, the switch off included, is refused
        for mode, value, fragment in (("fp8", "bf16", "the switch is off"),
                                      ("bf16-reference", "bf16", "its query (fp4sim) is part of the mode"),
                                      ("bf16-reference", "fp8", "its query (fp4sim) is part of the mode"),
                                      ("fp8-cupy", "fp4", "expected one of fp8, bf16")):
            with mode_env(mode), query_env(value):
                try:
                    resolve()
                except StartupRefused as e:
                    assert f"{Q}='{value}'" in str(e) and fragment in str(e) and "Refusing to start" in str(e), str(e)
                    INFO.setdefault("query_refusals", []).append(str(e))
                else:
                    raise AssertionError(f"{Q}={value} accepted with {ENV}={mode}")
        for mode in ("bf16", "bf16-fp4sim", "fp8-cupy", "fp8-rescore"):
            for value in ("fp8", "bf16"):
                with mode_env(mode), query_env(value):
                    resolve()

    @check
    def check_command_names_the_query():
        assert_check_command_says("bf16", (f"query: the rotated q rounded to bf16 once (the head weights without a q "
                                           f"scale) ({Q}=bf16)",))
        with query_env(None):
            assert_check_command_says("bf16", ("query: SGLang's fused fp8 q",))
