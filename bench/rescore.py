"""``cupy-dsa bench rescore``: what the exact top-k of two-level keys (``fp8-rescore``, issue 26) costs in decode,
MTP verify (next_n 2-4), varlen extend and prefill, against the top-k of bf16 keys and of SGLang's fp8 keys, on
this GPU.

Per case, on the same synthetic keys (stored by ``store_index_k``: bf16 keys, and fp8 keys with their int8 residual
pages in one launch), each column timed with the bench's CUDA-graph timer (:func:`.timing.time_calls`), the calls
rotating over distinct page sets of the caches where one call's bytes fit in L2. **top-k** is the stock top-k
(issue 31): SGLang 0.5.23's own v2 kernel (``topk_transform_paged_v2``, the H200's default; its ``plan_topk_v2``
built once outside the timing, as SGLang builds it once per forward) where SGLang's kernels run on this GPU, else
``cupy_dsa.paged_topk`` standing in for it (the run's JSON says which, under ``topk``); every row its own length
and page-table row, as SGLang passes them:

* ``bf16``: our bf16 logits (``paged_mqa_logits``; extend / prefill: ``mqa_logits`` varlen over the request's
  block-table row) + the top-k;
* ``fp8``: the same on SGLang's fp8 keys (same query);
* ``fp8 DeepGEMM``: DeepGEMM's fp8 logits as SGLang 0.5.23 calls them (:func:`.serve.fp8_route`: one row per token
  through ``fp8_paged_mqa_logits``; a one-request chunk of >= 8192 rows: the key gather + ``fp8_mqa_logits``) + the
  top-k: the stock step (DeepGEMM's columns past a row's length are not cleaned: the top-k reads only a row's
  length); the schedule is built once outside the timing;
* ``fp8-rescore``: the whole op (``rescore_topk`` / ``rescore_topk_prefill``) with our fp8 stage 1 (the plugin's
  ``stage1=cupy``: grouped verify, varlen extend);
* ``fp8-rescore (DeepGEMM stage 1)``: DeepGEMM's paged logits, one row per token, passed unmasked as
  ``stage1_logits`` to ``rescore_topk`` on those rows (the plugin's ``stage1=sglang``);
* ``stage 1``: our fp8 logits alone (what ``fp8-rescore`` computes first); ``stage 2 + selection``: ``rescore_topk``
  given those logits: K' candidates, stage-2 scores from hi + lo, the selection;
* ``stage 1 (DeepGEMM)`` / ``stage 2 + selection (DeepGEMM logits)``: the same split of the DeepGEMM variant (the
  selection reads only the columns a row sees, so unmasked logits cost nothing extra);
* ``fp8-rescore (DeepGEMM stage 1, SGLang v2 candidates)`` / ``stage 2 + selection (SGLang v2 candidates)``: the
  plugin's ``stage1=sglang`` since issue 48: SGLang's v2 top-k picks the K' candidates (k = K', raw positions,
  ``cupy_dsa.sglang.candidates``, its plan built once outside the timing), then ``rescore_topk(candidates=)``; where
  v2 is live and K' <= 2048;
* ``top-k SGLang v2`` / ``top-k SGLang v1`` / ``top-k cupy_dsa`` / ``top-k torch.topk``: each top-k alone on the
  stock step's logits (DeepGEMM's where it runs, else our fp8 logits): SGLang's v2 and v1 (sm_120's default) where
  they run here, our ``paged_topk``, and ``torch.topk(index_topk)`` of every column (what these columns used before
  issue 31).

``fp8-rescore`` = ``stage 1`` + ``stage 2 + selection`` up to launch overlap. Memory per index entry: bf16 256 B, fp8
132 B, fp8-rescore 264 B (hi + lo). Public ops only.

The floor of ``stage 2 + selection`` (issue 31), per case: max(bytes / the read-only stream, stage 2's flops / the
register-operand bf16 ``mma.sync`` ceiling), both ceilings measured in the same run (:func:`.timing.measure_ceilings`;
stage 2 runs f16 ``mma.sync`` m16n8k16, at the bf16 rate on these GPUs). Bytes: each row's candidates (min(K', the
entries it sees)) x 264 B (hi + lo) + each row's visible logits read once (4 B each); flops: candidates x 64 heads x
128 x 2 (fma): one combined f16 key per candidate (two, hi and lo, before issue 48).
The share reached = floor / the column's time, for ``stage 2 + selection`` and its DeepGEMM-logits twin; issue 31's
target: >= 60% on every case of >= 1M (2^20) rows x index entries (each request's entries x its rows), >= 40% below.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import cupy_dsa
from cupy_dsa import layouts, rescore

from . import peers
from .provenance import commit_label

SCHEMA = "cupy-dsa-rescore/1"
INDEX_TOPK = 512
K_PRIME = rescore.K_PRIME_MULTIPLE * INDEX_TOPK
CPU_INDEX_TOPK = 16  # the CPU cases' rows see a few hundred keys: a top-k that still selects among them
K = 1024
PHASES = ("decode", "verify", "extend", "prefill")

BF16, FP8, FP8_DG = "bf16", "fp8", "fp8 DeepGEMM"
RESCORE, RESCORE_DG = "fp8-rescore", "fp8-rescore (DeepGEMM stage 1)"
STAGE1, STAGE2 = "stage 1", "stage 2 + selection"
STAGE1_DG, STAGE2_DG = "stage 1 (DeepGEMM)", "stage 2 + selection (DeepGEMM logits)"
RESCORE_V2C, STAGE2_V2C = "fp8-rescore (DeepGEMM stage 1, SGLang v2 candidates)", "stage 2 + selection (SGLang v2 candidates)"
# each top-k alone on the stock step's logits (issue 31), by peers.TOPK_KEYS
TOPK_COLUMNS = {peers.SGLANG_V2: "top-k SGLang v2", peers.SGLANG_V1: "top-k SGLang v1",
                peers.CUPY_DSA_TOPK: "top-k cupy_dsa", peers.TORCH_TOPK: "top-k torch.topk"}
TOPK_V2, TOPK_V1, TOPK_OURS, TOPK_TORCH = TOPK_COLUMNS.values()
COLUMNS = ((BF16, FP8, FP8_DG, RESCORE, RESCORE_DG, RESCORE_V2C, STAGE1, STAGE2, STAGE1_DG, STAGE2_DG, STAGE2_V2C)
           + tuple(TOPK_COLUMNS.values()))
DEEPGEMM_COLUMNS = (FP8_DG, RESCORE_DG, RESCORE_V2C, STAGE1_DG, STAGE2_DG, STAGE2_V2C)
V2_CANDIDATE_COLUMNS = (RESCORE_V2C, STAGE2_V2C)
SGLANG_COLUMNS = (TOPK_V2, TOPK_V1)

# what bf16 / fp8 / fp8 DeepGEMM added before issue 31 (runs without a "topk" record)
TORCH_TOPK_LEGEND = {
    BF16: "our bf16-key logits + torch.topk(index_topk)",
    FP8: "our fp8-key logits + torch.topk(index_topk)",
    FP8_DG: "DeepGEMM's fp8 logits on SGLang 0.5.23's route for the step + torch.topk(index_topk) (standing in for "
            "SGLang's sgl-kernel top-k)",
}

LEGEND = {
    **TORCH_TOPK_LEGEND,
    RESCORE: "rescore_topk / rescore_topk_prefill, the whole op, stage 1 by cupy_dsa's fp8 kernels",
    RESCORE_DG: "DeepGEMM's paged fp8 logits (one row per token) + rescore_topk given them unmasked (the plugin's "
                "stage1=sglang)",
    STAGE1: "cupy_dsa's fp8 logits alone (stage 1 of fp8-rescore)",
    STAGE2: "rescore_topk given stage 1's logits: K' candidates, stage 2 from hi + lo, the selection",
    STAGE1_DG: "DeepGEMM's paged fp8 logits alone (stage 1 of the DeepGEMM variant)",
    STAGE2_DG: "rescore_topk given DeepGEMM's unmasked logits (candidates, stage 2, selection)",
    RESCORE_V2C: "DeepGEMM's paged fp8 logits + SGLang's v2 top-k at k = K' (the candidates) + rescore_topk given both "
                 "(the plugin's stage1=sglang since issue 48)",
    STAGE2_V2C: "SGLang's v2 top-k at k = K' on DeepGEMM's logits + rescore_topk given both (stage 2, selection)",
    TOPK_V2: "SGLang 0.5.23's v2 top-k alone (topk_transform_paged_v2, its plan built once outside the timing) on "
             "the stock step's logits",
    TOPK_V1: "SGLang 0.5.23's v1 top-k alone (topk_transform_paged, sm_120's default) on the stock step's logits",
    TOPK_OURS: "cupy_dsa.paged_topk alone on the stock step's logits",
    TOPK_TORCH: "torch.topk(index_topk) alone on the stock step's logits (every column; what bf16 / fp8 / fp8 "
                "DeepGEMM added before issue 31)",
}


def stock_topk_name(topk: dict) -> str:
    """How a run's legend names its stock top-k (``topk``: :meth:`peers.TopKs.describe`)."""
    if topk.get("stand_in"):
        return f"cupy_dsa.paged_topk, STANDING IN for SGLang's v2 top-k ({topk.get('stand_in_note', 'SGLang not run')})"
    return topk.get("stock_label") or topk.get("stock", "?")


def legend(topk: dict) -> dict:
    """The columns' legend for a run whose stock top-k is ``topk`` (:meth:`peers.TopKs.describe`)."""
    name = stock_topk_name(topk)
    return {**LEGEND,
            BF16: f"our bf16-key logits + the stock top-k ({name})",
            FP8: "our fp8-key logits + the stock top-k",
            FP8_DG: "DeepGEMM's fp8 logits on SGLang 0.5.23's route for the step + the stock top-k: the stock step"}

# the floor of "stage 2 + selection" (issue 31): its columns, its target (a share of the floor, by the case's rows x
# index entries), and what it counts
FLOOR_COLUMNS = (STAGE2, STAGE2_DG, STAGE2_V2C)
FLOOR_TARGET = {"min_entry_rows": 2**20, "large": 0.60, "small": 0.40}
STAGE2_FLOPS_PER_KEY = layouts.N_HEADS * layouts.HEAD_DIM * 2            # fma = 2 flops; one f16 key, 64 heads
# keys stage 2 multiplies per candidate: one combined key since issue 48; runs that do not record it multiplied two
# (the hi and the lo key), and their floors are counted so
STAGE2_KEYS_PER_CANDIDATE = 1
OLD_STAGE2_KEYS_PER_CANDIDATE = 2
LOGIT_BYTES = 4                                                           # fp32 stage-1 logits
MMA_KIND = "bf16"                                                         # stage 2's mma: bf16 m16n8k16

# memory per index entry; issue 26's target: fp8-rescore <= 1.05x bf16's
MEMORY_TARGET_VS_BF16 = 1.05
BYTES_PER_ENTRY = {"bf16": layouts.BF16_BYTES_PER_TOKEN, "fp8": layouts.FP8_BYTES_PER_TOKEN,
                   "fp8-rescore": rescore.TWO_LEVEL_BYTES_PER_TOKEN}


@dataclass(frozen=True)
class Case:
    phase: str                   # decode | verify | extend | prefill
    prefixes: tuple              # raw tokens of each request before this step (one index entry per 4)
    next_n: int = 1              # decode / verify: rows per request
    chunk: int = 0               # extend / prefill: new tokens (rows) per request
    index_topk: int = INDEX_TOPK

    @property
    def batch(self) -> int:
        return len(self.prefixes)

    @property
    def rows(self) -> int:
        return self.batch * (self.next_n if self.phase in ("decode", "verify") else self.chunk)

    @property
    def k_prime(self) -> int:
        return rescore.K_PRIME_MULTIPLE * self.index_topk

    def entries(self) -> list[int]:
        """Index entries of each request after the step (what its caches hold)."""
        if self.phase in ("decode", "verify"):
            return [p // 4 for p in self.prefixes]
        return [p // 4 + self.chunk // 4 for p in self.prefixes]

    def visible(self) -> list[int]:
        """Index entries each query row sees, request by request: decode / verify row j of next_n sees its request's
        entries less next_n - 1 - j; extend / prefill row j sees the prefix's and one more per 4 new tokens."""
        if self.phase in ("decode", "verify"):
            return [max(0, e - (self.next_n - 1) + j) for e in self.entries() for j in range(self.next_n)]
        return [p // 4 + (j + 1) // 4 for p in self.prefixes for j in range(self.chunk)]

    def entry_rows(self) -> int:
        """Rows x index entries: each request's entries after the step times its rows (the floor target's size)."""
        per_request = self.next_n if self.phase in ("decode", "verify") else self.chunk
        return per_request * sum(self.entries())


def _tokens(n: int) -> str:
    return f"{n // (1 << 20)}M" if n % (1 << 20) == 0 else (f"{n // K}K" if n % K == 0 else f"{n:,}")


def case_label(c: Case) -> str:
    """'decode 8 x 64K', 'verify 64 x 32K, next_n 2', 'extend 8 x 512 after 32K-64K', 'prefill chunk of 4,096
    after 32K' (raw tokens)."""
    if c.phase in ("decode", "verify"):
        ctx = _tokens(c.prefixes[0]) if len(set(c.prefixes)) == 1 else f"{_tokens(min(c.prefixes))}-" \
                                                                       f"{_tokens(max(c.prefixes))}"
        return f"{c.phase} {c.batch} x {ctx}" + (f", next_n {c.next_n}" if c.phase == "verify" else "")
    if c.phase == "prefill":
        return f"prefill chunk of {c.chunk:,} after {_tokens(c.prefixes[0])}"
    return f"extend {c.batch} x {c.chunk:,} after {_tokens(min(c.prefixes))}-{_tokens(max(c.prefixes))}"


def _spread(n: int, lo: int, hi: int) -> tuple:
    """n prefixes from lo to hi tokens, evenly, in whole 1K."""
    return tuple(lo + round(i * (hi - lo) / max(n - 1, 1) / K) * K for i in range(n))


DECODE = [(1, 64 * K), (8, 64 * K), (64, 64 * K), (8, 256 * K), (64, 256 * K), (4, 1024 * K)]  # (batch, tokens)
VERIFY = [(64, 32 * K), (16, 128 * K)]
VERIFY_NEXT_N = (2, 3, 4)
EXTEND = [(8, 512, 32 * K, 64 * K)]                          # (requests, rows each, shortest, longest prefix)
PREFILL = [(4096, 32 * K), (4096, 128 * K), (16384, 32 * K), (16384, 128 * K)]   # (chunk, prefix tokens)


def cases(device: torch.device, quick: bool) -> list[Case]:
    """Decode, verify (next_n 2-4, ``[B]`` lengths), extend (varlen) and prefill (one request) cases; on a CPU tiny
    ones (the ops' torch references) at index_topk 16."""
    if device.type != "cuda":
        t = CPU_INDEX_TOPK
        return [Case("decode", (1024, 1024), index_topk=t), Case("verify", (1024, 768), 2, index_topk=t),
                Case("extend", (512, 1024), chunk=8, index_topk=t), Case("prefill", (1024,), chunk=16, index_topk=t)]
    if quick:
        return [Case("decode", (64 * K,) * 8), Case("verify", (64 * K,) * 8, 2),
                Case("extend", _spread(8, 32 * K, 64 * K), chunk=512), Case("prefill", (32 * K,), chunk=4096)]
    return ([Case("decode", (tokens,) * B) for B, tokens in DECODE]
            + [Case("verify", (tokens,) * B, n) for B, tokens in VERIFY for n in VERIFY_NEXT_N]
            + [Case("extend", _spread(B, lo, hi), chunk=rows) for B, rows, lo, hi in EXTEND]
            + [Case("prefill", (prefix,), chunk=chunk) for chunk, prefix in PREFILL])


def memory_rows() -> list[dict]:
    """Bytes per index entry of each layout, their ratio to bf16's, and the target of fp8-rescore's."""
    out = []
    for layout, b in BYTES_PER_ENTRY.items():
        ratio = b / BYTES_PER_ENTRY["bf16"]
        target = MEMORY_TARGET_VS_BF16 if layout == "fp8-rescore" else None
        out.append({"layout": layout, "bytes_per_entry": b, "vs_bf16": ratio, "target_vs_bf16": target,
                    "verdict": None if target is None else ("pass" if ratio <= target else "miss")})
    return out


def deepgemm_route(c: Case) -> str:
    """The route SGLang 0.5.23 takes for the case's fp8 logits (:func:`.serve.fp8_route`); decode and verify rows,
    and a varlen extend of several requests, go one row per token through the paged call."""
    from . import serve

    if c.phase in ("decode", "verify"):
        return serve.FP8_PAGED
    return serve.fp8_route(serve.Case("prefill", c.batch, c.prefixes[0], 1, c.chunk))


# --------------------------------------------------------------------------------------------------
# inputs
# --------------------------------------------------------------------------------------------------

@dataclass
class Inputs:
    bf16: torch.Tensor
    hi: torch.Tensor
    lo: torch.Tensor
    tables: list                 # per rotation: block table [batch, pages] over distinct pages of the caches
    row_tables: list             # per rotation: the same, one row per query row (SGLang's paged rows)
    q: torch.Tensor              # decode / verify [B, next_n, 64, 128]; extend / prefill [T, 64, 128] (fp8)
    q_rows: torch.Tensor         # [rows, 1, 64, 128]
    weights: torch.Tensor        # [rows, 64] (q's scale folded in)
    lens: torch.Tensor           # decode / verify: int32 [B]; extend / prefill: ke, int32 [T]
    lens_rows: torch.Tensor      # int32 [rows]: the keys each row sees
    ks: torch.Tensor | None
    cu_rows: torch.Tensor | None
    width: int


def _bytes_per_call(c: Case) -> int:
    """The bytes one call of the case touches at most (bf16 keys and fp32 logits): decides the rotations."""
    entries = c.entries()
    width = max(math.ceil(n / layouts.PAGE_SLOTS) for n in entries) * layouts.PAGE_SLOTS
    return sum(entries) * layouts.BF16_BYTES_PER_TOKEN + c.rows * width * 4


def _inputs(c: Case, device, g, rot: int) -> Inputs:
    """The case's caches (``rot`` disjoint page sets, keys written by ``store_index_k``: bf16, and hi + lo in one
    launch), block tables, query and lengths."""
    from .sweeps import _paged_tables, make_freqs

    entries = c.entries()
    pages = [math.ceil(n / layouts.PAGE_SLOTS) for n in entries]
    table_w = max(pages)
    tables, P = _paged_tables(pages, rot, table_w, device, g)
    slots = P * layouts.PAGE_SLOTS
    longest = max(entries)
    kv = torch.randn(slots, layouts.HEAD_DIM, device=device, generator=g)
    pos = 4 * (torch.arange(slots, device=device) % longest)
    loc = torch.arange(slots, device=device)
    freqs = make_freqs(4 * longest, device)
    w_norm = torch.ones(layouts.HEAD_DIM, device=device)
    bf16 = layouts.empty_cache(P, "bf16", device)
    hi, lo = layouts.empty_cache(P, "fp8", device), rescore.empty_lo_cache(P, device)
    cupy_dsa.store_index_k(kv, bf16, positions=pos, out_loc=loc, norm_weight=w_norm, freqs_cis=freqs)
    cupy_dsa.store_index_k(kv, hi, positions=pos, out_loc=loc, norm_weight=w_norm, freqs_cis=freqs, lo_cache=lo)
    del kv, freqs
    B, R = c.batch, c.rows
    shape = (B, c.next_n) if c.phase in ("decode", "verify") else (R,)
    qf = torch.randn(*shape, layouts.N_HEADS, layouts.HEAD_DIM, device=device, generator=g)
    s = qf.abs().amax(-1).clamp_min(1e-4) / 448.0
    q = (qf / s[..., None]).to(torch.float8_e4m3fn)
    w = (torch.randn(R, layouts.N_HEADS, device=device, generator=g) / 90.5 * s.reshape(R, -1)).contiguous()
    ks = cu_rows = None
    if c.phase in ("decode", "verify"):
        lens = torch.tensor(entries, dtype=torch.int32, device=device)
        lens_rows = (lens[:, None] - (c.next_n - 1) + torch.arange(c.next_n, device=device)[None, :]).clamp_min(0)
        lens_rows = lens_rows.reshape(-1).to(torch.int32).contiguous()
        per_request = c.next_n
    else:  # row j of request b sees its prefix's entries and one more per 4 new tokens
        lens = torch.cat([p // 4 + (torch.arange(c.chunk, device=device) + 1) // 4 for p in c.prefixes])
        lens = lens.to(torch.int32).contiguous()
        lens_rows = lens
        ks = torch.zeros(R, dtype=torch.int32, device=device)
        cu_rows = (c.chunk * torch.arange(B + 1, device=device)).to(torch.int32)
        per_request = c.chunk
    row_tables = [bt.repeat_interleave(per_request, 0) for bt in tables]
    return Inputs(bf16, hi, lo, tables, row_tables, q, q.reshape(R, 1, layouts.N_HEADS, layouts.HEAD_DIM), w, lens,
                  lens_rows, ks, cu_rows, table_w * layouts.PAGE_SLOTS)


# --------------------------------------------------------------------------------------------------
# the timed calls
# --------------------------------------------------------------------------------------------------

def _bound(op, c: Case, x: Inputs) -> list:
    """``op`` bound to each rotation's rows (lengths, page-table rows), its plan built once here (outside the
    timing, as SGLang builds its plan once per forward)."""
    out = []
    for table in x.row_tables:
        b = op.bind(x.lens_rows, table, c.index_topk)
        b.plan()
        out.append(b)
    return out


def _calls(c: Case, x: Inputs, dg, topks=None) -> dict:
    """{column: [one call per rotation]}; the DeepGEMM columns only with ``dg``, SGLang's top-k only where
    ``topks`` (:class:`peers.TopKs`; default: ours standing in) has it."""
    topks = topks if topks is not None else peers.topks(x.q.device, sglang=False)
    topk = c.index_topk
    kp = c.k_prime
    rot = len(x.tables)
    stock_topk = _bound(topks.stock, c, x)
    decode = c.phase in ("decode", "verify")
    if decode:
        plan = cupy_dsa.paged_mqa_logits_plan(x.lens, c.next_n)

        def ours(cache, i, clean=True):
            return cupy_dsa.paged_mqa_logits(x.q, cache, x.weights, x.lens, x.tables[i], x.width, clean_logits=clean,
                                             plan=plan)

        def whole(i, **kw):
            return rescore.rescore_topk(x.q, x.weights, x.hi, x.lo, x.lens, x.tables[i], topk, kp, **kw)
    else:
        plan = cupy_dsa.mqa_logits_plan(x.cu_rows)

        def ours(cache, i, clean=True):
            return cupy_dsa.mqa_logits(x.q, cache, x.weights, x.ks, x.lens, block_table=x.tables[i],
                                       cu_rows=x.cu_rows, plan=plan, clean_logits=clean)

        def whole(i, **kw):
            return rescore.rescore_topk_prefill(x.q, x.weights, x.hi, x.lo, x.ks, x.lens, x.tables[i], topk, kp,
                                                cu_rows=x.cu_rows, **kw)

    # stage 1 as the whole op runs it: the selection reads only the columns a row sees (no cleaning)
    stage1 = [ours(x.hi, i, clean=False) for i in range(rot)]  # stage 2's input, one per rotation
    calls = {
        BF16: [lambda i=i: stock_topk[i].select(ours(x.bf16, i)) for i in range(rot)],
        FP8: [lambda i=i: stock_topk[i].select(ours(x.hi, i)) for i in range(rot)],
        RESCORE: [lambda i=i: whole(i, plan=plan) for i in range(rot)],
        STAGE1: [lambda i=i: ours(x.hi, i, clean=False) for i in range(rot)],
        STAGE2: [lambda i=i: whole(i, stage1_logits=stage1[i]) for i in range(rot)],
    }
    if dg is None:
        calls.update(_topk_alone(topks, c, x, stage1))
        return calls
    # DeepGEMM's paged rows (SGLang's paged route, and the plugin's stage1=sglang), its schedule built here once
    _, dg_rows = peers.deepgemm_decode(dg, x.q_rows, x.hi, x.weights, x.lens_rows[:, None], x.row_tables[0], x.width)

    def rows_rescore(i, logits):
        return rescore.rescore_topk(x.q_rows, x.weights, x.hi, x.lo, x.lens_rows, x.row_tables[i], topk, kp,
                                    stage1_logits=logits)

    from . import serve

    if deepgemm_route(c) == serve.FP8_NONPAGED:
        from .sweeps import _sgl_topk_ranges

        ks, ke = _sgl_topk_ranges(x.ks, x.lens, topk)  # the ranges SGLang passes with its own top-k
        n_keys = c.entries()[0]
        nonpaged = [peers.nonpaged_prefill(dg, x.q, x.weights, ks, ke, x.tables[i][0], n_keys) for i in range(rot)]
        nonpaged[0].check(x.hi)
        stock = [lambda i=i: nonpaged[i].logits(x.hi) for i in range(rot)]
    else:
        stock = [lambda i=i: dg_rows(x.row_tables[i]) for i in range(rot)]
    dg_stage1 = [dg_rows(x.row_tables[i]) for i in range(rot)]
    calls.update({
        FP8_DG: [lambda i=i: stock_topk[i].select(stock[i]()) for i in range(rot)],
        RESCORE_DG: [lambda i=i: rows_rescore(i, dg_rows(x.row_tables[i])) for i in range(rot)],
        STAGE1_DG: [lambda i=i: dg_rows(x.row_tables[i]) for i in range(rot)],
        STAGE2_DG: [lambda i=i: rows_rescore(i, dg_stage1[i]) for i in range(rot)],
    })
    if peers.SGLANG_V2 in topks.ops and kp <= _V2_MAX_K:
        calls.update(_v2_candidate_calls(c, x, dg_rows, dg_stage1, topks.ops[peers.SGLANG_V2].module))
    calls.update(_topk_alone(topks, c, x, [stock[i]() for i in range(rot)]))
    return calls


_V2_MAX_K = 2048   # SGLang's v2 top-k takes k <= 2048 (cupy_dsa.sglang.candidates.MAX_K)


def _v2_candidate_calls(c: Case, x: Inputs, dg_rows, dg_stage1, module) -> dict:
    """The plugin's stage1=sglang since issue 48: SGLang's v2 top-k (``module``: SGLang's top-k module as the run
    loaded it) at k = K' picks the candidates (``cupy_dsa.sglang.candidates``, the product's own call), then
    ``rescore_topk(candidates=)``."""
    from cupy_dsa.sglang import candidates

    choice = candidates.CandidateSelect(candidates.SGLANG_V2, "bench rescore")
    lens = x.lens_rows
    plan = module.plan_topk_v2(lens, out=lens.new_empty(lens.shape[0] + 1, 2))   # once, outside the timing

    def rescored(i, logits):
        given = candidates.select_candidates(choice, logits, lens, x.row_tables[i], c.index_topk, c.k_prime, plan,
                                             topk=module)
        return rescore.rescore_topk(x.q_rows, x.weights, x.hi, x.lo, x.lens_rows, x.row_tables[i], c.index_topk,
                                    stage1_logits=logits, candidates=given)

    rot = len(x.tables)
    return {RESCORE_V2C: [lambda i=i: rescored(i, dg_rows(x.row_tables[i])) for i in range(rot)],
            STAGE2_V2C: [lambda i=i: rescored(i, dg_stage1[i]) for i in range(rot)]}


def _topk_alone(topks, c: Case, x: Inputs, logits: list) -> dict:
    """Each top-k of ``topks`` alone on the stock step's logits (one tensor per rotation)."""
    out = {}
    for key, op in topks.ops.items():
        bound = _bound(op, c, x)
        out[TOPK_COLUMNS[key]] = [lambda i=i, b=bound: b[i].select(logits[i]) for i in range(len(logits))]
    return out


def _key_bytes(c: Case) -> dict:
    """Index-key bytes each column reads at least: every stored entry once (256 / 132 B), and for the rescore K' x
    264 B (hi + lo) per query row."""
    entries = sum(c.entries())
    stage2 = c.rows * c.k_prime * rescore.TWO_LEVEL_BYTES_PER_TOKEN
    fp8 = entries * layouts.FP8_BYTES_PER_TOKEN
    return {BF16: entries * layouts.BF16_BYTES_PER_TOKEN, FP8: fp8, FP8_DG: fp8, RESCORE: fp8 + stage2,
            RESCORE_DG: fp8 + stage2, RESCORE_V2C: fp8 + stage2, STAGE1: fp8, STAGE2: stage2, STAGE1_DG: fp8,
            STAGE2_DG: stage2, STAGE2_V2C: stage2,
            **{col: 0 for col in TOPK_COLUMNS.values()}}


def measure(c: Case, device, dg, dg_reason: str | None, seed: int, reps: int, topks=None) -> dict:
    """One case: us per call of every column (None where it did not run, with why), per query row, and their
    ratios to bf16 and to DeepGEMM's fp8 + top-k (``topks``: :class:`peers.TopKs`, default ours standing in)."""
    topks = topks if topks is not None else peers.topks(device, sglang=False)
    from .sweeps import _gen
    from .timing import rotations, time_calls

    rot = rotations(device, _bytes_per_call(c))
    row = {"phase": c.phase, "case": case_label(c), "batch": c.batch, "prefixes": list(c.prefixes),
           "next_n": c.next_n, "chunk": c.chunk, "rows": c.rows, "index_entries": sum(c.entries()),
           "index_topk": c.index_topk, "k_prime": c.k_prime, "deepgemm_route": deepgemm_route(c),
           "rotating_buffers": rot, "us": {col: None for col in COLUMNS}, "errors": {}, "timing": None,
           "key_bytes": _key_bytes(c)}
    for col in DEEPGEMM_COLUMNS if dg is None else ():
        row["errors"][col] = f"not measured: {dg_reason}"
    for key, col in TOPK_COLUMNS.items():
        if key not in topks.ops:
            row["errors"][col] = f"not measured: {topks.status.get(key)}"
    for col in V2_CANDIDATE_COLUMNS if dg is not None else ():
        if peers.SGLANG_V2 not in topks.ops:
            row["errors"][col] = f"not measured: {topks.status.get(peers.SGLANG_V2)}"
        elif c.k_prime > _V2_MAX_K:
            row["errors"][col] = f"not measured: K' {c.k_prime} is past the {_V2_MAX_K} SGLang's v2 top-k takes"
    try:
        x = _inputs(c, device, _gen(device, seed), rot)
        calls = _calls(c, x, dg, topks)
    except Exception as exc:  # one case failing must not end the run
        row["errors"]["inputs"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        return _ratios(row)
    for col in COLUMNS:
        if col not in calls:
            continue
        try:
            t = time_calls(calls[col], device, reps=reps)
            row["us"][col] = t.seconds * 1e6
            row["timing"] = t.method
        except Exception as exc:
            row["errors"][col] = f"{type(exc).__name__}: {str(exc)[:200]}"
    del x, calls
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return _ratios(row)


def _ratios(row: dict) -> dict:
    us = row["us"]
    row["us_per_row"] = {k: (v / row["rows"] if v is not None else None) for k, v in us.items()}
    row["vs_bf16"] = {k: (v / us[BF16] if v is not None and us[BF16] else None) for k, v in us.items()}
    row["vs_fp8_deepgemm"] = {k: (v / us[FP8_DG] if v is not None and us[FP8_DG] else None) for k, v in us.items()}
    return row


# --------------------------------------------------------------------------------------------------
# the floor of "stage 2 + selection" (issue 31)
# --------------------------------------------------------------------------------------------------

def floor_target(entry_rows: int) -> float:
    """Issue 31's target share of the floor for a case of ``entry_rows`` rows x index entries."""
    return FLOOR_TARGET["large"] if entry_rows >= FLOOR_TARGET["min_entry_rows"] else FLOOR_TARGET["small"]


def mma_ceiling(ceilings: dict | None) -> tuple[float, int] | None:
    """(TFLOP/s, warps per SM) of the best register-operand bf16 mma.sync ceiling measured (the floor assumes
    stage 2 at the best residency), or None when the run measured none."""
    rates = ((ceilings or {}).get("mma_sync") or {}).get(MMA_KIND)
    if not rates:
        return None
    warps = max(rates, key=lambda w: rates[w])
    return rates[warps], int(warps)


def floor(c: Case, ceilings: dict | None, keys_per_candidate: int = STAGE2_KEYS_PER_CANDIDATE) -> dict:
    """The floor of "stage 2 + selection" for case ``c``: what it moves and computes (``keys_per_candidate``: the
    f16 keys stage 2 multiplies per candidate, as the run's code did), and (where ``ceilings`` holds the read-only
    stream and the mma.sync ceiling, both measured in the same run) the time that costs, which bound binds, and the
    target share."""
    visible = c.visible()
    candidates = sum(min(c.k_prime, v) for v in visible)
    candidate_bytes = candidates * rescore.TWO_LEVEL_BYTES_PER_TOKEN
    logit_bytes = sum(visible) * LOGIT_BYTES
    flops = candidates * STAGE2_FLOPS_PER_KEY * keys_per_candidate
    read = (ceilings or {}).get("read_gbps")
    mma = mma_ceiling(ceilings)
    read_us = (candidate_bytes + logit_bytes) / (read * 1e9) * 1e6 if read else None
    mma_us = flops / (mma[0] * 1e12) * 1e6 if mma else None
    us = max(read_us, mma_us) if read_us is not None and mma_us is not None else None
    return {"entry_rows": c.entry_rows(), "candidates": candidates, "candidate_bytes": candidate_bytes,
            "logit_bytes": logit_bytes, "bytes": candidate_bytes + logit_bytes, "flops": flops,
            "read_gbps": read, "mma_tflops": mma[0] if mma else None, "mma_warps_per_sm": mma[1] if mma else None,
            "read_us": read_us, "mma_us": mma_us, "us": us,
            "binds": None if us is None else ("read" if read_us >= mma_us else "mma.sync"),
            "target": floor_target(c.entry_rows())}


def floor_shares(fl: dict, us: dict) -> tuple[dict, dict]:
    """({column: share of the floor reached}, {column: "pass" | "miss"}) of :data:`FLOOR_COLUMNS` for a floor
    ``fl`` (:func:`floor`) and a row's times ``us``; None where the floor or the time is missing."""
    share, verdict = {}, {}
    for col in FLOOR_COLUMNS:
        t = us.get(col)
        share[col] = fl["us"] / t if fl.get("us") and t else None
        verdict[col] = None if share[col] is None else ("pass" if share[col] >= fl["target"] else "miss")
    return share, verdict


def with_floor(row: dict, c: Case, ceilings: dict | None,
               keys_per_candidate: int = STAGE2_KEYS_PER_CANDIDATE) -> dict:
    """``row`` with its floor (:func:`floor`), the share of it each floor column reached and the verdicts."""
    fl = floor(c, ceilings, keys_per_candidate)
    fl["share"], fl["verdict"] = floor_shares(fl, row["us"])
    row["floor"] = fl
    return row


def case_of(row: dict) -> Case | None:
    """The :class:`Case` a JSON row was measured on; None for the first runs' rows (no phase recorded)."""
    if "phase" not in row or "prefixes" not in row:
        return None
    return Case(row["phase"], tuple(row["prefixes"]), row.get("next_n") or 1, row.get("chunk") or 0,
                row.get("index_topk") or INDEX_TOPK)


def rows(device: torch.device, quick: bool, seed: int, dg=None, dg_reason: str | None = "not asked for",
         progress=None, phases=None, topks=None, ceilings: dict | None = None) -> list[dict]:
    """The measured rows of :func:`cases` (only ``phases`` when given); ``topks``: :class:`peers.TopKs` (default:
    ours standing in for SGLang's); each row with the floor of "stage 2 + selection" against ``ceilings`` (those
    measured in the same run; None: the floor's bytes and flops only)."""
    topks = topks if topks is not None else peers.topks(device, sglang=False)
    case_list = [c for c in cases(device, quick) if phases is None or c.phase in phases]
    reps = (10 if quick else 25) if device.type == "cuda" else 2
    task = progress.add_task("rescore", total=len(case_list)) if progress is not None else None
    out = []
    for c in case_list:
        out.append(with_floor(measure(c, device, dg, dg_reason, seed, reps, topks), c, ceilings))
        if task is not None:
            progress.advance(task)
    return out


# --------------------------------------------------------------------------------------------------
# rendering (old results: decode rows with columns bf16 / fp8 / fp8-rescore / rescore stages, no schema)
# --------------------------------------------------------------------------------------------------

OLD_STAGES = "rescore stages"  # the first runs' name of "stage 2 + selection"


def is_rescore(doc) -> bool:
    """A `bench rescore` result: its schema, or the first runs' form (no schema; rows of 'us' per column)."""
    if not isinstance(doc, dict):
        return False
    if doc.get("schema") == SCHEMA:
        return True
    rs = doc.get("rows")
    return "schema" not in doc and isinstance(rs, list) and bool(rs) and all(
        isinstance(r, dict) and isinstance(r.get("us"), dict) and RESCORE in r["us"] for r in rs)


def _columns_of(doc) -> list[str]:
    """The columns a run holds a figure for, in :data:`COLUMNS` order (an old run's 'rescore stages' as stage 2)."""
    have = {k for r in doc["rows"] for k, v in r["us"].items() if v is not None}
    if OLD_STAGES in have:
        have.add(STAGE2)
    return [c for c in COLUMNS if c in have]


def _us(r, col):
    v = r["us"].get(col)
    if v is None and col == STAGE2:
        v = r["us"].get(OLD_STAGES)
    return v


def _row_label(r) -> str:
    if "case" in r:
        return r["case"]
    return f"decode {r['B']} x {_tokens(r['tokens'])}"  # the first runs' rows


def _fmt_us(v) -> str:
    return "—" if v is None else (f"{v / 1e3:.2f} ms" if v >= 1e3 else f"{v:.1f} us")


def markdown(doc: dict) -> str:
    """The run as markdown: a table per run (us per call; the fp8-rescore columns also per query row and as a
    ratio to DeepGEMM's fp8 + top-k where measured), the floor of "stage 2 + selection" and the share of it reached
    (issue 31; "—" where the run measured no ceilings), the legend, memory per index entry; runs that record their
    stock top-k (issue 31) also name it and give the top-k columns a table of their own."""
    topk_run = doc.get("topk")
    cols = [c for c in _columns_of(doc) if c not in TOPK_COLUMNS.values()]
    dg = FP8_DG in cols
    topk = doc.get("index_topk") or (doc["rows"][0].get("index_topk") if doc["rows"] else INDEX_TOPK)
    head = (f"{doc.get('device') or 'no GPU'}{', quick sizes' if doc.get('quick') else ''}, commit "
            f"`{commit_label(doc)}`: top-{topk} of each query row, time per call "
            f"({', '.join(sorted({r['timing'] for r in doc['rows'] if r.get('timing')})) or 'timing method not recorded'})"
            f"{'' if dg else '; DeepGEMM: ' + str(doc.get('deepgemm') or 'not recorded')}.")
    if topk_run:
        head += f" Stock top-k: {stock_topk_name(topk_run)}."
    ratio_cols = [(RESCORE, "fp8-rescore / fp8 DeepGEMM"), (RESCORE_DG, "fp8-rescore (DG stage 1) / fp8 DeepGEMM")] \
        if dg else [(RESCORE, "fp8-rescore / fp8")]
    if dg and RESCORE_V2C in cols:
        ratio_cols.append((RESCORE_V2C, "fp8-rescore (DG stage 1, v2 candidates) / fp8 DeepGEMM"))
    hdr = ["case"] + cols + ["fp8-rescore per token"] + [name for _, name in ratio_cols]
    lines = [head, "", "| " + " | ".join(hdr) + " |", "|" + "---|" * len(hdr)]
    base = FP8_DG if dg else FP8
    for r in doc["rows"]:
        rows_n = r.get("rows") or r.get("B")
        per = _us(r, RESCORE)
        cells = [_row_label(r)] + [_fmt_us(_us(r, c)) for c in cols]
        cells.append("—" if per is None or not rows_n else f"{per / rows_n:.2f} us")
        for col, _ in ratio_cols:
            a, b = _us(r, col), _us(r, base)
            cells.append("—" if a is None or not b else f"{a / b:.2f}x")
        lines.append("| " + " | ".join(cells) + " |")
    nonpaged = [_row_label(r) for r in doc["rows"] if r.get("deepgemm_route") and r["deepgemm_route"] != "paged rows"
                and _us(r, FP8_DG) is not None]
    if nonpaged:
        lines += ["", f"fp8 DeepGEMM on SGLang's non-paged route (key gather + fp8_mqa_logits): {'; '.join(nonpaged)}; "
                      "every other case: paged rows."]
    lines += _floor_table(doc)
    if topk_run:
        lines += _topk_table(doc)
    names = {**LEGEND, **(doc.get("columns") or {})} if topk_run else LEGEND
    shown = cols + ([c for c in TOPK_COLUMNS.values() if c in _columns_of(doc)] if topk_run else [])
    lines += ["", "Columns: " + "; ".join(f"**{c}**: {names[c]}" for c in shown) + "."]
    mem = doc.get("memory") or memory_rows()
    parts = [f"{m['layout']} {m['bytes_per_entry']} B ({m['vs_bf16']:.2f}x bf16"
             + (f", target <= {m['target_vs_bf16']:.2f}x: {m['verdict']}" if m.get("target_vs_bf16") else "") + ")"
             for m in mem]
    lines += ["", "Memory per index entry: " + ", ".join(parts) + "."]
    hidden = set(DEEPGEMM_COLUMNS) if not dg else set()
    if topk_run:  # a top-k that does not run here is named once, in the head or the top-k table
        hidden |= set(SGLANG_COLUMNS)
    errors = [f"{_row_label(r)}: {k}: {v}" for r in doc["rows"] for k, v in (r.get("errors") or {}).items()
              if k not in hidden and not (topk_run and k in V2_CANDIDATE_COLUMNS and "SGLang's v2 top-k not" in v)]
    if errors:
        lines += ["", "Not measured: " + "; ".join(errors) + "."]
    return "\n".join(lines) + "\n"


def _topk_table(doc: dict) -> list[str]:
    """The top-k columns of a run (each alone on the stock step's logits), with ours over SGLang v2's."""
    have = [c for c in TOPK_COLUMNS.values() if c in _columns_of(doc)]
    if not have:
        return []
    status = doc["topk"].get("status") or {}
    lines = ["", "Each top-k alone on the stock step's logits (us per call):", "",
             "| case | " + " | ".join(have) + (" | cupy_dsa / SGLang v2 |" if TOPK_V2 in have else " |"),
             "|---|" + "---|" * (len(have) + (TOPK_V2 in have))]
    for r in doc["rows"]:
        cells = [_row_label(r)] + [_fmt_us(_us(r, c)) for c in have]
        if TOPK_V2 in have:
            a, b = _us(r, TOPK_OURS), _us(r, TOPK_V2)
            cells.append("—" if a is None or not b else f"{a / b:.2f}x")
        lines.append("| " + " | ".join(cells) + " |")
    missing = [f"{TOPK_COLUMNS[k]}: {why}" for k, why in status.items() if why != "live" and TOPK_COLUMNS.get(k)]
    if missing:
        lines += ["", "Not run: " + "; ".join(missing) + "."]
    return lines


def _row_floor(doc: dict, r: dict) -> dict | None:
    """A row's floor: the one it recorded, else (runs from before the floor) its bytes and flops from its case,
    against the run's ceilings if any; None for the first runs' rows."""
    if r.get("floor"):
        return r["floor"]
    c = case_of(r)
    if c is None:
        return None
    fl = floor(c, doc.get("ceilings"), doc.get("stage2_keys_per_candidate", OLD_STAGE2_KEYS_PER_CANDIDATE))
    fl["share"], fl["verdict"] = floor_shares(fl, {col: _us(r, col) for col in FLOOR_COLUMNS})
    return fl


def _fmt_share(fl: dict, col: str) -> str:
    share, verdict = (fl.get("share") or {}).get(col), (fl.get("verdict") or {}).get(col)
    return "—" if share is None else f"{100 * share:.0f}%: {verdict}"


def _floor_table(doc: dict) -> list[str]:
    """The floor of "stage 2 + selection" per case, the share of it each floor column reached, issue 31's target
    and the verdicts."""
    floors = [(r, _row_floor(doc, r)) for r in doc["rows"]]
    floors = [(r, fl) for r, fl in floors if fl is not None]
    if not floors:
        return []
    cols = [c for c in FLOOR_COLUMNS if any(_us(r, c) is not None for r, _ in floors)]
    measured = [fl for _, fl in floors if fl.get("us") is not None]
    if measured:
        fl = measured[0]
        rates = (f"read-only stream {fl['read_gbps']:.0f} GB/s, bf16 mma.sync {fl['mma_tflops']:.0f} TFLOP/s at "
                 f"{fl['mma_warps_per_sm']} warps per SM, both measured in this run")
    else:
        rates = "this run measured no ceilings (it predates them): no floor in time, no share, no verdict"
    big = FLOOR_TARGET["min_entry_rows"]
    lines = ["", f"Floor of stage 2 + selection (issue 31): max(bytes / the read-only stream, stage 2's flops / the "
                 f"register-operand bf16 mma.sync ceiling, the rate of stage 2's f16 mma.sync too); {rates}. Bytes: each row's candidates (K' of the entries "
                 f"it sees) x 264 B (hi + lo) + its visible logits once x 4 B; flops: candidates x 64 heads x 128 x 2 "
                 f"(fma) x 2 (hi, lo). Target: >= {FLOOR_TARGET['large']:.0%} of the floor where rows x index entries "
                 f">= {big // 2**20}M, >= {FLOOR_TARGET['small']:.0%} below.", "",
             "| case | rows x entries | MB read | stage-2 GFLOP | floor | binds | target | "
             + " | ".join(f"{c} | share of floor" for c in cols) + " |",
             "|" + "---|" * (7 + 2 * len(cols))]
    for r, fl in floors:
        cells = [_row_label(r), _fmt_count(fl["entry_rows"]), f"{fl['bytes'] / 1e6:.1f}", f"{fl['flops'] / 1e9:.1f}",
                 _fmt_us(fl.get("us")), fl.get("binds") or "—", f">= {fl['target']:.0%}"]
        for c in cols:
            cells += [_fmt_us(_us(r, c)), _fmt_share(fl, c)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _fmt_count(n: int) -> str:
    """1.00M / 256K / 512: entries in units of 2^20 or 2^10."""
    return f"{n / 2**20:.2f}M" if n >= 2**20 else (f"{n / 2**10:.0f}K" if n >= 2**10 else str(n))
