"""cupy_dsa: bf16 index keys for the DeepSeek sparse-attention (DSA) indexer.

Public API:

* :func:`store_index_k` / :func:`store_index_k_from_plan` -- fused RMSNorm/LayerNorm -> RoPE ->
  Hadamard -> paged store of index keys (bf16 256 B/token, or SGLang's fp8 132 B/token);
* :func:`paged_mqa_logits` (decode, MTP rows) and :func:`mqa_logits` (prefill) -- indexer logits
  ``sum_h relu(q_h . k) * w_h`` from those keys;
* :func:`to_cupy` / :func:`to_torch` -- zero-copy views for users who want CuPy arrays;
* :func:`warm_up` -- compile every kernel instantiation before CUDA-graph capture;
* :func:`store_index_k_reference`, :func:`paged_mqa_logits_reference`, :func:`mqa_logits_reference` -- the
  torch references (any device), plus :func:`rotate_index_k_reference` (the fp32 key before rounding) and
  :func:`fp4sim_reference` (the fp4sim rounding).

Every op accepts CPU tensors too and then runs the torch reference (the test oracle).
"""

import importlib.util as _ilu
import sys as _sys
from pathlib import Path as _Path

# In a source checkout bench/ sits next to this package (an install maps it to cupy_dsa.bench). Bind the
# checkout's copy, so that `python -m cupy_dsa` and the tests of a checkout never pick up the bench of
# another (editable) install of the package.
_CHECKOUT = _Path(__file__).resolve().parent.parent
if ("cupy_dsa.bench" not in _sys.modules and (_CHECKOUT / "setup.cfg").is_file()
        and (_CHECKOUT / "bench" / "cli.py").is_file()):
    _spec = _ilu.spec_from_file_location("cupy_dsa.bench", _CHECKOUT / "bench" / "__init__.py",
                                         submodule_search_locations=[str(_CHECKOUT / "bench")])
    _bench = _ilu.module_from_spec(_spec)
    _sys.modules["cupy_dsa.bench"] = _bench
    _spec.loader.exec_module(_bench)
    bench = _bench  # what the import system binds for a subpackage it loads itself

from .layouts import (BF16_BYTES_PER_TOKEN, BF16_PAGE_BYTES, FP4_BYTES_PER_TOKEN, FP8_BYTES_PER_TOKEN,
                      FP8_PAGE_BYTES, HEAD_DIM, PAGE_SLOTS, empty_cache)
from .logits import mqa_logits, mqa_logits_reference, paged_mqa_logits, paged_mqa_logits_reference
from .runtime import to_cupy, to_torch, warm_up
from .store import (fp4sim_reference, rotate_index_k_reference, store_index_k, store_index_k_from_plan,
                    store_index_k_reference)

__version__ = "0.1.0"

__all__ = [
    "store_index_k", "store_index_k_from_plan", "paged_mqa_logits", "mqa_logits", "to_cupy", "to_torch",
    "warm_up", "store_index_k_reference", "paged_mqa_logits_reference", "mqa_logits_reference",
    "rotate_index_k_reference", "fp4sim_reference", "empty_cache", "PAGE_SLOTS", "HEAD_DIM", "BF16_BYTES_PER_TOKEN", "FP8_BYTES_PER_TOKEN",
    "FP4_BYTES_PER_TOKEN", "BF16_PAGE_BYTES", "FP8_PAGE_BYTES",
]
