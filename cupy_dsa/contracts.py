"""Contract checks shared by every op: tensor metadata only (no host sync), each error naming the argument.

TypeError for a wrong kind of value (not a tensor, wrong dtype, not an int), ValueError for a wrong value
(shape, strides, device, alignment, range).
"""

from __future__ import annotations

import numpy as np
import torch


def check_dtype(name: str, t, dtypes) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")


def check_shape(name: str, t: torch.Tensor, shape_desc: str, ok: bool) -> None:
    if not ok:
        raise ValueError(f"{name}: expected shape {shape_desc}, got {tuple(t.shape)}")


def check_contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")


def check_device(name: str, t: torch.Tensor, device: torch.device, like: str) -> None:
    """``t`` lives on ``device``, the device of argument ``like``."""
    if t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (the device of {like}), got {t.device}")


def check_aligned(name: str, t: torch.Tensor, nbytes: int = 16) -> None:
    """A CUDA tensor's data pointer is ``nbytes``-aligned (the kernels read vectors of that size)."""
    if t.is_cuda and t.data_ptr() % nbytes:
        raise ValueError(f"{name}: expected a {nbytes}-byte aligned data pointer (the kernel reads {nbytes}-byte "
                         f"vectors), got {t.data_ptr():#x}")


def check_bool(name: str, v) -> bool:
    """A bool (not a truthy value such as ``"yes"`` or 1)."""
    if not isinstance(v, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a bool, got {type(v).__name__} {v!r}")
    return bool(v)


def check_int(name: str, v, lo: int = 0, hi: int = 2**31 - 1) -> int:
    """An int (not a bool) in ``[lo, hi]`` (by default one that a kernel's 32-bit argument holds)."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise ValueError(f"{name}: expected an int in [{lo}, {hi}], got {v}")
    return int(v)
