"""cupy_dsa: bf16 index keys for the DeepSeek sparse-attention (DSA) indexer.

Public API:

* :func:`store_index_k` / :func:`store_index_k_from_plan` -- fused RMSNorm/LayerNorm -> RoPE ->
  Hadamard -> paged store of index keys (bf16 256 B/token, or SGLang's fp8 132 B/token);
* :func:`paged_mqa_logits` (decode, MTP verify as next_n rows per request) and :func:`mqa_logits` (prefill
  of one request, or of several in one launch with ``cu_rows``) -- indexer logits ``sum_h relu(q_h . k) * w_h``
  from those keys; :func:`paged_mqa_logits_plan` / :func:`mqa_logits_plan` build their schedules once per forward;
* :func:`rescore_topk` (decode / verify) and :func:`rescore_topk_prefill` -- two-level keys (``fp8-rescore``):
  fp8 candidates from SGLang's fp8 keys, rescored from their int8 residual pages (``store_index_k(...,
  lo_cache=)`` writes both), the exact top-k at about fp8's cost (``cupy_dsa.rescore``);
* :func:`prepare_index_q` -- SGLang's ``wq_b`` output -> RoPE -> Hadamard -> fp4sim bf16 or fp8 indexer
  query, with the folded head weights (:func:`prepare_index_q_reference` its torch reference);
* :func:`to_cupy` / :func:`to_torch` -- zero-copy views for users who want CuPy arrays;
* :func:`warm_up` -- compile every product kernel config before CUDA-graph capture;
* :func:`store_index_k_reference`, :func:`paged_mqa_logits_reference`, :func:`mqa_logits_reference` -- the
  torch references (any device), plus :func:`rotate_index_k_reference` (the fp32 key before rounding) and
  :func:`fp4sim_reference` (the fp4sim rounding).

Every op accepts CPU tensors too and then runs the torch reference (the test oracle).
"""

from pathlib import Path as _Path

# A checkout lays the package out as cupy_dsa/ beside bench/ and kernels/ (setup.cfg's package_dir maps them to
# cupy_dsa.bench / cupy_dsa.kernels when installed): run from the checkout's root, this source tree shadows an
# install, so its own bench/ is made importable as cupy_dsa.bench (`python -m cupy_dsa` works there too).
_CHECKOUT = _Path(__file__).resolve().parent.parent
if (_CHECKOUT / "setup.cfg").is_file() and (_CHECKOUT / "bench" / "cli.py").is_file():
    __path__.append(str(_CHECKOUT))

# The public names, imported on first use (PEP 562): `import cupy_dsa` and the CLI's --help stay free of torch.
_EXPORTS = {
    "layouts": ("BF16_BYTES_PER_TOKEN", "BF16_PAGE_BYTES", "FP4_BYTES_PER_TOKEN", "FP8_BYTES_PER_TOKEN",
                "FP8_PAGE_BYTES", "HEAD_DIM", "PAGE_SLOTS", "empty_cache"),
    "logits": ("mqa_logits", "mqa_logits_plan", "mqa_logits_reference", "paged_mqa_logits", "paged_mqa_logits_plan",
               "paged_mqa_logits_reference"),
    "launch": ("warm_up",),
    "query": ("prepare_index_q", "prepare_index_q_reference"),
    "rescore": ("RescoreTopK", "empty_lo_cache", "rescore_topk", "rescore_topk_prefill",
                "rescore_topk_prefill_reference", "rescore_topk_reference"),
    "runtime": ("to_cupy", "to_torch"),
    "topk": ("TopK", "paged_topk", "paged_topk_reference"),
    "store": ("fp4sim_reference", "rotate_index_k_reference", "store_index_k", "store_index_k_from_plan",
              "store_index_k_reference"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}


_SUBMODULES = ("arch", "contracts", "heuristics", "launch", "layouts", "logits", "query", "rescore", "runtime", "store", "topk")


def __getattr__(name):
    import importlib

    if name in _SUBMODULES:  # cupy_dsa.logits without importing it first, as when __init__ imported them all
        return importlib.import_module(f".{name}", __name__)
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'cupy_dsa' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_MODULE_OF))


__version__ = "0.1.0"

__all__ = [
    "store_index_k", "store_index_k_from_plan", "rescore_topk", "rescore_topk_prefill", "rescore_topk_reference",
    "rescore_topk_prefill_reference", "RescoreTopK", "empty_lo_cache", "prepare_index_q", "prepare_index_q_reference", "paged_mqa_logits", "paged_mqa_logits_plan", "mqa_logits",
    "mqa_logits_plan", "to_cupy", "to_torch", "paged_topk", "paged_topk_reference", "TopK",
    "warm_up", "store_index_k_reference", "paged_mqa_logits_reference", "mqa_logits_reference",
    "rotate_index_k_reference", "fp4sim_reference", "empty_cache", "PAGE_SLOTS", "HEAD_DIM", "BF16_BYTES_PER_TOKEN", "FP8_BYTES_PER_TOKEN",
    "FP4_BYTES_PER_TOKEN", "BF16_PAGE_BYTES", "FP8_PAGE_BYTES",
]
