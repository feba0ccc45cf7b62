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

from .contracts import check_int

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
