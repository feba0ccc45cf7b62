"""Peers measured live next to our kernels, never imported by the product: DeepGEMM's fp8 paged decode
logits and fp8 prefill logits (what stock SGLang calls on Hopper), SGLang's gather of a request's fp8 keys
out of the paged cache (its non-paged prefill route), and SGLang's own DeepSeek-V4 top-k kernels (issue 31:
the stock step's top-k). ``import deep_gemm`` or SGLang's top-k may fail; the bench then says why."""

from __future__ import annotations

import importlib.util
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import torch

from cupy_dsa.layouts import FP8_SCALE_OFFSET, HEAD_DIM, PAGE_SLOTS


def deepgemm():
    """(module, None) when DeepGEMM imports and runs here, else (None, reason)."""
    try:
        import deep_gemm
    except Exception as exc:  # not installed, or built for another torch
        return None, f"deep_gemm not importable ({type(exc).__name__}: {str(exc)[:120]})"
    for name in ("get_paged_mqa_logits_metadata", "fp8_paged_mqa_logits"):
        if not hasattr(deep_gemm, name):
            return None, f"deep_gemm has no {name}"
    return deep_gemm, None


def deepgemm_decode(dg, q_fp8, fp8_cache, weights, lens, block_table, width):
    """DeepGEMM's schedule and logits as SGLang calls them: lens as int32 [B, next_n] (row lengths), the
    fp8 pages viewed [P, 64, 1, 132], clean_logits off. Returns (schedule builder, logits call)."""
    B, next_n = q_fp8.shape[:2]
    lens_2d = lens if lens.dim() == 2 else (lens[:, None] - (next_n - 1)
                                            + torch.arange(next_n, device=lens.device, dtype=lens.dtype)[None, :])
    lens_2d = lens_2d.clamp_min(0).to(torch.int32).contiguous()
    n_sms = _num_sms(dg, q_fp8.device)
    pages = fp8_cache.view(fp8_cache.shape[0], 64, 1, 132)
    meta = dg.get_paged_mqa_logits_metadata(lens_2d, 64, n_sms)

    def schedule():
        return dg.get_paged_mqa_logits_metadata(lens_2d, 64, n_sms)

    def logits(bt=block_table):
        return dg.fp8_paged_mqa_logits(q_fp8, pages, weights, lens_2d, bt, meta, width, False)

    return schedule, logits


def _num_sms(dg, device) -> int:
    """The SM count DeepGEMM schedules for (SGLang passes ``deep_gemm.get_num_sms()``)."""
    if hasattr(dg, "get_num_sms"):
        return dg.get_num_sms()
    return torch.cuda.get_device_properties(device).multi_processor_count


def deepgemm_prefill(dg, q_fp8, keys, weights, ks, ke, *, clean_logits=True, max_seqlen_k=0):
    """DeepGEMM's fp8 prefill logits (``fp8_mqa_logits``) on the same rows and ranges. ``keys``: bf16 ``[S, 128]``,
    quantized here per token to e4m3 and an fp32 scale, or the ``(fp8 [S, 128], fp32 [S])`` pair SGLang's
    non-paged route gathers. SGLang's non-paged call passes ``clean_logits=False`` and ``max_seqlen_k`` (its
    compressed output). Returns the call (None when this DeepGEMM has no fp8_mqa_logits)."""
    if not hasattr(dg, "fp8_mqa_logits"):
        return None
    if isinstance(keys, tuple):
        k_fp8, scale = keys
    else:
        kf = keys.float()
        scale = (kf.abs().amax(1) / 448.0).clamp_min(1e-12)
        k_fp8 = (kf / scale[:, None]).to(torch.float8_e4m3fn).contiguous()
        scale = scale.contiguous()

    compressed = {"max_seqlen_k": max_seqlen_k} if max_seqlen_k else {}  # older DeepGEMMs lack the argument

    def logits():
        return dg.fp8_mqa_logits(q_fp8, (k_fp8, scale), weights, ks, ke, clean_logits, **compressed)

    return logits


def nonpaged_prefill(dg, q_fp8, weights, ks, ke, page_row, n_keys):
    """SGLang 0.5.23's non-paged prefill logits of one request (``_gather_nonpaged_index_k`` then
    ``_nonpaged_mqa_logits``): per call the request's first ``n_keys`` fp8 keys gathered out of a paged cache
    (pages ``page_row``), then DeepGEMM's ``fp8_mqa_logits`` with SGLang's arguments (clean off, ``max_seqlen_k`` =
    the keys' whole pages; column c of row t holds key ``ks[t] + c``). Returns a namespace: ``logits(fp8_cache)``,
    ``gather(fp8_cache)`` (the gather alone), ``gather_op`` (what gathers, :func:`fp8_gather`) and
    ``check(fp8_cache)``, which raises when SGLang's gather disagrees with the torch gather on those pages."""
    max_seqlen_k = math.ceil(n_keys / PAGE_SLOTS) * PAGE_SLOTS  # what SGLang passes: whole pages
    bind, gather_op = fp8_gather()
    gather = bind(page_row, n_keys)

    def logits(fp8_cache):
        return deepgemm_prefill(dg, q_fp8, gather(fp8_cache), weights, ks, ke, clean_logits=False,
                                max_seqlen_k=max_seqlen_k)()

    def check(fp8_cache):
        if not gather_op.startswith("SGLang"):
            return
        k, sc = gather(fp8_cache)
        k_ref, sc_ref = torch_fp8_gather(fp8_cache, page_row, n_keys)
        if not (torch.equal(k.view(torch.uint8), k_ref.view(torch.uint8)) and torch.equal(sc, sc_ref)):
            raise RuntimeError("SGLang's fp8 gather disagrees with the torch gather on the same pages")

    return SimpleNamespace(logits=logits, gather=gather, gather_op=gather_op, check=check, max_seqlen_k=max_seqlen_k)


def torch_fp8_gather(fp8_cache, page_row, n_entries):
    """A request's first ``n_entries`` fp8 keys out of the paged cache (uint8 ``[P, 8448]``, pages ``page_row``),
    as ``(fp8 [n, 128], fp32 scales [n])``: what SGLang's gather returns, in torch (one page gather, then the
    values and the scales split out)."""
    pages = fp8_cache[page_row[:math.ceil(n_entries / PAGE_SLOTS)].long()]
    values = pages[:, :FP8_SCALE_OFFSET].reshape(-1, HEAD_DIM)[:n_entries]
    scales = pages[:, FP8_SCALE_OFFSET:].contiguous().view(torch.float32).reshape(-1)[:n_entries]
    return values.view(torch.float8_e4m3fn), scales


def fp8_gather():
    """``(bind, what it is)``; ``bind(page_row, n_entries)`` returns ``gather(fp8_cache)`` of one request's keys.
    SGLang's own gather when it imports here (``GetKAndS.triton`` of sglang.kernels.ops.kvcache.dsa_index_k_cache,
    what the pool's ``get_index_k_scale_buffer`` runs on CUDA), else :func:`torch_fp8_gather`, saying why."""
    try:
        from sglang.kernels.ops.kvcache.dsa_index_k_cache import GetKAndS
    except Exception as exc:  # SGLang not installed here, or one of its imports fails
        return ((lambda page_row, n: lambda cache: torch_fp8_gather(cache, page_row, n)),
                f"torch gather (SGLang's GetKAndS not importable: {type(exc).__name__}: {str(exc)[:120]})")
    pool = SimpleNamespace(index_page_size=PAGE_SLOTS, index_head_dim=HEAD_DIM)  # what GetKAndS reads of the pool

    def bind(page_row, n_entries):
        pages = page_row.view(1, -1)  # SGLang passes the request's page-table row, [1, pages]
        seq_len = torch.full((1,), n_entries, dtype=torch.int32, device=page_row.device)

        def gather(fp8_cache):
            k, s = GetKAndS.triton(pool, fp8_cache, page_indices=pages, seq_len_tensor=seq_len,
                                   seq_len_sum=n_entries, max_seq_len=n_entries)
            return k.view(torch.float8_e4m3fn), s.view(torch.float32).squeeze(-1)

        return gather

    return bind, "SGLang's GetKAndS.triton (sglang.kernels.ops.kvcache.dsa_index_k_cache)"


# --------------------------------------------------------------------------------------------------
# top-k after the indexer logits (issue 31): SGLang's own kernels, ours, torch.topk
# --------------------------------------------------------------------------------------------------

SGLANG_V2, SGLANG_V1, CUPY_DSA_TOPK, TORCH_TOPK = "sglang-v2", "sglang-v1", "cupy_dsa", "torch"
TOPK_KEYS = (SGLANG_V2, SGLANG_V1, CUPY_DSA_TOPK, TORCH_TOPK)
V2_STOCK_ON = "SGLang's stock top-k on sm_90: H100, H200"
TOPK_LABELS = {
    SGLANG_V2: f"SGLang v2 (plan_topk_v2 + topk_transform_paged_v2, {V2_STOCK_ON})",
    SGLANG_V1: "SGLang v1 (topk_transform_paged, sm_120's stock top-k)",
    CUPY_DSA_TOPK: "cupy_dsa.paged_topk",
    TORCH_TOPK: "torch.topk (values and indices of each row; no length mask, no page transform)",
}
SGLANG_TOPK_MODULE = "sglang.kernels.ops.attention.dsv4.topk"
# SGLang v1's kernel takes k <= 1024 (topk_v1.cuh), v2's k <= 2048 (topk_v2.cuh)
SGLANG_MAX_TOPK = {SGLANG_V1: 1024, SGLANG_V2: 2048}
# what our stand-in cost against SGLang v2 where both were timed (H200, graph replays, fp32 scores, k = 512,
# cupy_dsa at a54fd74): rows x entries: (cupy_dsa.paged_topk us, SGLang v2 us)
STAND_IN_VS_V2 = {"48 x 6,144": (8.7, 3.7), "48 x 24,576": (28.0, 7.6), "48 x 65,536": (102.0, 13.0)}
STAND_IN_VS_V2_WHERE = "H200, CUDA-graph replays, k = 512, cupy_dsa at a54fd74"


@dataclass(frozen=True)
class BoundTopK:
    """A top-k bound to one batch's row lengths and page table: ``plan()`` is the per-forward work (SGLang v2's
    routing plan, built once per forward like its ``PagedIndexerMetadata``; nothing for the others), ``select(logits)``
    one layer's selection, SGLang's output form (int32 ``[rows, index_topk]`` slots, -1 padded) except torch.topk's."""
    plan: Callable[[], object]
    select: Callable[[torch.Tensor], object]


@dataclass(frozen=True)
class TopKOp:
    """One top-k implementation: ``bind(lens, page_table, index_topk)`` -> :class:`BoundTopK` (lens int32 ``[rows]``,
    page_table int32 ``[rows, pages]``, one row per logits row, as SGLang passes them)."""
    key: str
    label: str
    bind: Callable[[torch.Tensor, torch.Tensor, int], BoundTopK]
    module: object = None   # SGLang's top-k module it calls (fp8-rescore's candidates call it too), else None


def _nothing():
    return None


def cupy_dsa_topk() -> TopKOp:
    """Our ``paged_topk`` (one launch per layer, no plan)."""
    import cupy_dsa

    def bind(lens, page_table, index_topk):
        return BoundTopK(_nothing, lambda logits: cupy_dsa.paged_topk(logits, lens, page_table, index_topk).page_indices)

    return TopKOp(CUPY_DSA_TOPK, TOPK_LABELS[CUPY_DSA_TOPK], bind)


def torch_topk() -> TopKOp:
    """``torch.topk(logits, index_topk, dim=1)``: what the benches used before issue 31 (every column of the logits,
    no trivial rows, no page transform; kept as a column for comparison)."""
    def bind(lens, page_table, index_topk):
        return BoundTopK(_nothing, lambda logits: torch.topk(logits, min(index_topk, logits.shape[1]), dim=1))

    return TopKOp(TORCH_TOPK, TOPK_LABELS[TORCH_TOPK], bind)


def _install_kernel_stubs() -> list[str]:
    """Before the first ``import sglang`` on a machine without SGLang's kernel packages: the checkout's
    ``scripts/_sglang_env.py`` serves imports of the missing ones among sgl_kernel, flash_mla and flashinfer as
    stubs (deep_gemm is never stubbed: the DeepGEMM columns must run the real one or say why not). Returns the
    stubbed names; nothing when SGLang is imported already or the script is not there (an installed copy)."""
    if "sglang" in sys.modules:
        return []
    path = Path(__file__).resolve().parents[1] / "scripts" / "_sglang_env.py"
    if not path.is_file():
        return []
    spec = importlib.util.spec_from_file_location("_sglang_env", path)
    env = sys.modules.get("_sglang_env")
    if env is None:
        env = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(env)
        sys.modules["_sglang_env"] = env
    env.install()  # torchvision, where no real one imports
    return env.install_kernel_stubs(("sgl_kernel", "flash_mla", "flashinfer"))


def _sglang_bind(mod, version):
    def bind(lens, page_table, index_topk):
        if index_topk > SGLANG_MAX_TOPK[version]:
            raise ValueError(f"index_topk: SGLang {version[-2:]}'s top-k takes at most {SGLANG_MAX_TOPK[version]}, "
                             f"got {index_topk}")
        out = torch.empty(lens.shape[0], index_topk, dtype=torch.int32, device=lens.device)
        if version == SGLANG_V1:
            def select(logits):
                mod.topk_transform_paged(logits, lens, page_table, out, PAGE_SLOTS)
                return out

            return BoundTopK(_nothing, select)
        meta = torch.empty(lens.shape[0] + 1, 2, dtype=torch.int32, device=lens.device)  # as plan_topk_v2 allocates

        def plan():
            return mod.plan_topk_v2(lens, out=meta)

        def select(logits):
            mod.topk_transform_paged_v2(logits, lens, page_table, out, PAGE_SLOTS, meta)
            return out

        return BoundTopK(plan, select)

    return bind


def _self_check(op: TopKOp, device) -> None:
    """Run ``op`` once on rows of every kind (empty, trivial, past the cache, longer) and compare the selected
    positions with cupy_dsa's reference as sets (SGLang's order is unspecified); compiles SGLang's JIT kernels."""
    from cupy_dsa import topk as ours

    g = torch.Generator(device="cpu").manual_seed(31)
    k, width = 64, 4096
    lens = torch.tensor([0, 10, 64, 65, 700, 3000, 4096, 1], dtype=torch.int32)
    logits = torch.randn(len(lens), width, generator=g)
    table = torch.arange(len(lens) * width // PAGE_SLOTS, dtype=torch.int32).view(len(lens), -1)
    want = ours.paged_topk_reference(logits, lens, table, k).page_indices
    bound = op.bind(lens.to(device), table.to(device), k)
    bound.plan()
    got = bound.select(logits.to(device)).cpu()
    for r in range(len(lens)):
        a, b = sorted(v for v in got[r].tolist() if v >= 0), sorted(v for v in want[r].tolist() if v >= 0)
        if a != b:
            raise RuntimeError(f"row {r} (length {int(lens[r])}) selects {len(a)} slots that differ from the "
                               f"reference's {len(b)}")


_SGLANG_TOPK: dict = {}


def sglang_topk(version: str, device=None):
    """``(TopKOp, None)`` when SGLang 0.5.23's own DeepSeek-V4 top-k ``version`` ("v1": ``topk_transform_paged``,
    sm_120's default; "v2": ``plan_topk_v2`` + ``topk_transform_paged_v2``, the H200's) imports, JIT-compiles (nvcc,
    about a minute the first time) and selects what the reference does on ``device``; else ``(None, why not)``.
    The kernel-package stubs go in before SGLang is imported (:func:`_install_kernel_stubs`)."""
    key = {"v1": SGLANG_V1, "v2": SGLANG_V2}.get(version)
    if key is None:
        raise ValueError(f"version: expected 'v1' or 'v2', got {version!r}")
    device = torch.device(device) if device is not None else (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
    if device.type != "cuda" or torch.version.cuda is None or not torch.cuda.is_available():
        return None, f"SGLang's {version} top-k not run: it is a CUDA kernel and this run has no CUDA device"
    if (key, device) in _SGLANG_TOPK:
        return _SGLANG_TOPK[(key, device)]
    try:
        _install_kernel_stubs()
        mod = importlib.import_module(SGLANG_TOPK_MODULE)
    except Exception as exc:  # SGLang not installed here, or one of its imports fails
        result = None, f"SGLang's {version} top-k not importable ({type(exc).__name__}: {str(exc)[:160]})"
    else:
        op = TopKOp(key, TOPK_LABELS[key], _sglang_bind(mod, key), mod)
        try:
            with torch.cuda.device(device):
                _self_check(op, device)
                torch.cuda.synchronize()
            result = op, None
        except Exception as exc:  # nvcc / tvm-ffi JIT failed, or the kernel disagrees with the reference
            result = None, f"SGLang's {version} top-k did not run here ({type(exc).__name__}: {str(exc)[:200]})"
    _SGLANG_TOPK[(key, device)] = result
    return result


@dataclass(frozen=True)
class TopKs:
    """The top-k implementations of a run: ``stock`` (SGLang v2 where it runs here, else :func:`cupy_dsa_topk`
    standing in for it) is what the benches add to the stock step; ``ops`` every one that runs, by key;
    ``status`` "live" or why not, by key."""
    stock: TopKOp
    stand_in: bool
    ops: dict
    status: dict

    def describe(self) -> dict:
        """The run's record of its top-k (JSON)."""
        doc = {"stock": self.stock.key, "stock_label": self.stock.label, "stand_in": self.stand_in,
               "status": dict(self.status), "labels": {k: TOPK_LABELS[k] for k in TOPK_KEYS}}
        if self.stand_in:
            doc["stand_in_note"] = stand_in_note(self.status.get(SGLANG_V2))
        return doc


def stand_in_note(why: str | None) -> str:
    """What a stand-in stock top-k is, why, and what it cost against SGLang v2 where both were timed."""
    figures = "; ".join(f"{rows}: {us:g} us vs {v2:g}" for rows, (us, v2) in STAND_IN_VS_V2.items())
    return (f"cupy_dsa.paged_topk STANDS IN for SGLang's v2 top-k ({why or 'SGLang v2 not run'}); measured "
            f"slower than v2 where both ran ({STAND_IN_VS_V2_WHERE}; rows x entries: {figures}), so the stock "
            "step here is overstated by that difference per layer")


def topks(device, sglang: bool = True) -> TopKs:
    """The run's top-k implementations (SGLang's loaded only with ``sglang``)."""
    ops = {CUPY_DSA_TOPK: cupy_dsa_topk(), TORCH_TOPK: torch_topk()}
    status = {CUPY_DSA_TOPK: "live", TORCH_TOPK: "live"}
    for version, key in (("v2", SGLANG_V2), ("v1", SGLANG_V1)):
        op, why = sglang_topk(version, device) if sglang else (None, "not asked for")
        status[key] = why or "live"
        if op is not None:
            ops[key] = op
    stock = ops.get(SGLANG_V2, ops[CUPY_DSA_TOPK])
    ordered = {k: ops[k] for k in TOPK_KEYS if k in ops}
    return TopKs(stock, stock.key != SGLANG_V2, ordered, {k: status[k] for k in TOPK_KEYS})
