"""The kernel-level commands of ``cupy-dsa bench``: ``variants`` (every declared logits config on this GPU, or
another arch's product configs at its residency with ``--emulate``), ``rescore`` (the fp8-rescore top-k against the
bf16, fp8 and DeepGEMM ones, with the floor of its stage 2) and ``resources`` (ptxas registers, spills and shared
memory per arch, and the resident CTAs per SM). Options, checks and console output; the measurements live in
:mod:`.variants`, :mod:`.rescore` and :mod:`.resources`.
"""

from __future__ import annotations

import json
import re

import click

from . import cli_common as common
from . import output_guard

VARIANTS_SCHEMA = "cupy-dsa-variants/1"   # `bench variants` without --emulate


@click.command(name="variants")
@click.option("--device", default=None, metavar="DEV", help="CUDA device, e.g. cuda:1. [default: the current one]")
@click.option("--quick", is_flag=True, default=False, help="two decode cases and a smaller prefill.")
@click.option("--seed", type=common.SEED, default=0, show_default=True, help="random seed, 0 to 2^32 - 1.")
@click.option("--emulate", "emulate_arch", default=None, metavar="ARCH",
              type=click.Choice(["sm_120"]),   # the archs every arch declares the product configs of
              help="run ARCH's product configs (and their variants) on this GPU held to ARCH's CTAs per SM "
                   "(padded shared memory), against this GPU's natural residency and its own product configs.")
@click.option("--op", "ops", multiple=True, type=click.Choice(["decode", "verify", "prefill", "extend"]),
              help="--emulate: only these cases (repeatable). [default: all four]")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True), default=None,
              callback=output_guard.guarded_option(output_guard.JSON), help="write the rows as JSON.")
@click.option("--markdown", "markdown_path", type=click.Path(dir_okay=False, writable=True, allow_dash=True),
              default=None, callback=output_guard.guarded_option(output_guard.MARKDOWN),
              help="--emulate: write the table as markdown (- = stdout).")
@output_guard.FORCE_OPTION
def variants_cmd(device, quick, seed, emulate_arch, ops, json_path, markdown_path, force):
    """Time every declared config (product and experimental) of the decode and prefill logits on this GPU,
    on the same inputs; the product config of each case first (experimental configs run only here and in
    the tests). With --emulate ARCH: ARCH's product configs under ARCH's residency. Needs a CUDA GPU."""
    from rich.table import Table

    from . import report, variants

    if markdown_path and not emulate_arch:
        raise click.BadParameter("the markdown table is written for --emulate runs", param_hint="--markdown")
    if ops and not emulate_arch:
        raise click.BadParameter("cases are picked for --emulate runs", param_hint="--op")
    dev, _ = common.resolve_device("cuda", device, has_backend_option=False)
    run = output_guard.run_of({"schema": variants.EMULATE_SCHEMA if emulate_arch else VARIANTS_SCHEMA,
                               "target": emulate_arch, "device": common.device_name(dev), "quick": quick})
    output_guard.check(json_path, "--json", output_guard.JSON, run, force)
    output_guard.check(markdown_path, "--markdown", output_guard.MARKDOWN, run, force)
    if emulate_arch:
        err = common.console(stderr=True)
        rows, ceilings = variants.emulate_rows(
            dev, emulate_arch, quick, seed, ops=ops,
            progress=lambda r: err.print(f"[dim]{r['op']} {r['case']}: {r['config']}: {r['us_full']:.1f} us[/]"))
        doc = variants.emulate_document(common.device_name(dev), emulate_arch, quick, seed, rows, ceilings, ops)
        md = variants.emulate_markdown(doc)
        click.echo(md)
        if json_path:
            common.write_text(json_path, json.dumps(doc, indent=1) + "\n")
        if markdown_path:
            common.write_markdown(md if md.endswith("\n") else md + "\n", markdown_path)
        return
    from .timing import mma_rates

    ceilings = {"mma_sync": mma_rates(dev, quick)}
    rows = variants.decode_rows(dev, quick, seed) + variants.prefill_rows(dev, quick, seed, ceilings)
    table = Table(title=f"variants on {common.device_name(dev)}")
    for col in ("op", "case", "config", "us", "vs product"):
        table.add_column(col)
    for r in rows:
        case = (f"{r['layout']} B={r['B']} ctx={r['ctx']} next_n={r['next_n']}" if r["op"] == "decode"
                else f"q={r['q']} T={r['T']} S={r['S']} ({r['tflops']:.0f} TFLOP/s"
                + (f", {r['pct_mma']:.0f}% of the mma.sync ceiling at {r['mma_ceiling_warps']} warps/SM"
                   if r.get("pct_mma") is not None else "") + ")")
        table.add_row(r["op"], case, ("* " if r["product"] else "  ") + r["config"], f"{r['us']:.1f}",
                      f"{r['vs_product']:.3f}")
    report.print_fitted(common.console(), table, keys=2)
    if json_path:
        from . import provenance

        common.write_text(json_path, json.dumps({"schema": VARIANTS_SCHEMA, **provenance.provenance(),
                                                 "device": common.device_name(dev), "quick": quick, "seed": seed,
                                                 "ceilings": ceilings, "rows": rows}, indent=1) + "\n")


@click.command(name="rescore")
@click.option("--device", default=None, metavar="DEV", help="CUDA device, e.g. cuda:1. [default: the current one]")
@click.option("--quick", is_flag=True, default=False,
              help="one case per phase: decode 8 x 64K, verify 8 x 64K next_n 2, extend 8 x 512 after 32K-64K, "
                   "prefill chunk of 4,096 after 32K.")
@click.option("--phase", "phases", multiple=True, type=click.Choice(["decode", "verify", "extend", "prefill"]),
              help="time only these phases (repeatable). [default: all four]")
@click.option("--seed", type=common.SEED, default=0, show_default=True, help="random seed, 0 to 2^32 - 1.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True), default=None,
              callback=output_guard.guarded_option(output_guard.JSON),
              help="write the rows as JSON (schema cupy-dsa-rescore/1; `bench report FILE` prints its markdown table).")
@output_guard.FORCE_OPTION
def rescore_cmd(device, quick, phases, seed, json_path, force):
    """Time the exact top-k of two-level keys (fp8-rescore: fp8 logits, K' = 4 x index_topk candidates rescored
    from the fp8 and int8-residual pages) against the top-k of bf16 keys, of fp8 keys (our logits + the stock top-k)
    and of DeepGEMM's fp8 logits as SGLang calls them (+ the same top-k; when deep_gemm imports), on the same keys:
    decode, MTP verify (next_n 2-4), varlen extend and prefill chunks; stage 1 (logits) and stage 2 + selection
    apart, and the floor of stage 2 + selection (its bytes over the read-only stream, its flops over the bf16
    mma.sync ceiling, both measured in the same run) with the share of it reached; memory per index entry. The
    stock top-k is SGLang's own v2 kernel where it runs here (its v1 and our paged_topk timed beside it), else
    cupy_dsa.paged_topk standing in for it. Needs a CUDA GPU."""
    from rich.table import Table

    from . import peers, provenance, report
    from . import rescore as rescore_bench

    dev, _ = common.resolve_device("cuda", device, has_backend_option=False)
    output_guard.check(json_path, "--json", output_guard.JSON, output_guard.run_of(
        {"schema": rescore_bench.SCHEMA, "device": common.device_name(dev), "quick": quick}), force)
    import torch

    torch.cuda.set_device(dev)
    err = common.console(stderr=True)
    dg, reason = peers.deepgemm()
    if dg is None:
        err.print(f"[yellow]DeepGEMM columns not measured: {reason}[/]")
    topks = common.load_topks(dev, err)
    ceilings = _rescore_ceilings(dev, quick, err)
    doc = {"schema": rescore_bench.SCHEMA, **provenance.provenance(), "device": common.device_name(dev),
           "driver": provenance.driver_version(), "quick": quick, "seed": seed,
           "index_topk": rescore_bench.INDEX_TOPK, "k_prime": rescore_bench.K_PRIME, "deepgemm": reason or "live",
           "topk": topks.describe(), "columns": rescore_bench.legend(topks.describe()),
           "memory": rescore_bench.memory_rows(), "phases": list(phases) or list(rescore_bench.PHASES),
           "ceilings": ceilings, "floor_target": dict(rescore_bench.FLOOR_TARGET),
           "stage2_keys_per_candidate": rescore_bench.STAGE2_KEYS_PER_CANDIDATE, "note": rescore_bench.__doc__}
    with common.progress(err) as progress:
        doc["rows"] = rescore_bench.rows(dev, quick, seed, dg, reason, progress, phases=phases or None, topks=topks,
                                         ceilings=ceilings)
    cols = rescore_bench._columns_of(doc) if doc["rows"] else list(rescore_bench.COLUMNS)
    table = Table(title=f"top-{rescore_bench.INDEX_TOPK} per query row on {doc['device']} (us per call; x bf16)")
    for col in ("case", "rows") + tuple(cols):
        table.add_column(col)
    for r in doc["rows"]:
        table.add_row(r["case"], str(r["rows"]), *("-" if r["us"][c] is None else
                                                   f"{r['us'][c]:.1f} ({r['vs_bf16'][c]:.2f})" for c in cols))
    report.print_fitted(common.console(), table, keys=2)
    report.print_fitted(common.console(), _floor_table(doc, rescore_bench), keys=2)
    for r in doc["rows"]:
        for what, why in r["errors"].items():
            if (what not in rescore_bench.DEEPGEMM_COLUMNS or dg is not None) and what not in rescore_bench.SGLANG_COLUMNS:
                err.print(f"[red]{r['case']}: {what}: {why}[/]")
    if json_path:
        common.write_text(json_path, json.dumps(doc, indent=1) + "\n")


def _rescore_ceilings(dev, quick, err) -> dict | None:
    """The read-only stream and the register-operand mma.sync ceilings (with the copy and matmul ones), measured
    now for the floor of "stage 2 + selection"; None (the floor then has no time) when they cannot be measured."""
    from . import timing

    try:
        ceilings = timing.measure_ceilings(dev, quick)
    except Exception as exc:  # noqa: BLE001 - the run goes on without a floor in time, and says why
        err.print(f"[yellow]ceilings not measured ({type(exc).__name__}: {str(exc)[:200]}): no floor in time[/]")
        return None
    if not ceilings.get("read_gbps") or not (ceilings.get("mma_sync") or {}).get("bf16"):
        err.print("[yellow]the read-only stream or the bf16 mma.sync ceiling was not measured: no floor in time[/]")
    return ceilings


def _floor_table(doc, rescore_bench):
    """The floor of "stage 2 + selection" per case and the share of it reached (issue 31), as the console shows it."""
    from rich.table import Table

    fl0 = next((r["floor"] for r in doc["rows"] if r["floor"].get("us") is not None), None)
    rates = ("no ceilings measured" if fl0 is None else f"read {fl0['read_gbps']:.0f} GB/s, bf16 mma.sync "
             f"{fl0['mma_tflops']:.0f} TFLOP/s at {fl0['mma_warps_per_sm']} warps/SM")
    table = Table(title=f"floor of stage 2 + selection ({rates}): share reached, target")
    for col in ("case", "rows x entries", "MB", "GFLOP", "floor us", "binds", "target") + rescore_bench.FLOOR_COLUMNS:
        table.add_column(col)
    for r in doc["rows"]:
        fl = r["floor"]
        shares = [("-" if fl["share"][c] is None else f"{100 * fl['share'][c]:.0f}% {fl['verdict'][c]}")
                  for c in rescore_bench.FLOOR_COLUMNS]
        table.add_row(r["case"], f"{fl['entry_rows']:,}", f"{fl['bytes'] / 1e6:.1f}", f"{fl['flops'] / 1e9:.1f}",
                      "-" if fl["us"] is None else f"{fl['us']:.1f}", fl["binds"] or "-", f">= {fl['target']:.0%}",
                      *shares)
    return table



def _archs_option(ctx, param, values):
    """--arch: ``sm_NN`` of sm_80 or newer that this NVRTC compiles for (checked here: a bad arch would end
    in thousands of lines of NVRTC errors)."""
    from cupy_dsa import runtime

    archs = []
    for value in values:
        m = re.fullmatch(r"sm_(\d+)", value.strip().lower())
        if not m:
            raise click.BadParameter(f"expected an arch such as sm_90 (sm_{runtime.MIN_ARCH} or newer), got {value!r}")
        cc = int(m.group(1))
        if cc < runtime.MIN_ARCH:
            raise click.BadParameter(f"{value}: the kernels need sm_{runtime.MIN_ARCH} or newer (bf16 tensor-core "
                                     "mma and cp.async)")
        try:
            supported = runtime.cupy_module().cuda.nvrtc.getSupportedArchs()
        except Exception:  # noqa: BLE001 - no CuPy / NVRTC here: the compile says so itself
            supported = None
        if supported and cc not in supported:
            known = ", ".join(f"sm_{a}" for a in supported if a >= runtime.MIN_ARCH)
            raise click.BadParameter(f"{value}: this NVRTC does not compile for it (it does for {known})")
        archs.append(f"sm_{cc}")
    return tuple(archs)


@click.command(name="resources")
@click.option("--arch", "archs", multiple=True, callback=_archs_option,
              help="target arch, sm_80 or newer (repeatable). [default: sm_80 sm_89 sm_90 sm_100 sm_120]")
def resources_cmd(archs):
    """ptxas's registers / spills / shared memory of every product kernel config per target arch (NVRTC, no
    GPU), and the resident CTAs / warps per SM of the logits configs on each arch, as the README's tables."""
    from cupy_dsa import runtime

    from . import resources

    try:  # before any compile: without the CUDA extra this is the whole message, not a traceback's last line
        runtime.cupy_module()
    except ImportError as exc:
        raise click.ClickException(f"bench resources compiles the kernels with NVRTC through CuPy: {exc}") from None
    click.echo("NVRTC compiles every product config of each arch (minutes on a cold cache); each compile is named "
               "on stderr as it starts.", err=True)
    click.echo(resources.markdown(resources.rows(archs or resources.ARCHS, progress=lambda t: click.echo(t, err=True))))
    click.echo("\nResident CTAs x warps per SM of the logits product configs (bf16 keys, fp8 q; the limit that "
               "binds):\n")
    from cupy_dsa import arch as arch_limits

    click.echo(resources.residency_markdown(resources.residency_rows(
        [a for a in (archs or arch_limits.ARCH_LIMITS) if a in arch_limits.ARCH_LIMITS])))

