"""prepare_index_q: torch reference vs an independent float64 formulation (CPU), the fp8 scale and folded
weights exactly as SGLang computes them, bad input; on a GPU the kernel vs the reference, bit for bit.

Rounding boundaries: the float64 formulation rounds the exact value while the op rounds an fp32 one, so a
value sitting on an e2m1 / e4m3 boundary may land on the other neighbour. The tests therefore ask for exact
agreement on all but 1 % of the elements and, for every element, a dequantized error within one rounding
step: a wrong scale, RoPE pairing, missing Hadamard or wrong weights breaks both.
"""
import math

import numpy as np
import pytest
import torch

import cupy_dsa
from cupy_dsa import query

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
WEIGHT_SCALE = 128 ** -0.5 * 64 ** -0.5   # what SGLang's C4Indexer and the V4 reference pass


def make_inputs(t, *, max_pos=500, device="cpu", w_dtype=torch.bfloat16, pos_dtype=torch.int64):
    d = dict(device=device)
    q = (torch.randn(t, 64, 128, **d) * (torch.rand(t, 64, 1, **d) * 3 + 0.2)).to(torch.bfloat16)
    w = torch.randn(t, 64, **d).to(w_dtype)
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * (10000.0 ** (-torch.arange(32) / 32.0))[None]
    freqs = torch.stack((ang.cos(), ang.sin()), dim=-1).reshape(max_pos, 64).to(torch.float32).to(device)
    pos = torch.randint(0, max_pos, (t,), **d).to(pos_dtype)
    return q, w, freqs, pos


def rotated_f64(q, freqs, pos):
    """RoPE (complex multiply of interleaved pairs of the trailing 64 dims), then H_128 / sqrt(128), in float64."""
    x = q.double().numpy().copy()
    f = freqs.double().numpy()[pos.numpy()]
    c = (f[:, 0::2] + 1j * f[:, 1::2])[:, None, :]
    z = (x[..., 64::2] + 1j * x[..., 65::2]) * c
    x[..., 64::2], x[..., 65::2] = z.real, z.imag
    h = np.array([[1.0]])
    while h.shape[0] < 128:
        h = np.block([[h, h], [h, -h]])
    return x @ h.T / math.sqrt(128.0)


def fp4_f64(x):
    """Nearest e2m1 value times 2^ceil(log2(max(amax, 1e-4) / 6)) per 32 elements; returns (values, scales)."""
    b = x.reshape(*x.shape[:-1], 4, 32)
    scale = 2.0 ** np.ceil(np.log2(np.maximum(np.abs(b).max(-1, keepdims=True), 1e-4) / 6.0))
    a = np.abs(b) / scale
    r = E2M1[np.abs(a[..., None] - E2M1).argmin(-1)]
    return (np.sign(b) * r * scale).reshape(x.shape), np.broadcast_to(scale, b.shape).reshape(x.shape)


def call(numerics, q, w, freqs, pos, **kw):
    return cupy_dsa.prepare_index_q(q, w, freqs_cis=freqs, positions=pos, weight_scale=WEIGHT_SCALE,
                                    numerics=numerics, **kw)


# --------------------------------------------------------------------------------------------------
# CPU: reference vs the float64 math
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32])
def test_fp4sim_matches_float64_math(w_dtype):
    torch.manual_seed(0)
    q, w, freqs, pos = make_inputs(40, w_dtype=w_dtype)
    q_out, w_out = call("fp4sim", q, w, freqs, pos)
    assert q_out.dtype == torch.bfloat16 and q_out.shape == (40, 64, 128)
    x = rotated_f64(q, freqs, pos)
    ref, scale = fp4_f64(x)
    got = q_out.double().numpy()
    assert (got == ref).mean() > 0.99
    assert np.all(np.abs(got - x) <= scale * 1.0 + 1e-5 * np.abs(x).max(-1, keepdims=True))  # widest e2m1 half-step
    assert np.all(np.abs(got - ref) <= scale * 2.0)                    # at most one code from the nearest
    np.testing.assert_allclose(w_out.double().numpy(), w.double().numpy() * WEIGHT_SCALE, rtol=2e-7)
    assert w_out.dtype == torch.float32 and w_out.shape == (40, 64)


def test_fp8_matches_float64_math():
    torch.manual_seed(1)
    q, w, freqs, pos = make_inputs(40, pos_dtype=torch.int32)
    q_out, w_out = call("fp8", q, w, freqs, pos)
    assert q_out.dtype == torch.float8_e4m3fn and q_out.shape == (40, 64, 128)
    x = rotated_f64(q, freqs, pos)
    scale = np.maximum(np.abs(x).max(-1), 1e-4) / 448.0
    got_scale = w_out.double().numpy() / (w.double().numpy() * WEIGHT_SCALE)
    np.testing.assert_allclose(got_scale, scale, rtol=1e-5)
    v = x / scale[..., None]
    ref = torch.from_numpy(v).to(torch.float8_e4m3fn).double().numpy()
    got = q_out.double().numpy()
    assert (got == ref).mean() > 0.99
    ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(v), 2.0 ** -6))) - 3)   # e4m3 spacing at |v|
    # slack: the op's fp32 Hadamard sums err by ~1e-6 of the row's amax (448 here), not of |v|
    assert np.all(np.abs(got - v) <= 0.5 * ulp + 2e-3)


def test_bf16_matches_float64_math():
    """fp8-rescore's stage-2 query: the rotated q rounded to bf16 once (within half a bf16 ulp of the fp64
    rotation, up to the fp32 sums), the weights without a q scale."""
    torch.manual_seed(3)
    q, w, freqs, pos = make_inputs(40)
    q_out, w_out = call("bf16", q, w, freqs, pos)
    assert q_out.dtype == torch.bfloat16 and q_out.shape == (40, 64, 128)
    x = rotated_f64(q, freqs, pos)
    got = q_out.double().numpy()
    ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(x), 2.0 ** -126))) - 7)
    assert np.all(np.abs(got - x) <= 0.5 * ulp + 1e-6 * np.abs(x).max(-1, keepdims=True))
    assert (got == torch.from_numpy(x).to(torch.bfloat16).double().numpy()).mean() > 0.99
    np.testing.assert_allclose(w_out.double().numpy(), w.double().numpy() * WEIGHT_SCALE, rtol=2e-7)
    q8, w8 = call("fp8", q, w, freqs, pos)                                # the same rotation as the fp8 q's
    assert np.allclose((q8.double() * (w8 / w_out).double()[..., None]).numpy(), got, rtol=0.07, atol=1e-3)


def test_rope_uses_the_tokens_row_and_interleaved_pairs():
    """A query that is zero except pair j = 3 of the RoPE dims (70, 71): undoing the Hadamard on the op's
    dequantized fp8 output recovers exactly that pair, rotated by the angle of the token's table row."""
    q = torch.zeros(2, 64, 128, dtype=torch.bfloat16)
    q[:, :, 70], q[:, :, 71] = 1.0, 0.5
    _, _, freqs, _ = make_inputs(2)
    pos = torch.tensor([3, 200])
    q_out, scale = cupy_dsa.prepare_index_q(q, torch.ones(2, 64), freqs_cis=freqs, positions=pos,
                                            weight_scale=1.0, numerics="fp8")
    h = np.array([[1.0]])
    while h.shape[0] < 128:
        h = np.block([[h, h], [h, -h]])
    back = (q_out.double().numpy() * scale.double().numpy()[..., None]) @ h / math.sqrt(128.0)
    c, s = freqs[pos, 6].double().numpy(), freqs[pos, 7].double().numpy()
    np.testing.assert_allclose(back[..., 70], (c - 0.5 * s)[:, None].repeat(64, 1), atol=0.02)
    np.testing.assert_allclose(back[..., 71], (s + 0.5 * c)[:, None].repeat(64, 1), atol=0.02)
    others = np.ones(128, bool)
    others[[70, 71]] = False
    assert np.abs(back[..., others]).max() < 0.02


def test_fp8_scale_and_folded_weights_exactly_as_sglang():
    """One nonzero element outside the RoPE dims: every Hadamard output is +-v*128^-0.5 exactly, so amax,
    scale = max(amax, 1e-4)/448 and w*weight_scale*scale (fp32, left to right) are known to the bit; tiny v
    exercises the 1e-4 floor."""
    f32 = np.float32
    hs = f32(128.0 ** -0.5)
    for v in (3.5, 1e-6):
        q = torch.zeros(1, 64, 128, dtype=torch.bfloat16)
        q[0, :, 5] = v
        _, w, freqs, pos = make_inputs(1)
        _, w_out = call("fp8", q, w, freqs, pos)
        amax = f32(f32(torch.tensor(v, dtype=torch.bfloat16).item()) * hs)
        scale = f32(max(amax, f32(1e-4)) / f32(448.0))
        want = (w.float().numpy() * f32(WEIGHT_SCALE)).astype(f32) * scale
        assert np.array_equal(w_out.numpy(), want.astype(f32))


def test_out_is_written_in_place():
    q, w, freqs, pos = make_inputs(3)
    out = (torch.full((3, 64, 128), float("nan"), dtype=torch.bfloat16), torch.full((3, 64), float("nan")))
    res = call("fp4sim", q, w, freqs, pos, out=out)
    assert res[0] is out[0] and res[1] is out[1]
    want = call("fp4sim", q, w, freqs, pos)
    assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])


def test_outputs_feed_the_logits_op():
    """q_out / weights_out go straight into mqa_logits (bf16 fp4sim query and fp8 query alike)."""
    torch.manual_seed(2)
    q, w, freqs, pos = make_inputs(4)
    kv = torch.randn(10, 128).to(torch.bfloat16)
    ks, ke = torch.zeros(4, dtype=torch.int32), torch.full((4,), 10, dtype=torch.int32)
    for numerics in ("fp4sim", "fp8", "bf16"):
        q_out, w_out = call(numerics, q, w, freqs, pos)
        logits = cupy_dsa.mqa_logits(q_out, kv, w_out, ks, ke)
        assert logits.shape == (4, 10) and torch.isfinite(logits).all()


def test_product_instantiations():
    assert query.product_instantiations() == ["prepare_index_q<0, __nv_bfloat16>"]
    assert len(query.product_instantiations(numerics=("fp4sim", "fp8"),
                                            weight_dtypes=(torch.bfloat16, torch.float32))) == 4


# --------------------------------------------------------------------------------------------------
# bad input
# --------------------------------------------------------------------------------------------------

def test_bad_inputs_name_the_argument():
    q, w, freqs, pos = make_inputs(3)
    cases = [
        (dict(q=q.float()), "q"), (dict(q=q[:, :32]), "q"),
        (dict(q=q.permute(1, 0, 2).contiguous().permute(1, 0, 2)), "q"),
        (dict(w=w.half()), "weights"), (dict(w=w[:2]), "weights"), (dict(freqs=freqs.double()), "freqs_cis"),
        (dict(freqs=freqs[:, :32]), "freqs_cis"), (dict(pos=pos.float()), "positions"),
        (dict(pos=pos[:2]), "positions"), (dict(pos=torch.tensor([0, 1, 500])), "positions"),
        (dict(pos=torch.tensor([0, -1, 2])), "positions"), (dict(numerics="fp4"), "numerics"),
        (dict(weight_scale="x"), "weight_scale"),
        (dict(out=(torch.empty(3, 64, 128), torch.empty(3, 64))), r"out\[0\]"),
        (dict(out=(torch.empty(3, 64, 128, dtype=torch.bfloat16), torch.empty(3, 63))), r"out\[1\]"),
        (dict(out=torch.empty(1)), "out"),
    ]
    for change, name in cases:
        a = dict(q=q, w=w, freqs=freqs, pos=pos, numerics="fp4sim", weight_scale=WEIGHT_SCALE, out=None)
        a.update(change)
        with pytest.raises((ValueError, TypeError), match=name):
            cupy_dsa.prepare_index_q(a["q"], a["w"], freqs_cis=a["freqs"], positions=a["pos"],
                                     weight_scale=a["weight_scale"], numerics=a["numerics"], out=a["out"])


# --------------------------------------------------------------------------------------------------
# GPU: kernel vs reference
# --------------------------------------------------------------------------------------------------

def _on_gpu(numerics, t, w_dtype, pos_dtype, seed):
    torch.manual_seed(seed)
    q, w, freqs, pos = make_inputs(t, device="cuda", w_dtype=w_dtype, pos_dtype=pos_dtype)
    dtype = query._OUT_DTYPE[numerics]
    out = (torch.full((t, 64, 128 * dtype.itemsize), 0x7F, dtype=torch.uint8, device="cuda").view(dtype),
           torch.full((t, 64), float("nan"), device="cuda"))
    call(numerics, q, w, freqs, pos, out=out)
    ref = query.prepare_index_q_reference(q, w, freqs_cis=freqs, positions=pos, weight_scale=WEIGHT_SCALE,
                                          numerics=numerics)
    return (q, w, freqs, pos), out, ref


@pytest.mark.gpu
@pytest.mark.parametrize("numerics", ["fp4sim", "fp8", "bf16"])
@pytest.mark.parametrize("t", [1, 3, 64, 1031])
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32])
def test_kernel_matches_reference_bitwise(numerics, t, w_dtype):
    inputs, out, ref = _on_gpu(numerics, t, w_dtype, torch.int64 if t % 2 else torch.int32, seed=t)
    assert torch.equal(out[0].view(torch.uint8), ref[0].view(torch.uint8))   # poison fully overwritten too
    assert torch.equal(out[1], ref[1])
    again = call(numerics, *inputs)
    assert torch.equal(again[0].view(torch.uint8), out[0].view(torch.uint8)) and torch.equal(again[1], out[1])


@pytest.mark.gpu
def test_kernel_flags_out_of_range_positions_with_nan_weights():
    q, w, freqs, pos = make_inputs(4, device="cuda")
    pos[1], pos[3] = -1, freqs.shape[0]
    _, w_out = call("fp4sim", q, w, freqs, pos)
    bad = torch.isnan(w_out).all(dim=1).cpu()
    assert bad.tolist() == [False, True, False, True]


@pytest.mark.gpu
@pytest.mark.parametrize("numerics", ["fp4sim", "fp8", "bf16"])
def test_cuda_graph_capture_and_replay_with_new_inputs(numerics):
    q, w, freqs, pos = make_inputs(64, device="cuda")
    cupy_dsa.warm_up()
    out = call(numerics, q, w, freqs, pos)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(numerics, q, w, freqs, pos, out=out)
    q2, w2, _, pos2 = make_inputs(64, device="cuda")
    q.copy_(q2); w.copy_(w2); pos.copy_(pos2)
    graph.replay()
    torch.cuda.synchronize()
    ref = query.prepare_index_q_reference(q, w, freqs_cis=freqs, positions=pos, weight_scale=WEIGHT_SCALE,
                                          numerics=numerics)
    assert torch.equal(out[0].view(torch.uint8), ref[0].view(torch.uint8)) and torch.equal(out[1], ref[1])
