"""``cupy-dsa bench bytes``: what each index-key layout costs in memory, per layer and per full token.

Pure arithmetic (no GPU). Facts come from SGLang 0.5.23's pool code, the published DeepSeek configs and
FlashMLA's cache layout; every number that is not read from a published config or from SGLang's pool code is listed in
:data:`ASSUMPTIONS` and printed with the table.
"""

from __future__ import annotations

from dataclasses import dataclass

from cupy_dsa.layouts import BYTES_PER_TOKEN, PAGE_SLOTS

C4_RATIO, C128_RATIO = 4, 128   # raw tokens per entry on an indexer (CSA) layer / a heavily compressed layer


def v4_compress_ratios(n_layers: int) -> list[int]:
    """V4-Flash's ``compress_ratios`` for ``n_layers`` layers (HF config.json): 0, 0, then 4/128 alternating from
    layer 2 (43 layers: 21 ratio-4 + 20 ratio-128), and one more 0 for the MTP layer (44 entries)."""
    return [0, 0] + [C4_RATIO if i % 2 == 0 else C128_RATIO for i in range(n_layers - 2)] + [0]


def _v4_counts(n_layers: int) -> tuple[int, int]:
    ratios = v4_compress_ratios(n_layers)[:n_layers]
    return ratios.count(C4_RATIO), ratios.count(C128_RATIO)

# Index-key layouts side by side: bytes per index entry (one compressed token of one indexer layer).
INDEX_LAYOUTS = ("fp8", "fp4", "bf16", "bf16-fp4sim", "fp8-rescore")
ENTRY_BYTES = {**BYTES_PER_TOKEN, "fp8-rescore": 2 * BYTES_PER_TOKEN["fp8"]}  # fp8 page + its int8 residual page
LAYOUT_NOTES = {
    "fp8": "SGLang default: 128 e4m3 + fp32 scale",
    "fp4": "SGLang --enable-deepseek-v4-fp4-indexer: 64 B e2m1 + 4 ue8m0",
    "bf16": "cupy_dsa: 128 x bf16 (exact rounding)",
    "bf16-fp4sim": "cupy_dsa: 128 x bf16 holding FP4-representable values (DeepSeek reference QAT)",
    "fp8-rescore": "cupy_dsa: SGLang's fp8 page + an int8 residual page with a per-token fp32 scale beside it",
}

# Main-cache entry sizes (bytes per cached entry of one layer).
V4_MAIN_KV_ENTRY = 584   # SGLang's fp8 FlashMLA-style V4 KV entry (the C4 KV pool's entry size)
V32_MLA_FP8_ENTRY = 656  # FlashMLA fp8 MLA cache: 512 e4m3 + 4 fp32 scales + 64 bf16 RoPE


@dataclass(frozen=True)
class ModelConfig:
    name: str
    n_layers: int
    n_c4: int            # layers with an indexer (compress ratio 4 for V4; every layer for V3.2)
    n_c128: int          # heavily compressed (ratio 128) layers, V4 only
    index_ratio: int     # raw tokens per index entry (4 for V4's C4 indexer, 1 for V3.2)
    main_kv_entry: int   # bytes per main-cache entry per layer
    assumed: bool        # layer counts not taken from a published config we could read
    layer_note: str

    @property
    def main_kv_per_token(self) -> float:
        """Main (attention) KV bytes per raw token, all layers; sliding-window buffers excluded."""
        if self.index_ratio == 1:  # V3.2: MLA cache on every layer, one entry per token
            return float(self.n_layers * self.main_kv_entry)
        return self.n_c4 * self.main_kv_entry / 4 + self.n_c128 * self.main_kv_entry / 128


MODELS = (
    ModelConfig("DeepSeek-V4-Flash", 43, *_v4_counts(43), 4, V4_MAIN_KV_ENTRY, False,
                "43 layers; compress_ratios 0,0 then 4/128 alternating from layer 2 (the 44th entry, 0, is the "
                "MTP layer's) -> 21 C4 (indexer) + 20 C128 + 2 window-only layers"),
    ModelConfig("DeepSeek-V4-Pro", 61, *_v4_counts(61), 4, V4_MAIN_KV_ENTRY, True,
                "ASSUMED 61 layers with the Flash pattern -> 30 C4 (indexer) + 29 C128 + 2 window-only"),
    ModelConfig("DeepSeek-V3.2", 61, 61, 0, 1, V32_MLA_FP8_ENTRY, False,
                "61 layers; indexer on every layer at the full token rate; fp8 MLA cache 656 B/layer"),
)

ASSUMPTIONS = (
    "V4-Flash layer pattern (43 layers, compress_ratios 0,0,4,128,...,128,4 and 0 for the MTP layer): 21 C4 + 20 "
    "C128 layers; the MTP layer is not counted.",
    "V4-Pro layer counts are ASSUMED (61 layers, Flash's pattern: 30 C4 + 29 C128); not read from a config.",
    "V4 main KV: 584 B per cached entry (SGLang's fp8 V4 KV) on C4 layers (1 entry / 4 tokens) and C128 "
    "layers (1 entry / 128 tokens); the per-request 128-token sliding-window buffers and compressor state "
    "are constant per request and excluded.",
    "V3.2: fp8 MLA cache 656 B/token/layer; index keys stored per token on all 61 layers.",
    "Index pages hold 64 entries; partial pages and the allocator's reserved page are ignored.",
    "GiB = 2^30 bytes (the unit of `bench serve --memory-gib` too); 'tokens fit' = memory / (main KV + index keys) "
    "bytes per token, nothing else resident.",
)


GIB = 1 << 30
DEFAULT_GPU_MEM_GIB = 80.0   # an 80 GiB GPU's worth of KV memory (bench serve's default --memory-gib too)


def rows(gpu_mem_gib: float = DEFAULT_GPU_MEM_GIB) -> list[dict]:
    """One row per (model, index layout); capacity in ``gpu_mem_gib`` GiB of KV memory."""
    budget = gpu_mem_gib * GIB
    out = []
    for m in MODELS:
        fp8_total = None
        for layout in INDEX_LAYOUTS:
            entry = ENTRY_BYTES[layout]
            per_layer_token = entry / m.index_ratio
            index_per_token = per_layer_token * m.n_c4
            main = m.main_kv_per_token
            total = main + index_per_token
            if layout == "fp8":
                fp8_total = total
            fit = int(budget // total)
            out.append({
                "model": m.name,
                "layout": layout,
                "assumed": m.assumed,
                "bytes_per_entry": entry,
                "bytes_per_page": entry * PAGE_SLOTS,
                "index_layers": m.n_c4,
                "index_ratio": m.index_ratio,
                "index_bytes_per_token_per_layer": per_layer_token,
                "index_bytes_per_token": index_per_token,
                "main_kv_bytes_per_token": main,
                "total_kv_bytes_per_token": total,
                "index_share": index_per_token / total,
                "gpu_mem_gib": gpu_mem_gib,
                "tokens_fit": fit,
                "tokens_fit_vs_fp8": (fp8_total / total) if fp8_total else 1.0,
            })
    return out


def notes() -> list[str]:
    layouts = [f"{k}: {ENTRY_BYTES[k]} B/entry ({LAYOUT_NOTES[k]})" for k in INDEX_LAYOUTS]
    per_model = [f"{m.name}: {m.layer_note}" for m in MODELS]
    return layouts + per_model + list(ASSUMPTIONS)


def readme_block() -> str:
    """The README's memory table: DeepSeek-V4-Flash's KV bytes per token with each index-key layout a mode serves
    (what a PD transfer moves per prompt token), from :func:`rows` (``cupy-dsa bench bytes`` prints every model)."""
    flash = MODELS[0]
    mode = {"fp8": "`fp8`, `fp8-cupy`", "bf16": "`bf16`", "bf16-fp4sim": "`bf16-fp4sim`, `bf16-reference`",
            "fp8-rescore": "`fp8-rescore`"}
    lines = [f"{flash.name}, {flash.n_c4} C4 layers (`cupy-dsa bench bytes`; its assumptions are printed with it):",
             "", "| mode | index keys, B per entry | index keys, B per token | KV per token, main + index keys "
             "(what PD moves per prompt token) | KV bytes per token vs fp8 |", "|---|---|---|---|---|"]
    fp8 = None
    for r in rows():
        if r["model"] != flash.name or r["layout"] not in mode:
            continue
        fp8 = fp8 or r["total_kv_bytes_per_token"]
        lines.append(f"| {mode[r['layout']]} | {r['bytes_per_entry']} | {r['index_bytes_per_token']:,.0f} | "
                     f"{r['total_kv_bytes_per_token']:,.0f} B | {r['total_kv_bytes_per_token'] / fp8:.3f}x |")
    return "\n".join(lines)


def memory_text(record: dict) -> str:
    """A document's or row's KV memory budget with its unit: GiB since issue 50; runs before it recorded GB (1e9 B)."""
    if record.get("gpu_mem_gib") is not None:
        return f"{record['gpu_mem_gib']:g} GiB"
    return f"{record['gpu_mem_gb']:g} GB"
