"""Indexer query prep: SGLang's ``wq_b`` output -> RoPE -> Hadamard -> (fp4sim bf16 | fp8) + folded weights.

``q`` bf16 ``[T, 64, 128]``: RoPE on the trailing 64 dims (interleaved pairs ``(64+2j, 65+2j)``, table row
``positions[t]`` of the fp32 ``freqs_cis [max_pos, 64]`` the store takes), Hadamard-128 (natural-order
Sylvester, scale ``128^-0.5``), all fp32; then

* ``numerics="fp4sim"`` (DeepSeek-V4's reference): e2m1 with a power-of-two scale per 32 elements, bf16
  ``[T, 64, 128]`` out (a block of 32 that holds a NaN or an infinity comes out NaN);
  ``weights_out = float(w) * weight_scale``;
* ``numerics="fp8"`` (SGLang's ``fused_q_indexer_rope_hadamard_quant``): per (token, head)
  ``scale = max(amax, 1e-4) / 448``, ``float8_e4m3fn [T, 64, 128]`` out (RNE, saturating, of
  ``x * (1/scale)``); ``weights_out = (float(w) * weight_scale) * scale``.

* ``numerics="bf16"`` (fp8-rescore's stage-2 query): the rotated fp32 q rounded to bf16 once, ``[T, 64, 128]``;
  ``weights_out = float(w) * weight_scale`` (the fp8 numerics' weights without its q scale).

``weights_out`` is float32 ``[T, 64]``. Both outputs feed :func:`cupy_dsa.mqa_logits` as they are and
:func:`cupy_dsa.paged_mqa_logits` as ``q_out.view(B, next_n, 64, 128)`` / ``weights_out`` ``[B*next_n, 64]``.
SGLang and the V4 reference pass ``weight_scale = 128^-0.5 * 64^-0.5``.

One warp per (token, head) row (``kernels/prepare_index_q.cu``), sharing the key store's RoPE, Hadamard
and fp4 helpers; the torch reference below uses the store's reference stages, so kernel and reference
agree to the bit. CPU tensors run the reference; CUDA tensors launch on torch's current stream.
A CUDA token whose position lies outside ``[0, max_pos)`` gets NaN head weights (no host sync to check it).
"""

from __future__ import annotations

import torch

from . import launch, runtime
from .contracts import check_aligned, check_contiguous, check_device, check_dtype, check_shape
from .launch import F32, I32, I64, PTR
from .layouts import HEAD_DIM
from .store import (HADAMARD_SCALE, _fp4sim, _hadamard128, check_positions_in_table, check_rope_table,
                    fp8_quantize_reference, rope_reference)

INDEX_HEADS = 64
_NUMERICS_ID = {"fp4sim": 0, "fp8": 1, "bf16": 2}
_OUT_DTYPE = {"fp4sim": torch.bfloat16, "fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16}
_W_TYPE = {torch.bfloat16: "__nv_bfloat16", torch.float32: "float"}
WARPS_PER_BLOCK = 8

PREPARE_Q_KERNEL = launch.Kernel(
    "prepare_index_q.cu", "prepare_index_q", params=("Numerics", "TW"),
    args=(("q", PTR), ("weights", PTR), ("freqs", PTR), ("positions", PTR), ("q_out", PTR), ("weights_out", PTR),
          ("n_rows", I64), ("max_pos", I64), ("weight_scale", F32), ("pos64", I32)),
    threads=lambda cfg: 32 * WARPS_PER_BLOCK, render=lambda param, v: _W_TYPE[v] if param == "TW" else str(v))

# A problem: (numerics, weights dtype).
PREPARE_Q = launch.register(launch.Family(
    "prepare_index_q", problems=[(num, wd) for num in _NUMERICS_ID for wd in _W_TYPE],
    select=lambda p, arch: PREPARE_Q_KERNEL.config(Numerics=_NUMERICS_ID[p[0]], TW=p[1]),
    serves=lambda cfg, p: cfg == PREPARE_Q.select(p, None)))


def product_instantiations(*, numerics=("fp4sim",), weight_dtypes=(torch.bfloat16,)) -> list[str]:
    """Name expressions of the query prep for the given options (what one server launches)."""
    return [PREPARE_Q.select(p, None).expr for p in PREPARE_Q.problems if p[0] in numerics and p[1] in weight_dtypes]


def _check(q, weights, freqs_cis, positions, weight_scale, numerics, out):
    check_dtype("q", q, (torch.bfloat16,))
    check_shape("q", q, f"[T, {INDEX_HEADS}, {HEAD_DIM}]",
                q.dim() == 3 and tuple(q.shape[1:]) == (INDEX_HEADS, HEAD_DIM))
    check_contiguous("q", q)
    check_aligned("q", q, 8)
    t, dev = q.shape[0], q.device
    if numerics not in _NUMERICS_ID:
        raise ValueError(f"numerics: expected one of {tuple(_NUMERICS_ID)}, got {numerics!r}")
    if isinstance(weight_scale, bool) or not isinstance(weight_scale, (int, float)):
        raise TypeError(f"weight_scale: expected a float, got {type(weight_scale).__name__}")
    if not 0 < weight_scale < float("inf"):
        raise ValueError(f"weight_scale: expected a finite float > 0 (SGLang passes 128^-0.5 * 64^-0.5), "
                         f"got {weight_scale!r}")
    check_dtype("weights", weights, tuple(_W_TYPE))
    check_shape("weights", weights, f"[{t}, {INDEX_HEADS}] (T of q)", tuple(weights.shape) == (t, INDEX_HEADS))
    check_contiguous("weights", weights)
    check_device("weights", weights, dev, "q")
    check_rope_table(freqs_cis, dev, "q")
    check_dtype("positions", positions, (torch.int32, torch.int64))
    check_shape("positions", positions, f"[{t}] (T of q)", tuple(positions.shape) == (t,))
    check_contiguous("positions", positions)
    check_device("positions", positions, dev, "q")
    if out is not None:
        if not isinstance(out, tuple) or len(out) != 2:
            raise TypeError("out: expected a (q_out, weights_out) tuple")
        q_out, w_out = out
        check_dtype("out[0]", q_out, (_OUT_DTYPE[numerics],))
        check_shape("out[0]", q_out, f"[{t}, {INDEX_HEADS}, {HEAD_DIM}]", tuple(q_out.shape) == tuple(q.shape))
        check_contiguous("out[0]", q_out)
        check_device("out[0]", q_out, dev, "q")
        check_aligned("out[0]", q_out, 8)
        check_dtype("out[1]", w_out, (torch.float32,))
        check_shape("out[1]", w_out, f"[{t}, {INDEX_HEADS}]", tuple(w_out.shape) == (t, INDEX_HEADS))
        check_contiguous("out[1]", w_out)
        check_device("out[1]", w_out, dev, "q")


def prepare_index_q(q, weights, *, freqs_cis, positions, weight_scale, numerics="fp4sim", out=None):
    """Indexer query and head weights from SGLang's ``wq_b`` / ``weights_proj`` outputs (module docstring).
    Returns ``(q_out, weights_out)``; ``out=(q_out, weights_out)`` writes into given tensors instead."""
    _check(q, weights, freqs_cis, positions, weight_scale, numerics, out)
    if not q.is_cuda:
        check_positions_in_table(positions, freqs_cis)
        ref_q, ref_w = prepare_index_q_reference(q, weights, freqs_cis=freqs_cis, positions=positions,
                                                 weight_scale=weight_scale, numerics=numerics)
        if out is None:
            return ref_q, ref_w
        out[0].copy_(ref_q)
        out[1].copy_(ref_w)
        return out
    if out is None:
        out = (torch.empty(q.shape, dtype=_OUT_DTYPE[numerics], device=q.device),
               torch.empty(weights.shape, dtype=torch.float32, device=q.device))
    n_rows = q.shape[0] * INDEX_HEADS
    if n_rows:
        cfg = PREPARE_Q.select((numerics, weights.dtype), runtime.device_arch(q.device.index))
        cfg.launch(q.device, ((n_rows + WARPS_PER_BLOCK - 1) // WARPS_PER_BLOCK, 1, 1), q=q, weights=weights,
                   freqs=freqs_cis, positions=positions, q_out=out[0], weights_out=out[1], n_rows=n_rows,
                   max_pos=freqs_cis.shape[0], weight_scale=float(weight_scale),
                   pos64=int(positions.dtype == torch.int64))
    return out


def prepare_index_q_reference(q, weights, *, freqs_cis, positions, weight_scale, numerics="fp4sim"):
    """Torch reference of :func:`prepare_index_q` (any device), in the kernel's operation order.
    Positions must lie in ``[0, max_pos)``."""
    if numerics not in _NUMERICS_ID:
        raise ValueError(f"numerics: expected one of {tuple(_NUMERICS_ID)}, got {numerics!r}")
    t = q.shape[0]
    f = freqs_cis[positions.to(torch.int64)].to(torch.float32).repeat_interleave(INDEX_HEADS, dim=0)
    x = rope_reference(q.to(torch.float32).reshape(t * INDEX_HEADS, HEAD_DIM).clone(), f)
    x = _hadamard128(x.reshape(-1, 32, 4)).reshape(-1, HEAD_DIM) * HADAMARD_SCALE
    w = weights.to(torch.float32).reshape(-1) * torch.tensor(weight_scale, dtype=torch.float32, device=q.device)
    if numerics == "fp4sim":
        return _fp4sim(x).to(torch.bfloat16).view(q.shape), w.view(t, INDEX_HEADS)
    if numerics == "bf16":
        return x.to(torch.bfloat16).view(q.shape), w.view(t, INDEX_HEADS)
    codes, scale = fp8_quantize_reference(x)  # SGLang's per-row fp8, as the key store's fp8 layout quantizes
    return codes.view(torch.float8_e4m3fn).view(q.shape), (w * scale).view(t, INDEX_HEADS)


__all__ = ["prepare_index_q", "prepare_index_q_reference", "product_instantiations"]
