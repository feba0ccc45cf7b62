"""``cupy-dsa bench resources``: ptxas's resource report (registers, spills, shared memory) of every product
config on every target arch, as the markdown table the README lists. NVRTC only: no GPU needed."""

from __future__ import annotations

from cupy_dsa import launch, runtime

ARCHS = ("sm_80", "sm_89", "sm_90", "sm_100", "sm_120")


def rows(archs=ARCHS) -> list[dict]:
    out = []
    for arch in archs:
        configs = {c.expr: c for f in launch.families().values() for c in f.product(arch)}
        for source, exprs in launch.product_expressions(arch).items():
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
