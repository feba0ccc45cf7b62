"""store_index_k's test inputs, shared by tests/test_store.py and tests/test_store_two_level.py: random inputs, the
independent float64 formulation of a stored key, cache helpers, and for the GPU tests the device's rsqrtf swapped
into the reference (fixture ``device_rsqrt``) and a case of ~10% skipped rows (:func:`gpu_case`)."""
import math

import numpy as np
import pytest
import torch

from cupy_dsa import layouts, runtime, store
from cupy_dsa.layouts import BF16_PAGE_BYTES, FP8_PAGE_BYTES, FP8_SCALE_OFFSET, PAGE_SLOTS

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
STYLES = ("v4", "v32")
QUANT = (("bf16", "exact"), ("bf16", "fp4sim"), ("fp8", "exact"))


# --------------------------------------------------------------------------------------------------
# inputs and the independent float64 formulation
# --------------------------------------------------------------------------------------------------

def make_inputs(n, *, style="v4", max_pos=300, in_dtype=torch.float32, device="cpu", pos_dtype=torch.int64):
    d = dict(device=device)
    kv = (torch.randn(n, 128, **d) * (torch.rand(n, 1, **d) * 4 + 0.5) + torch.randn(n, 1, **d) * 0.3).to(in_dtype)
    w = torch.rand(128, **d) + 0.5
    b = torch.randn(128, **d) * 0.2 if style == "v32" else None
    ang = (torch.rand(max_pos, 32, dtype=torch.float64, **d) * 2 - 1) * math.pi
    freqs = torch.stack((ang.cos(), ang.sin()), dim=-1).reshape(max_pos, 64).float()
    pos = torch.randint(0, max_pos, (n,), **d).to(pos_dtype)
    return dict(kv=kv, positions=pos, norm_weight=w, norm_bias=b, freqs_cis=freqs)


def _hadamard_matrix():
    i = np.arange(128)
    pc = np.vectorize(lambda v: bin(int(v)).count("1"))(i[:, None] & i[None, :])
    return torch.from_numpy(np.where(pc % 2 == 0, 1.0, -1.0) / math.sqrt(128.0))


H128 = _hadamard_matrix()


def ideal_key(kv, positions, norm_weight, freqs_cis, norm_bias=None, eps=1e-6, key_style="v4", hadamard=True):
    """float64: norm, complex-multiplication RoPE, explicit Hadamard matrix."""
    x = kv.double().cpu()
    w = norm_weight.double().cpu()
    if key_style == "v4":
        x = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w
    else:
        d = x - x.mean(-1, keepdim=True)
        x = d / torch.sqrt((d * d).mean(-1, keepdim=True) + eps) * w + norm_bias.double().cpu()
    f = freqs_cis.double().cpu()[positions.long().cpu()]
    rot = torch.complex(f[:, 0::2], f[:, 1::2])
    x = x.clone()
    if key_style == "v4":
        z = torch.complex(x[:, 64::2], x[:, 65::2]) * rot
        x[:, 64::2], x[:, 65::2] = z.real, z.imag
    else:
        z = torch.complex(x[:, :32], x[:, 32:64]) * rot
        x[:, :32], x[:, 32:64] = z.real, z.imag
    if hadamard:
        x = x @ H128.T
    return x


def fp4_ideal(x):
    """float64 e2m1 rounding (nearest value, ties to the even code) with scale 2^ceil(log2(max(amax,1e-4)/6))."""
    xb = x.reshape(-1, 4, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    scale = torch.exp2(torch.ceil(torch.log2(torch.clamp_min(amax, 1e-4) / 6.0)))
    q = xb / scale
    dist = (q.abs()[..., None] - E2M1).abs()
    best = dist.min(-1, keepdim=True).values
    # among equally near codes take the even one (codes 0..7 in E2M1 order)
    cand = (dist == best) & (torch.arange(8) % 2 == 0)
    code = torch.where(cand.any(-1), cand.float().argmax(-1), dist.argmin(-1))
    return (torch.copysign(E2M1[code], q) * scale).reshape(x.shape), scale


def row_rms(x):
    return x.double().pow(2).mean(-1, keepdim=True).sqrt()


def unique_locs(n, num_pages, device="cpu"):
    return torch.randperm(num_pages * PAGE_SLOTS, device=device)[:n]


def poisoned(num_pages, layout, device="cpu"):
    return torch.randint(0, 256, (num_pages, layouts.page_bytes(layout)), dtype=torch.uint8, device=device)


def slot_bytes(cache, loc, layout):
    """Flat byte indices of the slots ``loc`` (values then scale for fp8), computed from the layout spec."""
    loc = loc.long()
    page, slot = loc // 64, loc % 64
    ar = torch.arange(256, device=loc.device)
    if layout == "bf16":
        base = page * BF16_PAGE_BYTES + slot * 256
        return (base[:, None] + ar).flatten()
    vals = page[:, None] * FP8_PAGE_BYTES + slot[:, None] * 128 + ar[:128]
    sc = page[:, None] * FP8_PAGE_BYTES + FP8_SCALE_OFFSET + slot[:, None] * 4 + ar[:4]
    return torch.cat((vals, sc), 1).flatten()


def read_slots(cache, loc, layout):
    """(values float32 [n, 128], scales float32 [n] or None) of the slots ``loc``."""
    flat = cache.reshape(-1).cpu()
    idx = slot_bytes(cache, loc.cpu(), layout).view(len(loc), -1)
    raw = flat[idx]
    if layout == "bf16":
        return raw.contiguous().view(torch.bfloat16).float(), None
    vals = raw[:, :128].contiguous().view(torch.float8_e4m3fn).float()
    sc = raw[:, 128:].contiguous().view(torch.float32).flatten()
    return vals * sc[:, None], sc




# --------------------------------------------------------------------------------------------------
# SGLang's plan rows, a good call (the bad-input tests change one argument of it)
# --------------------------------------------------------------------------------------------------

PLAN_N, PLAN_PAGES, PLAN_MAX_POS = 40, 3, 300


def _decode_plan(seq_lens):
    rows = np.zeros((len(seq_lens), 16), dtype=np.uint8)
    for i, s in enumerate(seq_lens):
        rows[i] = np.frombuffer(np.array([s & 0xFFFFFFFF, 0xDEADBEEF, 7, 9], dtype="<u4").tobytes(), np.uint8)
    return torch.from_numpy(rows)


def _prefill_plan(seq_lens, ragged):
    rows = np.zeros((len(seq_lens), 16), dtype=np.uint8)
    for i, (s, r) in enumerate(zip(seq_lens, ragged)):
        rows[i, :4] = np.frombuffer(np.uint32(s).tobytes(), np.uint8)
        rows[i, 4:6] = np.frombuffer(np.uint16(r).tobytes(), np.uint8)
        rows[i, 6:8] = np.frombuffer(np.uint16(0xBEEF).tobytes(), np.uint8)
        rows[i, 8:16] = 0xAB
    return torch.from_numpy(rows)


def _good():
    inp = make_inputs(6, style="v4")
    return dict(kv=inp["kv"], cache=layouts.empty_cache(2, "bf16"), positions=inp["positions"],
                out_loc=unique_locs(6, 2), norm_weight=inp["norm_weight"], freqs_cis=inp["freqs_cis"])


# --------------------------------------------------------------------------------------------------
# GPU cases
# --------------------------------------------------------------------------------------------------

@pytest.fixture
def device_rsqrt(monkeypatch):
    """Swap the GPU's rsqrtf into the reference, so kernel and reference must agree bit for bit."""
    cp = runtime.cupy_module()
    kern = cp.RawKernel(r'''
extern "C" __global__ void rsq(const float* x, float* y, long long n) {
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = rsqrtf(x[i]);
}''', "rsq", options=("-ftz=true",))

    def dev_rsqrt(x):
        xs = x.to("cuda", torch.float32).contiguous()
        y = torch.empty_like(xs)
        n = xs.numel()
        if n:
            torch.cuda.synchronize()
            with cp.cuda.Device(xs.device.index):
                kern(((n + 255) // 256,), (256,), (xs.data_ptr(), y.data_ptr(), np.int64(n)))
                cp.cuda.runtime.deviceSynchronize()
        return y.to(x.device)

    monkeypatch.setattr(store, "_rsqrt", dev_rsqrt)
    return dev_rsqrt


def _skip_mix(n, num_pages, max_pos, pos, loc):
    """~10% skips: negative / out-of-range out_loc and out-of-range positions."""
    r = torch.rand(n, device=loc.device)
    loc = torch.where(r < 0.03, torch.full_like(loc, -1), loc)
    loc = torch.where((r >= 0.03) & (r < 0.05), loc + num_pages * 64, loc)
    pos = torch.where((r >= 0.05) & (r < 0.08), torch.full_like(pos, -3), pos)
    pos = torch.where((r >= 0.08) & (r < 0.10), pos + max_pos, pos)
    return pos, loc


def _count(a, b):
    return (a != b).sum().item()




def gpu_case(n, key_style, in_dtype, **options):
    """A GPU store case of ``n`` keys: (inputs, pages, the store's keyword arguments, the rows it writes) with ~10%
    of the rows skipped (out_loc and positions out of range); ``options`` go into the keyword arguments."""
    dev = torch.device("cuda")
    max_pos = 4096
    pos_dtype = torch.int64 if in_dtype == torch.float32 else torch.int32
    inp = make_inputs(n, style=key_style, max_pos=max_pos, in_dtype=in_dtype, device=dev, pos_dtype=pos_dtype)
    num_pages = (n * 11 // 10) // 64 + 2
    loc = unique_locs(n, num_pages, dev)
    pos, loc = _skip_mix(n, num_pages, max_pos, inp["positions"], loc)
    kw = dict(positions=pos, out_loc=loc, norm_weight=inp["norm_weight"], freqs_cis=inp["freqs_cis"],
              norm_bias=inp["norm_bias"], key_style=key_style, **options)
    valid = (loc >= 0) & ((loc >> 6) < num_pages) & (pos >= 0) & (pos < max_pos)
    return inp, num_pages, kw, valid


def target_bytes(cache, kw, valid, layout):
    """Bool mask over ``cache``'s bytes: the slots the case's valid rows write."""
    target = torch.zeros(cache.numel(), dtype=torch.bool, device=cache.device)
    if valid.any():
        target[slot_bytes(cache, kw["out_loc"][valid], layout)] = True
    return target
