"""``cupy-dsa bench resources``: ptxas's resource report (registers, spills, shared memory) of every product
config on every target arch, as the markdown table the README lists. NVRTC only: no GPU needed."""

from __future__ import annotations

from cupy_dsa import launch, runtime

ARCHS = ("sm_80", "sm_89", "sm_90", "sm_100", "sm_120")


def rows(archs=ARCHS, progress=None) -> list[dict]:
    """ptxas's resources of every product config per arch; ``progress(text)`` is told each compile as it starts
    (a cold compile of all of them takes minutes)."""
    out = []
    for arch in archs:
        configs = {c.expr: c for f in launch.families().values() for c in f.product(arch)}
        for source, exprs in launch.product_expressions(arch).items():
            if progress:
                progress(f"compiling {source} for {arch} ({len(exprs)} product configs)")
            _, lowered, log = runtime.compile_cubin(source, exprs, arch, resource_usage=True)
            for expr, r in runtime.ptxas_resources(log, lowered).items():
                out.append(dict(r, arch=arch, config=expr, dynamic_smem=configs[expr].smem))
    return out


def markdown(rs: list[dict]) -> str:
    """Per arch and kernel: configs, register range, spill bytes, dynamic shared memory range."""
    groups: dict[tuple, list[dict]] = {}
    for r in rs:
        groups.setdefault((r["arch"], r["config"].split("<")[0]), []).append(r)
    lines = ["| arch | kernel | product configs | registers | spill bytes (st/ld) | dynamic smem (KiB) |",
             "|---|---|---|---|---|---|"]
    for (arch, kernel), g in groups.items():
        regs = sorted(r["registers"] for r in g)
        smem = sorted(r["dynamic_smem"] for r in g)
        spill = (sum(r["spill_stores"] for r in g), sum(r["spill_loads"] for r in g))
        lines.append(f"| {arch} | `{kernel}` | {len(g)} | {regs[0]}-{regs[-1]} | {spill[0]}/{spill[1]} | "
                     f"{smem[0] / 1024:.1f}-{smem[-1] / 1024:.1f} |")
    return "\n".join(lines)


def residency_rows(archs=None) -> list[dict]:
    """CTAs and warps per SM of the logits product configs on each arch of ``cupy_dsa.arch``'s table (bf16
    keys, SGLang's fp8 q): ptxas's registers and static shared memory with the arch's limits."""
    from cupy_dsa import arch as arch_limits
    from cupy_dsa import logits

    out = []
    for arch in archs or arch_limits.ARCH_LIMITS:
        cases = [("prefill", logits.PREFILL.select(("bf16", 1, 0), arch))]
        cases += [(f"decode next_n {n}", logits.DECODE.select(("bf16", 1, n), arch)) for n in (1, 2, 3, 4)]
        exprs = list(dict.fromkeys(c.expr for _, c in cases))
        _, lowered, log = runtime.compile_cubin(cases[0][1].source, exprs, arch, resource_usage=True)
        res = runtime.ptxas_resources(log, lowered)
        for what, cfg in cases:
            r = res[cfg.expr]
            resid = cfg.residency_on(arch, r)
            out.append(dict(arch=arch, op=what, kernel=cfg.kernel.name, config=str(cfg), registers=r["registers"],
                            smem=cfg.smem + r["static_smem"], ctas=resid.ctas, warps=resid.warps,
                            binding=resid.binding))
    return out


def residency_markdown(rs: list[dict]) -> str:
    """Per arch: resident CTAs x warps per SM (and the limit that binds) of each logits product config."""
    ops = list(dict.fromkeys(r["op"] for r in rs))
    lines = ["| arch | " + " | ".join(ops) + " |", "|---|" + "---|" * len(ops)]
    for arch in dict.fromkeys(r["arch"] for r in rs):
        cells = {r["op"]: r for r in rs if r["arch"] == arch}
        lines.append(f"| {arch} | " + " | ".join(
            f"{c['ctas']} x {c['warps'] // max(c['ctas'], 1)} = {c['warps']} warps ({c['binding']}"
            + (", wgmma" if "sm90" in c["kernel"] else "") + ")" for c in (cells[o] for o in ops)) + " |")
    return "\n".join(lines)
