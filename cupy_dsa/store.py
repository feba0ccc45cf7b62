"""Fused index-key store: norm -> RoPE -> Hadamard -> (fp4-simulate | fp8-quantize) -> paged cache.

One warp per compressed token, lane ``l`` owning elements ``4l..4l+3`` (natural order); the CUDA
template is ``kernels/store_index_k.cu``. The torch reference below follows the kernel's operation order
(per-lane partial sums then the same xor-butterfly tree, the same RoPE and Hadamard stages, and for V4 keys
SGLang 0.5.23's fused multiply-adds: the sum of squares as an FMA chain, each RoPE output as one FMA, rounded
once as the hardware does, see :func:`fma_f32`), so it matches the kernel to the bit except where ``rsqrtf``
(hardware approximation, <= 2 ulp) and ``torch.rsqrt`` differ: then single elements differ by one bf16 ulp
(one e4m3 code, and the fp8 scale by a few fp32 ulp). With the same operation order the fp8 pages are the
bytes SGLang's store writes for finite keys; they still differ where SGLang keeps a subnormal intermediate
(CuPy compiles with -ftz=true) and for a non-finite key (SGLang's clip, fmaxf(fminf(v, 448), -448), turns a NaN
value into 448 and its fmaxf amax skips it; here the row's scale is NaN and the key is counted as non-finite).

Layouts (``cupy_dsa.layouts``): ``uint8 [P, 16384]`` -> bf16 (256 B/token), ``uint8 [P, 8448]`` -> fp8
(SGLang's 132 B/token); two-level keys (``cupy_dsa.rescore``): an fp8 cache plus ``lo_cache`` (uint8, the same
shape), which receives in the same launch the int8 residual of each fp8 row (the kernel's third layout). Key
styles: ``"v4"`` (RMSNorm, interleaved RoPE on the trailing 64 dims) and ``"v32"`` (LayerNorm with bias, NeoX
RoPE on the leading 64 dims). Numerics: ``"exact"`` (RNE of the fp32 key) and ``"fp4sim"`` (DeepSeek-V4's
QAT: e2m1 with a power-of-two scale per 32 elements, stored as bf16; bf16 layout only).

CPU tensors run the torch reference; CUDA tensors launch the kernel on torch's current stream.
"""

from __future__ import annotations

import numpy as np
import torch

from . import launch, runtime
from .contracts import check_aligned, check_bool, check_contiguous, check_device, check_dtype, check_shape
from .launch import F32, I32, I64, PTR
from .layouts import FP8_SCALE_OFFSET, HEAD_DIM, PAGE_SLOTS, ROPE_DIM, as_page_rows, fp8_quantize_reference, layout_of
from .layouts import store_two_level_reference

# Template parameters of store_index_k<Layout, Numerics, Style, Hadamard, TIn, Source>; the index dtype
# (int32/int64 positions or plan out_loc) is a run-time kernel argument. "two-level" = the fp8 page and its
# int8 residual page (lo_cache), written by one launch.
_LAYOUT_ID = {"bf16": 0, "fp8": 1, "two-level": 2}
_NUMERICS_ID = {"exact": 0, "fp4sim": 1}
_STYLE_ID = {"v4": 0, "v32": 1}
_SOURCES = {"direct": 0, "decode": 1, "prefill": 2}   # positions, SGLang's decode / prefill plan rows
_IN_TYPE = {torch.float32: "float", torch.bfloat16: "__nv_bfloat16"}
_VARIANTS = (("bf16", "exact"), ("bf16", "fp4sim"), ("fp8", "exact"), ("two-level", "exact"))  # the kernel's

WARPS_PER_BLOCK = 8
TOKENS_PER_WARP = 2  # kTokensPerWarp in the kernel
TOKENS_PER_BLOCK = WARPS_PER_BLOCK * TOKENS_PER_WARP
BLOCK = (32 * WARPS_PER_BLOCK, 1, 1)


def _render(param, value):
    if param == "Hadamard":
        return "true" if value else "false"
    return _IN_TYPE[value] if param == "TIn" else str(value)


STORE_KERNEL = launch.Kernel(
    "store_index_k.cu", "store_index_k", params=("Layout", "Numerics", "Style", "Hadamard", "TIn", "Source"),
    args=(("kv", PTR), ("cache", PTR), ("lo_cache", PTR), ("items", PTR), ("out_loc", PTR), ("norm_w", PTR),
          ("norm_b", PTR), ("freqs", PTR), ("n", I64), ("n_loc", I64), ("num_pages", I64), ("max_pos", I64),
          ("eps", F32), ("ratio", I32), ("idx64", I32), ("nonfinite", PTR)),
    threads=lambda cfg: BLOCK[0], render=_render)

# A problem: (layout, numerics, key style, hadamard, kv dtype, source); every one has its instantiation.
STORE = launch.register(launch.Family(
    "store_index_k",
    problems=[(layout, num, style, had, in_dtype, src) for layout, num in _VARIANTS for style in _STYLE_ID
              for had in (True, False) for in_dtype in _IN_TYPE for src in _SOURCES],
    select=lambda p, arch: STORE_KERNEL.config(Layout=_LAYOUT_ID[p[0]], Numerics=_NUMERICS_ID[p[1]],
                                               Style=_STYLE_ID[p[2]], Hadamard=p[3], TIn=p[4], Source=_SOURCES[p[5]]),
    serves=lambda cfg, p: cfg == STORE.select(p, None)))


def product_instantiations(*, layouts=("bf16",), numerics=("exact",), key_styles=("v4",), hadamard=(True,),
                           in_dtypes=(torch.float32, torch.bfloat16),
                           sources=("direct", "decode", "prefill")) -> list[str]:
    """Name expressions of the store for the given options (every combination the kernel has), e.g. what
    one server launches: ``layouts=("bf16",), numerics=("exact",), in_dtypes=(torch.bfloat16,),
    sources=("decode", "prefill")``. Layouts: ``bf16``, ``fp8``, ``two-level`` (fp8 + ``lo_cache``). Sources:
    ``direct`` (positions), ``decode`` / ``prefill`` (plan rows)."""
    return [STORE.select(p, None).expr for p in STORE.problems
            if p[0] in layouts and p[1] in numerics and p[2] in key_styles and p[3] in hadamard
            and p[4] in in_dtypes and p[5] in sources]


FP4_BLOCK = 32
FP4_MAX = 6.0
FP4_MIN_AMAX = 1e-4
PLAN_INVALID = 0xFFFFFFFF

# The reference's reciprocal square root. The kernel uses rsqrtf (hardware approximation, <= 2 ulp);
# tests on a GPU may swap in a device rsqrtf to make the reference bit-exact.
_rsqrt = torch.rsqrt


# --------------------------------------------------------------------------------------------------
# Contract checks (tensor metadata only: no host sync)
# --------------------------------------------------------------------------------------------------

def _check_device(name, t, device):
    check_device(name, t, device, "kv")


def check_rope_table(freqs_cis, device, like: str) -> None:
    """The fp32 RoPE table ``[max_pos, 64]`` (cos, sin interleaved) the store and the query prep read."""
    check_dtype("freqs_cis", freqs_cis, (torch.float32,))
    check_shape("freqs_cis", freqs_cis, f"[max_pos, {ROPE_DIM}]",
                freqs_cis.dim() == 2 and freqs_cis.shape[1] == ROPE_DIM)
    check_contiguous("freqs_cis", freqs_cis)
    check_device("freqs_cis", freqs_cis, device, like)
    check_aligned("freqs_cis", freqs_cis, 16)


def check_positions_in_table(positions: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """``positions`` as int64 on their device, all rows of ``freqs_cis`` (a host sync: references only)."""
    pos = positions.to(torch.int64)
    if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= freqs_cis.shape[0]):
        raise ValueError(f"positions: expected values in [0, {freqs_cis.shape[0]}) (rows of freqs_cis)")
    return pos


def fma_f32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``a * b + c`` of float32 tensors rounded once to float32 (RNE), as the GPU's FMA does. The product is exact
    in float64; the float64 sum is made round-to-odd (TwoSum's error decides the last bit), and a round-to-odd
    value with 53 bits rounds to 24 bits exactly as the exact sum would (Boldo and Melquiond)."""
    p = a.to(torch.float64) * b.to(torch.float64)
    c64 = c.to(torch.float64)
    t = p + c64
    bb = t - p
    err = (p - (t - bb)) + (c64 - bb)
    even = (t.view(torch.int64) & 1) == 0
    toward = torch.where(err > 0, torch.full_like(t, float("inf")), torch.full_like(t, float("-inf")))
    t = torch.where((err != 0) & even & torch.isfinite(t), torch.nextafter(t, toward), t)
    return t.to(torch.float32)


def rope_reference(k: torch.Tensor, f: torch.Tensor, key_style: str = "v4", fused: bool = False) -> torch.Tensor:
    """RoPE of fp32 rows ``k [n, 128]`` (in place) by table rows ``f [n, 64]``, in the kernels' order: V4 rotates
    interleaved pairs ``(64+2j, 65+2j)`` of the trailing 64 dims, V3.2 the halves ``(j, 32+j)`` of the leading 64.
    ``fused``: SGLang's V4 key order, ``re' = fma(re, cos, -(im * sin))``, ``im' = fma(re, sin, im * cos)`` (the
    store); otherwise two products and a sum, each rounded (the query prep)."""
    cos, sin = f[:, 0::2], f[:, 1::2]
    if key_style == "v4":
        re, im = k[:, 64::2], k[:, 65::2]
    else:
        re, im = k[:, 0:32], k[:, 32:64]
    if fused:
        re2 = fma_f32(re, cos, -(im * sin))
        im2 = fma_f32(re, sin, im * cos)
    else:
        re2 = re * cos - im * sin
        im2 = re * sin + im * cos
    if key_style == "v4":
        k[:, 64::2], k[:, 65::2] = re2, im2
    else:
        k[:, 0:32], k[:, 32:64] = re2, im2
    return k


def _check_common(kv, cache, norm_weight, norm_bias, freqs_cis, eps, numerics, key_style, hadamard):
    check_dtype("kv", kv, (torch.float32, torch.bfloat16))
    check_shape("kv", kv, f"[N, {HEAD_DIM}]", kv.dim() == 2 and kv.shape[1] == HEAD_DIM)
    check_contiguous("kv", kv)
    dev = kv.device
    if numerics not in _NUMERICS_ID:
        raise ValueError(f"numerics: expected one of {tuple(_NUMERICS_ID)}, got {numerics!r}")
    if key_style not in _STYLE_ID:
        raise ValueError(f"key_style: expected one of {tuple(_STYLE_ID)}, got {key_style!r}")
    check_bool("hadamard", hadamard)
    if not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps: expected a non-negative float, got {eps!r}")
    if not isinstance(cache, torch.Tensor):
        raise TypeError(f"cache: expected a torch.Tensor, got {type(cache).__name__}")
    layout = layout_of(cache, "cache")
    check_contiguous("cache", cache)
    _check_device("cache", cache, dev)
    check_aligned("cache", cache, 16)
    if numerics == "fp4sim" and layout != "bf16":
        raise ValueError("numerics: 'fp4sim' needs a bf16-layout cache (uint8 [P, 16384]), got an fp8 cache")
    check_dtype("norm_weight", norm_weight, (torch.float32,))
    check_shape("norm_weight", norm_weight, f"[{HEAD_DIM}]", tuple(norm_weight.shape) == (HEAD_DIM,))
    check_contiguous("norm_weight", norm_weight)
    _check_device("norm_weight", norm_weight, dev)
    if key_style == "v32":
        if norm_bias is None:
            raise ValueError("norm_bias: key_style 'v32' (LayerNorm) needs a float32 [128] bias")
        check_dtype("norm_bias", norm_bias, (torch.float32,))
        check_shape("norm_bias", norm_bias, f"[{HEAD_DIM}]", tuple(norm_bias.shape) == (HEAD_DIM,))
        check_contiguous("norm_bias", norm_bias)
        _check_device("norm_bias", norm_bias, dev)
    elif norm_bias is not None:
        raise ValueError("norm_bias: only key_style 'v32' (LayerNorm) takes a bias; pass None for 'v4'")
    check_rope_table(freqs_cis, dev, "kv")
    check_aligned("kv", kv, 16 if kv.dtype == torch.float32 else 8)
    check_aligned("norm_weight", norm_weight, 16)
    if norm_bias is not None:
        check_aligned("norm_bias", norm_bias, 16)
    return layout


def _check_lo_cache(lo_cache, cache, layout, device) -> str:
    """The store's layout: ``cache``'s, or ``"two-level"`` when ``lo_cache`` (the residual pages) is given."""
    if lo_cache is None:
        return layout
    if layout != "fp8":
        raise ValueError("lo_cache: two-level keys need an fp8-layout cache (uint8 [P, 8448] or [P, 64, 1, 132]), "
                         "got a bf16-layout cache")
    check_dtype("lo_cache", lo_cache, (torch.uint8,))
    if lo_cache.shape != cache.shape:
        raise ValueError(f"lo_cache: expected the shape of cache {tuple(cache.shape)} (one residual slot per fp8 "
                         f"slot), got {tuple(lo_cache.shape)}")
    check_contiguous("lo_cache", lo_cache)
    _check_device("lo_cache", lo_cache, device)
    check_aligned("lo_cache", lo_cache, 16)
    if lo_cache.data_ptr() == cache.data_ptr() and cache.numel():
        raise ValueError("lo_cache: expected its own memory, got the memory of cache")
    return "two-level"


def _check_direct(kv, positions, out_loc):
    n = kv.shape[0]
    check_dtype("positions", positions, (torch.int32, torch.int64))
    check_shape("positions", positions, f"[{n}] (N of kv)", tuple(positions.shape) == (n,))
    check_contiguous("positions", positions)
    _check_device("positions", positions, kv.device)
    check_dtype("out_loc", out_loc, (torch.int32, torch.int64))
    check_shape("out_loc", out_loc, f"[{n}] (N of kv)", tuple(out_loc.shape) == (n,))
    check_contiguous("out_loc", out_loc)
    _check_device("out_loc", out_loc, kv.device)


def _check_plan(kv, plan, out_loc, compress_ratio, is_decode):
    n = kv.shape[0]
    check_dtype("plan", plan, (torch.uint8,))
    check_shape("plan", plan, f"[{n}, 16] (one 16-byte plan row per kv row)",
                 plan.dim() == 2 and tuple(plan.shape) == (n, 16))
    check_contiguous("plan", plan)
    _check_device("plan", plan, kv.device)
    check_aligned("plan", plan, 16)
    check_dtype("out_loc", out_loc, (torch.int32, torch.int64))
    check_shape("out_loc", out_loc, "[M] (1-D)", out_loc.dim() == 1)
    if is_decode and out_loc.shape[0] < n:
        raise ValueError(f"out_loc: a decode plan needs at least {n} entries (one per plan row), "
                         f"got {out_loc.shape[0]}")
    check_contiguous("out_loc", out_loc)
    _check_device("out_loc", out_loc, kv.device)
    check_bool("is_decode", is_decode)
    if isinstance(compress_ratio, bool) or not isinstance(compress_ratio, int) or not 0 < compress_ratio < 2**31:
        raise ValueError(f"compress_ratio: expected a positive int, got {compress_ratio!r}")


# --------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------

def store_index_k(kv, cache, *, positions, out_loc, norm_weight, freqs_cis, norm_bias=None, eps=1e-6,
                  numerics="exact", key_style="v4", hadamard=True, lo_cache=None) -> None:
    """Normalize, rotate and store index keys ``kv`` (float32/bfloat16 ``[N, 128]``) into ``cache``.

    ``positions`` int32/int64 ``[N]`` (RoPE row of ``freqs_cis`` float32 ``[max_pos, 64]``), ``out_loc``
    int32/int64 ``[N]`` (``page*64 + slot``). Rows with ``out_loc < 0``, ``out_loc >> 6 >= num_pages`` or a
    position outside ``[0, max_pos)`` are skipped; nothing else in the cache changes.
    ``lo_cache``: two-level keys (``cupy_dsa.rescore``): ``cache`` in the fp8 layout and ``lo_cache`` uint8 of
    its shape; the same launch writes each key's fp8 row to ``cache`` (the bytes of the plain fp8 store) and
    its int8 residual with its scale to the same slot of ``lo_cache``.
    """
    layout = _check_common(kv, cache, norm_weight, norm_bias, freqs_cis, eps, numerics, key_style, hadamard)
    store_layout = _check_lo_cache(lo_cache, cache, layout, kv.device)
    _check_direct(kv, positions, out_loc)
    if _stored_on_host(kv, lambda: _store_reference(kv, cache, positions, out_loc, norm_weight, freqs_cis,
                                                    norm_bias, eps, numerics, key_style, hadamard, layout,
                                                    lo_cache)):
        return
    n = kv.shape[0]
    if out_loc.dtype == torch.int32:
        # the direct kernel's one run-time index width is that of positions; out_loc is read as int64
        out_loc = out_loc.to(torch.int64)
    _launch((store_layout, numerics, key_style, hadamard, kv.dtype, "direct"), kv, as_page_rows(cache), lo_cache,
            positions, out_loc, norm_weight, norm_bias, freqs_cis, n, eps, 0, positions.dtype == torch.int64)


def store_index_k_from_plan(kv, plan, *, cache, out_loc, norm_weight, freqs_cis, is_decode, compress_ratio=4,
                            norm_bias=None, eps=1e-6, numerics="exact", key_style="v4",
                            hadamard=True, lo_cache=None) -> None:
    """Plan-native store (SGLang's 16-byte plan rows, uint8 ``[N, 16]``): work item ``w`` uses kv row ``w``.

    Decode (DecodePlan): skip if ``seq_len % compress_ratio != 0``; ``out_loc[w]``.
    Prefill/extend (CompressPlan): skip if ``seq_len == 0xFFFFFFFF``; ``out_loc[ragged_id]`` (a ragged_id
    past ``len(out_loc)`` is skipped, never read). ``position = seq_len - compress_ratio``.
    ``lo_cache``: two-level keys, as for :func:`store_index_k`.
    """
    layout = _check_common(kv, cache, norm_weight, norm_bias, freqs_cis, eps, numerics, key_style, hadamard)
    store_layout = _check_lo_cache(lo_cache, cache, layout, kv.device)
    _check_plan(kv, plan, out_loc, compress_ratio, is_decode)
    if _stored_on_host(kv, lambda: _store_reference(
            kv, cache, *plan_to_direct(plan, out_loc, is_decode=is_decode, compress_ratio=compress_ratio),
            norm_weight, freqs_cis, norm_bias, eps, numerics, key_style, hadamard, layout, lo_cache)):
        return
    n = kv.shape[0]
    _launch((store_layout, numerics, key_style, hadamard, kv.dtype, "decode" if is_decode else "prefill"), kv,
            as_page_rows(cache), lo_cache, plan, out_loc, norm_weight, norm_bias, freqs_cis, n, eps, compress_ratio,
            out_loc.dtype == torch.int64)


def _stored_on_host(kv, reference) -> bool:
    """Whether the call is done without a launch: CPU tensors run the torch ``reference()``; an empty batch has
    nothing to store."""
    if not kv.is_cuda:
        reference()
        return True
    return kv.shape[0] == 0


def _launch(problem, kv, rows, lo_cache, items, out_loc, norm_weight, norm_bias, freqs_cis, n, eps, ratio, idx64):
    cfg = STORE.select(problem, runtime.device_arch(kv.device.index))
    cfg.launch(kv.device, ((n + TOKENS_PER_BLOCK - 1) // TOKENS_PER_BLOCK, 1, 1), kv=kv, cache=rows,
               lo_cache=lo_cache, items=items,
               out_loc=out_loc, norm_w=norm_weight, norm_b=norm_bias, freqs=freqs_cis, n=n, n_loc=out_loc.shape[0],
               num_pages=rows.shape[0], max_pos=freqs_cis.shape[0], eps=float(eps), ratio=ratio, idx64=int(idx64),
               nonfinite=nonfinite_counter(kv.device))


# --------------------------------------------------------------------------------------------------
# Non-finite keys: counted by every store (kernel and reference), read only when asked (a host sync)
# --------------------------------------------------------------------------------------------------

_NONFINITE: dict = {}


def nonfinite_counter(device) -> torch.Tensor:
    """The int32 ``[1]`` counter every store on ``device`` adds its non-finite keys to (a key whose stored fp32
    value holds a NaN or an infinity: a bad checkpoint, an upstream race). Made once per device, so a launch
    allocates nothing and a CUDA graph keeps a valid pointer; call it before capturing (the plugin's warm-up
    does)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    counter = _NONFINITE.get(device)
    if counter is None:
        counter = _NONFINITE[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return counter


def nonfinite_keys(device) -> int:
    """Non-finite keys stored on ``device`` since the process started (or the last :func:`reset_nonfinite_keys`).
    Reads the GPU counter: a host sync, so only for ``check``, tests and the opt-in debug setting."""
    return int(nonfinite_counter(device).item())


def reset_nonfinite_keys(device) -> None:
    nonfinite_counter(device).zero_()


# --------------------------------------------------------------------------------------------------
# Torch reference (CPU backend and test oracle)
# --------------------------------------------------------------------------------------------------

def plan_to_direct(plan, out_loc, *, is_decode, compress_ratio=4):
    """Decode 16-byte plan rows into ``(positions int64 [N], out_loc int64 [N])``; skipped rows get
    ``out_loc = -1`` (the reference helper; the kernel decodes plans itself)."""
    p = plan.to(torch.int64)
    seq_len = p[:, 0] | (p[:, 1] << 8) | (p[:, 2] << 16) | (p[:, 3] << 24)
    positions = seq_len - compress_ratio
    locs_all = out_loc.to(torch.int64)
    if is_decode:
        valid = (seq_len % compress_ratio) == 0
        locs = locs_all[: plan.shape[0]].clone()
    else:
        valid = seq_len != PLAN_INVALID
        ragged = p[:, 4] | (p[:, 5] << 8)
        valid = valid & (ragged < locs_all.shape[0])  # as in the kernel: a ragged_id past out_loc is skipped
        safe = torch.where(valid, ragged, torch.zeros_like(ragged))
        locs = locs_all[safe]
    locs = torch.where(valid & (positions >= 0), locs, torch.full_like(locs, -1))
    return positions, locs


def _warp_sum(v: torch.Tensor) -> torch.Tensor:
    """dsa::warp_sum on ``[..., 32]`` lane values: xor butterfly 16, 8, 4, 2, 1 (every lane equal)."""
    lane = torch.arange(32, device=v.device)
    for m in (16, 8, 4, 2, 1):
        v = v + v[..., lane ^ m]
    return v[..., 0]


def _lane_sum4(a: torch.Tensor) -> torch.Tensor:
    """Per-lane ``((a0 + a1) + a2) + a3`` over ``[..., 32, 4]``."""
    return ((a[..., 0] + a[..., 1]) + a[..., 2]) + a[..., 3]


def _lane_sum4_sq_fma(x: torch.Tensor) -> torch.Tensor:
    """Per-lane sum of squares over ``[..., 32, 4]`` as SGLang's V4 store computes it: an FMA chain from x0 * x0."""
    s = x[..., 0] * x[..., 0]
    for i in (1, 2, 3):
        s = fma_f32(x[..., i], x[..., i], s)
    return s


def _hadamard128(x: torch.Tensor) -> torch.Tensor:
    """dsa::hadamard128 on ``[N, 32, 4]`` (two in-lane stages, then shuffles over lane bits 0..4)."""
    a0 = x[..., 0] + x[..., 1]
    a1 = x[..., 0] - x[..., 1]
    a2 = x[..., 2] + x[..., 3]
    a3 = x[..., 2] - x[..., 3]
    x = torch.stack((a0 + a2, a1 + a3, a0 - a2, a1 - a3), dim=-1)
    lane = torch.arange(32, device=x.device)
    for m in (1, 2, 4, 8, 16):
        upper = ((lane & m) != 0)[:, None]
        o = x[:, lane ^ m, :]
        x = torch.where(upper, o - x, x + o)
    return x


def _fp4sim(k: torch.Tensor) -> torch.Tensor:
    """e2m1 rounding with a power-of-two (ue8m0) scale per 32 elements, ties to the even code. A block that
    holds a NaN or an infinity has no scale: every element of it becomes NaN (as the kernel does)."""
    kb = k.view(-1, HEAD_DIM // FP4_BLOCK, FP4_BLOCK)
    amax = kb.abs().amax(dim=-1, keepdim=True)  # NaN when the block holds one
    finite = torch.isfinite(amax)
    amax = torch.where(finite, amax, torch.zeros_like(amax))
    # divide by a full tensor: torch on CUDA turns division by a Python scalar into a reciprocal multiply
    t = torch.clamp_min(amax, FP4_MIN_AMAX) / torch.full_like(amax, FP4_MAX)
    # exact ceil(log2(t)) for a normal fp32 t: exponent, +1 unless the mantissa is zero
    bits = t.view(torch.int32)
    e = ((bits >> 23) & 0xFF) - 127
    e = e + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    scale = ((e + 127) << 23).view(torch.float32)  # exact 2^e
    q = kb / scale
    a = q.abs()
    r = torch.where(a <= 0.25, 0.0, torch.where(a < 0.75, 0.5, torch.where(a <= 1.25, 1.0, torch.where(
        a < 1.75, 1.5, torch.where(a <= 2.5, 2.0, torch.where(a < 3.5, 3.0, torch.where(a <= 5.0, 4.0, 6.0)))))))
    r = torch.copysign(r.to(torch.float32), q)
    return torch.where(finite, r * scale, torch.full_like(q, float("nan"))).view(-1, HEAD_DIM)


def fp4sim_reference(x: torch.Tensor) -> torch.Tensor:
    """``numerics='fp4sim'`` rounding of any float tensor whose last dim is 128 (e2m1, power-of-two scale
    per 32 elements, ties to the even code), float32 out: what the store does to a key, applied to e.g. a
    query, as DeepSeek-V4's reference fp4-simulates both."""
    if x.shape[-1] != HEAD_DIM:
        raise ValueError(f"x: expected a last dimension of {HEAD_DIM}, got shape {tuple(x.shape)}")
    return _fp4sim(x.to(torch.float32).reshape(-1, HEAD_DIM)).view(x.shape)


HADAMARD_SCALE = float(np.float32(128.0 ** -0.5))  # fp32 bits 0x3db504f3


def rotate_index_k_reference(kv, positions, norm_weight, freqs_cis, norm_bias=None, eps=1e-6, key_style="v4",
                             hadamard=True, numerics="exact") -> torch.Tensor:
    """The fp32 key the kernel stores (before bf16/fp8 rounding; fp4-rounded for ``numerics='fp4sim'``),
    float32 ``[N, 128]``, in the kernel's operation order. Positions must lie in ``[0, max_pos)``."""
    if key_style not in _STYLE_ID:
        raise ValueError(f"key_style: expected one of {tuple(_STYLE_ID)}, got {key_style!r}")
    if numerics not in _NUMERICS_ID:
        raise ValueError(f"numerics: expected one of {tuple(_NUMERICS_ID)}, got {numerics!r}")
    n = kv.shape[0]
    pos = check_positions_in_table(positions.to(kv.device), freqs_cis)
    x = kv.to(torch.float32).reshape(n, 32, 4)
    w = norm_weight.to(torch.float32).reshape(32, 4)
    eps32 = torch.tensor(eps, dtype=torch.float32, device=kv.device)
    if key_style == "v4":
        ss = _warp_sum(_lane_sum4_sq_fma(x))
        nf = _rsqrt(ss / 128.0 + eps32)
        k = (x * nf[:, None, None]) * w
    else:
        mean = _warp_sum(_lane_sum4(x)) / 128.0
        d = x - mean[:, None, None]
        var = _warp_sum(_lane_sum4(d * d)) / 128.0
        rs = _rsqrt(var + eps32)
        k = ((d * rs[:, None, None]) * w) + norm_bias.to(torch.float32).reshape(32, 4)
    k = rope_reference(k.reshape(n, HEAD_DIM).clone(), freqs_cis[pos].to(torch.float32), key_style,
                       fused=key_style == "v4")
    if hadamard:
        inv = HADAMARD_SCALE  # 128^-0.5 correctly rounded in fp32, as the kernel's constant
        k = _hadamard128(k.reshape(n, 32, 4)).reshape(n, HEAD_DIM) * inv
    if numerics == "fp4sim":
        k = _fp4sim(k)
    return k


def store_index_k_reference(kv, cache, *, positions, out_loc, norm_weight, freqs_cis, norm_bias=None, eps=1e-6,
                            numerics="exact", key_style="v4", hadamard=True, lo_cache=None) -> None:
    """Torch reference of :func:`store_index_k` (any device; same checks, same skip rules)."""
    layout = _check_common(kv, cache, norm_weight, norm_bias, freqs_cis, eps, numerics, key_style, hadamard)
    _check_lo_cache(lo_cache, cache, layout, kv.device)
    _check_direct(kv, positions, out_loc)
    _store_reference(kv, cache, positions, out_loc, norm_weight, freqs_cis, norm_bias, eps, numerics,
                     key_style, hadamard, layout, lo_cache)


def _store_reference(kv, cache, positions, out_loc, norm_weight, freqs_cis, norm_bias, eps, numerics,
                     key_style, hadamard, layout, lo_cache=None):
    rows = as_page_rows(cache)
    num_pages = rows.shape[0]
    pos = positions.to(torch.int64)
    loc = out_loc.to(torch.int64)
    valid = (loc >= 0) & ((loc >> 6) < num_pages) & (pos >= 0) & (pos < freqs_cis.shape[0])
    idx = valid.nonzero().flatten()
    if idx.numel() == 0:
        return
    k = rotate_index_k_reference(kv[idx], pos[idx], norm_weight, freqs_cis, norm_bias, eps, key_style,
                                 hadamard, numerics)
    nonfinite_counter(kv.device).add_((~torch.isfinite(k)).any(dim=1).sum().to(torch.int32))
    loc = loc[idx]
    if lo_cache is not None:
        store_two_level_reference(k, cache, lo_cache, loc)
        return
    page, slot = loc >> 6, loc & (PAGE_SLOTS - 1)
    if layout == "bf16":
        rows.view(torch.bfloat16).view(num_pages * PAGE_SLOTS, HEAD_DIM)[loc] = k.to(torch.bfloat16)
        return
    codes, scales = fp8_quantize_reference(k)
    values = rows[:, :FP8_SCALE_OFFSET].view(num_pages, PAGE_SLOTS, HEAD_DIM)
    values[page, slot] = codes
    rows[:, FP8_SCALE_OFFSET:].view(torch.float32)[page, slot] = scales


__all__ = ["store_index_k", "store_index_k_from_plan", "store_index_k_reference", "rotate_index_k_reference",
           "fp8_quantize_reference", "fp4sim_reference", "plan_to_direct", "nonfinite_counter", "nonfinite_keys",
           "reset_nonfinite_keys", "fma_f32"]
