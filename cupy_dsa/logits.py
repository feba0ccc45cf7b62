"""Indexer logits: ``logits[r, n] = sum_{h<64} relu(q[r,h,:] . k[n,:]) * w[r,h]`` (fp32 accumulate).

Two entry points, both dispatching CPU tensors to the torch reference (the CPU backend and the test oracle)
and CUDA tensors to one templated kernel in ``kernels/mqa_logits.cu``:

* :func:`paged_mqa_logits` -- decode / MTP verify: ``q [B, next_n, 64, 128]`` against each request's
  paged keys (DeepGEMM ``fp8_paged_mqa_logits`` contract, either cache layout);
* :func:`mqa_logits` -- prefill: ``q [T, 64, 128]`` against one request's keys (contiguous bf16 ``[S, 128]``
  or the paged cache plus that request's block table), row ``i`` seeing keys ``[ks[i], ke[i])``.

fp8 layout: ``logit = k_scale[n] * sum_h relu(q . k_fp8) * w`` (the scale applied after the head sum, as
DeepGEMM does). Outputs are fp32 with a row stride that is a multiple of 4 elements (top-k needs it).

The GPU path does no host sync and allocates only with torch: decode work is split by
:func:`paged_mqa_logits_plan` (a small kernel over ``context_lens``, built once per forward) over one wave
of CTAs, and every launch grid depends on host integers and the device only, so the calls can be captured
in a CUDA graph after :func:`warm_up` and stay balanced when replayed with new lengths.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from . import runtime
from .layouts import (BF16_PAGE_BYTES, FP8_PAGE_BYTES, HEAD_DIM, N_HEADS, PAGE_SLOTS, bf16_view, fp8_views,
                      layout_of)

_SRC = "mqa_logits.cu"
_FP8 = torch.float8_e4m3fn
_Q_DTYPES = (_FP8, torch.bfloat16)
_NEG_INF = float("-inf")

# Kernel range modes (must match kernels/mqa_logits.cu).
_MODE_CAUSAL_1D, _MODE_LENS_2D, _MODE_KS_KE = 0, 1, 2
_TILE_KEYS = 32         # keys per warp tile in the kernel
_MAX_GRID_Y = 65535

# Host-side tuning knobs (read on every call, so a bench can flip them; defaults are the shipped choice).
TUNING = {
    "decode_prefetch": 0,        # bf16 keys: register double-buffer of the next key tile (1) or occupancy (0)
    "prefill_rows": 4,           # query rows per CTA: 4 (4 warps; H200: 422 TFLOP/s at 4K x 64K) or 8 (8 warps,
                                 # ~129 KiB shared memory; 376 TFLOP/s there)
    "prefill_prefetch": 0,       # contiguous keys, 8-row tiles: register double-buffer of the next key tile
    "prefill_keys_per_cta": 4096,  # CTAs per row tile = ceil(keys / this)
    "fp8_mma": 0,                # fp8 keys x fp8 q: 0 = f16 mma of shift-expanded bytes (all archs); 1 = e4m3
                                 # mma.sync m16n8k32 where native (sm_89, sm_120+; elsewhere same as 0): half
                                 # the mma, no conversion, but Ada fp8 tensor cores add with ~13-bit precision;
                                 # 2 = e4m3 mma on every sm_89+ target (sm_90/100: ptxas emulates it, slower;
                                 # a layout test / bench variant). Not exposed for other dtype combinations.
    "sm90_wgmma": 1,             # sm_90, bf16 keys, decode: the wgmma kernel (1) or the mma.sync kernel (0)
    "sm90_ctas_per_sm": 0,       # wgmma decode CTAs per SM (one wave); 0 = the configuration's own
    "decode_l2_hint": 1,         # L2 prefetch size of the streaming key loads: 2 = 256 B, 1 = 128 B, 0 = none;
                                 # 0 / 1 exist only for decode next_n=1 with fp8 q (else 2 is used).
                                 # H200, 64 x 32K bf16: 128 B 142.9 us, 256 B 145.5 us, none 151.3 us
    "sm90_prefill": None,        # sm_90 prefill, bf16 keys: (stages, split, warpgroups, schedule) of the wgmma
                                 # kernel; None = the shipped _SM90_PREFILL_CONFIG
    "sm90_prefill_parts": 0,     # CTAs per 4-row tile of the wgmma prefill; 0 = sized to fill a few waves
}


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# --------------------------------------------------------------------------------------------------
# Instantiations
# --------------------------------------------------------------------------------------------------

def _expr(key_fp8: int, q_fp8: int, rows: int, paged: int, warps: int, prefetch: int, l2_hint: int = 2,
          mma8: int = 0) -> str:
    return f"mqa_logits_kernel<{key_fp8}, {q_fp8}, {rows}, {paged}, {warps}, {prefetch}, {l2_hint}, {mma8}>"


def _decode_expr(key_fp8: int, q_fp8: int, rows: int, prefetch: int = 0, l2_hint: int = 2, mma8: int = 0) -> str:
    return f"mqa_logits_decode_kernel<{key_fp8}, {q_fp8}, {rows}, {prefetch}, {l2_hint}, {mma8}>"


_PLAN_EXPR = "paged_mqa_logits_plan_kernel"


def _declared_instantiations() -> list[str]:
    ex = [_PLAN_EXPR]
    for kf in (0, 1):
        for qf in (1, 0):
            # fp8 x fp8: both the e4m3-mma (sm_89+; f16 on sm_80) and the f16-mma variant (TUNING fp8_mma)
            for mma8 in ((0, 1, 2) if kf and qf else (0,)):
                for rows in (1, 2, 3, 4):  # decode (rows = next_n)
                    ex.append(_decode_expr(kf, qf, rows, 0, 2, mma8))
                    if kf == 0:            # register double-buffering: a bench variant for bf16 keys
                        ex.append(_decode_expr(kf, qf, rows, 1))
                ex.append(_expr(kf, qf, 4, 1, 4, 0, 2, mma8))   # paged prefill, 4-row tiles
                ex.append(_expr(kf, qf, 8, 1, 8, 0, 2, mma8))   # paged prefill, 8-row tiles
    for hint in (0, 1):                            # L2 prefetch-size variants: main decode shapes only
        ex.append(_decode_expr(0, 1, 1, 0, hint))
        ex.append(_decode_expr(1, 1, 1, 0, hint))
    for qf in (1, 0):                               # contiguous bf16 keys (prefill)
        ex.append(_expr(0, qf, 4, 0, 4, 0))
        ex.append(_expr(0, qf, 8, 0, 8, 0))
        ex.append(_expr(0, qf, 8, 0, 8, 1))
    return ex


_INSTANTIATIONS = _declared_instantiations()
_DECLARED = frozenset(_INSTANTIATIONS)
runtime.register_instantiations(_SRC, _INSTANTIATIONS)

# sm_90 decode with bf16 keys: the wgmma kernel of kernels/mqa_logits_sm90.cuh (included by mqa_logits.cu).
# next_n -> (pipeline stages, CTAs per SM, wgmma chunks), chosen on the H200 under the balanced schedule
# (2026-12-01, fp8 q, CUDA-graph replays; 64 x 32K / long-tail B=64 / 1 x 256K + 63 x 2K / 1 x 8K, us):
# next_n 1: (3, 3, 1) 141 / 111 / 34.9 / 5.1; (4, 2, 1) 152 / 123 / 35.4 / 5.1; (2, 4, 1) 140 / 109 / 34.2 / 5.6;
#           mma.sync 140 / 109 / 35.5 / 6.7.
# next_n 2: (2, 3, 1) 170 / 131 / 41.7 / 7.0; (3, 2, 1) 187 / 154 / 46.1 / 6.7; mma.sync 199 / 152 / 50.9 / 9.5.
# next_n 3: (2, 2, 3) 263 / 214 / 62.6 / 8.4; (3, 2, 3) 268 / 218 / 64.4 / 8.4; mma.sync 275 / 212 / 66.4 / 11.1.
# next_n 4: (2, 2, 2) 279 / 237 / 69.5 / 9.6; (2, 2, 4) 323 / 263 / 78.2 / 9.9; mma.sync 377 / 285 / 91.4 / 14.1.
_SM90_CONFIG = {1: (3, 3, 1), 2: (2, 3, 1), 3: (2, 2, 3), 4: (2, 2, 2)}


def _sm90_expr(q_fp8: int, next_n: int) -> str:
    stages, ctas, split = _SM90_CONFIG[next_n]
    return f"mqa_logits_sm90_decode_kernel<{q_fp8}, {next_n}, {stages}, {ctas}, {split}>"


def _sm90_smem_bytes(next_n: int) -> int:
    # mirrors dsa::sm90::Smem: alignment slack + q tiles + key stages + weights
    return (1024 + next_n * N_HEADS * HEAD_DIM * 2 + _SM90_CONFIG[next_n][0] * BF16_PAGE_BYTES
            + next_n * N_HEADS * 4)


runtime.register_instantiations(_SRC, [_sm90_expr(qf, nn) for qf in (1, 0) for nn in _SM90_CONFIG])

# sm_90 prefill with bf16 keys (contiguous or paged): the wgmma kernel of kernels/mqa_logits_sm90.cuh, 4 query
# rows per CTA; config = (key stages per key group, wgmma chunks per warpgroup, warpgroups, schedule). Chosen on
# the H200 (2026-12-01, fp8 q, causal, CUDA-graph replays; % of the bf16 matmul measured in the same run at
# 4K x 64K contiguous / paged, 1K x 16K, 8K x 128K): (4, 1, 2, 2) 69.8 / 69.2 / 65.1 / 69.2;
# (4, 1, 4, 2) 68.5 / 63.5 / 65.5 / 65.1; (4, 1, 4, 0) 66.0 / 65.6 / 62.9 / 65.6; (4, 2, 2, 2) 66.5 / 60.6 /
# 62.3 / 66.2; (3, 1, 4, 2) and (5, 1, 4, 2) within 1% of (4, 1, 4, 2); the mma.sync kernel 54.1 / 52.6 / 50.9 /
# 53.7. From 8 rows on it is faster at every length measured (8 x 64K: 23.6 vs 128.7 us; 64 x 64K: 182 vs 188).
_SM90_PREFILL_ROWS = 4
_SM90_PREFILL_CONFIG = (4, 1, 2, 2)
_SM90_PREFILL_MIN_ROWS = 8     # fewer rows: the mma.sync kernel (not measured below 8 rows)


def _sm90_prefill_expr(q_fp8: int, paged: int, config=None) -> str:
    stages, split, wgs, sched = config or _SM90_PREFILL_CONFIG
    return f"mqa_logits_sm90_prefill_kernel<{q_fp8}, {paged}, {stages}, {split}, {wgs}, {sched}>"


def _sm90_prefill_smem_bytes(config=None) -> int:
    # mirrors dsa::sm90::PrefillSmem: alignment slack + q tile + two key groups' stages + weights
    stages = (config or _SM90_PREFILL_CONFIG)[0]
    return (1024 + _SM90_PREFILL_ROWS * N_HEADS * HEAD_DIM * 2 + 2 * stages * BF16_PAGE_BYTES
            + _SM90_PREFILL_ROWS * N_HEADS * 4)


runtime.register_instantiations(_SRC, [_sm90_prefill_expr(qf, pg) for qf in (1, 0) for pg in (0, 1)])


def _mma8(key_fp8: int, q_fp8: int) -> int:
    return int(TUNING["fp8_mma"]) if (key_fp8 and q_fp8) else 0


def _smem_bytes(rows: int) -> int:
    # q fragments (rows x 64 heads x 128 x 16 bit) + weights
    return rows * (N_HEADS * HEAD_DIM * 2 + N_HEADS * 4)


@functools.lru_cache(maxsize=None)
def _device_info(index: int) -> tuple[int, int]:
    props = torch.cuda.get_device_properties(index)
    optin = getattr(props, "shared_memory_per_block_optin", 0) or 48 * 1024
    return props.multi_processor_count, optin


# --------------------------------------------------------------------------------------------------
# Validation (host metadata only)
# --------------------------------------------------------------------------------------------------

def _check_dtype(name, t, dtypes):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")


def _check_device(name, t, device):
    if t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (same device as q), got {t.device}")


def _check_contiguous(name, t):
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")


def _check_int(name, v, lo=0):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
    if v < lo:
        raise ValueError(f"{name}: expected an int >= {lo}, got {v}")
    return int(v)


def _check_kv_cache(kv_cache, device):
    if not isinstance(kv_cache, torch.Tensor):
        raise TypeError(f"kv_cache: expected a torch.Tensor, got {type(kv_cache).__name__}")
    layout = layout_of(kv_cache)  # ValueError naming kv_cache
    _check_device("kv_cache", kv_cache, device)
    _check_contiguous("kv_cache", kv_cache)
    return layout


def _alloc_out(out, rows, width, device):
    """fp32 [rows, width] whose row stride is a multiple of 4 elements (a view of [rows, ceil4(width)])."""
    if out is None:
        return torch.empty(rows, _ceil_div(width, 4) * 4, dtype=torch.float32, device=device)[:, :width]
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out: expected a torch.Tensor, got {type(out).__name__}")
    if out.dtype != torch.float32:
        raise TypeError(f"out: expected dtype torch.float32, got {out.dtype}")
    if tuple(out.shape) != (rows, width):
        raise ValueError(f"out: expected shape {(rows, width)}, got {tuple(out.shape)}")
    if out.device != device:
        raise ValueError(f"out: expected a tensor on {device}, got {out.device}")
    if rows > 0 and width > 0 and (out.stride(1) != 1 or out.stride(0) % 4 != 0 or out.stride(0) < width):
        raise ValueError(f"out: expected stride(1) == 1 and a row stride that is a multiple of 4 and >= {width}, "
                         f"got strides {out.stride()}")
    return out


def _check_paged(q, kv_cache, weights, context_lens, block_table, max_context_len):
    _check_dtype("q", q, _Q_DTYPES)
    if q.dim() != 4 or q.shape[2] != N_HEADS or q.shape[3] != HEAD_DIM or not 1 <= q.shape[1] <= 4:
        raise ValueError(f"q: expected shape [B, next_n, {N_HEADS}, {HEAD_DIM}] with next_n in 1..4, "
                         f"got {tuple(q.shape)}")
    _check_contiguous("q", q)
    device = q.device
    B, next_n = q.shape[0], q.shape[1]
    layout = _check_kv_cache(kv_cache, device)
    _check_dtype("weights", weights, (torch.float32,))
    if tuple(weights.shape) != (B * next_n, N_HEADS):
        raise ValueError(f"weights: expected shape {(B * next_n, N_HEADS)}, got {tuple(weights.shape)}")
    _check_device("weights", weights, device)
    _check_contiguous("weights", weights)
    _check_context_lens(context_lens, B, next_n, device)
    _check_dtype("block_table", block_table, (torch.int32,))
    if block_table.dim() != 2 or block_table.shape[0] != B:
        raise ValueError(f"block_table: expected shape [{B}, max_pages], got {tuple(block_table.shape)}")
    if block_table.shape[1] > 0 and block_table.stride(1) != 1:
        raise ValueError(f"block_table: expected stride(1) == 1, got strides {block_table.stride()}")
    _check_device("block_table", block_table, device)
    max_context_len = _check_int("max_context_len", max_context_len)
    return layout, B, next_n, max_context_len


def _check_context_lens(context_lens, B, next_n, device=None):
    _check_dtype("context_lens", context_lens, (torch.int32,))
    if tuple(context_lens.shape) not in ((B,), (B, next_n)):
        raise ValueError(f"context_lens: expected shape ({B},) or ({B}, {next_n}), got {tuple(context_lens.shape)}")
    if device is not None:
        _check_device("context_lens", context_lens, device)
    _check_contiguous("context_lens", context_lens)


def _check_plan(plan, B, device):
    if not isinstance(plan, torch.Tensor):
        raise TypeError(f"plan: expected the torch.Tensor of paged_mqa_logits_plan, got {type(plan).__name__}")
    if plan.dtype != torch.int64 or tuple(plan.shape) != (B + 1,):
        raise ValueError(f"plan: expected int64 shape ({B + 1},) from paged_mqa_logits_plan(context_lens, next_n), "
                         f"got {plan.dtype} {tuple(plan.shape)}")
    _check_device("plan", plan, device)
    _check_contiguous("plan", plan)


def paged_mqa_logits_plan_reference(context_lens, next_n, *, out=None):
    """Torch reference of :func:`paged_mqa_logits_plan` (any device)."""
    B, next_n = _check_plan_args(context_lens, next_n, out)
    lens = context_lens.long()
    longest = lens.amax(1) if lens.dim() == 2 else lens       # 1-D: the last row sees the most
    pages = (longest.clamp_min(0) + PAGE_SLOTS - 1) // PAGE_SLOTS
    if out is None:
        out = torch.empty(B + 1, dtype=torch.int64, device=context_lens.device)
    out[0] = 0
    torch.cumsum(pages, 0, out=out[1:])
    return out


def _check_plan_args(context_lens, next_n, out):
    next_n = _check_int("next_n", next_n, 1)
    if next_n > 4:
        raise ValueError(f"next_n: expected 1..4, got {next_n}")
    _check_dtype("context_lens", context_lens, (torch.int32,))
    if context_lens.dim() == 0:
        raise ValueError(f"context_lens: expected shape [B] or [B, {next_n}], got a 0-d tensor")
    B = context_lens.shape[0]
    _check_context_lens(context_lens, B, next_n)
    if out is not None:
        _check_plan(out, B, context_lens.device)
    return B, next_n


def _check_prefill(q, kv, weights, ks, ke, block_table, max_seqlen_k, rows):
    _check_dtype("q", q, _Q_DTYPES)
    if q.dim() != 3 or q.shape[1] != N_HEADS or q.shape[2] != HEAD_DIM:
        raise ValueError(f"q: expected shape [T, {N_HEADS}, {HEAD_DIM}], got {tuple(q.shape)}")
    _check_contiguous("q", q)
    device = q.device
    T = q.shape[0]
    if not isinstance(kv, torch.Tensor):
        raise TypeError(f"kv: expected a torch.Tensor, got {type(kv).__name__}")
    if block_table is None:
        if kv.dtype != torch.bfloat16:
            raise TypeError(f"kv: expected contiguous bfloat16 keys [S, {HEAD_DIM}] (or a paged cache with "
                            f"block_table=), got dtype {kv.dtype}")
        if kv.dim() != 2 or kv.shape[1] != HEAD_DIM:
            raise ValueError(f"kv: expected shape [S, {HEAD_DIM}], got {tuple(kv.shape)}")
        _check_device("kv", kv, device)
        _check_contiguous("kv", kv)
        layout, num_keys, bt = "contiguous", kv.shape[0], None
    else:
        try:
            layout = layout_of(kv)
        except ValueError as e:
            raise ValueError(str(e).replace("kv_cache:", "kv (paged cache):")) from None
        _check_device("kv", kv, device)
        _check_contiguous("kv", kv)
        _check_dtype("block_table", block_table, (torch.int32,))
        if block_table.dim() == 2 and block_table.shape[0] == 1:
            bt = block_table[0]
        elif block_table.dim() == 1:
            bt = block_table
        else:
            raise ValueError(f"block_table: expected shape [num_pages] or [1, num_pages] (one request), "
                             f"got {tuple(block_table.shape)}")
        if bt.shape[0] > 0 and bt.stride(0) != 1:
            raise ValueError(f"block_table: expected unit stride along pages, got strides {block_table.stride()}")
        _check_device("block_table", block_table, device)
        num_keys = bt.shape[0] * PAGE_SLOTS
    _check_dtype("weights", weights, (torch.float32,))
    if tuple(weights.shape) != (T, N_HEADS):
        raise ValueError(f"weights: expected shape {(T, N_HEADS)}, got {tuple(weights.shape)}")
    _check_device("weights", weights, device)
    _check_contiguous("weights", weights)
    for name, t in (("ks", ks), ("ke", ke)):
        _check_dtype(name, t, (torch.int32,))
        if tuple(t.shape) != (T,):
            raise ValueError(f"{name}: expected shape ({T},), got {tuple(t.shape)}")
        _check_device(name, t, device)
        _check_contiguous(name, t)
    max_seqlen_k = _check_int("max_seqlen_k", max_seqlen_k)
    if rows is None:
        start, end = 0, T
    else:
        try:
            start, end = (int(v) for v in rows)
        except (TypeError, ValueError):
            raise TypeError(f"rows: expected a (start, end) pair of ints, got {rows!r}") from None
        if not 0 <= start <= end <= T:
            raise ValueError(f"rows: expected 0 <= start <= end <= {T}, got {rows!r}")
    width = max_seqlen_k if max_seqlen_k > 0 else num_keys
    return layout, bt, num_keys, width, start, end


# --------------------------------------------------------------------------------------------------
# References (torch, any device, fp32 math, bounded memory)
# --------------------------------------------------------------------------------------------------

_REF_KEY_CHUNK = 4096
_REF_ROW_CHUNK = 64


def _key_source(layout, kv):
    """(values [P,64,128] as fp32-convertible, scales [P,64] fp32 or None) for a paged cache."""
    if layout == "bf16":
        return bf16_view(kv), None
    values, scales = fp8_views(kv)
    return values.view(_FP8), scales


def _gather_pages(values, scales, entries, num_pages):
    """Keys of the given block-table entries as fp32 [n*64, 128] (zeros for invalid entries), their fp32
    scales [n*64] (ones for the bf16 layout) and a validity mask [n*64]."""
    entries = entries.long()
    valid = (entries >= 0) & (entries < num_pages)
    idx = torch.where(valid, entries, torch.zeros_like(entries))
    k = values[idx].float() * valid[:, None, None]
    k = k.reshape(-1, HEAD_DIM)
    s = (scales[idx].reshape(-1) if scales is not None
         else torch.ones(k.shape[0], dtype=torch.float32, device=k.device))
    return k, s, valid.repeat_interleave(PAGE_SLOTS)


def _head_sum(qf, wf, k, s):
    """qf [R,64,128] fp32, wf [R,64], k [N,128] fp32, s [N] -> [R, N] fp32."""
    scores = torch.einsum("rhd,nd->rhn", qf, k)
    return torch.einsum("rhn,rh->rn", scores.clamp_min_(0), wf) * s


def paged_mqa_logits_reference(q, kv_cache, weights, context_lens, block_table, max_context_len, *,
                               clean_logits=False, out=None, plan=None):
    """Torch reference of :func:`paged_mqa_logits` (any device; writes -inf to every masked column; a
    ``plan`` is checked, not needed)."""
    layout, B, next_n, width = _check_paged(q, kv_cache, weights, context_lens, block_table, max_context_len)
    if plan is not None:
        _check_plan(plan, B, q.device)
    out = _alloc_out(out, B * next_n, width, q.device)
    out.fill_(_NEG_INF)
    if width == 0 or B == 0:
        return out
    values, scales = _key_source(layout, kv_cache)
    num_pages = kv_cache.shape[0]
    lens = context_lens.long()
    if lens.dim() == 1:
        lens = lens[:, None] - (next_n - 1 - torch.arange(next_n, device=lens.device))[None, :]
    lens = lens.clamp(0, width).cpu()
    bt_width = block_table.shape[1]
    qf_all = q.float().view(B, next_n, N_HEADS, HEAD_DIM)
    wf_all = weights.view(B, next_n, N_HEADS)
    for b in range(B):
        L = int(lens[b].max())
        n_pages = min(_ceil_div(L, PAGE_SLOTS), bt_width)
        if n_pages == 0:
            continue
        pos_lim = lens[b].to(q.device)
        for p0 in range(0, n_pages, _REF_KEY_CHUNK // PAGE_SLOTS):
            p1 = min(n_pages, p0 + _REF_KEY_CHUNK // PAGE_SLOTS)
            k, s, valid = _gather_pages(values, scales, block_table[b, p0:p1], num_pages)
            vals = _head_sum(qf_all[b], wf_all[b], k, s)                     # [next_n, n]
            pos = torch.arange(p0 * PAGE_SLOTS, p1 * PAGE_SLOTS, device=q.device)
            vis = (pos[None, :] < pos_lim[:, None]) & valid[None, :]
            c1 = min(p1 * PAGE_SLOTS, width)
            n = c1 - p0 * PAGE_SLOTS
            out[b * next_n:(b + 1) * next_n, p0 * PAGE_SLOTS:c1] = torch.where(
                vis[:, :n], vals[:, :n], torch.full_like(vals[:, :n], _NEG_INF))
    return out


def mqa_logits_reference(q, kv, weights, ks, ke, *, block_table=None, max_seqlen_k=0, clean_logits=True,
                         rows=None, out=None):
    """Torch reference of :func:`mqa_logits` (any device; writes -inf to every masked column)."""
    layout, bt, num_keys, width, start, end = _check_prefill(q, kv, weights, ks, ke, block_table,
                                                            max_seqlen_k, rows)
    out = _alloc_out(out, end - start, width, q.device)
    out.fill_(_NEG_INF)
    if width == 0 or end == start:
        return out
    compressed = max_seqlen_k > 0
    ks_l = ks.long().cpu()
    ke_l = ke.long().cpu()
    if layout != "contiguous":
        values, scales = _key_source(layout, kv)
    for r0 in range(start, end, _REF_ROW_CHUNK):
        r1 = min(end, r0 + _REF_ROW_CHUNK)
        lo = ks_l[r0:r1].clamp(0, num_keys)
        hi = torch.minimum(ke_l[r0:r1], torch.tensor(num_keys)).clamp_min(0)
        nonempty = hi > lo
        if not bool(nonempty.any()):
            continue
        k_lo = int(lo[nonempty].min())
        k_hi = int(hi[nonempty].max())
        qf = q[r0:r1].float()
        wf = weights[r0:r1]
        lo_d, hi_d = lo.to(q.device), hi.to(q.device)
        for c0 in range(k_lo - k_lo % PAGE_SLOTS, k_hi, _REF_KEY_CHUNK):
            c1 = min(k_hi, c0 + _REF_KEY_CHUNK)
            if layout == "contiguous":
                k = kv[c0:c1].float()
                s = torch.ones(c1 - c0, dtype=torch.float32, device=q.device)
                valid = torch.ones(c1 - c0, dtype=torch.bool, device=q.device)
            else:
                p0, p1 = c0 // PAGE_SLOTS, _ceil_div(c1, PAGE_SLOTS)
                k, s, valid = _gather_pages(values, scales, bt[p0:p1], kv.shape[0])
                k, s, valid = k[: c1 - c0], s[: c1 - c0], valid[: c1 - c0]
            vals = _head_sum(qf, wf, k, s)                                       # [rows, c1-c0]
            pos = torch.arange(c0, c1, device=q.device)
            vis = (pos[None, :] >= lo_d[:, None]) & (pos[None, :] < hi_d[:, None]) & valid[None, :]
            vals = torch.where(vis, vals, torch.full_like(vals, _NEG_INF))
            if not compressed:
                out[r0 - start:r1 - start, c0:c1] = vals
                continue
            for i in range(r1 - r0):                  # column c of row i holds key ks[i] + c
                if not bool(nonempty[i]):
                    continue
                off = int(ks_l[r0 + i])
                a, b_ = max(c0, int(lo[i])), min(c1, int(hi[i]), off + width)
                if b_ > a:
                    out[r0 - start + i, a - off:b_ - off] = vals[i, a - c0:b_ - c0]
    return out


# --------------------------------------------------------------------------------------------------
# Public ops
# --------------------------------------------------------------------------------------------------

# Kernel scalars: NumPy-typed (a Python int would not be marshalled as int32); cached, since constructing
# a NumPy scalar costs ~0.5 us and a call passes ~10 of them.
_I32 = functools.lru_cache(maxsize=4096)(np.int32)
_I64 = functools.lru_cache(maxsize=4096)(np.int64)


def _check_aligned(**tensors):
    for name, t in tensors.items():
        if t.data_ptr() % 16:
            raise ValueError(f"{name}: expected 16-byte aligned data (the kernel reads 16-byte vectors), "
                             f"got address {t.data_ptr():#x}")


def _launch(expr, device, grid, warps, rows, args):
    runtime.launch(_SRC, expr, device, grid, (warps * 32, 1, 1), args, shared_mem=_smem_bytes(rows))


def paged_mqa_logits_plan(context_lens, next_n, *, out=None):
    """Balanced schedule of a decode batch for :func:`paged_mqa_logits`: int64 ``[B + 1]``, entry ``b`` = the
    pages (64 index entries) that requests ``< b`` compute, a request computing ``ceil(longest row / 64)``.

    context_lens: int32 ``[B]`` or ``[B, next_n]`` as for :func:`paged_mqa_logits`. Computed on the tensor's
    device by one small kernel (no host sync, capturable in a CUDA graph); ``out`` reuses a plan buffer.
    Build it once per forward batch and pass it to every layer's call: it stays valid while
    ``context_lens`` holds the same values.
    """
    if not context_lens.is_cuda:
        return paged_mqa_logits_plan_reference(context_lens, next_n, out=out)
    B, next_n = _check_plan_args(context_lens, next_n, out)
    if out is None:
        out = torch.empty(B + 1, dtype=torch.int64, device=context_lens.device)
    runtime.launch(_SRC, _PLAN_EXPR, context_lens.device, (1, 1, 1), (1024, 1, 1),
                   (context_lens.data_ptr(), _I32(1 if context_lens.dim() == 2 else 0), _I32(B), _I32(next_n),
                    out.data_ptr()))
    return out


_DECODE_GRID: dict[tuple, int] = {}


def _one_wave(expr, device, threads, smem, cap=None):
    """Grid of a balanced decode kernel: the CTAs that are resident at once on the whole device."""
    key = (device.index, expr, cap)
    grid = _DECODE_GRID.get(key)
    if grid is None:
        n_sms, _ = _device_info(device.index)
        per_sm = runtime.resident_ctas_per_sm(_SRC, expr, device.index, threads, smem)
        grid = _DECODE_GRID[key] = n_sms * (min(per_sm, cap) if cap else per_sm)
    return grid


def _decode_kernel(layout: str, q_fp8: int, next_n: int, arch: str) -> tuple[str, bool]:
    """(name expression, is the sm_90 wgmma kernel) that decode launches for this problem and arch."""
    if layout == "bf16" and next_n in _SM90_CONFIG and TUNING["sm90_wgmma"] and arch == "sm_90":
        return _sm90_expr(q_fp8, next_n), True
    kf = int(layout == "fp8")
    prefetch = 1 if (TUNING["decode_prefetch"] and layout == "bf16") else 0
    mma8 = _mma8(kf, q_fp8)
    expr = _decode_expr(kf, q_fp8, next_n, prefetch, TUNING["decode_l2_hint"], mma8)
    if expr not in _DECLARED:  # the L2-hint variants exist for the main decode shapes only
        expr = _decode_expr(kf, q_fp8, next_n, prefetch, 2, mma8)
    return expr, False


def product_instantiations(arch: str, *, q_fp8=(1,), next_ns=(1,), layouts=("bf16",)) -> list[str]:
    """The name expressions (of ``mqa_logits.cu``) that decode and paged prefill launch on ``arch`` for
    these q dtypes (1 = fp8, 0 = bf16), next_n values and cache layouts with the current TUNING: what a
    server warms up (the rest compiles on first use)."""
    ex = [_PLAN_EXPR]
    for layout in layouts:
        kf = int(layout == "fp8")
        for qf in q_fp8:
            ex += [_decode_kernel(layout, qf, nn, arch)[0] for nn in next_ns]
            ex += [_expr(kf, qf, rows, 1, rows, 0, 2, _mma8(kf, qf)) for rows in (4, 8)]  # paged prefill tiles
    return list(dict.fromkeys(ex))


def paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, max_context_len, *,
                     clean_logits=False, out=None, plan=None):
    """Decode / MTP logits against paged keys (DeepGEMM ``fp8_paged_mqa_logits`` semantics).

    q: fp8 e4m3 or bf16 ``[B, next_n, 64, 128]``, next_n 1..4. kv_cache: bf16 layout (uint8 ``[P, 16384]`` or
    bf16 ``[P, 64, 128]``) or fp8 layout (uint8 ``[P, 8448]`` or ``[P, 64, 1, 132]``). weights: fp32
    ``[B*next_n, 64]``. context_lens: int32 ``[B]`` (row ``i`` of request ``b`` sees
    ``ctx[b] - (next_n-1-i)`` keys) or ``[B, next_n]`` (per-row lengths). block_table: int32 ``[B, max_pages]``;
    entries outside ``[0, P)`` are never read and their keys are masked. plan: the batch's
    :func:`paged_mqa_logits_plan` of these ``context_lens`` (built here when None).

    The work is the pages each request's rows see, split evenly over one wave of CTAs whatever the mix of
    lengths. Returns fp32 ``[B*next_n, max_context_len]`` (row stride a multiple of 4). Columns ``< len`` are
    valid; with ``clean_logits`` every other column is -inf, otherwise they are unspecified.
    """
    if not q.is_cuda:
        return paged_mqa_logits_reference(q, kv_cache, weights, context_lens, block_table, max_context_len,
                                          clean_logits=clean_logits, out=out, plan=plan)
    layout, B, next_n, width = _check_paged(q, kv_cache, weights, context_lens, block_table, max_context_len)
    if plan is not None:
        _check_plan(plan, B, q.device)
    out = _alloc_out(out, B * next_n, width, q.device)
    if B == 0 or width == 0:
        return out
    _check_aligned(q=q, kv_cache=kv_cache)
    if plan is None:
        plan = paged_mqa_logits_plan(context_lens, next_n)
    bt_width = block_table.shape[1]
    bt_stride = _I64(block_table.stride(0) if bt_width > 0 else 0)
    lens_2d = _I32(1 if context_lens.dim() == 2 else 0)
    clean = _I32(1 if clean_logits else 0)
    qf = int(q.dtype == _FP8)
    expr, sm90 = _decode_kernel(layout, qf, next_n, runtime.device_arch(q.device.index))
    if sm90:
        smem = _sm90_smem_bytes(next_n)
        cps = TUNING["sm90_ctas_per_sm"] or _SM90_CONFIG[next_n][1]
        args = (q.data_ptr(), weights.data_ptr(), kv_cache.data_ptr(), _I64(kv_cache.shape[0]),
                block_table.data_ptr(), bt_stride, _I32(bt_width), context_lens.data_ptr(), lens_2d, _I32(width),
                out.data_ptr(), _I64(out.stride(0)), clean, plan.data_ptr(), _I32(B))
        runtime.launch(_SRC, expr, q.device, (_one_wave(expr, q.device, 128, smem, cps), 1, 1), (128, 1, 1), args,
                       shared_mem=smem)
        return out
    mode = _MODE_LENS_2D if context_lens.dim() == 2 else _MODE_CAUSAL_1D
    smem = _smem_bytes(next_n)
    args = (q.data_ptr(), weights.data_ptr(), kv_cache.data_ptr(), _I64(kv_cache.shape[0]),
            block_table.data_ptr(), bt_stride, _I32(bt_width), context_lens.data_ptr(), context_lens.data_ptr(),
            _I32(mode), _I32(0), _I32(B * next_n), _I32(width), out.data_ptr(), _I64(out.stride(0)), _I32(width),
            _I32(0), clean, plan.data_ptr(), _I32(B))
    runtime.launch(_SRC, expr, q.device, (_one_wave(expr, q.device, 128, smem), 1, 1), (128, 1, 1), args,
                   shared_mem=smem)
    return out


def mqa_logits(q, kv, weights, ks, ke, *, block_table=None, max_seqlen_k=0, clean_logits=True, rows=None,
               out=None):
    """Prefill logits of one request: row ``i`` sees key columns ``j in [ks[i], ke[i])``.

    q: fp8 e4m3 or bf16 ``[T, 64, 128]``. kv: contiguous bf16 keys ``[S, 128]``, or a paged cache (either
    layout) with ``block_table`` int32 ``[num_pages]`` / ``[1, num_pages]`` of this request (S = num_pages*64).
    weights: fp32 ``[T, 64]``; ks, ke: int32 ``[T]``.

    Returns fp32 ``[end-start, S]``, or ``[end-start, max_seqlen_k]`` when ``max_seqlen_k > 0`` (compressed:
    column ``c`` of row ``i`` holds key ``ks[i] + c``). ``rows=(start, end)`` computes query rows
    ``start..end-1`` only. ``clean_logits``: columns outside ``[ks, ke)`` are -inf (else unspecified).
    """
    if not q.is_cuda:
        return mqa_logits_reference(q, kv, weights, ks, ke, block_table=block_table, max_seqlen_k=max_seqlen_k,
                                    clean_logits=clean_logits, rows=rows, out=out)
    layout, bt, num_keys, width, start, end = _check_prefill(q, kv, weights, ks, ke, block_table,
                                                            max_seqlen_k, rows)
    out = _alloc_out(out, end - start, width, q.device)
    n_rows = end - start
    if n_rows == 0 or width == 0:
        return out
    compressed = max_seqlen_k > 0
    if compressed and clean_logits:
        out.fill_(_NEG_INF)  # the kernel writes only columns whose key it processes
    if num_keys == 0:
        if clean_logits:
            out.fill_(_NEG_INF)
        return out
    _check_aligned(q=q, kv=kv)
    kf, qf = int(layout == "fp8"), int(q.dtype == _FP8)
    paged = layout != "contiguous"
    if paged:
        kv_ptr, n_pages, bt_ptr, bt_width = kv.data_ptr(), kv.shape[0], bt.data_ptr(), bt.shape[0]
    else:
        kv_ptr, n_pages, bt_ptr, bt_width = kv.data_ptr(), 0, 0, 0
    if (not kf and TUNING["sm90_wgmma"] and n_rows >= _SM90_PREFILL_MIN_ROWS
            and runtime.device_arch(q.device.index) == "sm_90"):
        _sm90_prefill(q, kv_ptr, n_pages, bt_ptr, bt_width, weights, ks, ke, start, end, num_keys, out, width,
                      compressed, clean_logits, qf, int(paged))
        return out
    _, optin = _device_info(q.device.index)
    tile_rows = TUNING["prefill_rows"]
    if _smem_bytes(tile_rows) > optin or n_rows <= 4:
        tile_rows = 4
    warps = 8 if tile_rows == 8 else 4
    prefetch = 1 if (TUNING["prefill_prefetch"] and not paged and tile_rows == 8) else 0
    tiles = _ceil_div(num_keys, _TILE_KEYS)
    per_tile = _ceil_div(num_keys, max(_TILE_KEYS, TUNING["prefill_keys_per_cta"]))
    grid = (_ceil_div(n_rows, tile_rows), max(1, min(_ceil_div(tiles, warps), per_tile, _MAX_GRID_Y)), 1)
    expr = _expr(kf, qf, tile_rows, int(paged), warps, prefetch, 2, _mma8(kf, qf))
    args = (q.data_ptr(), weights.data_ptr(), kv_ptr, _I64(n_pages), bt_ptr, _I64(0), _I32(bt_width),
            ks.data_ptr(), ke.data_ptr(), _I32(_MODE_KS_KE), _I32(start), _I32(end), _I32(num_keys),
            out.data_ptr(), _I64(out.stride(0)), _I32(width), _I32(1 if compressed else 0),
            _I32(1 if (clean_logits and not compressed) else 0))
    _launch(expr, q.device, grid, warps, tile_rows, args)
    return out


def _sm90_prefill(q, kv_ptr, n_pages, bt_ptr, bt_width, weights, ks, ke, start, end, num_keys, out, width,
                  compressed, clean_logits, qf, paged):
    """Launch the sm_90 wgmma prefill kernel: one CTA per 4-row tile, the tile's key blocks cut into parts so
    that short prompts still fill a few waves."""
    n_sms, _ = _device_info(q.device.index)
    tiles = _ceil_div(end - start, _SM90_PREFILL_ROWS)
    blocks = _ceil_div(num_keys, PAGE_SLOTS)
    parts = TUNING["sm90_prefill_parts"] or max(1, min(_ceil_div(3 * n_sms, tiles), _ceil_div(blocks, 16)))
    parts = min(parts, _MAX_GRID_Y)
    config = TUNING["sm90_prefill"] or _SM90_PREFILL_CONFIG
    expr = _sm90_prefill_expr(qf, paged, config)
    args = (q.data_ptr(), weights.data_ptr(), kv_ptr, _I64(n_pages), bt_ptr, _I32(bt_width), ks.data_ptr(),
            ke.data_ptr(), _I32(start), _I32(end), _I32(num_keys), out.data_ptr(), _I64(out.stride(0)),
            _I32(width), _I32(1 if compressed else 0), _I32(1 if (clean_logits and not compressed) else 0))
    runtime.launch(_SRC, expr, q.device, (tiles, parts, 1), (128 * config[2], 1, 1), args,
                   shared_mem=_sm90_prefill_smem_bytes(config))
