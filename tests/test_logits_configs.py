"""Launch configs of the logits kernels: the declared sm_90 configs fit Hopper, the product instantiations,
scheduling variants bitwise equal, reruns deterministic, an undeclared config refused.
"""

import pytest
import torch

from cupy_dsa import logits as L
from cupy_dsa.logits import (mqa_logits, paged_mqa_logits)
from logits_cases import (ARCH, configs, D, FP8, gpu, gpu_paged_case, gpu_prefill_case, H, make_q, PS)


def test_sm90_config_fits_hopper():
    """The sm_90 wgmma decode configs: shared memory of the asked CTAs per SM fits an H100/H200 SM."""
    sm90 = [c for c in L.DECODE.declared("sm_90") if c.kernel is L.SM90_DECODE_KERNEL]
    assert {c.NextN for c in sm90} == {1, 2, 3, 4}
    for cfg in sm90:
        assert cfg.smem <= 227 * 1024, str(cfg)
        assert cfg.MinBlocks * (cfg.smem + 1024) <= 228 * 1024, str(cfg)   # 1 KiB reserved per CTA
        assert cfg.Stages >= 2 and cfg.NextN % cfg.Split == 0


def test_product_instantiations_are_product_configs():
    """What a server warms up is a product config of the arch (what warm_up and the CI matrix compile)."""
    from cupy_dsa import launch
    for arch in ("sm_80", "sm_89", "sm_90", "sm_100", "sm_120"):
        product = set(launch.product_expressions(arch)["mqa_logits.cu"])
        ex = L.product_instantiations(arch, q_fp8=(1, 0), next_ns=(1, 2, 3, 4), layouts=("bf16", "fp8"))
        contiguous = {L.PREFILL.select(("contiguous", qf, 0), arch).expr for qf in (1, 0)}  # no server launches them
        assert set(ex) == product - contiguous, set(ex) ^ (product - contiguous)
        assert any("sm90" in e for e in ex) == (arch == "sm_90")
    one = L.product_instantiations("sm_90", q_fp8=(1,), next_ns=(1,), layouts=("bf16",))
    assert one == ["paged_mqa_logits_plan_kernel", "mqa_logits_plan_kernel", "mqa_logits_sm90_decode_kernel<1, 1, 3, 3, 1, 1, 0>",
                   "mqa_logits_sm90_prefill_kernel<1, 1, 4, 1, 2, 2>"]


def assert_bitwise_equal(outs):
    """Every (what, logits) of ``outs`` equals the first, bit for bit."""
    for what, o in outs[1:]:
        assert torch.equal(o, outs[0][1]), f"{what} differs from {outs[0][0]}: {int((o != outs[0][1]).sum())} entries"


@gpu
def test_gpu_variants_bitwise_equal(seed):
    """Variants of one kernel that change scheduling (Prefetch, L2Hint, MinBlocks, CTAs per SM, keys per CTA; the
    q-in-registers prefill's ring depth, n-tiles per pass and item size), never the arithmetic order, give bitwise
    equal results; Mma8 = 1 changes the arithmetic (left out)."""
    for layout, q_fp8 in (("bf16", 0), ("bf16", 1), ("fp8", 1)):
        q, cache, _, w, ctx, bt = gpu_paged_case(seed, B=7, next_n=1, max_pages=50, P=400, layout=layout,
                                                 q_dtype=FP8 if q_fp8 else torch.bfloat16, lens_2d=False)
        for kernel in (L.SM90_DECODE_KERNEL, L.DECODE_KERNEL):
            outs = []
            for cfg in configs(L.DECODE, (layout, q_fp8, 1), kernel):
                if cfg.values.get("Mma8"):
                    continue
                with L.DECODE.forced(cfg, ARCH):
                    outs.append((cfg, paged_mqa_logits(q, cache, w, ctx, bt, 50 * PS, clean_logits=True)))
            assert_bitwise_equal(outs)
    T = 77
    q2 = make_q((T, H, D), FP8, "cuda")
    w2 = torch.randn(T, H, device="cuda")
    kv = torch.randn(3000, D, device="cuda").to(torch.bfloat16)
    ke = torch.randint(0, 3000, (T,), dtype=torch.int32, device="cuda")
    ks = (ke - 900).clamp_min(0)

    def forced_prefill(cfgs, field, values):
        """The prefill logits of each config with each value of ``field`` forced: (what, logits)."""
        outs = []
        for cfg in cfgs:
            for value in values(cfg):
                with L.PREFILL.forced(cfg.replace(**{field: value}), ARCH):
                    outs.append((f"prefill {cfg} {field}={value}", mqa_logits(q2, kv, w2, ks, ke)))
        return outs

    contiguous = ("contiguous", 1, 0)
    outs = forced_prefill(configs(L.PREFILL, contiguous, Mma8=0), "keys_per_cta", lambda c: (c.keys_per_cta, 64))
    assert len(outs) > 2
    assert_bitwise_equal(outs)
    # q in registers: ring depth, n-tiles per pass, item size
    outs = forced_prefill(configs(L.PREFILL, contiguous, L.QREG_PREFILL_KERNEL), "keys_per_item",
                          lambda c: (c.keys_per_item, 64, 192))
    assert len(outs) > 3
    assert_bitwise_equal(outs)
    # sm_90: the product wgmma one, with other cuts of a tile's key blocks over CTAs
    assert_bitwise_equal(forced_prefill(configs(L.PREFILL, contiguous, L.SM90_PREFILL_KERNEL)[:1], "parts",
                                        lambda c: (0, 1, 3, 40)))


def test_forcing_an_undeclared_config_fails():
    """An undeclared combination is an error, never a silent fallback to another instantiation."""
    undeclared = L.DECODE_KERNEL.config(KeyFp8=0, QFp8=1, Rows=2, Warps=8, MT=4, Prefetch=0, L2Hint=0, Mma8=0,
                                        MinBlocks=4)
    with pytest.raises(ValueError, match="not a declared config"):
        with L.DECODE.forced(undeclared, "sm_90"):
            pass


@gpu
def test_gpu_deterministic(seed):
    """Ten reruns of every fp8-key decode config and of the product prefill are bitwise equal."""
    for layout in ("bf16", "fp8"):
        q, cache, _, w, ctx, bt = gpu_paged_case(seed, B=9, next_n=3, max_pages=40, P=300, layout=layout,
                                                 q_dtype=FP8, lens_2d=True)
        for cfg in configs(L.DECODE, (layout, 1, 3)):
            with L.DECODE.forced(cfg, ARCH):
                first = paged_mqa_logits(q, cache, w, ctx, bt, 40 * PS, clean_logits=True)
                for i in range(10):
                    again = paged_mqa_logits(q, cache, w, ctx, bt, 40 * PS, clean_logits=True)
                    assert torch.equal(again, first), f"{cfg} rerun {i}: {int((again != first).sum())} entries differ"
    for kind in ("fp8", "bf16", "contiguous"):  # on sm_90 the bf16 kinds take the wgmma kernel
        q, kv, bt, _, _, w, ks, ke = gpu_prefill_case(seed, kind, FP8, 150, 30)
        first = mqa_logits(q, kv, w, ks, ke, block_table=bt)
        for i in range(10):
            again = mqa_logits(q, kv, w, ks, ke, block_table=bt)
            assert torch.equal(again, first), f"prefill {kind} rerun {i}: {int((again != first).sum())} differ"
