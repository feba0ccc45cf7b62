"""The DeepSeek-V4 models the serve bench and the sweeps measure (their indexer shape), apart from either so that
both can import them."""

from __future__ import annotations

from dataclasses import dataclass

from .bytes import C4_RATIO, v4_compress_ratios


MAX_CONTEXT = 1 << 20   # DeepSeek-V4's context window, 1M tokens (its config.json: max_position_embeddings 1048576)


@dataclass(frozen=True)
class ServeModel:
    name: str
    n_layers: int
    n_c4: int
    index_topk: int
    source: str
    assumed: str | None  # why a figure is assumed, or None when every figure is read
    max_context: int = MAX_CONTEXT   # tokens per request the model takes (max_position_embeddings)


BUILTIN = {
    "v4-flash": ServeModel("DeepSeek-V4-Flash", 43, v4_compress_ratios(43)[:43].count(C4_RATIO), 512,
                           "built-in (V4-Flash HF config.json: num_hidden_layers 43, compress_ratios "
                           "[0, 0, 4, 128, ..., 128, 4, 0] of 44 entries, the last the MTP layer's)", None),
    "v4-pro": ServeModel("DeepSeek-V4-Pro", 61, v4_compress_ratios(61)[:61].count(C4_RATIO), 1024,
                         "built-in (index_topk 1024 per vLLM #40811)",
                         "61 layers with V4-Flash's compress_ratios pattern are ASSUMED (no published V4-Pro layer "
                         "count was at hand); pass --model <config.json> for the real figure"),
}
