"""Store helpers of the "on" and "fp8cupy" scenarios: SGLang compressor plans written byte by byte, the store
cases both key layouts are checked on, the two ways SGLang reaches the hooked store (compressor_v2's binding and
its own call site), an independent float64 index key and the bf16 cache compared with it."""
from __future__ import annotations

import types
from typing import NamedTuple

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


def decode_plan(seq_lens):
    """SGLang's decode plan, one request per row at its seq_len."""
    from sglang.kernels.ops.attention.dsv4.compress import CompressorDecodePlan

    return CompressorDecodePlan(4, plan_rows([(s, i32(0), 0, 0) for s in seq_lens]))


class StoreCase(NamedTuple):
    """A store call's inputs and the slots it must write: ``expected`` = [(row of kv, slot, position)]. The bf16
    and fp8-cupy store checks share the cases (the plan decides the slots whatever the key layout) and compare
    the bytes with their own layout's oracle."""
    kv: torch.Tensor
    w: torch.Tensor
    fc: torch.Tensor
    plan: object
    out_loc: torch.Tensor
    expected: list


def decode_case():
    # seq_len 9 is not a compression boundary: skipped; position = seq_len - 4; slot 130 is in another page
    kv, w, fc = store_inputs(5)
    return StoreCase(kv, w, fc, decode_plan((8, 9, 12, 400, 16)), torch.tensor([5, 6, 7, 70, 130]),
                     [(0, 5, 4), (2, 7, 8), (3, 70, 396), (4, 130, 12)])


def prefill_case():
    # invalid entry skipped; location = out_loc[ragged_id]
    from sglang.kernels.ops.attention.dsv4.compress import CompressorPrefillPlan

    kv, w, fc = store_inputs(4)
    rows = [(4, 2), (0xFFFFFFFF, 0), (16, 5), (64, 1)]
    plan = CompressorPrefillPlan(4, plan_rows([(s, u16x2(r, 4), 0, 0) for s, r in rows]),
                                 torch.zeros(4, 8, dtype=torch.uint8))
    return StoreCase(kv, w, fc, plan, torch.arange(100, 108), [(0, 102, 0), (2, 105, 12), (3, 101, 60)])


def call_site_case():
    kv, w, fc = store_inputs(3)
    return StoreCase(kv, w, fc, decode_plan((16, 18, 20)), torch.tensor([11, 12, 13]), [(0, 11, 12), (2, 13, 16)])


def index_cache():
    """Layer 0's index-key cache of a fresh pool of this process's mode (bf16 or SGLang's fp8 pages)."""
    return make_index_pool(size=256).index_k_with_scale_buffer[0]


def store_through_binding(case):
    """The hooked store through compressor_v2's binding, as SGLang calls it; the cache it wrote."""
    from sglang.srt.layers.attention.dsv4 import compressor_v2

    cache = index_cache()
    compressor_v2.compress_norm_rope_store(case.kv, case.plan, norm_weight=case.w, norm_eps=1e-6, freq_cis=case.fc,
                                          out_loc=case.out_loc, kvcache=cache, page_size=64)
    return cache


def store_through_sglang_call_site(case, cache):
    """SGLang's own CompressorBackendMixin._forward_compress_all_in_one (indexer branch) with its CUDA-JIT
    compress_forward replaced by a stand-in that returns the compressed rows: the hooked store must accept
    exactly the keywords SGLang passes and write the planned slots of ``cache``. Returns the keywords of each call
    that reached cupy_dsa's store (``core.store_index_k_bf16``)."""
    from sglang.srt.layers.attention.dsv4 import compressor_v2

    from cupy_dsa.sglang import core

    class Backend(compressor_v2.CompressorBackendMixin):
        forward_metadata = types.SimpleNamespace(c4_compress_metadata=case.plan)

    seen = {}

    def fake_compress_forward(**kw):
        seen["plan"] = kw["plan"]
        return case.kv

    stores = []
    real_store = core.store_index_k_bf16

    def spied_store(*a, **k):
        stores.append(k)
        return real_store(*a, **k)

    orig = compressor_v2.compress_forward
    compressor_v2.compress_forward = fake_compress_forward
    core.store_index_k_bf16 = spied_store
    try:
        rows = case.kv.shape[0]
        Backend()._forward_compress_all_in_one(
            kv_score_buffer=torch.zeros(8, 512), kv_score_input=torch.zeros(rows, 512), ape=torch.zeros(4, 128),
            head_dim=128, norm=types.SimpleNamespace(weight=case.w, variance_epsilon=1e-6), freqs_cis_cache=case.fc,
            kv_cache=cache, is_indexer=True, rotate=True, compress_ratio=4, page_size=64, out_loc=case.out_loc)
    finally:
        compressor_v2.compress_forward = orig
        core.store_index_k_bf16 = real_store
    assert seen["plan"] is case.plan
    return stores


def assert_bf16_keys(cache, case):
    """The bf16 cache holds the float64 index key (to bf16 precision) at exactly the expected slots."""
    flat = cache.view(torch.bfloat16).view(-1, 128)
    written = sorted(int(i) for i in (cache.view(-1, 256) != 0).any(1).nonzero().flatten())
    assert written == sorted(loc for _, loc, _ in case.expected), f"written slots {written}, expected {case.expected}"
    for row, loc, pos in case.expected:
        ref = key_f64(case.kv[row:row + 1], torch.tensor([pos]), case.w, case.fc)[0]
        err = (flat[loc].double() - ref).abs().max().item()
        assert err <= 1e-2 * ref.abs().max().item() + 1e-3, f"slot {loc}: max error {err:.3g}"
