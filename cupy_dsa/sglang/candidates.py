"""fp8-rescore's K' candidates inside SGLang: picked by the top-k kernel SGLang itself runs for the step, called
with k = K' and raw positions out, where that kernel takes K'; otherwise by cupy_dsa's own select.

SGLang 0.5.23's DeepSeek-V4 top-k kernels (``sglang.kernels.ops.attention.dsv4.topk``), as its forward picks them
(``--dsa-topk-backend sgl-kernel``, its default):

* v2, ``topk_transform_paged_v2`` (``SGLANG_OPT_USE_TOPK_V2``, on by default; SGLang turns it off on sm_120, whose
  99 KB of shared memory per CTA it does not fit): k <= 2048. ``page_tables=None`` writes the raw positions. Its
  plan is SGLang's own, built once per forward (``indexer_metadata.topk_metadata``, or one per row chunk).
* v1, ``topk_transform_paged`` (sm_120's): k <= 1024, raw positions through ``out_raw_indices`` (it writes the page
  indices too, into a scratch buffer).

Both hand each row's K' greatest logits as positions in arrival order, -1 padded (a row that sees fewer lists
them all); ``cupy_dsa.rescore.rescore_topk(..., candidates=)`` scores them. Product code reaches these kernels
only through SGLang's own functions. Imports SGLang only inside functions."""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from .. import layouts

SGLANG_TOPK_V2_ENV = "SGLANG_OPT_USE_TOPK_V2"


class CandidateSelect(NamedTuple):
    """Who selects fp8-rescore's K' candidates: ``kernel`` ("sglang-v2", "sglang-v1" or "cupy_dsa") and why."""
    kernel: str
    why: str

    @property
    def sglang(self) -> bool:
        return self.kernel != CUPY_DSA

    def describe(self) -> str:
        return f"candidates: {KERNEL_TEXT[self.kernel]} ({self.why})"


SGLANG_V2, SGLANG_V1, CUPY_DSA = "sglang-v2", "sglang-v1", "cupy_dsa"
MAX_K = {SGLANG_V2: 2048, SGLANG_V1: 1024}
KERNEL_TEXT = {SGLANG_V2: "SGLang's v2 top-k (topk_transform_paged_v2) at k = K'",
               SGLANG_V1: "SGLang's v1 top-k (topk_transform_paged) at k = K'",
               CUPY_DSA: "cupy_dsa's own select"}


def candidate_select(k_prime: int | None, *, stage1: str, topk_backend: str, use_topk_v2: bool) -> CandidateSelect:
    """The select of a server whose fp8-rescore stage 1 is ``stage1``, SGLang's ``--dsa-topk-backend`` is
    ``topk_backend`` and whose v2 top-k is on (``use_topk_v2``), for K' = ``k_prime`` (None: not known yet)."""
    if stage1 != "sglang":
        return CandidateSelect(CUPY_DSA, "stage 1 by cupy_dsa's kernels")
    if topk_backend != "sgl-kernel":
        return CandidateSelect(CUPY_DSA, f"--dsa-topk-backend {topk_backend}: SGLang runs no raw-position kernel "
                                         f"of its own")
    kernel = SGLANG_V2 if use_topk_v2 else SGLANG_V1
    if k_prime is not None and k_prime > MAX_K[kernel]:
        return CandidateSelect(CUPY_DSA, f"K' = {k_prime} is past the {MAX_K[kernel]} that {kernel} takes")
    why = "SGLang's own top-k for this step" + ("" if k_prime is None else f", K' = {k_prime}")
    return CandidateSelect(kernel, f"{why}; K' above {MAX_K[kernel]} falls back to cupy_dsa's own select")


def sglang_topk_v2_enabled(arch: str | None) -> bool:
    """Whether SGLang runs its v2 top-k: ``SGLANG_OPT_USE_TOPK_V2`` (default on), which its DeepSeek-V4 start-up
    turns off on sm_120 / sm_121 (``arch``: the GPU's, None when none is visible)."""
    raw = os.environ.get(SGLANG_TOPK_V2_ENV, "").strip().lower()
    on = raw not in ("0", "false", "no", "off")
    return on and not (arch is not None and arch in ("sm_120", "sm_121"))


def check_text(settings, arch: str | None) -> str:
    """What ``check`` says of the candidates: the select each model gets with these fp8-rescore ``settings``
    (``modes.RescoreSettings``) under SGLang's default top-k backend on ``arch`` (None: no GPU visible)."""
    from .modes import MODEL_INDEX_TOPK

    use_v2 = sglang_topk_v2_enabled(arch)
    parts = []
    for model, index_topk in MODEL_INDEX_TOPK.items():
        kp = settings.k_prime(index_topk) if settings.k_prime_problem(index_topk) is None else None
        if kp is None:
            parts.append(f"{model}: refused (K' below index_topk {index_topk})")
            continue
        choice = candidate_select(kp, stage1=settings.stage1, topk_backend="sgl-kernel", use_topk_v2=use_v2)
        parts.append(f"{model} (index_topk {index_topk}, K' {kp}): {KERNEL_TEXT[choice.kernel]}")
    where = f"on {arch}" if arch else "no GPU visible: sm_90 / sm_100 assumed"
    return (f"candidates with --dsa-topk-backend sgl-kernel (SGLang's default), {where}, "
            f"{SGLANG_TOPK_V2_ENV} {'on' if use_v2 else 'off'}: " + "; ".join(parts))


def select_of_backend(backend, k_prime: int, stage1: str) -> CandidateSelect:
    """The select for a forward of SGLang's attention backend ``backend`` (its ``dsa_topk_backend``)."""
    topk = getattr(backend, "dsa_topk_backend", None)
    name = getattr(topk, "value", "sgl-kernel") if topk is not None else "sgl-kernel"
    use_v2 = bool(topk.should_use_topk_v2()) if topk is not None else sglang_topk_v2_enabled(None)
    return candidate_select(k_prime, stage1=stage1, topk_backend=name, use_topk_v2=use_v2)


def v2_plan(choice: CandidateSelect, indexer_metadata, lens: torch.Tensor, rows: slice, all_rows: bool,
            chunk: int | None) -> torch.Tensor | None:
    """v2's plan for these rows as SGLang's forward takes it: the forward's own (``topk_metadata`` for all rows,
    ``topk_metadata_chunks[chunk]`` for a row chunk, both built once per forward), else ``plan_topk_v2`` over the
    rows' lengths, as SGLang builds one for a chunk it has no plan for. None for v1."""
    if choice.kernel != SGLANG_V2:
        return None
    if all_rows:
        own = getattr(indexer_metadata, "topk_metadata", None)
    else:
        chunks = getattr(indexer_metadata, "topk_metadata_chunks", None)
        own = chunks[chunk] if chunks is not None and chunk is not None and chunk < len(chunks) else None
    if own is not None:
        return own
    from sglang.kernels.ops.attention.dsv4.topk import plan_topk_v2

    return plan_topk_v2(lens[rows])


def select_candidates(choice: CandidateSelect, logits: torch.Tensor, lens: torch.Tensor, page_table: torch.Tensor,
                      index_topk: int, k_prime: int, plan: torch.Tensor | None, topk=None) -> torch.Tensor:
    """int32 ``[rows, K']``: each row's K' greatest ``logits`` (fp32 ``[rows, >= max len]``, row stride a multiple of
    4) among its first ``lens[r]`` columns, as positions, -1 padded, by SGLang's kernel ``choice`` (``plan``: v2's,
    from ``plan_topk_v2`` over these rows' lengths). K' is ``k_prime`` capped at the logits' width, and at least
    ``index_topk`` (what rescore_topk takes). ``topk``: SGLang's top-k module (default: the one SGLang's forward
    imports; the benches pass the one they loaded)."""
    if topk is None:
        from sglang.kernels.ops.attention.dsv4 import topk

    kp = max(index_topk, min(k_prime, logits.shape[1]))
    out = torch.empty(logits.shape[0], kp, dtype=torch.int32, device=logits.device)
    if choice.kernel == SGLANG_V2:
        topk.topk_transform_paged_v2(logits, lens, None, out, layouts.PAGE_SLOTS, plan)
    elif choice.kernel == SGLANG_V1:
        pages = torch.empty_like(out)   # v1 writes raw positions only beside the page indices
        topk.topk_transform_paged(logits, lens, page_table, pages, layouts.PAGE_SLOTS, out)
    else:
        raise ValueError(f"choice: expected one of SGLang's kernels ({SGLANG_V2}, {SGLANG_V1}), got {choice.kernel}")
    return out


__all__ = ["CandidateSelect", "candidate_select", "select_of_backend", "select_candidates", "sglang_topk_v2_enabled",
           "v2_plan", "check_text", "SGLANG_V2", "SGLANG_V1", "CUPY_DSA", "MAX_K"]
