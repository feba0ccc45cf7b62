"""`cupy-dsa bench variants --emulate`: the cases, the residency it holds this GPU to, the markdown table, the
README's emulation block; the RTX PRO 6000 roofline model of `bench serve`."""
import json
import re
from pathlib import Path

import pytest
import torch

from cupy_dsa import arch as arch_limits
from cupy_dsa import heuristics, logits
from cupy_dsa.bench import variants
from click.testing import CliRunner

from cupy_dsa.bench.cli import main


def test_every_emulated_product_config_is_declared_everywhere():
    """Any arch can force the emulated archs' product configs (the tests, the sanitizers and the bench do on
    the H200), for every problem of the logits families."""
    for fam in (logits.DECODE, logits.PREFILL):
        for target in heuristics.EMULATED_ARCHS:
            for arch in ("sm_80", "sm_90", "sm_100"):
                declared = {(c.kernel, c.template) for c in fam.declared(arch)}
                missing = [str(c) for c in fam.product(target) if (c.kernel, c.template) not in declared]
                assert not missing, (fam.name, target, arch, missing)


def test_cases_are_served_by_the_target_product_configs():
    for quick in (True, False):
        cases = variants.emulate_cases(quick, 0)
        assert {c[0] for c in cases} == {"decode", "verify", "prefill", "extend"}
        for op, name, family, problem, _ in cases:
            for arch in heuristics.EMULATED_ARCHS:
                cfg = family.select(problem, arch)
                # declared on the H200, so that it can be forced there
                assert any(c.kernel is cfg.kernel and c.template == cfg.template for c in family.declared("sm_90"))


def _row(target, product, warps, us_full, us_emul, case="64 x 32K, next_n 4",
         config="mqa_logits_decode_kernel<0, 1, 4, 8, 1, 0, 2, 0, 1>"):
    return dict(op="verify", case=case, target=target, config=config, product=product,
                warps=warps, mt=1, target_ctas=1 if target == "sm_120" else None,
                target_warps=warps if target == "sm_120" else None, target_binding="shared memory",
                held_ctas=1, natural_ctas=2, smem_pad=1000, us_full=us_full, us_emulated=us_emul,
                emulated_vs_full=None if us_emul is None else us_emul / us_full, pct_roofline=50.0, bound="matmul",
                tflops_emulated=1.0, key_bytes=1, flops=1)


def test_markdown_table():
    rows = [_row("sm_120", True, 8, 300.0, 330.0),
            _row("sm_120", False, 4, 280.0, 400.0, config="mqa_logits_decode_kernel<0, 1, 4, 4, 1, 0, 2, 0, 3>"),
            _row("sm_120", True, 8, 300.0, 330.0),            # the product again (a variant equal to it): shown once
            _row("sm_90", True, None, 250.0, None)]
    rows[3]["config"] = "mqa_logits_sm90_decode_kernel<1, 4, 2, 2, 2>"
    md = variants.emulate_markdown(variants.emulate_document("NVIDIA H200", "sm_120", False, 0, rows, {}))
    lines = md.splitlines()
    assert "| verify | 64 x 32K, next_n 4 | * 8 warps, MT 1 | 1 x 8 warps (shared memory) | 300.0 | 330.0 | 1.10 |" \
        in md
    assert "| 1.32x |" in md and "| 1.60x |" in md                    # vs this GPU's product (250 us)
    assert md.count("* 8 warps, MT 1 |") == 1 and "| 4 warps, MT 1, MinBlocks 3 |" in md
    own = lines[-3]
    assert own.startswith("This GPU's own product configs") and "next_n 4: 250.0 us" in own
    # one figure where the range is one ("lose 1.00-1.00x" read as a loss where there was none)
    assert lines[-1] == ("At sm_120's residency its product configs take 1.10x the time of the same config at this "
                         "GPU's residency, the 4-warp configs 1.43x. Grouped verify: 50% of max(read, matmul) time.")


def test_cli_emulate_needs_a_gpu_and_a_known_arch():
    from cupy_dsa.bench.cli_kernels import variants_cmd

    emulate = next(p for p in variants_cmd.params if p.name == "emulate_arch")
    assert tuple(emulate.type.choices) == heuristics.EMULATED_ARCHS   # only archs whose configs are declared here
    for arch in ("sm_90", "sm_89"):
        r = CliRunner().invoke(main, ["bench", "variants", "--emulate", arch])
        assert r.exit_code == 2 and "sm_120" in r.output
    r = CliRunner().invoke(main, ["bench", "variants", "--markdown", "-"])
    assert r.exit_code == 2 and "--emulate" in r.output


@pytest.mark.gpu
def test_padding_holds_this_gpu_to_the_target_residency():
    """For every product config of the emulated archs, the padded launch is held to exactly the target's CTAs
    per SM (the driver's count), and the target needs the pad (sm_120 holds fewer CTAs than the H200)."""
    idx = torch.cuda.current_device()
    for target in heuristics.EMULATED_ARCHS:
        configs = list(dict.fromkeys(c for fam in (logits.DECODE, logits.PREFILL) for c in fam.product(target)))
        resources = variants._target_resources(configs, target)
        for cfg in configs:
            want, padded, held = variants.padded_for(cfg, target, resources, idx)
            assert held == want.ctas >= 1, (str(cfg), str(want), held)
            assert want.warps >= arch_limits.MIN_WARPS_PER_SM


def _block(name):
    root = Path(__file__).parent.parent
    text = (root / "README.md").read_text() + (root / "bench" / "results" / "README.md").read_text()
    m = re.search(rf"<!-- {name} -->\n(.*?)<!-- /{name} -->", text, re.S)
    assert m, f"no README has a {name} block"
    return m.group(1).strip()


def _newest_emulation() -> dict:
    """The newest committed sm_120 emulation run (bench/results/*-emulate-sm120.json): the one the README renders."""
    docs = [json.loads(f.read_text()) for f in (Path(__file__).parent.parent / "bench/results").glob("*-emulate-sm120.json")]
    assert docs, "no committed emulation run"
    return max(docs, key=lambda d: d["date"])


def _rendered_from(name, doc, render):
    from cupy_dsa.bench import readme

    note = readme.stale_note(doc)   # the block says when its run predates a kernel change
    body = _block(f"results:{name}")
    assert (readme.without_stale_note(body) if note is None else body) == render(doc).strip() + (note or "")


def test_readme_emulation_block_is_the_results_file():
    doc = _newest_emulation()
    assert doc["schema"] == variants.EMULATE_SCHEMA and not doc["quick"] and doc["target"] == "sm_120"
    assert doc["ceilings"]["mma_sync"]["bf16"], "the README's emulation carries the mma.sync ceiling (issue 33)"
    _rendered_from("emulate-sm120", doc, variants.emulate_markdown)


def test_readme_model_block_is_the_emulation_run():
    """The RTX PRO 6000 model is rendered from the newest emulation run: the published rates, and bf16 keys' time at
    the share of the roofline each step kind's sm_120 product config reached there."""
    from cupy_dsa.bench import roofline

    doc = _newest_emulation()
    _rendered_from("model-rtx-pro-6000", doc, roofline.readme_block)
    shares = roofline.measured_shares(doc)
    assert set(shares) == {"decode", "verify", "prefill"} and all(0 < s <= 1 for s in shares.values())
    body = _block("results:model-rtx-pro-6000")
    assert f"({100 * shares['prefill']:.0f}%)" in body and doc["git_commit"] in body


def test_model_shares_need_the_ceiling():
    """A run without the mma.sync ceiling (or without a step kind's product row) gives no measured share: the
    README block keeps what it had and says why."""
    from cupy_dsa.bench import readme, roofline

    doc = _newest_emulation()
    old = dict(doc, rows=[dict(r, pct_mma_roofline=None) for r in doc["rows"]])
    with pytest.raises(ValueError, match="prefill 4K x 64K causal with the mma.sync ceiling"):
        roofline.measured_shares(dict(doc, rows=[r for r in doc["rows"] if r["op"] != "prefill"]))
    assert "mma.sync ceiling" in readme.EMULATE_README_BLOCKS["model-rtx-pro-6000"].missing(old)
    rows = roofline.model_rows([], 21, shares=roofline.measured_shares(doc))
    assert rows == []
    text = "<!-- results:model-rtx-pro-6000 -->\nold\n<!-- /results:model-rtx-pro-6000 -->\n"
    assert readme.readme_update(text, old, readme.EMULATE_README_BLOCKS)[0] == text


# --------------------------------------------------------------------------------------------------
# The register-operand mma.sync ceiling (bench/timing.py): its kernel compiles everywhere; the shares use the
# ceiling measured at the residency a row ran at. Figures below are STAND-INS (not measurements).
# --------------------------------------------------------------------------------------------------

STAND_IN_CEILINGS = {"mma_sync": {"bf16": {"4": 500.0, "8": 600.0, "16": 640.0}, "e4m3": None, "chains": 8,
                                  "e4m3_note": "e4m3 mma.sync is not native on sm_90 (ptxas emulates it): not measured"}}


@pytest.mark.parametrize("arch", ["sm_80", "sm_89", "sm_90", "sm_120"])
def test_mma_ceiling_kernel_compiles_without_spills(arch):
    from cupy_dsa import runtime
    from cupy_dsa.bench import timing

    exprs = timing.mma_ceiling_expressions(arch)
    assert exprs == (["mma_ceiling<0>", "mma_ceiling<1>"] if arch in ("sm_89", "sm_120") else ["mma_ceiling<0>"])
    _, lowered, log = runtime.compile_cubin("mma_ceiling", exprs, arch, source=timing.MMA_CEILING_SRC,
                                            resource_usage=True)
    res = runtime.ptxas_resources(log, lowered)
    assert set(res) == set(exprs)
    assert all(r["spill_stores"] == r["spill_loads"] == 0 and r["registers"] >= 4 * timing.MMA_CHAINS
               for r in res.values()), res          # the accumulators stay in registers


def test_mma_ceiling_at_picks_the_residency_it_ran_at():
    from cupy_dsa.bench import timing

    at = timing.mma_ceiling_at
    assert at(STAND_IN_CEILINGS, 8) == (600.0, 8) and at(STAND_IN_CEILINGS, 12) == (600.0, 8)
    assert at(STAND_IN_CEILINGS, 4) == (500.0, 4) and at(STAND_IN_CEILINGS, 2) == (500.0, 4)
    assert at(STAND_IN_CEILINGS, 48) == (640.0, 16)
    assert at(STAND_IN_CEILINGS, 8, "e4m3") is None and at({}, 8) is None and at(STAND_IN_CEILINGS, None) is None
    assert timing.mma_rates(torch.device("cpu")) is None       # CPU: nothing measured, no ratios


def test_markdown_states_the_mma_sync_share():
    rows = [_row("sm_120", True, 8, 300.0, 330.0), _row("sm_90", True, None, 250.0, None)]
    rows[1]["config"] = "mqa_logits_sm90_decode_kernel<1, 4, 2, 2, 2>"
    rows[0].update(variants._mma_shares((600.0, 8), flops=330e-6 * 300e12, read_s=100e-6, seconds=330e-6))
    rows[1].update(variants._mma_shares(None, 1, 1, 1))
    assert rows[0]["pct_mma"] == pytest.approx(50.0) and rows[0]["pct_mma_roofline"] == pytest.approx(50.0)
    md = variants.emulate_markdown(variants.emulate_document("NVIDIA H200", "sm_120", False, 0, rows,
                                                             STAND_IN_CEILINGS))
    assert "% mma.sync ceiling" in md and "| 50% of 600 at 8 warps/SM; 50% |" in md
    assert "bf16 m16n8k16 500 at 4, 600 at 8, 640 at 16" in md and "E4m3 mma.sync is not native on sm_90" in md
    assert "Grouped verify: 50% of max(read, matmul) time, 50% of max(read, mma.sync ceiling)." in md.splitlines()[-1]
    assert "configs -x" not in md   # no 4-warp rows: no empty range
    # a results file from before the ceiling renders as it did (no column)
    old = variants.emulate_markdown(variants.emulate_document("NVIDIA H200", "sm_120", False, 0,
                                                              [_row("sm_120", True, 8, 300.0, 330.0)], {}))
    assert "mma.sync" not in old


def test_markdown_names_the_q_in_registers_prefill_and_the_config_it_replaced():
    rows = [_row("sm_120", True, 8, 300.0, 300.0, case="4K x 64K causal", config="mqa_logits_qreg_kernel<1, 0, 4, 2>"),
            _row("sm_120", False, 8, 330.0, 330.0, case="4K x 64K causal",
                 config="mqa_logits_kernel<0, 1, 4, 8, 1, 0, 0, 2, 0, 1> keys_per_cta=16384")]
    for r, pct in zip(rows, (60.0, 55.0)):
        r.update(op="prefill", tflops_emulated=400.0 * pct / 60.0, pct_mma=pct, mma_ceiling_tflops=600.0,
                 mma_ceiling_warps=8, pct_mma_roofline=pct)
    rows[1]["previous"] = True
    md = variants.emulate_markdown(variants.emulate_document("NVIDIA H200", "sm_120", False, 0, rows,
                                                             STAND_IN_CEILINGS))
    assert "| * q in registers, 8 rows x 1 warp, 4 stages, NT 2 |" in md
    assert ("Prefill at 60% of the bf16 mma.sync ceiling at 8 warps/SM (the 4-row-tile config it replaced: 367 "
            "TFLOP/s, 55%).") in md.splitlines()[-1]
    cfg = logits.PREFILL.select(("contiguous", 1, 0), "sm_120")
    assert cfg.kernel is logits.QREG_PREFILL_KERNEL
    assert heuristics.previous_small_smem_prefill(("contiguous", 1, 0), "sm_120").kernel is logits.PREFILL_KERNEL
