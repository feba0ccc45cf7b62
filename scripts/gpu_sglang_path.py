#!/usr/bin/env python3
"""SGLang 0.5.23's own DeepSeek-V4 indexer code driving cupy_dsa's CUDA kernels, checked against the CPU path.

A standalone script (not collected by pytest): ``bash scripts/run_sglang_gpu.sh`` installs SGLang's wheels from
``.whl_sgl/`` into a ``--target`` directory and runs it; ``python scripts/gpu_sglang_path.py --device cpu`` is
the dry mode (the same code with the CPU backends on both sides), which CI-style machines can run. This file holds
the phases; their set-up (SGLang, the batch, one world per device) is ``scripts/_sglang_path_world.py`` and their
checks ``scripts/_sglang_path_checks.py``.

What runs is SGLang's: the plugin loaded by ``load_plugins()`` (the hooks applied to SGLang's functions),
``DeepSeekV4IndexerPool`` on the device (16384-byte bf16 page rows), ``CompressorDecodePlan`` /
``CompressorPrefillPlan`` objects, ``PagedIndexerMetadata``, the compressor's call site
``CompressorBackendMixin._forward_compress_all_in_one`` (its hooked ``compress_norm_rope_store``) and
``C4IndexerBackendMixin.forward_c4_indexer`` (hooked) with SGLang's torch top-k. Stand-ins, each for a piece
that needs a CUDA package or JIT this machine does not have:

* ``compress_forward`` (SGLang's CUDA JIT compressor) returns the compressed rows given here;
* ``_forward_prepare_normal`` (the q path: SGLang's fused JIT RoPE/Hadamard/fp8 quant) returns the fp8 q and
  weights given here;
* the plan rows are built here in SGLang's 16-byte DecodePlan / CompressPlan layout (SGLang's generator is
  a CUDA JIT module, ``c_plan.cuh``, which needs nvcc);
* top-k: SGLang's torch fallback ``topk_transform_pytorch_vectorized`` (``DSATopKBackend.TORCH``) instead of
  sgl-kernel's; ``PagedIndexerMetadata`` without DeepGEMM's schedule (``SGLANG_FP8_PAGED_MQA_LOGITS_TORCH=1``);
* ``get_parallel()`` answers ``attn_cp_size=1`` (no distributed state in one process);
* imports of ``sgl_kernel`` / ``deep_gemm`` / ``flash_mla`` / ``flashinfer``, when not installed, are served by a
  test-only stub (``scripts/_sglang_env.py``) whose functions raise if anything calls them.

Phases, each on both devices with the same inputs: the prompt's index keys stored through an extend plan;
an extend batch of three requests with different prefixes (one none) and new-token counts (one varlen
launch); a one-request extend (varlen); decode (rows); target verify with next_n 2 and 4 (grouped); decode in
one ``torch.cuda.graph`` capture (two C4 layers sharing the batch's balanced schedule) replayed twice with new
lengths and inputs; then next_n 4 target verify captured once and replayed twice with new lengths. Checked: cache bytes (<= 1 bf16 ulp,
same slots written), logits (valid columns), top-k overlap (>= 0.99 per row), page indices = the slot
transform of the raw indices.

The ``bf16 query`` phase runs extend, decode and verify again with ``SGLANG_CUPY_DSA_INDEX_Q=bf16``: the hook prepares
the query from the layer's projections (``prepare_index_q(numerics="bf16")``) on each route (CUDA-graph capture of
that path: tests/test_sglang_gpu.py::test_gpu_bf16_query_path_graph).

The ``fp8-cupy`` phase repeats all of it (store, extend batch, one-request extend, decode, verify next_n 2 and 4,
decode and verify CUDA graphs) with ``SGLANG_CUPY_DSA_INDEX_K=fp8-cupy``: SGLang's 8448-byte fp8 pool written by
cupy_dsa's store (device bytes = the CPU path's, an e4m3 code at most one step apart and the fp32 scale a few ulp
where the device's ``rsqrtf`` differs from torch's) and scored by cupy_dsa's fp8-key kernels; on decode, extend
and verify it also runs SGLang's own fp8 forward on the device (its torch fp8 logits) and checks that the two
top-k agree up to ties at SGLang's bf16 precision against an fp64 oracle.

The ``fp8-rescore`` phase repeats it with ``SGLANG_CUPY_DSA_INDEX_K=fp8-rescore``: SGLang's fp8 pool with its residual
pages beside it, both written by one store launch (the fp8 bytes checked as in fp8-cupy, the keys the two pages hold
within 1e-3 of the CPU path's), then extend, decode, verify and both CUDA graphs twice, with stage 1 from cupy_dsa's
kernels (the plugin's routes) and from SGLang's own fp8 logits call (here its torch fp8 logits: DeepGEMM is not on
this machine), each rescored top-k against the CPU path's (overlap >= 0.99 per row, SGLang's slot transform). Stage 2
takes stage 1's fp8 q here (``SGLANG_CUPY_DSA_INDEX_Q=fp8``: the layer stand-in has no projections). Not run here:
the default bf16 stage-2 query through SGLang's forward (its query prep, ``prepare_index_q(numerics="bf16")``, is
GPU-tested in tests/test_query.py; the forward with it is checked on CPU in tests/sglang_checks) and HiCache's
transfer of the hi and lo pages (checked on CPU through SGLang's host pools and transfer engine, sgl_kernel's
``transfer_kv_direct`` stood in by torch: tests/sglang_checks/checks_hicache.py; sgl_kernel is stubbed here too).
Last line: ``SGLANG GPU PATH: PASS ...`` or ``FAIL ...``.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))  # this checkout's cupy_dsa when it is not pip-installed

os.environ.update({
    "SGLANG_CUPY_DSA_INDEX_K": "bf16",
    "SGLANG_PLUGINS": "cupy_dsa",
    "SGLANG_FP8_PAGED_MQA_LOGITS_TORCH": "1",              # PagedIndexerMetadata without DeepGEMM
    "SGLANG_OPT_USE_TOPK_V2": "0",                         # the v2 top-k plan is a JIT kernel
})

import _sglang_env  # noqa: E402

_sglang_env.install()
STUBBED = _sglang_env.install_kernel_stubs()

import torch  # noqa: E402

from bench.timing import capture_graph  # noqa: E402  (the checkout's bench/, installed as cupy_dsa.bench)

from _sglang_path_checks import (  # noqa: E402
    PROBLEMS, check, compare_caches, compare_logits, compare_topk, compare_with_sglang_fp8, fp8_oracle)
from _sglang_path_world import EXTEND, MAX_POS, NOTES, PROMPTS, Batch, World, load_sglang, log  # noqa: E402


# --------------------------------------------------------------------------------------------------
# Phases
# --------------------------------------------------------------------------------------------------

ROUTES = {"paged_logits": "rows", "verify_logits": "grouped", "extend_logits": "varlen"}
RESCORE_ROUTES = {"rescore_rows": "rows", "rescore_verify": "grouped", "rescore_extend": "varlen"}


class LogitsSpy:
    """Records what the hook's logits routes return (eager phases only); ``rescored``: its rescoring routes (the
    selection they return) instead."""

    def __init__(self, core, rescored=False):
        self.routes = RESCORE_ROUTES if rescored else ROUTES
        self.core, self.out = core, []
        self.real = {name: getattr(core, name) for name in self.routes}

    def __enter__(self):
        def spy(name):
            def f(*a, **k):
                r = self.real[name](*a, **k)
                self.out.append((self.routes[name], r.raw_indices.clone() if hasattr(r, "raw_indices") else r.clone()))
                return r
            return f

        for name in self.routes:
            setattr(self.core, name, spy(name))
        return self

    def __exit__(self, *exc):
        for name, f in self.real.items():
            setattr(self.core, name, f)


def indexer_phase(name, sg, worlds, batch, tokens, mode, batch_size, g, expect_kind="rows", extend_lens=None,
                  draft=None, reference=False, sglang_baseline=False, rescored=False):
    """reference: in bf16-reference mode, the query built by the hook from the layer's projections.
    sglang_baseline (fp8-cupy): SGLang's own fp8 forward_c4_indexer runs too, on the device world's fp8 pool, and
    the two top-k are compared up to ties. rescored (fp8-rescore): the rescoring routes are spied on instead of the
    logits routes, and the top-k of both worlds compared."""
    from cupy_dsa.sglang import core

    lens, pt = batch.rows_of(tokens)
    q = torch.randn(len(tokens), 64, 128, generator=g).to(torch.float8_e4m3fn)
    w = torch.rand(len(tokens), 64, generator=g)
    q_raw = torch.randn(len(tokens), 64, 128, generator=g).bfloat16()
    w_raw = torch.rand(len(tokens), 64, generator=g).bfloat16()
    mds, spies = [], []
    orig = sg.ix.get_parallel
    sg.ix.get_parallel = lambda: types.SimpleNamespace(attn_cp_size=1)
    try:
        for world in worlds:
            b = world.indexer_backend(world.to(q), world.to(w), world.to(lens), world.to(pt), mode, batch_size,
                                      extend_lens=extend_lens, draft=draft)
            with LogitsSpy(core, rescored=rescored) as spy:
                mds.append(world.run_indexer(b, layer_fields=world.reference_layer(q_raw, w_raw) if reference else None))
            spies.append(spy.out)
        if sglang_baseline:
            world = worlds[0]
            b = world.indexer_backend(world.to(q), world.to(w), world.to(lens), world.to(pt), mode, batch_size,
                                      extend_lens=extend_lens, draft=draft)
            with core.env_vars({core.ENV_NAME: "fp8"}):  # the hook hands the call to SGLang's own body
                theirs = world.run_indexer(b)
            oracle = fp8_oracle(world.cache.cpu(), q, w, pt)  # the keys both forwards read
            compare_with_sglang_fp8(f"{name} vs SGLang's fp8", mds[0], theirs, oracle, lens)
    finally:
        sg.ix.get_parallel = orig
    kinds = [k for k, _ in spies[0]]
    check(kinds and all(k == expect_kind for k in kinds), f"{name}: logits came from {kinds}, expected {expect_kind}")
    if rescored:
        rec = compare_topk(name, mds[0], mds[1], pt, lens)
        log(f"  {name}: {len(tokens)} rows ({expect_kind}, rescored), min top-k overlap with the CPU path {rec:.4f}")
        return
    got = torch.cat([t.cpu() for _, t in spies[0]])
    ref = torch.cat([t for _, t in spies[1]])
    check(got.shape == ref.shape, f"{name}: logits {tuple(got.shape)} vs {tuple(ref.shape)} on the CPU path")
    worst = compare_logits(name, got, ref, lens)
    rec = compare_topk(name, mds[0], mds[1], pt, lens)
    log(f"  {name}: {len(tokens)} rows ({expect_kind}), logits worst {worst:.2f}x tol, min top-k overlap {rec:.4f}")


def replay_and_compare(graph, dev_step, state, dev_world, dev_backend, name, page_table, lens):
    """One step on new inputs (the graph's replay, or eager without one), then the CPU world's step, and the
    caches and top-k of both compared."""
    if graph is not None:
        graph.replay()
        torch.cuda.synchronize()
    else:
        dev_step()
    state[1][3]()
    compare_caches(name, dev_world, state[1][0])
    compare_topk(name, dev_backend.forward_metadata.core_metadata, state[1][2].forward_metadata.core_metadata,
                 page_table, lens)
    log(f"  {name}: ok" if not PROBLEMS else f"  {name}: {len(PROBLEMS)} problems so far")


def capture_or_run(step, capture, what):
    """With ``capture``: ``capture_graph`` (two warm-up runs, one CUDA-graph capture of ``step``, returned);
    else one eager run (None)."""
    if not capture:
        step()
        return None
    graph, _ = capture_graph(step)
    torch.cuda.synchronize()
    log(f"  {what} captured in one CUDA graph")
    return graph


def graph_verify_phase(sg, worlds, batch, g, capture, n=4):
    """Target verify (n draft rows per request, grouped) captured once, replayed with new lengths; the draft
    tokens' keys are stored eagerly before each replay on both sides."""
    B = len(PROMPTS)
    R = B * n
    state = []
    orig = sg.ix.get_parallel
    sg.ix.get_parallel = lambda: types.SimpleNamespace(attn_cp_size=1)
    try:
        for world in worlds:
            bufs = types.SimpleNamespace(
                q=torch.zeros(R, 64, 128, device=world.device).to(torch.float8_e4m3fn),
                w=torch.zeros(R, 64, device=world.device), lens=torch.ones(R, dtype=torch.int32, device=world.device),
                pt=world.to(batch.page_table.repeat_interleave(n, 0)))
            backend = world.indexer_backend(bufs.q, bufs.w, bufs.lens, bufs.pt, sg.ForwardMode.TARGET_VERIFY, B,
                                            draft=n)
            state.append((world, bufs, backend, lambda world=world, backend=backend: world.run_indexer(
                backend, layers=(0, 1))))

        def new_inputs():
            tokens = [(b, batch.lens[b] + i) for b in range(B) for i in range(n)]
            rows, loc = batch.store_plan(tokens)
            kv = torch.randn(rows.shape[0], 128, generator=g).bfloat16()
            for world, _, _, _ in state:
                world.store(world.prefill_plan, world.to(rows), world.to(kv), world.to(loc))
            lens, _ = batch.rows_of(tokens)
            inp = dict(q=torch.randn(R, 64, 128, generator=g).to(torch.float8_e4m3fn), w=torch.rand(R, 64, generator=g),
                       lens=lens)
            for _, bufs, _, _ in state:
                for k, v in inp.items():
                    getattr(bufs, k).copy_(v.to(getattr(bufs, k).device))
            return lens

        lens = new_inputs()
        dev_world, _, dev_backend, dev_step = state[0]
        graph = capture_or_run(dev_step, capture, f"target verify (next_n {n}, 2 C4 layers)")
        state[1][3]()
        compare_topk("verify graph warm-up", dev_backend.forward_metadata.core_metadata,
                     state[1][2].forward_metadata.core_metadata, batch.page_table.repeat_interleave(n, 0), lens)
        for replay, jump in enumerate(((57, 3, 200), (130, 66, 9))):
            batch.lens = [m + j for m, j in zip(batch.lens, jump)]
            lens = new_inputs()
            replay_and_compare(graph, dev_step, state, dev_world, dev_backend,
                               f"verify graph replay {replay + 1} (lens {lens.tolist()})",
                               batch.page_table.repeat_interleave(n, 0), lens)
    finally:
        sg.ix.get_parallel = orig


def graph_phase(sg, worlds, batch, g, capture):
    """Decode (store + two C4 layers) captured once, replayed with new lengths; the CPU path runs eagerly."""
    B = len(PROMPTS)
    state = []
    for world in worlds:
        bufs = types.SimpleNamespace(
            kv=torch.zeros(B, 128, dtype=torch.bfloat16, device=world.device), plan=torch.zeros(B, 16, dtype=torch.uint8, device=world.device),
            loc=torch.zeros(B, dtype=torch.int64, device=world.device),
            q=torch.zeros(B, 64, 128, device=world.device).to(torch.float8_e4m3fn),
            w=torch.zeros(B, 64, device=world.device), lens=torch.ones(B, dtype=torch.int32, device=world.device),
            pt=world.to(batch.page_table))
        backend = world.indexer_backend(bufs.q, bufs.w, bufs.lens, bufs.pt, sg.ForwardMode.DECODE, B)

        def step(world=world, bufs=bufs, backend=backend):
            world.store(world.decode_plan, bufs.plan, bufs.kv, bufs.loc)
            world.run_indexer(backend, layers=(0, 1))

        state.append((world, bufs, backend, step))

    def new_inputs():
        rows, loc = batch.decode_plan()
        lens = torch.tensor([(n + 1) // 4 for n in batch.lens], dtype=torch.int32)
        inp = dict(kv=torch.randn(B, 128, generator=g).bfloat16(), plan=rows, loc=loc,
                   q=torch.randn(B, 64, 128, generator=g).to(torch.float8_e4m3fn), w=torch.rand(B, 64, generator=g),
                   lens=lens)
        batch.lens = [n + 1 for n in batch.lens]
        return inp, lens

    def fill(bufs, inp):
        for k, v in inp.items():
            getattr(bufs, k).copy_(v.to(getattr(bufs, k).device))

    inp, lens = new_inputs()
    for _, bufs, _, _ in state:
        fill(bufs, inp)
    dev_world, dev_bufs, dev_backend, dev_step = state[0]
    graph = capture_or_run(dev_step, capture, "decode step (store + 2 C4 layers)")
    state[1][3]()
    compare_topk("graph warm-up", dev_backend.forward_metadata.core_metadata, state[1][2].forward_metadata.core_metadata,
                 batch.page_table, lens)
    for replay, jump in enumerate(((68, 131, 9), (3, 260, 70))):
        # the decode steps in between, stored eagerly on both sides, so the replay sees new lengths (and
        # crosses index pages) over keys that are all written
        tokens = [(b, p) for b, (n, j) in enumerate(zip(batch.lens, jump)) for p in range(n, n + j)]
        rows, loc = batch.store_plan(tokens)
        kv = torch.randn(rows.shape[0], 128, generator=g).bfloat16()
        for world, _, _, _ in state:
            world.store(world.prefill_plan, world.to(rows), world.to(kv), world.to(loc))
        batch.lens = [n + j for n, j in zip(batch.lens, jump)]
        inp, lens = new_inputs()
        for _, bufs, _, _ in state:
            fill(bufs, inp)
        replay_and_compare(graph, dev_step, state, dev_world, dev_backend,
                           f"graph replay {replay + 1} (lens {lens.tolist()})", batch.page_table, lens)


# the phases that need no earlier phase's state (the others build on the prompt store and on each other)
STANDALONE_PHASES = ("fp8-cupy", "fp8-rescore")


def run(device, seed, only=None):
    t0 = time.time()
    sg = load_sglang(STUBBED)
    from cupy_dsa.sglang import core

    g = torch.Generator().manual_seed(seed)
    ang = torch.rand(MAX_POS, 32, generator=g) * 6.2831853
    freq_cis = torch.polar(torch.ones_like(ang), ang)      # complex64 [max_pos, 32], as SGLang passes it
    norm_w = torch.rand(128, generator=g) + 0.5
    worlds = [World(sg, device, norm_w, freq_cis), World(sg, "cpu", norm_w, freq_cis)]
    # from here on a call into a stubbed kernel package raises, naming it (imports and pool set-up are done)
    _sglang_env.strict_kernel_stubs()
    batch = Batch(g)

    def warm(what):
        # compile and load the mode's kernels up front, so no phase below pays for it
        if device != "cpu":
            t = time.time()
            core.ensure_warm(torch.device(device))
            log(f"  {what} warmed in {time.time() - t:.1f} s")

    warm("kernels")
    phases = []

    def phase(name, fn):
        if only and name not in only:
            return
        log(f"[{name}]")
        try:
            fn()
            phases.append(name)
        except Exception:  # noqa: BLE001 - report and go on with the next phase
            PROBLEMS.append(f"{name}: {traceback.format_exc().strip().splitlines()[-1]}")
            log(traceback.format_exc())

    def prompt_store(worlds=worlds, batch=batch):
        tokens = [(b, p) for b, n in enumerate(PROMPTS) for p in range(n)]
        rows, loc = batch.store_plan(tokens)
        kv = torch.randn(rows.shape[0], 128, generator=g).bfloat16()  # the model dtype
        for world in worlds:
            world.store(world.prefill_plan, world.to(rows), world.to(kv), world.to(loc))
        compare_caches("prompt store (extend plan)", worlds[0], worlds[1])

    def extend_batch(worlds=worlds, batch=batch, **kw):
        # 3 requests, different prefixes and new-token counts, request 0 with no prefix: one varlen launch
        tokens = [(b, p) for b, (n, e) in enumerate(zip(PROMPTS, EXTEND)) for p in range(n - e, n)]
        indexer_phase("extend, 3 requests", sg, worlds, batch, tokens, sg.ForwardMode.EXTEND, 3, g,
                      expect_kind=kw.pop("expect_kind", "varlen"), extend_lens=EXTEND, **kw)

    def extend_one(worlds=worlds, batch=batch, **kw):
        b, n = 2, PROMPTS[2]
        tokens = [(b, p) for p in range(n - 67, n)]
        indexer_phase("extend, 1 request", sg, worlds, batch, tokens, sg.ForwardMode.EXTEND, 1, g,
                      expect_kind=kw.pop("expect_kind", "varlen"), extend_lens=(67,), **kw)

    def decode(worlds=worlds, batch=batch, **kw):
        rows, loc = batch.decode_plan()
        kv = torch.randn(len(PROMPTS), 128, generator=g).bfloat16()
        for world in worlds:
            world.store(world.decode_plan, world.to(rows), world.to(kv), world.to(loc))
        compare_caches("decode store", worlds[0], worlds[1])
        batch.lens = [n + 1 for n in batch.lens]
        tokens = [(b, n - 1) for b, n in enumerate(batch.lens)]
        indexer_phase("decode", sg, worlds, batch, tokens, sg.ForwardMode.DECODE, len(PROMPTS), g, **kw)

    def verify(worlds=worlds, batch=batch, **kw):
        kind = kw.pop("expect_kind", "grouped")
        for n in (2, 4):
            tokens = [(b, m + i) for b, m in enumerate(batch.lens) for i in range(n)]
            rows, loc = batch.store_plan(tokens)
            kv = torch.randn(rows.shape[0], 128, generator=g).bfloat16()  # the model dtype
            for world in worlds:
                world.store(world.prefill_plan, world.to(rows), world.to(kv), world.to(loc))
            compare_caches(f"verify store (next_n {n})", worlds[0], worlds[1])
            indexer_phase(f"target verify, next_n {n}", sg, worlds, batch, tokens, sg.ForwardMode.TARGET_VERIFY,
                          len(PROMPTS), g, expect_kind=kind, draft=n, **kw)
        # the drafts were rejected: the requests go on from their decode lengths (the slots get rewritten)

    def projected_query_routes(label):
        # extend, decode and verify with the layer's projections: the hook builds the query the mode (and
        # SGLANG_CUPY_DSA_INDEX_Q) asks for with prepare_index_q on each route
        tokens = [(b, p) for b, (n, e) in enumerate(zip(PROMPTS, EXTEND)) for p in range(n - e, n)]
        indexer_phase(f"{label} extend, 3 requests", sg, worlds, batch, tokens, sg.ForwardMode.EXTEND, 3,
                      g, expect_kind="varlen", extend_lens=EXTEND, reference=True)
        tokens = [(b, m - 1) for b, m in enumerate(batch.lens)]
        indexer_phase(f"{label} decode", sg, worlds, batch, tokens, sg.ForwardMode.DECODE, len(PROMPTS), g,
                      reference=True)
        tokens = [(b, m - 2 + i) for b, m in enumerate(batch.lens) for i in range(2)]
        indexer_phase(f"{label} target verify, next_n 2", sg, worlds, batch, tokens, sg.ForwardMode.TARGET_VERIFY,
                      len(PROMPTS), g, expect_kind="grouped", draft=2, reference=True)

    def reference_mode():
        # bf16-reference: the hook builds DeepSeek-V4's reference query (prepare_index_q) on each route
        with core.env_vars({core.ENV_NAME: "bf16-reference"}):
            projected_query_routes("bf16-reference")

    def bf16_query():
        # SGLANG_CUPY_DSA_INDEX_Q=bf16: the hook prepares the query from the layer's projections (prepare_index_q,
        # bf16 numerics) on each route, over the bf16 keys of the prompt store
        with core.env_vars({core.QUERY_ENV: "bf16"}):
            if device != "cpu":
                core.ensure_warm(torch.device(device))
            projected_query_routes("bf16 query")

    def fp8_cupy():
        # SGLang's fp8 index keys (SGLang's pool, 8448-byte rows) on cupy_dsa's store and kernels: every step above
        # again, in new pools, with SGLang's own fp8 forward on the device as the top-k baseline
        with core.env_vars({core.ENV_NAME: "fp8-cupy"}):
            worlds8 = [World(sg, device, norm_w, freq_cis), World(sg, "cpu", norm_w, freq_cis)]
            batch8 = Batch(g)
            warm("fp8-cupy kernels")
            prompt_store(worlds8, batch8)
            every_step_again(worlds8, batch8, sglang_baseline=True)

    def every_step_again(worlds_, batch_, rows_only=False, **checks):
        # extend (batch, one request), decode, verify and both graph steps on a mode's own pools; rows_only: the
        # routes that run one row per token (SGLang's stage 1) are expected where the plugin's would be grouped
        rows = {"expect_kind": "rows"} if rows_only else {}
        extend_batch(worlds_, batch_, **checks, **rows)
        extend_one(worlds_, batch_, **checks, **rows)
        decode(worlds_, batch_, **checks)
        verify(worlds_, batch_, **checks, **rows)
        graph_phase(sg, worlds_, batch_, g, capture=device != "cpu")
        graph_verify_phase(sg, worlds_, batch_, g, capture=device != "cpu")

    phase("prompt store", prompt_store)
    phase("extend batch", extend_batch)
    phase("extend one request", extend_one)
    phase("decode", decode)
    phase("verify", verify)
    phase("bf16-reference", reference_mode)
    phase("bf16 query", bf16_query)
    phase("cuda graph" if device != "cpu" else "graph step (eager on cpu)",
          lambda: graph_phase(sg, worlds, batch, g, capture=device != "cpu"))
    phase("verify cuda graph" if device != "cpu" else "verify graph step (eager on cpu)",
          lambda: graph_verify_phase(sg, worlds, batch, g, capture=device != "cpu"))
    def fp8_rescore():
        # two-level keys: SGLang's fp8 pool plus its residual pages, both written by one store launch; every step
        # above with stage 1 from cupy_dsa's kernels (the plugin's routes) and from SGLang's own fp8 logits call
        # (its torch fp8 logits here: no DeepGEMM on this machine; one row per token), top-k against the CPU path
        with core.env_vars({core.ENV_NAME: "fp8-rescore"}):
            worlds2 = [World(sg, device, norm_w, freq_cis), World(sg, "cpu", norm_w, freq_cis)]
            batch2 = Batch(g)
            prompt_store(worlds2, batch2)
            for stage1 in ("cupy", "sglang"):
                # the layer stand-in has no projections to build a bf16 q from: the fp8 query
                with core.env_vars({core.QUERY_ENV: "fp8", core.RESCORE_STAGE1_ENV: stage1}):
                    warm(f"fp8-rescore (stage1={stage1}) kernels")
                    log(f"  stage 1: {core.rescore_settings().describe()}")
                    every_step_again(worlds2, batch2, rows_only=stage1 == "sglang", rescored=True)

    phase("fp8-cupy", fp8_cupy)
    phase("fp8-rescore", fp8_rescore)
    return phases, time.time() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=int(os.environ.get("CUPY_DSA_SEED", "0")))
    ap.add_argument("--only", choices=STANDALONE_PHASES, action="append",
                    help="run only this phase (repeatable); every phase runs by default")
    args = ap.parse_args()
    where = args.device
    if where.startswith("cuda"):
        if not torch.cuda.is_available():
            print("SGLANG GPU PATH: FAIL (no CUDA device; use --device cpu for the dry mode)")
            return 1
        where = f"{args.device} ({torch.cuda.get_device_name(0)}, torch {torch.__version__})"
    log(f"device {where}, seed {args.seed}")
    try:
        phases, secs = run(args.device, args.seed, only=args.only)
    except BaseException:  # noqa: BLE001 - set-up failed (imports, hooks, pool)
        log(traceback.format_exc())
        print(f"SGLANG GPU PATH: FAIL (set-up: {traceback.format_exc().strip().splitlines()[-1]})")
        return 1
    mode = "" if args.device != "cpu" else " [dry mode: CPU backends on both sides]"
    notes = f"; {'; '.join(NOTES)}" if NOTES else ""
    if PROBLEMS:
        print(f"SGLANG GPU PATH: FAIL ({len(PROBLEMS)} problems: {' | '.join(PROBLEMS)}){mode}")
        return 1
    print(f"SGLANG GPU PATH: PASS ({len(phases)} phase{'' if len(phases) == 1 else 's'}: {', '.join(phases)}; {where}; {secs:.0f} s; "
          f"stubbed: {','.join(STUBBED) or 'none'}{notes}){mode}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
