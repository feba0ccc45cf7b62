"""``cupy-dsa bench serve``: what bf16 index keys cost one forward of a DeepSeek-V4 server, next to SGLang's fp8.

One forward's indexer work on every C4 layer (one cache per layer, as the server keeps them): the store of the
forward's new index entries, the logits of the layer, and the schedule built once per forward (ForwardPlans).
bf16 runs our ops on the plugin's routes (decode rows, grouped verify next_n = n, varlen extend for a prefill
chunk); fp8-cupy runs the same ops and routes on SGLang's fp8 layout (the plugin's fp8-cupy mode); fp8 runs
DeepGEMM's ``fp8_paged_mqa_logits`` on one row per token as SGLang calls it, with our store op writing the fp8
layout standing in for SGLang's fp8 store kernel. Top-k is the same in all three and left out.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from cupy_dsa.layouts import BYTES_PER_TOKEN, HEAD_DIM, N_HEADS, PAGE_SLOTS

from .bytes import C4_RATIO, C128_RATIO, v4_compress_ratios

SCHEMA = "cupy-dsa-serve/1"
GIB = 2**30
CACHE_BUDGET_SHARE = 0.6  # share of free GPU memory the per-layer caches may take (the rest: outputs, graphs)

COUNTED = ("one forward = per C4 layer: store of the forward's new index entries + logits, and the schedule once "
           "per forward; top-k is identical for bf16 and fp8 and excluded. New entries per forward: decode/verify "
           "ceil(batch * next_n / 4) (on average one entry per 4 tokens), prefill chunk / 4. fp8 = DeepGEMM "
           "fp8_paged_mqa_logits on one row per token (SGLang's call) + our store op writing SGLang's fp8 layout "
           "(standing in for SGLang's fp8 store kernel); fp8-cupy = the plugin's fp8-cupy mode, our store and "
           "logits on the bf16 routes over SGLang's fp8 layout (same bytes as fp8, our kernels). A prefill chunk is "
           "one request of --chunk tokens after a prefix of --context tokens.")

# What `measure` times: (layout name, cache layout); "fp8" is DeepGEMM's call, the others are our ops.
TIMED = (("bf16", "bf16"), ("fp8-cupy", "fp8"), ("fp8", "fp8"))


@dataclass(frozen=True)
class ServeModel:
    name: str
    n_layers: int
    n_c4: int
    index_topk: int
    source: str
    assumed: str | None  # why a figure is assumed, or None when every figure is read


BUILTIN = {
    "v4-flash": ServeModel("DeepSeek-V4-Flash", 43, v4_compress_ratios(43)[:43].count(C4_RATIO), 512,
                           "built-in (V4-Flash HF config.json: num_hidden_layers 43, compress_ratios "
                           "[0, 0, 4, 128, ..., 128, 4, 0] of 44 entries, the last the MTP layer's)", None),
    "v4-pro": ServeModel("DeepSeek-V4-Pro", 61, v4_compress_ratios(61)[:61].count(C4_RATIO), 1024,
                         "built-in (index_topk 1024 per vLLM #40811)",
                         "61 layers with V4-Flash's compress_ratios pattern are ASSUMED (no published V4-Pro layer "
                         "count was at hand); pass --model <config.json> for the real figure"),
}


RATIOS = (0, C4_RATIO, C128_RATIO)  # what a DeepSeek-V4 layer compresses by (0: window only)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # JSON true / false are not counts


def parse_config(path: str) -> ServeModel:
    """A DeepSeek-V4 HF ``config.json``: ``compress_ratios`` (one entry per layer, each 0, 4 or 128; the ratio-4
    layers carry the indexer), the layer count from ``num_hidden_layers`` (HF) or ``n_layers`` (DeepSeek's
    inference config) when present (ratios past it, e.g. an MTP layer's, are not counted), ``index_topk``, and
    ``index_n_heads`` / ``index_head_dim`` which must be 64 / 128 (the kernels' shape). Raises ValueError naming
    the field. The model is named by ``_name_or_path``, else by the config's path."""
    try:
        cfg = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path!r} as JSON ({type(exc).__name__}: {exc})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path!r}: expected a JSON object, got {type(cfg).__name__}")
    ratios = cfg.get("compress_ratios")
    if not isinstance(ratios, list) or not ratios or not all(_is_int(r) and r in RATIOS for r in ratios):
        bad = [r for r in ratios if not (_is_int(r) and r in RATIOS)] if isinstance(ratios, list) else None
        raise ValueError(f"{path!r}: expected 'compress_ratios', a non-empty list with one of 0, 4, 128 per layer "
                         f"(4 = indexer layer), got {ratios!r}" + (f" ({', '.join(map(repr, bad))} not one of them)"
                                                                   if bad else ""))
    n_layers = cfg.get("num_hidden_layers", cfg.get("n_layers", len(ratios)))
    if not _is_int(n_layers) or not 0 < n_layers <= len(ratios):
        raise ValueError(f"{path!r}: expected 'num_hidden_layers' (or 'n_layers') an int in 1..{len(ratios)} (the "
                         f"length of compress_ratios), got {n_layers!r}")
    n_c4 = ratios[:n_layers].count(C4_RATIO)
    if n_c4 == 0:
        raise ValueError(f"{path!r}: no indexer layer: compress_ratios has no ratio-4 layer in its first {n_layers} "
                         f"(num_hidden_layers), so there is no index cache to measure")
    for field, want in (("index_n_heads", N_HEADS), ("index_head_dim", HEAD_DIM)):
        if field in cfg and not (_is_int(cfg[field]) and cfg[field] == want):
            raise ValueError(f"{path!r}: expected {field} = {want} (the indexer shape the kernels take), "
                             f"got {cfg[field]!r}")
    topk = cfg.get("index_topk")
    if not _is_int(topk) or topk <= 0:
        raise ValueError(f"{path!r}: expected 'index_topk', a positive int, got {topk!r}")
    name = cfg.get("_name_or_path")
    return ServeModel(name if isinstance(name, str) and name else str(path), n_layers, n_c4, topk,
                      f"config {path}", None)


def resolve_model(value: str) -> ServeModel:
    return BUILTIN[value] if value in BUILTIN else parse_config(value)


def memory_rows(model: ServeModel, memory_gib: float) -> list[dict]:
    """Index-cache bytes per raw token of all C4 layers and the tokens that fit in ``memory_gib`` (partial
    pages ignored), per layout."""
    out = []
    for layout in ("bf16", "fp8"):
        entry = BYTES_PER_TOKEN[layout]
        per_token = model.n_c4 * entry / C4_RATIO
        out.append({"layout": layout, "bytes_per_entry": entry, "index_layers": model.n_c4,
                    "index_bytes_per_token": per_token, "memory_gib": memory_gib,
                    "tokens_fit": int(memory_gib * GIB // per_token)})
    return out


@dataclass(frozen=True)
class Case:
    phase: str       # "decode" (next_n 1), "verify" (next_n 2..4) or "prefill" (one chunk)
    batch: int
    context: int     # raw tokens per request before this forward
    next_n: int
    chunk: int       # prefill tokens (0 for decode / verify)

    @property
    def new_entries(self) -> int:
        return self.chunk // C4_RATIO if self.phase == "prefill" else math.ceil(self.batch * self.next_n / C4_RATIO)


def case_label(c: Case) -> str:
    """What a case measures, in raw tokens: 'decode 32 x 8K', 'verify 32 x 8K, next_n 2', 'prefill chunk of
    4,096 after 8K'."""
    if c.phase == "prefill":
        return f"prefill chunk of {c.chunk:,} after {_tokens(c.context)}"
    return f"{c.phase} {c.batch} x {_tokens(c.context)}" + (f", next_n {c.next_n}" if c.phase == "verify" else "")


def cases(batch: int, contexts, next_n: int, chunk: int) -> list[Case]:
    step = "decode" if next_n == 1 else "verify"
    return ([Case(step, batch, c, next_n, 0) for c in contexts]
            + [Case("prefill", 1, c, 1, chunk) for c in contexts])


# --------------------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------------------

def _cache_pages(case: Case) -> int:
    """Pages one layer's cache needs: every request's pages after this forward, plus one spare."""
    if case.phase == "prefill":
        return math.ceil((case.context + case.chunk) / C4_RATIO / PAGE_SLOTS) + 1
    per_req = math.ceil((case.context + case.next_n) / C4_RATIO / PAGE_SLOTS)
    return case.batch * per_req + 1


def _layer_caches(case: Case, layout: str, n_c4: int, device, g):
    """Distinct caches, one per C4 layer, or as many as fit in CACHE_BUDGET_SHARE of free memory (cycled)."""
    from .sweeps import _random_cache

    pages = _cache_pages(case)
    one = pages * PAGE_SLOTS * BYTES_PER_TOKEN[layout]
    if device.type == "cuda":
        fit = max(1, min(n_c4, int(torch.cuda.mem_get_info(device)[0] * CACHE_BUDGET_SHARE // one)))
    else:  # the torch reference at test sizes
        fit = n_c4
    return [_random_cache(pages, layout, device, g) for _ in range(fit)], pages


def _tables(case: Case, device, g):
    """Block table [B, pages per request] over the layer cache's pages, shuffled (an allocator's free list is
    not in order); the last page stays spare."""
    if case.phase == "prefill":
        w = _cache_pages(case) - 1
    else:
        w = math.ceil((case.context + case.next_n) / C4_RATIO / PAGE_SLOTS)
    perm = torch.randperm(case.batch * w, device=device, generator=g).to(torch.int32)
    return perm.view(case.batch, w)


def _forward(case: Case, layout: str, model: ServeModel, device, g, dg):
    """(forward callable, layers with their own cache) for one layout of :data:`TIMED`: ``bf16`` and
    ``fp8-cupy`` run our ops on the plugin's routes (bf16 rows, or SGLang's fp8 rows), ``fp8`` DeepGEMM."""
    import cupy_dsa

    from . import peers
    from .sweeps import make_freqs

    cache_layout = dict(TIMED)[layout]
    ours = layout != "fp8"
    caches, pages = _layer_caches(case, cache_layout, model.n_c4, device, g)
    n_new = case.new_entries
    kv = torch.randn(n_new, HEAD_DIM, device=device, generator=g)
    positions = torch.arange(n_new, dtype=torch.int32, device=device)
    freqs = make_freqs(max(n_new, 1), device)
    norm_w = 1.0 + 0.1 * torch.randn(HEAD_DIM, device=device, generator=g)
    table = _tables(case, device, g)
    # new entry i belongs to request i % B (a decode step spreads them over the batch) and follows its context
    i = torch.arange(n_new, device=device)
    req, entry = i % case.batch, case.context // C4_RATIO + i // case.batch
    out_loc = table[req, entry // PAGE_SLOTS].to(torch.int64) * PAGE_SLOTS + entry % PAGE_SLOTS
    width = table.shape[1] * PAGE_SLOTS

    def store(cache):
        cupy_dsa.store_index_k(kv, cache, positions=positions, out_loc=out_loc, norm_weight=norm_w, freqs_cis=freqs)

    if case.phase == "prefill":
        T = case.chunk
        prefix = case.context // C4_RATIO
        q = torch.randn(T, N_HEADS, HEAD_DIM, device=device, generator=g).to(torch.float8_e4m3fn)
        weights = torch.rand(T, N_HEADS, device=device, generator=g) / math.sqrt(N_HEADS * HEAD_DIM)
        lens = (prefix + (torch.arange(T, device=device) + 1) // C4_RATIO).to(torch.int32)
        if ours:
            ks = torch.zeros(T, dtype=torch.int32, device=device)
            cu_rows = torch.tensor([0, T], dtype=torch.int32, device=device)

            def layer_logits(cache, plan):
                return cupy_dsa.mqa_logits(q, cache, weights, ks, lens, block_table=table, cu_rows=cu_rows,
                                           plan=plan, clean_logits=False)

            def build_plan():
                return cupy_dsa.mqa_logits_plan(cu_rows)
        else:
            q_rows, row_table, lens_rows = q.view(T, 1, N_HEADS, HEAD_DIM), table.expand(T, -1).contiguous(), lens
    else:
        B, n = case.batch, case.next_n
        entries = case.context // C4_RATIO
        lens_2d = (entries + (torch.arange(n, device=device) + 1) // C4_RATIO).to(torch.int32)[None, :].repeat(B, 1)
        q = torch.randn(B, n, N_HEADS, HEAD_DIM, device=device, generator=g).to(torch.float8_e4m3fn)
        weights = torch.rand(B * n, N_HEADS, device=device, generator=g) / math.sqrt(N_HEADS * HEAD_DIM)
        lens = lens_2d.reshape(-1) if n == 1 else lens_2d
        if ours:
            def layer_logits(cache, plan):
                return cupy_dsa.paged_mqa_logits(q, cache, weights, lens, table, width, plan=plan)

            def build_plan():
                return cupy_dsa.paged_mqa_logits_plan(lens, n)
        else:
            q_rows = q.view(B * n, 1, N_HEADS, HEAD_DIM)
            row_table, lens_rows = table.repeat_interleave(n, 0), lens_2d.reshape(-1).contiguous()

    if not ours:
        schedule, _ = peers.deepgemm_decode(dg, q_rows, caches[0], weights, lens_rows[:, None], row_table, width)
        calls = [peers.deepgemm_decode(dg, q_rows, c, weights, lens_rows[:, None], row_table, width)[1] for c in caches]

        def forward():
            schedule()  # SGLang builds DeepGEMM's schedule once per forward
            for i in range(model.n_c4):
                store(caches[i % len(caches)])
                calls[i % len(calls)]()
    else:
        def forward():
            plan = build_plan()  # ForwardPlans: the first C4 layer builds it, the others reuse it
            for i in range(model.n_c4):
                store(caches[i % len(caches)])
                layer_logits(caches[i % len(caches)], plan)

    return forward, len(caches)


def measure(case: Case, model: ServeModel, device, dg, seed: int, reps: int) -> dict:
    """ms of one forward for bf16, fp8-cupy and (with DeepGEMM) fp8, for one case."""
    from .sweeps import _gen
    from .timing import time_calls

    row = {"phase": case.phase, "batch": case.batch, "context": case.context, "next_n": case.next_n,
           "chunk": case.chunk, "new_entries": case.new_entries, "bf16_ms": None, "fp8_ms": None,
           "fp8_cupy_ms": None, "added_ms": None, "ratio": None, "fp8_cupy_ratio": None, "layer_caches": {},
           "timing": None, "error": None}
    for layout, _ in TIMED:
        if layout == "fp8" and dg is None:
            continue
        try:
            fwd, n_caches = _forward(case, layout, model, device, _gen(device, seed), dg)
            t = time_calls([fwd], device, reps=reps)
            row[f"{layout.replace('-', '_')}_ms"] = t.seconds * 1e3
            row["layer_caches"][layout] = n_caches
            row["timing"] = t.method
            del fwd
        except Exception as exc:  # one case failing must not end the run
            failed = f"{layout}: {type(exc).__name__}: {str(exc)[:200]}"
            row["error"] = f"{row['error']}; {failed}" if row["error"] else failed
        torch.cuda.empty_cache()
    if row["bf16_ms"] is not None and row["fp8_ms"] is not None:
        row["added_ms"] = row["bf16_ms"] - row["fp8_ms"]
        row["ratio"] = row["bf16_ms"] / row["fp8_ms"]
    if row["fp8_cupy_ms"] is not None and row["fp8_ms"] is not None:
        row["fp8_cupy_ratio"] = row["fp8_cupy_ms"] / row["fp8_ms"]  # our kernels against DeepGEMM, same bytes
    return row


def plot(doc: dict, path: str) -> None:
    """ms per decode (or verify) step and per prefill chunk over context, bf16 vs fp8, and the added ms: one row
    of two panels per phase the run measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    step = "verify" if doc["next_n"] > 1 else "decode"
    phases = [(ph, [r for r in doc["timings"] if (r["phase"] == "prefill") == (ph == "prefill")
                    and r["bf16_ms"] is not None]) for ph in (step, "prefill")]
    phases = [(ph, rows) for ph, rows in phases if rows] or [(step, [])]
    with plt.rc_context({"font.size": 9, "xtick.labelsize": 8, "ytick.labelsize": 8, "legend.fontsize": 8}):
        fig, axes = plt.subplots(len(phases), 2, figsize=(11, 4 * len(phases)), squeeze=False)
        for (phase, rows), (ax, ax2) in zip(phases, axes):
            for layout, style, label in (("bf16", "o-", "bf16 index keys"),
                                         ("fp8_cupy", "^:", "fp8 index keys, cupy_dsa kernels (fp8-cupy)"),
                                         ("fp8", "s--", "fp8 index keys, DeepGEMM")):
                pts = [(r["context"], r.get(f"{layout}_ms")) for r in rows if r.get(f"{layout}_ms") is not None]
                if pts:
                    ax.plot(*zip(*pts), style, label=label)
            added = [(r["context"], r["added_ms"]) for r in rows if r["added_ms"] is not None]
            if added:
                ax2.plot(*zip(*added), "o-", color="tab:red")
            unit = (f"prefill chunk of {rows[0]['chunk']:,} tokens" if phase == "prefill" and rows
                    else f"{phase} step, batch {doc['batch']}")
            for a in (ax, ax2):
                a.set_xscale("log", base=2)
                a.set_xlabel("context (raw tokens per request)" if phase != "prefill" else "prefix (raw tokens)")
                a.grid(alpha=0.3)
            ax.set_ylabel(f"indexer ms per {phase} (all C4 layers)")
            ax.set_title(unit)
            if rows:
                ax.legend()
            ax2.set_ylabel("added ms (bf16 - fp8)")
            ax2.set_title(f"{phase}: what bf16 keys add")
        fig.suptitle(f"{doc['model']['name']}, batch {doc['batch']}, next_n {doc['next_n']}, {doc['device']}")
        fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown(doc: dict) -> str:
    """The run as a markdown table (the README's cost table is this, generated from the results file)."""
    m = doc["model"]
    head = (f"{m['name']} ({m['index_layers']} C4 layers), {doc.get('device') or 'no GPU'}, torch "
            f"{doc.get('torch_version') or 'not recorded'}, commit "
            f"`{(doc.get('git_commit') or 'not recorded')[:12]}`: indexer ms per forward over every C4 layer "
            f"(store + logits + the schedule; top-k excluded); fp8 = DeepGEMM as SGLang calls it.")
    # runs from before fp8-cupy have no fp8_cupy_ms: their table stays as it was
    cupy8 = any(r.get("fp8_cupy_ms") is not None for r in doc["timings"])
    extra_head, extra_rule = (" fp8 keys, cupy_dsa (fp8-cupy) | fp8-cupy / DeepGEMM |", "---|---|") if cupy8 else ("", "")
    lines = [head, "", f"| step | batch x context (tokens) | bf16 keys | fp8 keys | added | ratio |{extra_head}",
             f"|---|---|---|---|---|---|{extra_rule}"]
    for r in doc["timings"]:
        step = {"decode": "decode", "verify": f"verify, next_n {r['next_n']}",
                "prefill": f"prefill chunk of {r['chunk']:,}"}[r["phase"]]
        ms = [f"{r[k]:.2f} ms" if r.get(k) is not None else "—" for k in ("bf16_ms", "fp8_ms", "added_ms", "fp8_cupy_ms")]
        ratio = f"{r['ratio']:.2f}x" if r["ratio"] is not None else "—"
        ctx = f"{r['batch']} x {_tokens(r['context'])}" if r["phase"] != "prefill" else f"after {_tokens(r['context'])}"
        extra = ""
        if cupy8:
            r8 = f"{r['fp8_cupy_ratio']:.2f}x" if r.get("fp8_cupy_ratio") is not None else "—"
            extra = f" {ms[3]} | {r8} |"
        lines.append(f"| {step} | {ctx} | {ms[0]} | {ms[1]} | {ms[2]} | {ratio} |{extra}")
    mem = {r["layout"]: r for r in doc["memory"]}
    if {"bf16", "fp8"} <= mem.keys():
        b, f = mem["bf16"], mem["fp8"]
        lines += ["", f"Index cache: {b['index_bytes_per_token']:.0f} B per token with bf16 keys, "
                      f"{f['index_bytes_per_token']:.0f} B with fp8; {b['memory_gib']:g} GiB hold "
                      f"{b['tokens_fit'] / 1e6:.1f}M tokens of index keys (bf16) or {f['tokens_fit'] / 1e6:.1f}M (fp8)."]
    if not doc.get("measured"):
        asked = f" Cases asked for: {'; '.join(doc['cases'])}." if doc.get("cases") else ""
        lines += ["", f"Not measured: {doc.get('not_measured')}.{asked}"]
    return "\n".join(lines) + "\n"


def _tokens(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 and n < 1 << 20 else f"{n:,}"
