"""Page geometry of the C4 index-key cache, in one place.

SGLang keeps one 2-D ``uint8 [num_pages, page_bytes]`` tensor per C4 layer; a page holds 64 compressed
slots (``out_loc = page * 64 + slot``). Two row formats:

* ``bf16`` (cupy_dsa): 64 x 256 B. Slot ``s`` at byte ``s*256``, element ``e`` at ``+2e`` (bf16,
  little-endian, natural element order). No scale block. Pages are 16 KiB, 1 KiB aligned.
* ``fp8`` (SGLang's default): 64 x 128 e4m3 values (slot ``s`` at ``s*128``), then 64 fp32 scales (slot
  ``s`` at ``8192 + 4s``); 8448 B/page = 132 B/token. Dequantised value = fp8 * scale.
"""

from __future__ import annotations

import torch

from .contracts import check_device, check_dtype, check_int

PAGE_SLOTS = 64
HEAD_DIM = 128
ROPE_DIM = 64
N_HEADS = 64

BF16_BYTES_PER_TOKEN = 2 * HEAD_DIM                  # 256
FP8_BYTES_PER_TOKEN = HEAD_DIM + 4                   # 132: values + fp32 scale
FP4_BYTES_PER_TOKEN = HEAD_DIM // 2 + HEAD_DIM // 32  # 68: e2m1 nibbles + 4 ue8m0 exponents
BF16_PAGE_BYTES = PAGE_SLOTS * BF16_BYTES_PER_TOKEN  # 16384
FP8_PAGE_BYTES = PAGE_SLOTS * FP8_BYTES_PER_TOKEN    # 8448
FP8_SCALE_OFFSET = PAGE_SLOTS * HEAD_DIM             # 8192: start of the scale block in an fp8 page
FP8_MAX = 448.0
FP8_MIN_AMAX = 1e-4

LAYOUTS = ("bf16", "fp8")
BYTES_PER_TOKEN = {"bf16": BF16_BYTES_PER_TOKEN, "fp8": FP8_BYTES_PER_TOKEN,
                   "fp4": FP4_BYTES_PER_TOKEN, "bf16-fp4sim": BF16_BYTES_PER_TOKEN}
PAGE_BYTES = {"bf16": BF16_PAGE_BYTES, "fp8": FP8_PAGE_BYTES}


def page_bytes(layout: str) -> int:
    if layout not in PAGE_BYTES:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    return PAGE_BYTES[layout]


def _cache_device(device) -> torch.device | None:
    """``device`` as a torch.device that can hold a tensor here, or a ValueError naming ``device``."""
    if device is None:
        return None  # torch's default device
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"device: expected a torch device such as 'cpu', 'cuda' or 'cuda:0', got {device!r}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device: {device!r} needs a CUDA GPU and none is available "
                             "(torch.cuda.is_available() is False); use device='cpu' for the torch reference")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device: {dev} does not exist ({torch.cuda.device_count()} CUDA device(s))")
    return dev


def empty_cache(num_pages: int, layout: str, device="cpu") -> torch.Tensor:
    """A zeroed ``uint8 [num_pages, page_bytes]`` cache, as SGLang allocates it."""
    num_pages = check_int("num_pages", num_pages)
    nbytes = page_bytes(layout)
    return torch.zeros(num_pages, nbytes, dtype=torch.uint8, device=_cache_device(device))


def layout_of(cache: torch.Tensor, name: str = "kv_cache") -> str:
    """Infer the layout from a cache tensor (uint8 page rows, or typed views SGLang hands around); a bad
    cache raises a ValueError whose message starts with ``name`` (the caller's argument name)."""
    if cache.dtype == torch.bfloat16 and cache.dim() == 3 and tuple(cache.shape[1:]) == (PAGE_SLOTS, HEAD_DIM):
        return "bf16"
    if cache.dtype == torch.uint8:
        if cache.dim() == 2 and cache.shape[1] in (BF16_PAGE_BYTES, FP8_PAGE_BYTES):
            return "bf16" if cache.shape[1] == BF16_PAGE_BYTES else "fp8"
        if cache.dim() == 4 and tuple(cache.shape[1:]) == (PAGE_SLOTS, 1, FP8_BYTES_PER_TOKEN):
            return "fp8"
    raise ValueError(
        f"{name}: expected uint8 [P, 16384] or bfloat16 [P, 64, 128] (bf16 layout), or uint8 [P, 8448] "
        f"or [P, 64, 1, 132] (fp8 layout); got {cache.dtype} {tuple(cache.shape)}")


def as_page_rows(cache: torch.Tensor, name: str = "kv_cache") -> torch.Tensor:
    """The cache as contiguous ``uint8 [P, page_bytes]`` rows (a view, never a copy)."""
    layout = layout_of(cache, name)
    if not cache.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {cache.stride()}")
    return cache.view(torch.uint8).view(cache.shape[0], PAGE_BYTES[layout])


def bf16_view(cache: torch.Tensor) -> torch.Tensor:
    """``bfloat16 [P, 64, 128]`` view of a bf16-layout cache."""
    rows = as_page_rows(cache)
    return rows.view(torch.bfloat16).view(rows.shape[0], PAGE_SLOTS, HEAD_DIM)


def fp8_views(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values uint8 [P, 64, 128], scales float32 [P, 64])`` views of an fp8-layout cache."""
    rows = as_page_rows(cache)
    values = rows[:, :FP8_SCALE_OFFSET].view(rows.shape[0], PAGE_SLOTS, HEAD_DIM)
    scales = rows[:, FP8_SCALE_OFFSET:].contiguous().view(torch.float32)
    return values, scales


def dequantize(cache: torch.Tensor) -> torch.Tensor:
    """Every slot as ``float32 [P, 64, 128]`` (fp8 values times their scale)."""
    layout = layout_of(cache)
    if layout == "bf16":
        return bf16_view(cache).float()
    values, scales = fp8_views(cache)
    return values.view(torch.float8_e4m3fn).float() * scales[..., None]


def fp8_quantize_reference(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's per-token fp8: ``scale = max(amax, 1e-4)/448`` (plain fp32), ``e4m3(RNE(k * (1/scale)))``.
    Returns ``(codes uint8 [N, 128], scales float32 [N])``."""
    amax = k.abs().amax(dim=-1)
    scale = torch.clamp_min(amax, FP8_MIN_AMAX) / torch.full_like(amax, FP8_MAX)  # true division on CUDA too
    inv = 1.0 / scale
    v = (k * inv[:, None]).clamp(-FP8_MAX, FP8_MAX)
    return v.to(torch.float8_e4m3fn).view(torch.uint8), scale


# --------------------------------------------------------------------------------------------------
# fp8-rescore's two-level page pair: SGLang's fp8 page ("hi") and an int8 residual page ("lo") in the fp8 page
# geometry (the encoding and why: cupy_dsa.rescore's docstring)
# --------------------------------------------------------------------------------------------------

LO_MAX = 127
LO_BYTES_PER_TOKEN = HEAD_DIM + 4                    # 132: int8 codes + fp32 scale
TWO_LEVEL_BYTES_PER_TOKEN = 2 * LO_BYTES_PER_TOKEN   # 264: hi (SGLang's fp8) + lo
LO_PAGE_BYTES = FP8_PAGE_BYTES                       # 8448, the fp8 page geometry


def _check_two_level_keys(k):
    check_dtype("k", k, (torch.float32, torch.bfloat16))
    if k.dim() != 2 or k.shape[1] != HEAD_DIM:
        raise ValueError(f"k: expected shape [N, {HEAD_DIM}], got {tuple(k.shape)}")


def residual_encode_reference(k: torch.Tensor):
    """Two-level encoding of rotated keys ``k`` (float32/bfloat16 ``[N, 128]``: what the store quantizes).

    Returns ``(hi uint8 [N, 128] e4m3 codes, hi_scale float32 [N], lo int8 [N, 128], lo_scale float32 [N])``; the
    hi codes and scales are :func:`cupy_dsa.layouts.fp8_quantize_reference`'s (SGLang's fp8 bytes)."""
    _check_two_level_keys(k)
    kf = k.to(torch.float32)
    hi, hi_scale = fp8_quantize_reference(kf)
    r = kf - hi.view(torch.float8_e4m3fn).float() * hi_scale[:, None]
    # a key holding a NaN or an infinity has no residual scale: zero codes, NaN scale (the store kernel's rule;
    # otherwise the int8 conversion of a NaN code would be undefined)
    finite = torch.isfinite(r).all(dim=-1)
    amax = r.abs().amax(dim=-1)
    # true divisions (a full tensor: torch on CUDA turns division by a Python scalar into a reciprocal multiply)
    lo_scale = torch.where(amax > 0, amax / torch.full_like(amax, LO_MAX), torch.ones_like(amax))
    lo_scale = torch.where(finite, lo_scale, torch.full_like(lo_scale, float("nan")))
    codes = torch.round(r / lo_scale[:, None]).clamp_(-LO_MAX, LO_MAX)
    lo = torch.where(finite[:, None], codes, torch.zeros_like(codes)).to(torch.int8)
    return hi, hi_scale, lo, lo_scale


def two_level_dequant_reference(hi, hi_scale, lo, lo_scale) -> torch.Tensor:
    """``k_hat`` float32 ``[N, 128]`` = ``e4m3(hi) * hi_scale + lo * lo_scale`` (cupy_dsa.rescore's docstring)."""
    check_dtype("hi", hi, (torch.uint8, torch.float8_e4m3fn))
    if hi.dim() != 2 or hi.shape[1] != HEAD_DIM:
        raise ValueError(f"hi: expected shape [N, {HEAD_DIM}], got {tuple(hi.shape)}")
    n = hi.shape[0]
    check_dtype("hi_scale", hi_scale, (torch.float32,))
    if tuple(hi_scale.shape) != (n,):
        raise ValueError(f"hi_scale: expected shape ({n},) (N of hi), got {tuple(hi_scale.shape)}")
    check_dtype("lo", lo, (torch.int8,))
    if tuple(lo.shape) != (n, HEAD_DIM):
        raise ValueError(f"lo: expected shape ({n}, {HEAD_DIM}) (as hi), got {tuple(lo.shape)}")
    check_dtype("lo_scale", lo_scale, (torch.float32,))
    if tuple(lo_scale.shape) != (n,):
        raise ValueError(f"lo_scale: expected shape ({n},) (N of hi), got {tuple(lo_scale.shape)}")
    for name, t in (("hi_scale", hi_scale), ("lo", lo), ("lo_scale", lo_scale)):
        check_device(name, t, hi.device, "hi")
    h = hi.view(torch.float8_e4m3fn).float() * hi_scale[:, None]
    return h + lo.float() * lo_scale[:, None]


def empty_lo_cache(num_pages: int, device="cpu") -> torch.Tensor:
    """A zeroed lo cache ``uint8 [num_pages, 8448]`` (the fp8 page geometry, int8 codes)."""
    num_pages = check_int("num_pages", num_pages)
    return torch.zeros(num_pages, LO_PAGE_BYTES, dtype=torch.uint8, device=device)


def lo_views(lo_cache: torch.Tensor):
    """``(codes int8 [P, 64, 128], scales float32 [P, 64])`` views of a lo cache."""
    values, scales = fp8_views(lo_cache)
    return values.view(torch.int8), scales


def check_two_level_pair(hi_cache, lo_cache, device=None):
    """The checks of an fp8-rescore page pair: SGLang's fp8 hi cache and its lo cache of the same shape (on ``device``
    when given, else on hi's)."""
    if not isinstance(hi_cache, torch.Tensor):
        raise TypeError(f"hi_cache: expected a torch.Tensor, got {type(hi_cache).__name__}")
    if layout_of(hi_cache, "hi_cache") != "fp8":
        raise ValueError(f"hi_cache: expected SGLang's fp8 layout (uint8 [P, 8448] or [P, 64, 1, 132]), got "
                         f"{hi_cache.dtype} {tuple(hi_cache.shape)}")
    if not isinstance(lo_cache, torch.Tensor):
        raise TypeError(f"lo_cache: expected a torch.Tensor, got {type(lo_cache).__name__}")
    check_dtype("lo_cache", lo_cache, (torch.uint8,))
    if lo_cache.shape != hi_cache.shape:
        raise ValueError(f"lo_cache: expected the shape of hi_cache {tuple(hi_cache.shape)}, got "
                         f"{tuple(lo_cache.shape)}")
    for name, t in (("hi_cache", hi_cache), ("lo_cache", lo_cache)):
        if not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")
        if device is not None:
            check_device(name, t, device, "q")
    if device is None:
        check_device("lo_cache", lo_cache, hi_cache.device, "hi_cache")


def store_two_level_reference(k: torch.Tensor, hi_cache: torch.Tensor, lo_cache: torch.Tensor,
                              out_loc: torch.Tensor) -> None:
    """Write rotated keys ``k [N, 128]`` at ``out_loc`` (int32/int64 ``[N]``, ``page * 64 + slot``) into the hi
    (fp8 layout) and lo caches; rows with ``out_loc < 0`` or a page past the caches are skipped."""
    _check_two_level_keys(k)
    check_two_level_pair(hi_cache, lo_cache)
    check_device("k", k, hi_cache.device, "hi_cache")
    check_dtype("out_loc", out_loc, (torch.int32, torch.int64))
    if tuple(out_loc.shape) != (k.shape[0],):
        raise ValueError(f"out_loc: expected shape ({k.shape[0]},) (N of k), got {tuple(out_loc.shape)}")
    hi_rows, lo_rows = as_page_rows(hi_cache, "hi_cache"), lo_cache.view(hi_cache.shape[0], LO_PAGE_BYTES)
    num_pages = hi_rows.shape[0]
    loc = out_loc.to(torch.int64).to(k.device)
    ok = ((loc >= 0) & ((loc >> 6) < num_pages)).nonzero().flatten()
    if ok.numel() == 0:
        return
    hi, hi_scale, lo, lo_scale = residual_encode_reference(k[ok])
    page, slot = loc[ok] >> 6, loc[ok] & (PAGE_SLOTS - 1)
    for rows, codes, scales in ((hi_rows, hi, hi_scale), (lo_rows, lo.view(torch.uint8), lo_scale)):
        rows[:, :FP8_SCALE_OFFSET].view(num_pages, PAGE_SLOTS, HEAD_DIM)[page, slot] = codes
        rows[:, FP8_SCALE_OFFSET:].view(torch.float32)[page, slot] = scales
