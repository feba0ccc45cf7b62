"""The indexer's top-k in SGLang's output form: :func:`paged_topk` (``kernels/topk.cu``) and its torch reference.

What SGLang's ``topk_transform_paged`` kernels compute after the indexer logits: row ``r`` sees positions ``[0, n)``,
``n = clamp(lens[r], 0, width)``; a row with ``n <= index_topk`` selects ``0 .. n - 1`` without reading logits (SGLang's
trivial path), any other row its ``index_topk`` greatest logits, ties to the lower position (SGLang leaves ties
unspecified). Outputs int32 ``[rows, index_topk]``, -1 padded: ``page_indices`` (SGLang's slot transform,
``(page_table[r, i >> 6] << 6) | (i & 63)``) and optionally ``raw_indices`` (the positions ``i``). Selected keys come in
position order (SGLang's are unordered), so reruns are bitwise identical.

One CTA per row, or on sm_90+ a cluster of 2-8 CTAs per row where the rows are few (:func:`select_cluster`): a radix
select with 12-bit digits whose first digit is counted while the row (or the CTA's slice of it) is read, once, into
shared memory (rows of up to 16,384 visible keys, 49,152 on sm_90 / sm_100: :func:`row_cache_keys`; slices of up to
8,192; longer ones are read again from L2 by each radix pass). The
benches time the stock step as the fp8 logits plus this op, standing in for SGLang's own top-k where SGLang
cannot run; ``cupy-dsa bench rescore`` times it beside SGLang's v1 and v2 kernels where they can.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import arch as arch_limits
from . import launch, runtime
from .contracts import check_bool, check_contiguous, check_device, check_dtype, check_int
from .launch import I32, I64, PTR
from .layouts import PAGE_SLOTS
from .logits import device_info

SELECT_THREADS = 512                 # the radix kernels' block (kSelectThreads in kernels/radix_select.cuh)
LIST_CAP = 2048                      # keys of the k-th key's first-digit bin collected in shared memory (kListCap)
ROW_CACHE_KEYS = 16384               # visible keys a row may have to be read into shared memory once, on every arch
_SELECT_STATIC_SMEM = 33 * 1024      # the select kernels' own shared memory (RowSelectShared and a few words)
_SRC = "topk.cu"


def row_cache_keys(arch: str | None) -> int:
    """The longest row (visible keys) the per-row select kernels of ``arch`` read into shared memory once: 16,384
    everywhere, more where a block may take more shared memory (in 16K steps: 48K keys on sm_90 / sm_100, 32K on
    sm_80). Longer rows are read again from L2 by each radix pass."""
    if arch is None:
        return ROW_CACHE_KEYS
    room = arch_limits.limits(arch).smem_per_block - _SELECT_STATIC_SMEM
    return max(ROW_CACHE_KEYS, (room // 4 - 4) // ROW_CACHE_KEYS * ROW_CACHE_KEYS)


def row_cache_class(width: int, arch: str | None) -> str:
    """Which cache a per-row select launch of rows up to ``width`` keys takes: "small" (16,384 keys, the one that
    leaves room for two CTAs per SM), "large" (:func:`row_cache_keys`), or "none"."""
    if width <= ROW_CACHE_KEYS:
        return "small"
    return "large" if width <= row_cache_keys(arch) else "none"


def row_cache_entries(cache: str, arch: str | None) -> int:
    """The ``CacheEntries`` template value of the per-row select kernels (here and in cupy_dsa.rescore) for a cache
    class: u32 entries, the keys plus the 16-byte alignment pad of the row's body (kSelectCache) rounded up."""
    return {"none": 0, "small": ROW_CACHE_KEYS + 4, "large": row_cache_keys(arch) + 4,
            "slice": SLICE_CACHE_KEYS + 4}[cache]


# A cluster of CTAs per row (sm_90+, kernels/radix_select.cuh's select_row): each CTA reads a slice of the row and the
# CTAs merge their digit counts and their k-th bin's keys through distributed shared memory. One CTA per row leaves
# most SMs idle where the rows are few (48 decode rows: 48 of 132 SMs). A CTA's select is a chain of block-wide
# passes whose fixed cost a slice does not shorten, so a cluster pays only for long slices (H100, the select alone at
# k = 2048, us, one CTA / clusters of 2 / 4 / 8: 48 x 6K 8.9 / 10.3 / 11.6 / 23.3; 48 x 24K 19.1 / 18.1 / 15.4 /
# 26.4; 144 x 6K 11.0 / 19.2 / 28.3 / 61.4; 1 x 64K 54.5 / 31.6 / 20.8 / 14.3).
CLUSTER_SIZES = (2, 4, 8)            # 8: the portable cluster size
SLICE_CACHE_KEYS = 8192              # keys of a slice a cluster CTA reads into shared memory once (64K-key rows at 8)
CLUSTER_MIN_SLICE = 4096             # keys a cluster CTA gets at least
CLUSTER_CTAS_PER_SM = 2              # cluster CTAs per SM counted on at most (what sm_90 / sm_100 hold; timed on an H100)


def cluster_ctas_per_sm(arch: str) -> int:
    """Cluster CTAs one SM of ``arch`` holds at once, by their shared memory (slice cache, merged list, the select's
    own), at most CLUSTER_CTAS_PER_SM: two on sm_90 / sm_100, one on the 100 KB archs (sm_120)."""
    smem = _select_smem(row_cache_entries("slice", arch), CLUSTER_SIZES[0]) + _SELECT_STATIC_SMEM
    return max(1, min(CLUSTER_CTAS_PER_SM, arch_limits.ctas_by_smem(arch, smem)))


def select_cluster(width: int, rows: int, n_sms: int, arch: str | None) -> int:
    """CTAs per row of the per-row select kernels: 1, or on an arch with thread-block clusters the largest of
    CLUSTER_SIZES whose CTAs all stay resident at once over the rows (:func:`cluster_ctas_per_sm` per SM) and leave
    each at least CLUSTER_MIN_SLICE of the row."""
    if arch is None or not arch_limits.has_clusters(arch):
        return 1
    per_sm = cluster_ctas_per_sm(arch)
    fits = [c for c in CLUSTER_SIZES if rows * c <= per_sm * n_sms and width >= c * CLUSTER_MIN_SLICE]
    return max(fits, default=1)


def row_select_problem(width: int, rows: int, n_sms: int, arch: str | None) -> tuple[str, int]:
    """The per-row select kernels' problem for rows of up to ``width`` keys: (row cache class, CTAs per row); a
    cluster's CTAs take the "slice" cache."""
    cluster = select_cluster(width, rows, n_sms, arch)
    return ("slice" if cluster > 1 else row_cache_class(width, arch)), cluster


def row_select_values(problem: tuple[str, int], arch: str | None) -> dict:
    """Template values (CacheEntries, Cluster) of a per-row select problem on ``arch`` (one CTA per row where the arch
    has no clusters)."""
    cache, cluster = problem
    if cluster > 1 and (arch is None or arch_limits.has_clusters(arch)):
        return dict(CacheEntries=row_cache_entries("slice", arch), Cluster=cluster)
    return dict(CacheEntries=row_cache_entries("small" if cache == "slice" else cache, arch), Cluster=1)


def _select_smem(cache_entries: int, cluster: int) -> int:
    return 4 * (cache_entries + cache_entries % 2) + (LIST_CAP * 8 if cluster > 1 else 0)


def row_select_smem(cfg) -> int:
    """Dynamic shared memory of a per-row select config (kSelectSmemBytes): the row cache and, with clusters, the
    merged keys of the k-th key's bin (kListCap int64)."""
    return _select_smem(cfg.CacheEntries, cfg.Cluster)


ROW_SELECT_PROBLEMS = [("small", 1), ("large", 1), ("none", 1)] + [("slice", c) for c in CLUSTER_SIZES]

TOPK_KERNEL = launch.Kernel(
    _SRC, "paged_topk_kernel", params=("CacheEntries", "Cluster"),
    args=(("logits", PTR), ("logits_stride", I64), ("width", I32), ("lens", PTR), ("page_table", PTR),
          ("pt_stride", I64), ("index_topk", I32), ("page_indices", PTR), ("raw_indices", PTR)),
    threads=lambda cfg: SELECT_THREADS, smem=row_select_smem,
    smem_check="dsa::radix::kSelectSmemBytes<{CacheEntries}, {Cluster}>")

# A problem: row_select_problem's. Every config computes every row (a row or slice longer than its cache is read from
# L2; the grid is rows x the config's Cluster), so any of them serves any problem.
TOPK = launch.register(launch.Family(
    "paged_topk", problems=ROW_SELECT_PROBLEMS,
    select=lambda p, arch: TOPK_KERNEL.config(**row_select_values(p, arch)),
    serves=lambda cfg, p: cfg.kernel is TOPK_KERNEL))


class TopK(NamedTuple):
    """int32 ``[rows, index_topk]`` each, -1 padded: ``page_indices`` (SGLang's form) and ``raw_indices`` (positions;
    None unless asked for)."""
    page_indices: torch.Tensor
    raw_indices: torch.Tensor | None


def _check(logits, lens, page_table, index_topk, raw_indices):
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits: expected a torch.Tensor, got {type(logits).__name__}")
    check_dtype("logits", logits, (torch.float32,))
    if logits.dim() != 2:
        raise ValueError(f"logits: expected shape [rows, width], got {tuple(logits.shape)}")
    R = logits.shape[0]
    if R > 0 and logits.shape[1] > 1 and logits.stride(1) != 1:
        raise ValueError(f"logits: expected stride(1) == 1 (SGLang's contract), got strides {logits.stride()}")
    if not isinstance(lens, torch.Tensor):
        raise TypeError(f"lens: expected a torch.Tensor, got {type(lens).__name__}")
    check_dtype("lens", lens, (torch.int32,))
    if tuple(lens.shape) != (R,):
        raise ValueError(f"lens: expected shape ({R},) (one length per logits row), got {tuple(lens.shape)}")
    check_contiguous("lens", lens)
    if not isinstance(page_table, torch.Tensor):
        raise TypeError(f"page_table: expected a torch.Tensor, got {type(page_table).__name__}")
    check_dtype("page_table", page_table, (torch.int32,))
    if page_table.dim() != 2 or page_table.shape[0] != R:
        raise ValueError(f"page_table: expected shape [{R}, pages] (one row per logits row), got "
                         f"{tuple(page_table.shape)}")
    if page_table.shape[1] > 1 and page_table.stride(1) != 1:
        raise ValueError(f"page_table: expected stride(1) == 1, got strides {page_table.stride()}")
    for name, t in (("lens", lens), ("page_table", page_table)):
        check_device(name, t, logits.device, "logits")
    index_topk = check_int("index_topk", index_topk, 1)
    return index_topk, check_bool("raw_indices", raw_indices)


def paged_topk_reference(logits, lens, page_table, index_topk, *, raw_indices=False) -> TopK:
    """:func:`paged_topk` in torch (CPU backend and test oracle), selected keys in position order."""
    index_topk, want_raw = _check(logits, lens, page_table, index_topk, raw_indices)
    R, dev = logits.shape[0], logits.device
    width = min(logits.shape[1], page_table.shape[1] * PAGE_SLOTS)
    n = lens.long().clamp(0, width)
    page_out = torch.full((R, index_topk), -1, dtype=torch.int32, device=dev)
    raw_out = torch.full_like(page_out, -1)
    if R and width:
        cols = torch.arange(width, device=dev)
        seen = cols[None, :] < n[:, None]
        # ties to the lower position: a stable descending sort; unseen columns last
        s = logits[:, :width].float().masked_fill(~seen, float("-inf"))
        order = torch.sort(s, dim=1, descending=True, stable=True).indices
        order = order.gather(1, torch.sort(seen.gather(1, order).to(torch.int8), dim=1, descending=True,
                                           stable=True).indices)
        m = min(index_topk, width)
        pos = torch.sort(order[:, :m], dim=1).values                       # position order
        trivial = n <= index_topk                                            # 0 .. n - 1, no logits read
        seq = torch.arange(m, device=dev)[None, :].expand(R, m)
        pos = torch.where(trivial[:, None], seq, pos)
        ok = seq < torch.minimum(n, torch.full_like(n, index_topk))[:, None]
        page = page_table.long().gather(1, (pos // PAGE_SLOTS).clamp(max=page_table.shape[1] - 1))
        slot = (page * PAGE_SLOTS + pos % PAGE_SLOTS).to(torch.int32)   # int32 wrap, as the kernel's
        page_out[:, :m] = torch.where(ok, slot, torch.full_like(slot, -1))
        raw_out[:, :m] = torch.where(ok, pos, torch.full_like(pos, -1)).to(torch.int32)
    return TopK(page_out, raw_out if want_raw else None)


def paged_topk(logits, lens, page_table, index_topk, *, raw_indices=False) -> TopK:
    """Top-``index_topk`` of each row's visible logits in SGLang's output form (see the module docstring).

    logits float32 ``[rows, width]`` (last dim contiguous), lens int32 ``[rows]``, page_table int32 ``[rows, pages]``
    (SGLang's per-row page table); positions past ``pages * 64`` are never visible. One launch, no host sync, no
    data-dependent shape: capturable in a CUDA graph (after :func:`cupy_dsa.warm_up`). CPU tensors run the
    reference. Returns :class:`TopK`."""
    if not (isinstance(logits, torch.Tensor) and logits.is_cuda):
        return paged_topk_reference(logits, lens, page_table, index_topk, raw_indices=raw_indices)
    index_topk, want_raw = _check(logits, lens, page_table, index_topk, raw_indices)
    R, dev = logits.shape[0], logits.device
    page_out = torch.empty(R, index_topk, dtype=torch.int32, device=dev)
    raw_out = torch.empty_like(page_out) if want_raw else None
    if R == 0:
        return TopK(page_out, raw_out)
    width = min(logits.shape[1], page_table.shape[1] * PAGE_SLOTS)
    arch = runtime.device_arch(dev.index)
    n_sms, _ = device_info(dev.index)
    cfg = TOPK.select(row_select_problem(width, R, n_sms, arch), arch)
    cfg.launch(dev, (R * cfg.Cluster, 1, 1), logits=logits if width > 0 else None, logits_stride=logits.stride(0), width=width,
               lens=lens, page_table=page_table if page_table.shape[1] > 0 else None,
               pt_stride=page_table.stride(0), index_topk=index_topk, page_indices=page_out, raw_indices=raw_out)
    return TopK(page_out, raw_out)


__all__ = ["paged_topk", "paged_topk_reference", "TopK"]
