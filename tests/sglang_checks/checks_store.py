"""Store helpers of the "on" scenario: SGLang compressor plans written byte by byte, an independent float64
index key, the hooked store through compressor_v2's binding compared with it."""
from __future__ import annotations


import torch

from harness import make_index_pool


def plan_rows(fields):
    """uint8 [N, 16] plan rows from per-row (u32, i32/u16 pair, i32, i32) little-endian words."""
    import numpy as np

    arr = np.zeros((len(fields), 16), dtype=np.uint8)
    for i, (w0, w1, w2, w3) in enumerate(fields):
        arr[i] = np.frombuffer(np.array([w0], "<u4").tobytes() + w1 + np.array([w2, w3], "<i4").tobytes(),
                               dtype=np.uint8)
    return torch.from_numpy(arr)


def i32(v):
    import numpy as np

    return np.array([v], "<i4").tobytes()


def u16x2(a, b):
    import numpy as np

    return np.array([a, b], "<u2").tobytes()


def key_f64(kv, pos, w, fc, eps=1e-6):
    """Independent float64 index key: RMSNorm, interleaved RoPE on dims 64..127, Hadamard-128 / sqrt(128)."""
    x = kv.double()
    x = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w.double()
    rot = torch.view_as_complex(x[:, 64:].reshape(-1, 32, 2).contiguous())
    rot = rot * fc[pos].to(torch.complex128)
    x = torch.cat([x[:, :64], torch.view_as_real(rot).reshape(-1, 64)], dim=1)
    h = torch.ones(1, 1, dtype=torch.float64)
    for _ in range(7):
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return x @ h.T / 128 ** 0.5


def store_inputs(n, max_pos=512):
    kv = torch.randn(n, 128)
    w = torch.rand(128) + 0.5
    ang = torch.rand(max_pos, 32) * 6.28
    fc = torch.polar(torch.ones_like(ang), ang)
    return kv, w, fc


def check_store(plan, kv, w, fc, out_loc, expected):
    """Run the hooked store (through compressor_v2's binding, as SGLang calls it) and compare."""
    from sglang.srt.layers.attention.dsv4 import compressor_v2

    pool = make_index_pool(size=256)
    cache = pool.index_k_with_scale_buffer[0]
    compressor_v2.compress_norm_rope_store(kv, plan, norm_weight=w, norm_eps=1e-6, freq_cis=fc, out_loc=out_loc,
                                          kvcache=cache, page_size=64)
    flat = cache.view(torch.bfloat16).view(-1, 128)
    written = sorted(int(i) for i in (cache.view(-1, 256) != 0).any(1).nonzero().flatten())
    assert written == sorted(loc for _, loc, _ in expected), f"written slots {written}, expected {expected}"
    for row, loc, pos in expected:
        ref = key_f64(kv[row:row + 1], torch.tensor([pos]), w, fc)[0]
        got = flat[loc].double()
        err = (got - ref).abs().max().item()
        assert err <= 1e-2 * ref.abs().max().item() + 1e-3, f"slot {loc}: max error {err:.3g}"
