"""Indexer logits: ``logits[r, n] = sum_{h<64} relu(q[r,h,:] . k[n,:]) * w[r,h]`` (fp32 accumulate).

Two entry points, both dispatching CPU tensors to the torch reference (the CPU backend and the test oracle)
and CUDA tensors to the kernels of ``kernels/mqa_logits.cu`` (``mma.sync`` templates everywhere; on sm_90 the
wgmma decode and prefill kernels of ``kernels/mqa_logits_sm90.cuh`` for bf16 keys):

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

import torch

from . import runtime
from .contracts import check_aligned, check_bool, check_contiguous, check_device, check_dtype, check_int
# Launch specs and per-arch config selection (re-exported: the bench and tests force configs through them)
from .heuristics import (DECODE, DECODE_KERNEL, PLAN, PLAN_KERNEL, PREFILL, PREFILL_KERNEL, QREG_PREFILL_KERNEL,
                         QREG_PREFILL_ROWS, SM90_DECODE_KERNEL, SM90_PREFILL_KERNEL, VARLEN_PLAN, VARLEN_PLAN_KERNEL,
                         _SM90_PREFILL_ROWS, _VARLEN_TILE_ROWS, product_instantiations)
from .layouts import (HEAD_DIM, N_HEADS, PAGE_SLOTS, bf16_view, fp8_views,
                      layout_of)

_FP8 = torch.float8_e4m3fn
_Q_DTYPES = (_FP8, torch.bfloat16)
_NEG_INF = float("-inf")

# Kernel range modes (must match kernels/mqa_logits.cu).
_MODE_CAUSAL_1D, _MODE_LENS_2D, _MODE_KS_KE = 0, 1, 2
_TILE_KEYS = 32         # keys per warp tile in the kernel
_MAX_GRID_Y = 65535
MAX_NEXT_N = 4          # query rows per request of the decode kernels (MTP draft tokens + 1)

def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@functools.lru_cache(maxsize=None)
def device_info(index: int) -> tuple[int, int]:
    props = torch.cuda.get_device_properties(index)
    optin = getattr(props, "shared_memory_per_block_optin", 0) or 48 * 1024
    return props.multi_processor_count, optin


# --------------------------------------------------------------------------------------------------
# Validation (host metadata only)
# --------------------------------------------------------------------------------------------------

def _check_kv_cache(kv_cache, device):
    if not isinstance(kv_cache, torch.Tensor):
        raise TypeError(f"kv_cache: expected a torch.Tensor, got {type(kv_cache).__name__}")
    layout = layout_of(kv_cache)  # ValueError naming kv_cache
    check_device("kv_cache", kv_cache, device, "q")
    check_contiguous("kv_cache", kv_cache)
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


def check_paged(q, kv_cache, weights, context_lens, block_table, max_context_len):
    check_dtype("q", q, _Q_DTYPES)
    if q.dim() != 4 or q.shape[2] != N_HEADS or q.shape[3] != HEAD_DIM or not 1 <= q.shape[1] <= MAX_NEXT_N:
        raise ValueError(f"q: expected shape [B, next_n, {N_HEADS}, {HEAD_DIM}] with next_n an int in "
                         f"[1, {MAX_NEXT_N}], got {tuple(q.shape)}")
    check_contiguous("q", q)
    device = q.device
    B, next_n = q.shape[0], q.shape[1]
    layout = _check_kv_cache(kv_cache, device)
    check_dtype("weights", weights, (torch.float32,))
    if tuple(weights.shape) != (B * next_n, N_HEADS):
        raise ValueError(f"weights: expected shape {(B * next_n, N_HEADS)}, got {tuple(weights.shape)}")
    check_device("weights", weights, device, "q")
    check_contiguous("weights", weights)
    _check_context_lens(context_lens, B, next_n, device)
    check_dtype("block_table", block_table, (torch.int32,))
    if block_table.dim() != 2 or block_table.shape[0] != B:
        raise ValueError(f"block_table: expected shape [{B}, max_pages], got {tuple(block_table.shape)}")
    if block_table.shape[1] > 0 and block_table.stride(1) != 1:
        raise ValueError(f"block_table: expected stride(1) == 1, got strides {block_table.stride()}")
    check_device("block_table", block_table, device, "q")
    max_context_len = check_int("max_context_len", max_context_len)
    return layout, B, next_n, max_context_len


def _check_context_lens(context_lens, B, next_n, device=None):
    check_dtype("context_lens", context_lens, (torch.int32,))
    if tuple(context_lens.shape) not in ((B,), (B, next_n)):
        raise ValueError(f"context_lens: expected shape ({B},) or ({B}, {next_n}), got {tuple(context_lens.shape)}")
    if device is not None:
        check_device("context_lens", context_lens, device, "q")
    check_contiguous("context_lens", context_lens)


# A plan records, on the host at build time, the call it was made for; the op compares (no device read).
_MADE_FOR = "_cupy_dsa_made_for"


def _made_for(plan: torch.Tensor, what) -> torch.Tensor:
    setattr(plan, _MADE_FOR, what)
    return plan


def _check_plan(plan, B, device, like="q"):
    if not isinstance(plan, torch.Tensor):
        raise TypeError(f"plan: expected the torch.Tensor of paged_mqa_logits_plan, got {type(plan).__name__}")
    if plan.dtype != torch.int64 or tuple(plan.shape) != (B + 1,):
        raise ValueError(f"plan: expected int64 shape ({B + 1},) from paged_mqa_logits_plan(context_lens, next_n), "
                         f"got {plan.dtype} {tuple(plan.shape)}")
    check_device("plan", plan, device, like)
    check_contiguous("plan", plan)


def _check_plan_next_n(plan, next_n):
    made = getattr(plan, _MADE_FOR, next_n)
    if made != next_n:
        raise ValueError(f"plan: made by paged_mqa_logits_plan(context_lens, next_n={made}), this call has "
                         f"next_n {next_n} (q.shape[1]): build the plan with the call's next_n")


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
    return _made_for(out, next_n)


def _check_plan_args(context_lens, next_n, out):
    next_n = check_int("next_n", next_n, 1, MAX_NEXT_N)
    check_dtype("context_lens", context_lens, (torch.int32,))
    if context_lens.dim() == 0:
        raise ValueError(f"context_lens: expected shape [B] or [B, {next_n}], got a 0-d tensor")
    B = context_lens.shape[0]
    _check_context_lens(context_lens, B, next_n)
    if out is not None:
        _check_plan(out, B, context_lens.device, "context_lens")
    return B, next_n


def check_prefill(q, kv, weights, ks, ke, block_table, max_seqlen_k, rows, cu_rows=None):
    """Host checks of a prefill call; returns (layout, block table, num_keys, width, start, end, cu_rows): the
    block table is 1-D for one request, 2-D [batch, max_pages] with ``cu_rows`` (varlen)."""
    check_dtype("q", q, _Q_DTYPES)
    if q.dim() != 3 or q.shape[1] != N_HEADS or q.shape[2] != HEAD_DIM:
        raise ValueError(f"q: expected shape [T, {N_HEADS}, {HEAD_DIM}], got {tuple(q.shape)}")
    check_contiguous("q", q)
    device = q.device
    T = q.shape[0]
    if not isinstance(kv, torch.Tensor):
        raise TypeError(f"kv: expected a torch.Tensor, got {type(kv).__name__}")
    if block_table is None:
        if cu_rows is not None:
            raise ValueError("cu_rows: several requests need a paged cache and its block_table [batch, max_pages]")
        if kv.dtype != torch.bfloat16:
            raise TypeError(f"kv: expected contiguous bfloat16 keys [S, {HEAD_DIM}] (or a paged cache with "
                            f"block_table=), got dtype {kv.dtype}")
        if kv.dim() != 2 or kv.shape[1] != HEAD_DIM:
            raise ValueError(f"kv: expected shape [S, {HEAD_DIM}], got {tuple(kv.shape)}")
        check_device("kv", kv, device, "q")
        check_contiguous("kv", kv)
        layout, num_keys, bt = "contiguous", kv.shape[0], None
    else:
        try:
            layout = layout_of(kv)
        except ValueError as e:
            raise ValueError(str(e).replace("kv_cache:", "kv (paged cache):")) from None
        check_device("kv", kv, device, "q")
        check_contiguous("kv", kv)
        check_dtype("block_table", block_table, (torch.int32,))
        if cu_rows is not None:
            cu_rows = _check_cu_rows(cu_rows, T, device)
            B = cu_rows.shape[0] - 1
            if block_table.dim() != 2 or block_table.shape[0] < B:
                raise ValueError(f"block_table: expected shape [{B}, max_pages] (one row per request of cu_rows), "
                                 f"got {tuple(block_table.shape)}")
            bt = block_table
            if bt.shape[1] > 0 and bt.stride(1) != 1:
                raise ValueError(f"block_table: expected stride(1) == 1, got strides {block_table.stride()}")
            num_keys = bt.shape[1] * PAGE_SLOTS
        else:
            if block_table.dim() == 2 and block_table.shape[0] == 1:
                bt = block_table[0]
            elif block_table.dim() == 1:
                bt = block_table
            else:
                raise ValueError(f"block_table: expected shape [num_pages] or [1, num_pages] (one request; several "
                                 f"requests take cu_rows=), got {tuple(block_table.shape)}")
            if bt.shape[0] > 0 and bt.stride(0) != 1:
                raise ValueError(f"block_table: expected unit stride along pages, got strides {block_table.stride()}")
            num_keys = bt.shape[0] * PAGE_SLOTS
        check_device("block_table", block_table, device, "q")
    check_dtype("weights", weights, (torch.float32,))
    if tuple(weights.shape) != (T, N_HEADS):
        raise ValueError(f"weights: expected shape {(T, N_HEADS)}, got {tuple(weights.shape)}")
    check_device("weights", weights, device, "q")
    check_contiguous("weights", weights)
    for name, t in (("ks", ks), ("ke", ke)):
        check_dtype(name, t, (torch.int32,))
        if tuple(t.shape) != (T,):
            raise ValueError(f"{name}: expected shape ({T},), got {tuple(t.shape)}")
        check_device(name, t, device, "q")
        check_contiguous(name, t)
    max_seqlen_k = check_int("max_seqlen_k", max_seqlen_k)
    start, end = _check_rows(rows, T)
    width = max_seqlen_k if max_seqlen_k > 0 else num_keys
    return layout, bt, num_keys, width, start, end, cu_rows


def _check_rows(rows, T):
    if rows is None:
        return 0, T
    try:
        start, end = (int(v) for v in rows)
    except (TypeError, ValueError):
        raise TypeError(f"rows: expected a (start, end) pair of ints, got {rows!r}") from None
    if not 0 <= start <= end <= T:
        raise ValueError(f"rows: expected 0 <= start <= end <= {T}, got {rows!r}")
    return start, end


def _check_cu_rows(cu_rows, T, device):
    """cu_rows: int32 [batch + 1] row offsets (request b owns rows [cu_rows[b], cu_rows[b + 1])). Values are
    checked when they are on the host (a CPU tensor for a CUDA call is then copied to q's device); a device
    tensor is taken as it is (a check would sync) and the kernels clip every request to the launch's rows."""
    _check_plan_cu_rows(cu_rows)
    if cu_rows.device.type == "cpu":
        v = cu_rows.to(torch.int64)
        if cu_rows.shape[0] > 1 and bool((v[1:] < v[:-1]).any()):
            raise ValueError(f"cu_rows: expected non-decreasing row offsets, got {cu_rows.tolist()[:16]}")
        if int(v[0]) < 0 or int(v[-1]) > T:
            raise ValueError(f"cu_rows: expected offsets within [0, {T}] (the rows of q), got first {int(v[0])}, "
                             f"last {int(v[-1])}")
        if device.type == "cuda":
            if torch.cuda.is_current_stream_capturing():
                raise ValueError("cu_rows: a host tensor cannot be copied during CUDA-graph capture; pass it on "
                                 "q's device")
            cu_rows = cu_rows.to(device)
    else:
        check_device("cu_rows", cu_rows, device, "q")
    return cu_rows


# --------------------------------------------------------------------------------------------------
# References (torch, any device, fp32 math, bounded memory)
# --------------------------------------------------------------------------------------------------

_REF_KEY_CHUNK = 4096
REF_ROW_CHUNK = 64


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
    clean_logits = check_bool("clean_logits", clean_logits)
    layout, B, next_n, width = check_paged(q, kv_cache, weights, context_lens, block_table, max_context_len)
    if plan is not None:
        _check_plan(plan, B, q.device)
        _check_plan_next_n(plan, next_n)
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


def mqa_logits_reference(q, kv, weights, ks, ke, *, block_table=None, cu_rows=None, plan=None, max_seqlen_k=0,
                         clean_logits=True, rows=None, out=None):
    """Torch reference of :func:`mqa_logits` (any device; writes -inf to every masked column, and to the rows
    of no request of ``cu_rows``; a ``plan`` is checked, not needed)."""
    clean_logits = check_bool("clean_logits", clean_logits)
    layout, bt, num_keys, width, start, end, cu_rows = check_prefill(q, kv, weights, ks, ke, block_table,
                                                                      max_seqlen_k, rows, cu_rows)
    if plan is not None:
        _check_varlen_plan(plan, cu_rows, q.device)
        _check_plan_rows(plan, rows, start, end)
    out = _alloc_out(out, end - start, width, q.device)
    out.fill_(_NEG_INF)
    if width == 0 or end == start:
        return out
    compressed = max_seqlen_k > 0
    ks_l = ks.long().cpu()
    ke_l = ke.long().cpu()
    if layout != "contiguous":
        values, scales = _key_source(layout, kv)

    def fill(bt, lo_row, hi_row):
        """Rows [lo_row, hi_row) of one request (block table ``bt``) into out."""
        for r0 in range(lo_row, hi_row, REF_ROW_CHUNK):
            r1 = min(hi_row, r0 + REF_ROW_CHUNK)
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

    if cu_rows is None:
        fill(bt, start, end)
        return out
    offsets = cu_rows.tolist()
    for b in range(len(offsets) - 1):
        lo_row, hi_row = max(offsets[b], start), min(offsets[b + 1], end)
        if hi_row > lo_row:
            fill(bt[b], lo_row, hi_row)
    return out


# --------------------------------------------------------------------------------------------------
# Public ops
# --------------------------------------------------------------------------------------------------

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
    cfg = PLAN.select((), runtime.device_arch(context_lens.device.index))
    cfg.launch(context_lens.device, (1, 1, 1), lens=context_lens, lens_2d=int(context_lens.dim() == 2), batch=B,
               next_n=next_n, plan=out)
    return _made_for(out, next_n)


_DECODE_GRID: dict[tuple, int] = {}


def _one_wave(cfg, device) -> int:
    """Grid of a balanced decode kernel: the CTAs that are resident at once on the whole device (at most the
    config's ``ctas_per_sm`` per SM, where it has one)."""
    key = (device.index, cfg)
    grid = _DECODE_GRID.get(key)
    if grid is None:
        n_sms, _ = device_info(device.index)
        per_sm = cfg.resident_ctas_per_sm(device.index)
        cap = cfg.values.get("ctas_per_sm", 0)
        grid = _DECODE_GRID[key] = n_sms * (min(per_sm, cap) if cap else per_sm)
    return grid


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
    clean_logits = check_bool("clean_logits", clean_logits)
    if not q.is_cuda:
        return paged_mqa_logits_reference(q, kv_cache, weights, context_lens, block_table, max_context_len,
                                          clean_logits=clean_logits, out=out, plan=plan)
    layout, B, next_n, width = check_paged(q, kv_cache, weights, context_lens, block_table, max_context_len)
    if plan is not None:
        _check_plan(plan, B, q.device)
        _check_plan_next_n(plan, next_n)
    out = _alloc_out(out, B * next_n, width, q.device)
    if B == 0 or width == 0:
        return out
    check_aligned("q", q)
    check_aligned("kv_cache", kv_cache)
    if plan is None:
        plan = paged_mqa_logits_plan(context_lens, next_n)
    bt_width = block_table.shape[1]
    bt_stride = block_table.stride(0) if bt_width > 0 else 0
    lens_2d = int(context_lens.dim() == 2)
    cfg = DECODE.select((layout, int(q.dtype == _FP8), next_n), runtime.device_arch(q.device.index))
    grid = (_one_wave(cfg, q.device), 1, 1)
    if cfg.kernel is SM90_DECODE_KERNEL:
        cfg.launch(q.device, grid, q=q, weights=weights, kv=kv_cache, kv_pages=kv_cache.shape[0],
                   block_table=block_table, bt_stride=bt_stride, bt_width=bt_width, lens=context_lens,
                   lens_2d=lens_2d, width=width, out=out, out_stride=out.stride(0), clean=int(clean_logits),
                   plan=plan, batch=B)
    else:
        cfg.launch(q.device, grid, q=q, weights=weights, kv=kv_cache, kv_pages=kv_cache.shape[0],
                   block_table=block_table, bt_tile_stride=bt_stride, bt_width=bt_width, lens0=context_lens,
                   lens1=context_lens, mode=_MODE_LENS_2D if lens_2d else _MODE_CAUSAL_1D, row_start=0,
                   row_end=B * next_n, num_keys=width, out=out, out_stride=out.stride(0), width=width, compressed=0,
                   clean=int(clean_logits), plan=plan, batch=B)
    return out


def mqa_logits_plan(cu_rows, *, rows=None, out=None):
    """The tile plan of a varlen :func:`mqa_logits` call: int64 ``[batch + 1]``, entry ``b`` = the 4-row tiles of
    the requests before ``b``, request ``b`` owning rows ``[cu_rows[b], cu_rows[b + 1])`` clipped to ``rows``.

    cu_rows: int32 ``[batch + 1]`` on the device of the call. One small kernel (no host sync, capturable); build
    it once per forward (and row chunk: pass the chunk's ``rows``, the same as the logits call's) and reuse it
    for every layer. ``out`` reuses a plan buffer.
    """
    start, end = (0, 2**31 - 1) if rows is None else _check_rows(rows, 2**31 - 1)
    _check_plan_cu_rows(cu_rows)
    if not cu_rows.is_cuda:  # host offsets: refused as mqa_logits refuses them (device ones are not read)
        _check_cu_rows(cu_rows, 2**31 - 1, cu_rows.device)
    B = cu_rows.shape[0] - 1
    if out is not None:
        _check_varlen_plan(out, cu_rows, cu_rows.device)
    if not cu_rows.is_cuda:
        return mqa_logits_plan_reference(cu_rows, rows=rows, out=out)
    if out is None:
        out = torch.empty(B + 1, dtype=torch.int64, device=cu_rows.device)
    cfg = VARLEN_PLAN.select((), runtime.device_arch(cu_rows.device.index))
    cfg.launch(cu_rows.device, (1, 1, 1), cu_rows=cu_rows, batch=B, row_start=start, row_end=end, plan=out)
    return _made_for(out, None if rows is None else (start, end))


def mqa_logits_plan_reference(cu_rows, *, rows=None, out=None):
    """Torch reference of :func:`mqa_logits_plan` (any device)."""
    start, end = (0, 2**31 - 1) if rows is None else _check_rows(rows, 2**31 - 1)
    _check_plan_cu_rows(cu_rows)
    v = cu_rows.to(torch.int64)
    lo = v[:-1].clamp_min(start)
    hi = torch.maximum(lo, v[1:].clamp_max(end))
    tiles = (hi - lo + _VARLEN_TILE_ROWS - 1) // _VARLEN_TILE_ROWS
    if out is None:
        out = torch.empty(cu_rows.shape[0], dtype=torch.int64, device=cu_rows.device)
    out[0] = 0
    torch.cumsum(tiles, 0, out=out[1:])
    return _made_for(out, None if rows is None else (start, end))


def _check_plan_cu_rows(cu_rows):
    """The host-metadata contract of cu_rows (type, dtype, shape, contiguity), shared by the plan and the op."""
    if not isinstance(cu_rows, torch.Tensor):
        raise TypeError(f"cu_rows: expected an int32 torch.Tensor [batch + 1], got {type(cu_rows).__name__}")
    check_dtype("cu_rows", cu_rows, (torch.int32,))
    if cu_rows.dim() != 1 or cu_rows.shape[0] < 1:
        raise ValueError(f"cu_rows: expected shape [batch + 1] (row offsets, batch >= 0), got {tuple(cu_rows.shape)}")
    check_contiguous("cu_rows", cu_rows)


def _check_plan_rows(plan, rows, start, end):
    """A varlen plan counts the tiles of the rows it was made for: every row (``rows=None``) or one chunk."""
    if not hasattr(plan, _MADE_FOR):
        return
    made = getattr(plan, _MADE_FOR)
    call = None if rows is None else (start, end)
    if made != call:
        raise ValueError(f"plan: made by mqa_logits_plan(cu_rows, rows={made}), this call has rows={call}: "
                         "build the plan with the call's rows")


def _check_varlen_plan(plan, cu_rows, device):
    if cu_rows is None:
        raise ValueError("plan: a plan (mqa_logits_plan) goes with cu_rows= (several requests)")
    B = cu_rows.shape[0] - 1
    if not isinstance(plan, torch.Tensor):
        raise TypeError(f"plan: expected the torch.Tensor of mqa_logits_plan, got {type(plan).__name__}")
    if plan.dtype != torch.int64 or tuple(plan.shape) != (B + 1,):
        raise ValueError(f"plan: expected int64 shape ({B + 1},) from mqa_logits_plan(cu_rows, rows=...), "
                         f"got {plan.dtype} {tuple(plan.shape)}")
    check_device("plan", plan, device, "q")
    check_contiguous("plan", plan)


def mqa_logits(q, kv, weights, ks, ke, *, block_table=None, cu_rows=None, plan=None, max_seqlen_k=0,
               clean_logits=True, rows=None, out=None):
    """Prefill logits: row ``i`` sees key columns ``j in [ks[i], ke[i])`` of its request's keys.

    q: fp8 e4m3 or bf16 ``[T, 64, 128]``. weights: fp32 ``[T, 64]``; ks, ke: int32 ``[T]``.
    One request: kv is contiguous bf16 keys ``[S, 128]``, or a paged cache (either layout) with ``block_table``
    int32 ``[num_pages]`` / ``[1, num_pages]`` (S = num_pages*64).
    Several requests in one launch (varlen, a multi-request extend): kv is a paged cache, ``cu_rows`` int32
    ``[batch + 1]`` gives request ``b`` the rows ``[cu_rows[b], cu_rows[b + 1])`` (non-decreasing, within
    ``[0, T]``), ``block_table`` int32 ``[batch, max_pages]`` holds its pages (S = max_pages*64, key ``j`` of
    row ``i`` is key ``j`` of its request). Row tiles never hold two requests' rows. ``plan``: the call's
    :func:`mqa_logits_plan` (built here when None; build it once per forward and reuse it across layers).
    Rows of no request are not written.

    Returns fp32 ``[end-start, S]``, or ``[end-start, max_seqlen_k]`` when ``max_seqlen_k > 0`` (compressed:
    column ``c`` of row ``i`` holds key ``ks[i] + c``). ``rows=(start, end)`` computes query rows
    ``start..end-1`` only (a row chunk). ``clean_logits``: columns outside ``[ks, ke)`` are -inf (else
    unspecified). No host sync (a CPU ``cu_rows`` is checked on the host and copied, outside graph capture).
    """
    clean_logits = check_bool("clean_logits", clean_logits)
    if not q.is_cuda:
        return mqa_logits_reference(q, kv, weights, ks, ke, block_table=block_table, cu_rows=cu_rows, plan=plan,
                                    max_seqlen_k=max_seqlen_k, clean_logits=clean_logits, rows=rows, out=out)
    layout, bt, num_keys, width, start, end, cu_rows = check_prefill(q, kv, weights, ks, ke, block_table,
                                                                      max_seqlen_k, rows, cu_rows)
    varlen = cu_rows is not None
    if plan is not None:
        _check_varlen_plan(plan, cu_rows, q.device)
        _check_plan_rows(plan, rows, start, end)
    out = _alloc_out(out, end - start, width, q.device)
    n_rows = end - start
    batch = cu_rows.shape[0] - 1 if varlen else 1
    if n_rows == 0 or width == 0 or batch == 0:
        return out
    compressed = max_seqlen_k > 0
    if compressed and clean_logits:
        out.fill_(_NEG_INF)  # the kernel writes only columns whose key it processes
    if num_keys == 0:
        if clean_logits:
            out.fill_(_NEG_INF)
        return out
    check_aligned("q", q)
    check_aligned("kv", kv)
    problem = (layout, int(q.dtype == _FP8), int(varlen))
    arch = runtime.device_arch(q.device.index)
    cfg = PREFILL.select(problem, arch)
    n_sms, optin = device_info(q.device.index)
    if cfg.smem > optin:
        raise ValueError(f"mqa_logits: {cfg} needs {cfg.smem} B of shared memory, the device has {optin} B")
    paged = layout != "contiguous"
    bt_stride = bt.stride(0) if (varlen and bt.shape[1] > 0) else 0
    bt_width = (bt.shape[1] if varlen else bt.shape[0]) if paged else 0
    if varlen and plan is None:
        plan = mqa_logits_plan(cu_rows, rows=(start, end))
    varlen_args = dict(tile_plan=plan if varlen else None, cu_rows=cu_rows, batch=batch if varlen else 0)
    # row tiles: a request adds at most one partial tile (the grid is an upper bound; extra CTAs exit)
    tiles = _ceil_div(n_rows, _VARLEN_TILE_ROWS) + (batch if varlen else 0)
    if cfg.kernel is SM90_PREFILL_KERNEL:
        # one CTA per 4-row tile and part of its key blocks; parts fill a few waves when the rows are few
        if not varlen:
            tiles = _ceil_div(n_rows, _SM90_PREFILL_ROWS)
        parts = cfg.parts or max(1, min(_ceil_div(3 * n_sms, tiles), _ceil_div(num_keys, 16 * PAGE_SLOTS)))
        cfg.launch(q.device, (tiles, min(parts, _MAX_GRID_Y), 1), q=q, weights=weights, kv=kv,
                   kv_pages=kv.shape[0] if paged else 0, block_table=bt if paged else None, bt_stride=bt_stride,
                   bt_width=bt_width, ks=ks, ke=ke, row_start=start, row_end=end, num_keys=num_keys, out=out,
                   out_stride=out.stride(0), width=width, compressed=int(compressed),
                   clean=int(clean_logits and not compressed), **varlen_args)
        return out
    if cfg.kernel is QREG_PREFILL_KERNEL:
        # persistent: one wave of CTAs walking (part, row tile) items of keys_per_item keys
        tiles = _ceil_div(n_rows, QREG_PREFILL_ROWS)
        chunks_per_item = max(1, cfg.keys_per_item // PAGE_SLOTS)
        items = tiles * _ceil_div(num_keys, chunks_per_item * PAGE_SLOTS)
        if items >= 2**31:
            raise ValueError(f"mqa_logits: {n_rows} rows x {num_keys} keys is {items} work items of "
                             f"{cfg.keys_per_item} keys, more than 2^31 - 1: pass rows= chunks")
        cfg.launch(q.device, (min(_one_wave(cfg, q.device), items), 1, 1), q=q, weights=weights, kv=kv,
                   kv_pages=kv.shape[0] if paged else 0, block_table=bt if paged else None, bt_tile_stride=0,
                   bt_width=bt_width, lens0=ks, lens1=ke, mode=_MODE_KS_KE, row_start=start, row_end=end,
                   num_keys=num_keys, out=out, out_stride=out.stride(0), width=width, compressed=int(compressed),
                   clean=int(clean_logits and not compressed), tiles=tiles, chunks_per_item=chunks_per_item)
        return out
    warps = cfg.block[0] // 32
    if not varlen:
        tiles = _ceil_div(n_rows, cfg.Rows)
    key_tiles = _ceil_div(num_keys, _TILE_KEYS)
    per_tile = _ceil_div(num_keys, max(_TILE_KEYS, cfg.keys_per_cta))
    grid = (tiles, max(1, min(_ceil_div(key_tiles, warps), per_tile, _MAX_GRID_Y)), 1)
    cfg.launch(q.device, grid, q=q, weights=weights, kv=kv, kv_pages=kv.shape[0] if paged else 0,
               block_table=bt if paged else None, bt_tile_stride=bt_stride, bt_width=bt_width, lens0=ks,
               lens1=ke, mode=_MODE_KS_KE, row_start=start, row_end=end, num_keys=num_keys, out=out,
               out_stride=out.stride(0), width=width, compressed=int(compressed),
               clean=int(clean_logits and not compressed), **varlen_args)
    return out
