"""Split invariance of one C4 layer's index-key store: the splits, the driver and the bit-for-bit comparison (no
SGLang, no GPU here; ``scripts/gpu_split_invariance.py`` runs it with SGLang 0.5.23's JIT compressor kernels, and
tests/test_split_invariance.py with the torch stand-in below).

A sequence of ``total`` raw tokens, each with its fixed projection row (``kv_score``: fp32 ``[512]``, SGLang's
``| kv_overlap | kv | score_overlap | score |`` columns), goes through the C4 compressor (4 raw tokens -> one
index entry, windows of 8 overlapping by 4) and the store, split in different ways:

* one prefill of every token;
* a prefill to a length of each residue mod 4, then one decode step per token;
* prefill chunks whose sizes are not multiples of 4;
* MTP verify: a prefill, then verify steps of ``verify_n`` draft tokens of which the first ``accepted`` are the
  sequence's and the rest are junk (rejected drafts), the next step starting after the accepted ones.

Whatever the split, every entry is the same function of the same 8 raw rows, so the compressor's output rows and
the index pages (every mode's bytes) must be identical to the one-prefill run, and so must the top-k of a fixed
query. A difference is reported where it is: the entry (its raw positions), the split and the residue of its
prefill length, the step that wrote the entry, and the differing page bytes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

RATIO = 4
WINDOW = 2 * RATIO          # C4 overlaps two groups of 4
HEAD_DIM = 128
KV_SCORE_DIM = 4 * HEAD_DIM  # | kv_overlap | kv | score_overlap | score |
PAGE_SLOTS = 64
RING = 8                    # SGLang's compress-state ring without speculative decoding
RING_MTP = 16               # with it (SGLang's get_compress_state_ring_size(4, drafts > 0))
CHUNK_SIZES = (5, 7, 13, 3, 9, 6, 11, 1, 17, 10)   # none a multiple of 4
ACCEPT_PATTERN = (4, 1, 3, 2, 4, 4, 1, 2)           # accepted drafts per verify step (of VERIFY_N)
VERIFY_N = 4
PLAN_INVALID = 0xFFFFFFFF


@dataclass(frozen=True)
class Step:
    """One forward of the request: ``kind`` "prefill" (an extend from ``prefix``), "decode" (one token) or "verify"
    (``length`` draft tokens from ``prefix``, the first ``accepted`` of them the sequence's)."""
    kind: str
    prefix: int
    length: int
    accepted: int | None = None

    @property
    def end(self) -> int:
        return self.prefix + self.length


@dataclass
class Split:
    name: str
    steps: list
    residue: int | None = None   # the first prefill's length mod 4, where the split is named by it
    ring: int = RING


def split_plans(total: int, *, decode_tail: int = 13, chunk_sizes=CHUNK_SIZES, verify_n: int = VERIFY_N,
                accept_pattern=ACCEPT_PATTERN) -> list[Split]:
    """The splits of a ``total``-token sequence: one prefill (the reference, first), a prefill to each residue mod 4
    followed by decode steps, prefill chunks of ``chunk_sizes`` (cycled; the last one takes what is left, moved so
    no chunk is a multiple of 4 where the sizes allow), and MTP verify after a prefill."""
    if total < 2 * WINDOW + decode_tail + 4:
        raise ValueError(f"total: expected at least {2 * WINDOW + decode_tail + 4} tokens, got {total}")
    splits = [Split("one prefill", [Step("prefill", 0, total)], residue=total % RATIO)]
    for r in range(RATIO):
        p = total - decode_tail
        p -= (p - r) % RATIO   # the largest length <= total - decode_tail with p = r mod 4
        steps = [Step("prefill", 0, p)] + [Step("decode", t, 1) for t in range(p, total)]
        splits.append(Split(f"prefill {p} (= {r} mod 4), then {total - p} decodes", steps, residue=r))
    sizes, pos, i = [], 0, 0
    while pos < total:
        n = min(chunk_sizes[i % len(chunk_sizes)], total - pos)
        sizes.append(n)
        pos += n
        i += 1
    if len(sizes) > 1 and sizes[-1] % RATIO == 0:   # fold one token from the previous chunk into the last
        sizes[-2] -= 1
        sizes[-1] += 1
        if sizes[-2] % RATIO == 0:
            sizes[-2] -= 1
            sizes[-1] += 1
    steps, pos = [], 0
    for n in sizes:
        steps.append(Step("prefill", pos, n))
        pos += n
    splits.append(Split(f"prefill chunks {','.join(map(str, sizes[:6]))},...", steps, residue=sizes[0] % RATIO))
    p = total // 2 + 1
    steps, pos, i = [Step("prefill", 0, p)], p, 0
    while pos < total:
        a = min(accept_pattern[i % len(accept_pattern)], verify_n, total - pos)
        steps.append(Step("verify", pos, verify_n, accepted=a))
        pos += a
        i += 1
    splits.append(Split(f"MTP verify, {verify_n} drafts after a prefill of {p}", steps, residue=p % RATIO,
                        ring=RING_MTP))
    return splits


def step_rows(step: Step, true_rows: torch.Tensor, junk_rows: torch.Tensor) -> torch.Tensor:
    """The kv_score rows a step feeds the compressor: the sequence's, then junk for a verify step's rejected drafts
    (positions the sequence writes again later)."""
    keep = step.length if step.accepted is None else step.accepted
    rows = true_rows[step.prefix:step.prefix + keep]
    if keep < step.length:
        rows = torch.cat([rows, junk_rows[step.prefix + keep:step.end]])
    return rows


def entries_completed(step: Step) -> list[tuple[int, int]]:
    """``(ragged row, entry)`` of the compressed entries a step writes: token ``j`` at position ``prefix + j``
    completes entry ``(prefix + j) // 4`` when ``(prefix + j + 1) % 4 == 0``."""
    return [(j, (step.prefix + j) // RATIO) for j in range(step.length) if (step.prefix + j + 1) % RATIO == 0]


def prefill_plan_rows(step: Step) -> torch.Tensor:
    """SGLang's CompressPlan rows (uint8 ``[length, 16]``) of one request's extend, as its planner writes them:
    ``seq_len = position + 1``, ``ragged_id``, ``buffer_len`` for each token that completes an entry, the rest
    invalid (the store reads ``seq_len`` and ``ragged_id`` only)."""
    rows = torch.zeros(step.length, 4, dtype=torch.int64)
    rows[:, 0] = PLAN_INVALID
    for i, (j, _) in enumerate(entries_completed(step)):
        rows[i, 0] = step.prefix + j + 1
        rows[i, 1] = j | ((WINDOW - min(j + 1, WINDOW)) << 16)
        rows[i, 2] = rows[i, 3] = -1
    return _pack(rows)


def decode_plan_rows(seq_len: int) -> torch.Tensor:
    rows = torch.tensor([[seq_len, 0, -1, -1]], dtype=torch.int64)
    return _pack(rows)


def _pack(rows: torch.Tensor) -> torch.Tensor:
    """int64 ``[n, 4]`` words -> uint8 ``[n, 16]`` (little-endian u32 each)."""
    u32 = rows & 0xFFFFFFFF
    out = torch.zeros(rows.shape[0], 16, dtype=torch.uint8)
    for w in range(4):
        for b in range(4):
            out[:, 4 * w + b] = ((u32[:, w] >> (8 * b)) & 0xFF).to(torch.uint8)
    return out


def out_locs(step: Step) -> torch.Tensor:
    """c4_out_loc of a step: one index-K slot per ragged row (entry ``position // 4``; the request's pages are
    ``0, 1, ...`` in this harness) for an extend, one per request for a decode."""
    if step.kind == "decode":
        return torch.tensor([(step.end - 1) // RATIO], dtype=torch.int64)
    return torch.arange(step.prefix, step.end, dtype=torch.int64) // RATIO


# --------------------------------------------------------------------------------------------------
# The torch stand-in of SGLang's C4 compressor (CPU tests, the dry mode)
# --------------------------------------------------------------------------------------------------

def compress_entry(rows: dict, entry: int, ape: torch.Tensor) -> torch.Tensor:
    """SGLang's C4 entry ``entry`` from the raw rows it sees (``rows[position]``: fp32 ``[512]``): per dim, the
    softmax over 8 scores (previous group: ``score_overlap + ape[j]``, current: ``score + ape[4 + j]``) weighting
    their kv (``kv_overlap`` / ``kv``); the previous group of entry 0 is kv 0, score -FLT_MAX. Not bit-exact with
    SGLang's kernel (its __expf, fast-math division), only with itself: the stand-in is split-invariant by
    construction, as SGLang's kernel must be."""
    kvs, scores = [], []
    lowest = torch.finfo(torch.float32).min
    for j in range(WINDOW):
        pos = RATIO * entry - RATIO + j
        prev = j < RATIO
        if pos < 0:
            kvs.append(torch.zeros(HEAD_DIM))
            scores.append(torch.full((HEAD_DIM,), lowest))
            continue
        r = rows[pos]
        kvs.append(r[0:128] if prev else r[128:256])
        scores.append((r[256:384] if prev else r[384:512]) + ape[j])
    kv, s = torch.stack(kvs), torch.stack(scores)
    w = torch.softmax(s, dim=0)
    return (w * kv).sum(0)


@dataclass
class TorchCompressor:
    """The compressor's state as a map position -> raw row (what SGLang's state ring keeps for the positions a later
    entry still needs). ``defect_residue``: a planted bug for the tests: a prefill whose end is that residue mod 4
    does not keep its last partial group's rows (the next step then completes the entry from stale rows)."""
    ape: torch.Tensor
    defect_residue: int | None = None
    rows: dict = field(default_factory=dict)

    def reset(self) -> None:
        self.rows = {}

    def run(self, step: Step, kv_score: torch.Tensor) -> torch.Tensor:
        """The compressed rows ``[len(entries_completed(step)), 128]`` of the step (in ragged order)."""
        out = []
        for j in range(step.length):
            self.rows[step.prefix + j] = kv_score[j]
            if (step.prefix + j + 1) % RATIO == 0:
                out.append(compress_entry(self.rows, (step.prefix + j) // RATIO, self.ape))
        if (self.defect_residue is not None and step.kind == "prefill" and step.end % RATIO == self.defect_residue
                and step.end % RATIO):
            for p in range(step.end - step.end % RATIO, step.end):
                self.rows[p] = torch.zeros(KV_SCORE_DIM)
        return torch.stack(out) if out else torch.zeros(0, HEAD_DIM)


# --------------------------------------------------------------------------------------------------
# The driver and the comparison
# --------------------------------------------------------------------------------------------------

def page_entry(layout: str, byte: int) -> tuple[int, str]:
    """(entry, part) of a byte offset into a cache of ``layout`` ("bf16": 256 B per slot; "fp8": 128 value bytes
    per slot, then 4 scale bytes per slot after the page's 8192 value bytes)."""
    if layout == "bf16":
        page, off = divmod(byte, PAGE_SLOTS * 256)
        return page * PAGE_SLOTS + off // 256, "value"
    page, off = divmod(byte, PAGE_SLOTS * 132)
    if off < PAGE_SLOTS * 128:
        return page * PAGE_SLOTS + off // 128, "value"
    return page * PAGE_SLOTS + (off - PAGE_SLOTS * 128) // 4, "scale"


def compare_pages(name: str, layout: str, ref: torch.Tensor, got: torch.Tensor, writers: dict, entries: int,
                  limit: int = 8) -> list:
    """Findings where two caches of ``layout`` differ in the sequence's ``entries`` (a rejected draft may write an
    entry past them, which no row sees): per entry (up to ``limit``), its raw positions, the step of the split that
    wrote it, how many bytes differ and the first of them (reference vs this split)."""
    a, b = ref.reshape(-1).cpu(), got.reshape(-1).cpu()
    diff = (a != b).nonzero().flatten().tolist()
    by_entry: dict = {}
    for byte in diff:
        entry, part = page_entry(layout, byte)
        if entry < entries:
            by_entry.setdefault(entry, []).append((byte, part))
    out = []
    for entry in sorted(by_entry)[:limit]:
        bytes_ = by_entry[entry]
        first = bytes_[0][0]
        out.append({"what": f"{name} page bytes", "entry": entry, "raw_positions": [RATIO * entry, RATIO * entry + 3],
                    "written_by": writers.get(entry), "bytes_differing": len(bytes_),
                    "parts": sorted({p for _, p in bytes_}),
                    "first_byte": {"offset": first, "reference": int(a[first]), "this_split": int(b[first])}})
    if len(by_entry) > limit:
        out.append({"what": f"{name} page bytes", "more_entries": len(by_entry) - limit})
    return out


def compare_rows(ref: dict, got: dict, writers: dict, limit: int = 8) -> list:
    """The compressor's output rows (entry -> fp32 [128]) that differ bit for bit."""
    out = []
    for entry in sorted(ref):   # the reference holds the sequence's entries only
        if entry not in got:
            out.append({"what": "compressor output", "entry": entry, "missing": True})
        elif not torch.equal(ref[entry].view(torch.int32), got[entry].view(torch.int32)):
            d = (ref[entry] - got[entry]).abs()
            out.append({"what": "compressor output", "entry": entry,
                        "raw_positions": [RATIO * entry, RATIO * entry + 3], "written_by": writers.get(entry),
                        "elements_differing": int((ref[entry].view(torch.int32) != got[entry].view(torch.int32)).sum()),
                        "max_abs_difference": float(d[torch.isfinite(d)].max()) if torch.isfinite(d).any() else math.inf})
        if len(out) >= limit:
            break
    return out


def run_split(split: Split, backend, true_rows: torch.Tensor, junk_rows: torch.Tensor) -> dict:
    """One split through ``backend`` (``reset(ring)``, ``step(step, rows) -> compressed rows``, ``pages() ->
    {mode: (layout, tensor)}``, ``topk() -> {mode: tensor}``): its compressor rows, the step that last wrote each
    entry, its pages and top-k."""
    backend.reset(split.ring)
    rows, writers = {}, {}
    for i, step in enumerate(split.steps):
        out = backend.step(step, step_rows(step, true_rows, junk_rows))
        for (j, entry), row in zip(entries_completed(step), out):
            rows[entry] = row.detach().cpu().clone()
            writers[entry] = {"step": i, "kind": step.kind, "prefix": step.prefix, "length": step.length,
                              "end_mod_4": step.end % RATIO}
    return {"rows": rows, "writers": writers, "pages": backend.pages(), "topk": backend.topk()}


def check_splits(backend, total: int, *, seed: int = 0, splits=None) -> dict:
    """Every split of :func:`split_plans` against the one-prefill run. Returns ``{"splits": [{name, residue, steps,
    findings}], "ok": bool}``; ``findings`` empty where the split is byte-identical in every mode."""
    g = torch.Generator().manual_seed(seed)
    true_rows = torch.randn(total, KV_SCORE_DIM, generator=g)
    junk_rows = torch.randn(total + VERIFY_N, KV_SCORE_DIM, generator=g) * 3
    splits = split_plans(total) if splits is None else splits
    ref = run_split(splits[0], backend, true_rows, junk_rows)
    results = []
    for split in splits[1:]:
        got = run_split(split, backend, true_rows, junk_rows)
        findings = compare_rows(ref["rows"], got["rows"], got["writers"])
        for mode, (layout, pages) in ref["pages"].items():
            findings += compare_pages(mode, layout, pages, got["pages"][mode][1], got["writers"], total // RATIO)
        for mode, sel in ref["topk"].items():
            if not torch.equal(sel.cpu(), got["topk"][mode].cpu()):
                rows = (sel.cpu() != got["topk"][mode].cpu()).any(1).nonzero().flatten().tolist()
                findings.append({"what": f"{mode} top-k", "rows_differing": rows})
        results.append({"name": split.name, "residue": split.residue, "steps": len(split.steps), "findings": findings})
    return {"total_tokens": total, "entries": total // RATIO, "modes": sorted(ref["pages"]),
            "splits": results, "ok": all(not r["findings"] for r in results)}


def summary_lines(result: dict) -> list[str]:
    """One line per split, then where the first difference of each failing split is."""
    lines = []
    for r in result["splits"]:
        status = "identical" if not r["findings"] else f"{len(r['findings'])} finding(s)"
        lines.append(f"  {r['name']}: {status}")
        for f in r["findings"][:3]:
            where = f.get("written_by") or {}
            lines.append(f"    {f['what']}: entry {f.get('entry')} (raw {f.get('raw_positions')}), split residue "
                         f"{r['residue']}, written by step {where.get('step')} ({where.get('kind')} ending at "
                         f"{where.get('prefix', 0) + where.get('length', 0)}, = {where.get('end_mod_4')} mod 4)"
                         + (f", {f['bytes_differing']} bytes differ, first {f['first_byte']}" if 'first_byte' in f
                            else ""))
    return lines


# --------------------------------------------------------------------------------------------------
# The store side (every mode) and the torch stand-in backend
# --------------------------------------------------------------------------------------------------

STOCK = "fp8"   # SGLang's own store (its JIT fused_norm_rope kernel on the GPU; cupy_dsa's fp8 reference on the CPU)


class StoreSide:
    """One index cache per mode for one C4 layer, written by each step's compressed rows: the stock mode through
    ``stock_store(kv, plan_rows, is_decode, out_loc, cache)``, every hooked mode through the plugin's store
    (``cupy_dsa.sglang.core.store_index_k_bf16``, the body of its store hook). The top-k of a fixed query over the
    final pages: cupy_dsa's logits and select for the mode's layout (fp8-rescore: its two-stage select)."""

    def __init__(self, modes, entries: int, device, stock_store, *, seed: int = 0, index_topk: int = 64):
        from cupy_dsa.sglang import core

        self.core, self.modes, self.device, self.stock_store = core, list(modes), torch.device(device), stock_store
        self.pages_n = (entries + PAGE_SLOTS - 1) // PAGE_SLOTS
        self.entries, self.index_topk = entries, index_topk
        g = torch.Generator().manual_seed(seed + 1)
        self.norm_weight = (torch.rand(HEAD_DIM, generator=g) + 0.5).to(self.device)
        ang = torch.rand(entries * RATIO + RATIO, 32, generator=g) * 6.2831853
        self.freq_cis = torch.polar(torch.ones_like(ang), ang).to(self.device)    # SGLang's complex64 table
        self.q = torch.randn(4, 1, 64, 128, generator=g)
        self.w = torch.rand(4, 64, generator=g).to(self.device)
        self.caches = {}

    def reset(self) -> None:
        from cupy_dsa import layouts

        self.caches = {}
        for mode in self.modes:
            rec = self.core.record(mode)
            cache = torch.zeros(self.pages_n, layouts.page_bytes(rec.cache_layout), dtype=torch.uint8,
                                device=self.device)
            self.caches[mode] = (cache, torch.zeros_like(cache) if rec.two_level else None)

    def store(self, kv: torch.Tensor, plan_rows: torch.Tensor, is_decode: bool, out_loc: torch.Tensor) -> None:
        for mode, (cache, lo) in self.caches.items():
            if mode == STOCK:
                self.stock_store(kv, plan_rows, is_decode, out_loc, cache)
            else:
                self.core.store_index_k_bf16(kv, plan_rows, is_decode=is_decode, compress_ratio=RATIO,
                                             norm_weight=self.norm_weight, norm_eps=1e-6, freq_cis=self.freq_cis,
                                             out_loc=out_loc, kvcache=cache, mode=mode, lo_cache=lo)

    def pages(self) -> dict:
        return {mode: (self.core.record(mode).cache_layout, cache.clone()) for mode, (cache, _) in self.caches.items()} \
            | {f"{mode} (lo pages)": ("fp8", lo.clone()) for mode, (_, lo) in self.caches.items() if lo is not None}

    def topk(self) -> dict:
        import cupy_dsa
        from cupy_dsa import rescore

        lens = torch.full((4,), self.entries, dtype=torch.int32, device=self.device)
        bt = torch.arange(self.pages_n, dtype=torch.int32, device=self.device).repeat(4, 1)
        out = {}
        for mode, (cache, lo) in self.caches.items():
            rec = self.core.record(mode)
            q = self.q.to(torch.bfloat16 if rec.query in ("bf16", "fp4sim") and not rec.two_level
                          else torch.float8_e4m3fn).to(self.device)
            if lo is not None:
                out[mode] = rescore.rescore_topk(q, self.w, cache, lo, lens, bt, self.index_topk).raw_indices
                continue
            logits = cupy_dsa.paged_mqa_logits(q, cache, self.w, lens, bt, self.pages_n * PAGE_SLOTS)
            out[mode] = cupy_dsa.paged_topk(logits, lens, bt, self.index_topk, raw_indices=True).raw_indices
        return out


def cpu_stock_store(norm_weight, freq_cis):
    """The stock store's CPU stand-in: cupy_dsa's fp8 store (SGLang's layout and quantization, its FMA order)."""
    def store(kv, plan_rows, is_decode, out_loc, cache):
        import cupy_dsa
        from cupy_dsa.sglang import core

        cupy_dsa.store_index_k_from_plan(kv, plan_rows, cache=cache, out_loc=out_loc, norm_weight=norm_weight,
                                         freqs_cis=core.rope_table(freq_cis), is_decode=is_decode, eps=1e-6)
    return store


class TorchBackend:
    """The CPU dry mode: the torch compressor stand-in, the store side on the CPU."""

    def __init__(self, modes, total: int, *, seed: int = 0, defect_residue: int | None = None):
        g = torch.Generator().manual_seed(seed + 2)
        self.compressor = TorchCompressor(torch.randn(WINDOW, HEAD_DIM, generator=g), defect_residue)
        self.side = StoreSide(modes, total // RATIO, "cpu", None, seed=seed)
        self.side.stock_store = cpu_stock_store(self.side.norm_weight, self.side.freq_cis)

    def reset(self, ring: int) -> None:
        self.compressor.reset()
        self.side.reset()

    def step(self, step: Step, kv_score: torch.Tensor) -> torch.Tensor:
        rows = self.compressor.run(step, kv_score)
        if step.kind == "decode":
            plan, kv = decode_plan_rows(step.end), torch.zeros(1, HEAD_DIM)
            if len(rows):
                kv[0] = rows[0]
        else:
            plan, kv = prefill_plan_rows(step), torch.zeros(step.length, HEAD_DIM)
            kv[:len(rows)] = rows
        self.side.store(kv, plan, step.kind == "decode", out_locs(step))
        return rows

    def pages(self) -> dict:
        return self.side.pages()

    def topk(self) -> dict:
        return self.side.topk()


def markdown(result: dict) -> str:
    """A result as the markdown block bench/results/README.md keeps: one row per split, then the P4 line."""
    lines = [f"Split invariance of one C4 layer, {result['total_tokens']} tokens ({result['entries']} entries), "
             f"{result.get('compressor', '')} on {result.get('device', '')}; modes {', '.join(result['modes'])}:", "",
             "| split | first prefill mod 4 | steps | compressor rows, pages (every mode), top-k vs one prefill |",
             "|---|---|---|---|"]
    for r in result["splits"]:
        if r["findings"]:
            f = r["findings"][0]
            w = f.get("written_by") or {}
            cell = (f"**differ**: {len(r['findings'])} finding(s); first: {f['what']}, entry {f.get('entry')} (raw "
                    f"{f.get('raw_positions')}), written by a {w.get('kind')} ending at "
                    f"{w.get('prefix', 0) + w.get('length', 0)} (= {w.get('end_mod_4')} mod 4)")
        else:
            cell = "identical, bit for bit"
        lines.append(f"| {r['name']} | {r['residue']} | {r['steps']} | {cell} |")
    p4 = result.get("p4")
    if p4:
        lines += ["", f"fp8-cupy's pages against SGLang's stock fp8 store on the same compressor rows ({p4['keys']} keys):"
                      f" {p4['value_bytes_differing']} of {p4['value_bytes']} value bytes and "
                      f"{p4['scale_words_differing']} scale words differ."]
    return "\n".join(lines) + "\n"
