"""``cupy-dsa bench variants``: every declared config (product and experimental) of the logits families on
this GPU, timed on the same inputs, one row per (case, config); the product config of each case comes first,
so a row's ``vs_product`` says what switching to that variant would gain or lose.

Variants are launched through the public ops with ``Family.forced`` (the only way an experimental config
runs); the timer is the bench's CUDA-graph timer over 5 calls.
"""

from __future__ import annotations

import torch

from cupy_dsa import arch as arch_limits
from cupy_dsa import heuristics, launch, layouts, logits, runtime

from .provenance import commit_label

HEADS, DIM = layouts.N_HEADS, layouts.HEAD_DIM
DECODE_CASES = [(1, 8192, 1), (64, 32768, 1), (128, 16384, 1), (4, 262144, 1), (64, 32768, 2), (64, 32768, 4)]


def _time_us(fn, device, reps):
    from .timing import time_calls

    return time_calls([fn] * 5, device, reps=reps).seconds * 1e6


def _rows_for(family: launch.Family, problem, arch, run, device, reps, base: dict) -> list[dict]:
    rows = []
    product_us = None
    for cfg in family.candidates(problem, arch):
        with family.forced(cfg, arch):
            us = _time_us(run, device, reps)
        product_us = us if product_us is None else product_us
        rows.append(dict(base, config=str(cfg), product=not rows, us=us, vs_product=us / product_us,
                         warps_per_sm=cfg.resident_ctas_per_sm(device.index) * cfg.block[0] // 32,
                         mma_sync=cfg.kernel not in (logits.SM90_DECODE_KERNEL, logits.SM90_PREFILL_KERNEL)))
    return rows


def decode_rows(device, quick: bool, seed: int) -> list[dict]:
    g = torch.Generator(device=device).manual_seed(seed)
    arch = runtime.device_arch(device.index)
    rows = []
    for layout in ("bf16", "fp8"):
        for B, ctx_len, next_n in DECODE_CASES[:2] if quick else DECODE_CASES:
            pages = ctx_len // layouts.PAGE_SLOTS
            cache = layouts.empty_cache(B * pages, layout, device=device)
            cache.random_(0, 120, generator=g)
            q = torch.randn(B, next_n, HEADS, DIM, device=device, generator=g).mul_(3).to(torch.float8_e4m3fn)
            w = torch.randn(B * next_n, HEADS, device=device, generator=g)
            ctx = torch.full((B,), ctx_len, dtype=torch.int32, device=device)
            bt = torch.randperm(B * pages, device=device, generator=g).to(torch.int32).view(B, pages)
            plan = logits.paged_mqa_logits_plan(ctx, next_n)
            rows += _rows_for(logits.DECODE, (layout, 1, next_n), arch,
                              lambda: logits.paged_mqa_logits(q, cache, w, ctx, bt, ctx_len, plan=plan), device,
                              10 if quick else 30, dict(op="decode", layout=layout, B=B, ctx=ctx_len, next_n=next_n))
            del cache
    return rows


def prefill_rows(device, quick: bool, seed: int, ceilings: dict | None = None) -> list[dict]:
    """Every declared prefill config on one causal case; each mma.sync config's rate as % of the register-operand
    mma.sync ceiling (``ceilings["mma_sync"]``, measured in the same process) at the warps per SM it ran at."""
    from .timing import mma_ceiling_at

    g = torch.Generator(device=device).manual_seed(seed)
    arch = runtime.device_arch(device.index)
    T, S = (2048, 16384) if quick else (4096, 65536)
    kv = torch.randn(S, DIM, device=device, generator=g).to(torch.bfloat16)
    rows = []
    for q_fp8 in (1, 0):
        q = torch.randn(T, HEADS, DIM, device=device, generator=g)
        q = q.mul_(3).to(torch.float8_e4m3fn) if q_fp8 else q.to(torch.bfloat16)
        w = torch.randn(T, HEADS, device=device, generator=g)
        ke = (torch.arange(T, device=device) + S - T + 1).to(torch.int32)   # causal: query i at key S-T+i
        ks = torch.zeros(T, dtype=torch.int32, device=device)
        out = torch.empty(T, S, device=device)
        flops = 2 * HEADS * DIM * float(ke.double().sum())
        for row in _rows_for(logits.PREFILL, ("contiguous", q_fp8, 0), arch,
                             lambda: logits.mqa_logits(q, kv, w, ks, ke, clean_logits=False, out=out), device,
                             10 if quick else 30, dict(op="prefill", layout="contiguous", q="fp8" if q_fp8 else "bf16",
                                                       T=T, S=S)):
            tflops = flops / row["us"] / 1e6
            mma = mma_ceiling_at(ceilings, row["warps_per_sm"]) if row["mma_sync"] else None
            rows.append(dict(row, tflops=tflops, pct_mma=100 * tflops / mma[0] if mma else None,
                             mma_ceiling_warps=mma[1] if mma else None))
    return rows


# --------------------------------------------------------------------------------------------------
# Emulation: another arch's product configs on this GPU, held to that arch's CTAs per SM
# --------------------------------------------------------------------------------------------------
#
# The config (instantiated for this GPU) is launched twice: as this GPU holds it (its natural residency) and
# with its dynamic shared memory padded (the kernels' ``smem_pad`` host parameter) so that exactly as many
# CTAs per SM are resident as the target arch holds (from ``cupy_dsa.arch``'s limits and ptxas's registers
# for the target). What this measures is the cost of the target's residency on this GPU's SMs, not the
# target GPU's speed: an H200 SM is not an sm_120 SM (clock, tensor-core rate, L2 and DRAM differ).


def _target_resources(configs, target: str) -> dict:
    """ptxas's resources of these configs compiled for ``target`` (NVRTC, one compile per source)."""
    out = {}
    by_source: dict[str, list[str]] = {}
    for cfg in configs:
        by_source.setdefault(cfg.source, []).append(cfg.expr)
    for source, exprs in by_source.items():
        exprs = list(dict.fromkeys(exprs))
        _, lowered, log = runtime.compile_cubin(source, exprs, target, resource_usage=True)
        out.update(runtime.ptxas_resources(log, lowered))
        missing = [e for e in exprs if e not in out]
        if missing:
            raise RuntimeError(f"ptxas reported no resources for {missing} on {target}; its log ends:\n{log[-1500:]}")
    return out


def padded_for(cfg, target: str, resources: dict, device_index: int):
    """``(target Residency, config with smem_pad, CTAs per SM this GPU holds of it)``: the pad that leaves
    this GPU the target's CTAs per SM (none when this GPU holds no more than the target anyway)."""
    r = resources[cfg.expr]
    want = cfg.residency_on(target, r)
    natural = cfg.resident_ctas_per_sm(device_index)
    if want.ctas <= 0 or natural <= want.ctas:
        return want, cfg, natural
    props = torch.cuda.get_device_properties(device_index)
    per_sm = int(getattr(props, "shared_memory_per_multiprocessor", 0) or 228 * 1024)
    optin = int(getattr(props, "shared_memory_per_block_optin", 0) or 227 * 1024)
    budget = min(per_sm // want.ctas - arch_limits.KIB, optin) - r["static_smem"]
    pad = max(0, budget - cfg.smem)
    padded = cfg.replace(smem_pad=pad)
    for _ in range(64):            # the driver's own count decides (its reserved and static shared memory)
        held = padded.resident_ctas_per_sm(device_index)
        if held == want.ctas:
            break
        pad += 256 if held > want.ctas else -256
        padded = cfg.replace(smem_pad=max(0, pad))
    return want, padded, padded.resident_ctas_per_sm(device_index)


def _decode_case(device, g, lens, next_n):
    """Decode / grouped verify of requests seeing ``lens`` entries: the inputs of ``bench logits``'s decode cases
    (one rotation: these batches are larger than L2)."""
    from .sweeps import DecodeBatch, _decode_inputs

    pages = [-(-n // layouts.PAGE_SLOTS) for n in lens]
    width = max(pages) * layouts.PAGE_SLOTS
    cache, (bt,), q, w, ctx = _decode_inputs(device, DecodeBatch("emulate", lens, width), next_n, "bf16", "fp8", 1, g)
    plan = logits.paged_mqa_logits_plan(ctx, next_n)
    out = torch.empty(len(lens) * next_n, width, device=device)
    key_bytes = sum(pages) * layouts.BF16_PAGE_BYTES
    flops = 2 * HEADS * DIM * next_n * sum(lens)
    return (lambda: logits.paged_mqa_logits(q, cache, w, ctx, bt, width, plan=plan, out=out)), key_bytes, flops


def _prefill_case(device, g, T, S):
    kv = (0.3 * torch.randn(S, DIM, device=device, generator=g)).to(torch.bfloat16)
    q = torch.randn(T, HEADS, DIM, device=device, generator=g).to(torch.float8_e4m3fn)
    w = torch.rand(T, HEADS, device=device, generator=g) / (HEADS * DIM) ** 0.5
    ke = (torch.arange(T, device=device) + S - T + 1).to(torch.int32)
    ks = torch.zeros(T, dtype=torch.int32, device=device)
    out = torch.empty(T, S, device=device)
    flops = 2 * HEADS * DIM * float(ke.double().sum())
    return (lambda: logits.mqa_logits(q, kv, w, ks, ke, clean_logits=False, out=out)), S * 2 * DIM, flops


def _extend_case(device, g, requests):
    """Varlen extend: (prefix entries, new rows) per request, row j seeing prefix + (j + 1) // 4 entries."""
    from .sweeps import _paged_tables, _random_cache

    pages = [-(-(p + (n + 1) // 4) // layouts.PAGE_SLOTS) for p, n in requests]
    table_w = max(pages)
    cache = _random_cache(sum(pages), "bf16", device, g)
    (bt,), _ = _paged_tables(pages, 1, table_w, device, g)
    T = sum(n for _, n in requests)
    q = torch.randn(T, HEADS, DIM, device=device, generator=g).to(torch.float8_e4m3fn)
    w = torch.rand(T, HEADS, device=device, generator=g) / (HEADS * DIM) ** 0.5
    lens = torch.cat([p + (torch.arange(n) + 1) // 4 for p, n in requests]).to(torch.int32).to(device)
    counts = torch.tensor([n for _, n in requests])
    cu_rows = torch.nn.functional.pad(counts.cumsum(0), (1, 0)).to(torch.int32).to(device)
    ks = torch.zeros(T, dtype=torch.int32, device=device)
    plan = logits.mqa_logits_plan(cu_rows)
    out = torch.empty(T, table_w * layouts.PAGE_SLOTS, device=device)
    flops = 2 * HEADS * DIM * float(lens.double().sum())
    return (lambda: logits.mqa_logits(q, cache, w, ks, lens, block_table=bt, cu_rows=cu_rows, plan=plan,
                                      clean_logits=False, out=out)), sum(pages) * layouts.BF16_PAGE_BYTES, flops


def emulate_cases(quick: bool, seed: int) -> list[tuple]:
    """(op, case name, family, problem, builder(device, generator) -> (call, key bytes, flops)) of the
    emulation: decode next_n 1 and grouped verify next_n 2-4 (64 x 32K index entries, and a long-tail batch),
    prefill of one request (4K rows x 64K keys, causal) and a varlen extend, bf16 keys, SGLang's fp8 q."""
    from .sweeps import long_tail

    K = 1024
    B, ctx = (16, 16 * K) if quick else (64, 32 * K)
    tail = long_tail(48, seed, max_len=128 * K, median=32 * K)
    cases = [("decode" if n == 1 else "verify", f"{B} x {ctx // K}K, next_n {n}", logits.DECODE, ("bf16", 1, n),
              lambda d, g, n=n: _decode_case(d, g, [ctx] * B, n)) for n in (1, 2, 3, 4)]
    if not quick:
        cases.append(("verify", "48 long-tail (median 32K), next_n 4", logits.DECODE, ("bf16", 1, 4),
                      lambda d, g: _decode_case(d, g, tail, 4)))
    T, S = (2 * K, 16 * K) if quick else (4 * K, 64 * K)
    cases.append(("prefill", f"{T // K}K x {S // K}K causal", logits.PREFILL, ("contiguous", 1, 0),
                  lambda d, g: _prefill_case(d, g, T, S)))
    reqs = [(8 * K, 2 * K), (24 * K, 2 * K), (40 * K, 2 * K), (64 * K, 2 * K)]
    cases.append(("extend", "4 x 2K new, prefixes 8K-64K", logits.PREFILL, ("bf16", 1, 1),
                  lambda d, g: _extend_case(d, g, reqs[:2] if quick else reqs)))
    return cases


def _mma_shares(mma, flops: float, read_s: float, seconds: float) -> dict:
    """A row's share of the register-operand mma.sync ceiling measured at its residency (``mma``: (TFLOP/s,
    warps per SM it was measured at), or None): the flop rate over the ceiling, and max(read time, flops at the
    ceiling) over the time (the roofline of the mma.sync family)."""
    if mma is None:
        return dict(mma_ceiling_tflops=None, mma_ceiling_warps=None, pct_mma=None, pct_mma_roofline=None)
    tflops, warps = mma
    return dict(mma_ceiling_tflops=tflops, mma_ceiling_warps=warps, pct_mma=100 * flops / seconds / 1e12 / tflops,
                pct_mma_roofline=100 * max(read_s, flops / (tflops * 1e12)) / seconds)


def emulate_rows(device, target: str, quick: bool, seed: int, progress=None, ops=None) -> tuple[list[dict], dict]:
    """Per case (of the ops ``ops``, default all): the target arch's product config at this GPU's natural
    residency and at the target's (padded shared memory), its 4-warp variant likewise (the sizing before the
    target had its own), the variants with more live accumulator chains (q-in-registers prefill: its ring
    depths and n-tiles per pass, and the 4-row-tile config it replaced), and this GPU's own product config for
    reference. Returns (rows, ceilings)."""
    from .timing import measure_ceilings, mma_ceiling_at, time_calls

    arch = runtime.device_arch(device.index)
    ceilings = measure_ceilings(device, quick)
    read_bps = (ceilings["read_gbps"] or ceilings["copy_gbps"] / 2) * 1e9
    mm_flops = ceilings["matmul_tflops"] * 1e12
    reps = 10 if quick else 20
    rows = []
    for op, name, family, problem, build in emulate_cases(quick, seed):
        if ops and op not in ops:
            continue
        g = torch.Generator(device=device).manual_seed(seed)
        call, key_bytes, flops = build(device, g)
        read_s, mm_s = key_bytes / read_bps, flops / mm_flops
        product = family.select(problem, target)
        variants = [product]
        previous = None
        if product.kernel is logits.QREG_PREFILL_KERNEL:
            previous = heuristics.previous_small_smem_prefill(problem, target)
            variants += [c for c in family.candidates(problem, arch) if c.kernel is product.kernel]
            variants += [product.replace(keys_per_item=8192), previous]   # longer items: fewer q loads
        elif product.kernel is logits.DECODE_KERNEL or product.kernel is logits.PREFILL_KERNEL:
            variants += [c for c in family.candidates(problem, arch)
                         if c.kernel is product.kernel and c.Rows == product.Rows and (c.Prefetch == 0 or c.Warps == 8)
                         and c.Mma8 == 0 and c.L2Hint == product.L2Hint and c.values.get("keys_per_cta", 4096) == 4096
                         and (c.Warps, c.MT, c.Prefetch) != (product.Warps, product.MT, product.Prefetch)]
            if product.kernel is logits.PREFILL_KERNEL:   # longer key ranges per CTA: fewer q stagings and tails
                variants += [product.replace(keys_per_cta=k) for k in (8192, 16384)]
        variants = list(dict.fromkeys(variants))     # the product is one of them: timed once
        resources = _target_resources(variants, target)
        for cfg in variants:
            want, padded, held = padded_for(cfg, target, resources, device.index)
            with family.forced(cfg, arch):
                full = time_calls([call], device, reps=reps).seconds
            emul = full
            if padded != cfg:                     # this GPU holds more CTAs per SM than the target
                with family.forced(padded, arch):
                    emul = time_calls([call], device, reps=reps).seconds
            mma = mma_ceiling_at(ceilings, want.warps)   # the mma.sync ceiling at the target's residency
            rows.append(dict(op=op, case=name, target=target, config=str(cfg), product=cfg == product,
                             previous=cfg == previous, warps=cfg.block[0] // 32, mt=cfg.values.get("MT"),
                             prefetch=cfg.values.get("Prefetch", 0), target_ctas=want.ctas, target_warps=want.warps,
                             target_binding=want.binding, held_ctas=held, natural_ctas=cfg.resident_ctas_per_sm(device.index),
                             smem_pad=padded.smem_pad, us_full=full * 1e6, us_emulated=emul * 1e6,
                             emulated_vs_full=emul / full, pct_roofline=100 * max(read_s, mm_s) / emul,
                             bound="read" if read_s >= mm_s else "matmul",
                             tflops_emulated=flops / emul / 1e12, key_bytes=key_bytes, flops=flops,
                             **_mma_shares(mma, flops, read_s, emul)))
            if progress:
                progress(rows[-1])
        own = family.select(problem, arch)
        with family.forced(own, arch):
            t = time_calls([call], device, reps=reps).seconds
        rows.append(dict(op=op, case=name, target=arch, config=str(own), product=True, warps=own.values.get("Warps"),
                         mt=own.values.get("MT"), target_ctas=None, target_warps=None, target_binding=None,
                         held_ctas=own.resident_ctas_per_sm(device.index), natural_ctas=own.resident_ctas_per_sm(device.index),
                         smem_pad=0, us_full=t * 1e6, us_emulated=None, emulated_vs_full=None,
                         pct_roofline=100 * max(read_s, mm_s) / t, bound="read" if read_s >= mm_s else "matmul",
                         tflops_emulated=None, key_bytes=key_bytes, flops=flops))
        if progress:
            progress(rows[-1])
        del call
        torch.cuda.empty_cache()
    return rows, ceilings


EMULATE_SCHEMA = "cupy-dsa-emulate/1"


def emulate_document(device_name: str, target: str, quick: bool, seed: int, rows: list, ceilings: dict,
                     ops=None) -> dict:
    from .provenance import provenance

    return {"schema": EMULATE_SCHEMA, **provenance(), "device": device_name, "target": target, "quick": quick,
            "seed": seed, "ops": list(ops) if ops else None, "ceilings": ceilings, "rows": rows}


def _case_config(r) -> str:
    if not r["warps"]:
        return r["config"].split("<")[0]
    if r["config"].startswith("mqa_logits_qreg_kernel"):
        _, _, stages, nt = (v.strip() for v in r["config"].split("<")[1].split(">")[0].split(","))
        extra = " ".join(x for x in r["config"].split(">", 1)[1].split() if x)
        return f"q in registers, {r['warps']} rows x 1 warp, {stages} stages, NT {nt}" + (f", {extra}" if extra else "")
    extra = " ".join(x for x in r["config"].split(">", 1)[1].split() if x)
    prefetch = ", prefetch" if r.get("prefetch") else ""
    min_blocks = r["config"].split(">", 1)[0].split(",")[-1].strip()   # the last template parameter
    blocks = f", MinBlocks {min_blocks}" if r["warps"] == 4 else ""
    return f"{r['warps']} warps, MT {r['mt']}{prefetch}{blocks}" + (f", {extra}" if extra else "")


def emulate_markdown(doc: dict) -> str:
    """One line per (case, config): the target's residency, time at this GPU's residency and at the target's,
    their ratio, % of the roofline (max of the read-stream and bf16-matmul times measured in the same run) at
    the target's residency, and the ratio to this GPU's own product config."""
    target, dev = doc["target"], doc["device"]
    has_mma = any(r.get("pct_mma") is not None for r in doc["rows"])   # results from before the mma.sync ceiling
    lines = [f"Emulated on {dev}: {target}'s product configs (marked *) and variants, instantiated for this GPU, "
             f"held to {target}'s CTAs per SM by padded shared memory (commit {commit_label(doc, 'unknown')}).",
             "",
             f"| op | case | config | {target} residency | us, this GPU's residency | us, {target}'s | ratio | "
             f"% roofline at {target}'s | " + ("% mma.sync ceiling (TFLOP/s; max(read, mma.sync)) | " if has_mma else "")
             + "vs this GPU's product |",
             "|---|---|---|---|---|---|---|---|---|" + ("---|" if has_mma else "")]
    own = {(r["op"], r["case"]): r for r in doc["rows"] if r["target"] != target}
    seen = set()
    for r in doc["rows"]:
        if r["target"] != target or (r["case"], r["config"]) in seen:   # a variant equal to the product: once
            continue
        seen.add((r["case"], r["config"]))
        ref = own.get((r["op"], r["case"]))
        vs = f"{r['us_emulated'] / ref['us_full']:.2f}x" if ref else "-"
        res = f"{r['target_ctas']} x {r['target_warps'] // max(r['target_ctas'], 1)} warps ({r['target_binding']})"
        lines.append(f"| {r['op']} | {r['case']} | {'* ' if r['product'] else ''}{_case_config(r)} | {res} | "
                     f"{r['us_full']:.1f} | {r['us_emulated']:.1f} | {r['emulated_vs_full']:.2f} | "
                     f"{r['pct_roofline']:.0f}% ({r['bound']}) | " + (_mma_cell(r) if has_mma else "") + f"{vs} |")
    lines += ["", "This GPU's own product configs on the same inputs: " + "; ".join(
        f"{r['op']} {r['case']}: {r['us_full']:.1f} us ({r['pct_roofline']:.0f}% of the roofline, "
        f"{_case_config(r)})" for r in own.values()) + "."]
    if has_mma:
        lines += ["", _mma_ceiling_note(doc.get("ceilings") or {})]
    summary = _emulate_summary([r for r in doc["rows"] if r["target"] == target], target)
    return "\n".join(lines + ([""] + [summary] if summary else []))


def _mma_cell(r) -> str:
    if r.get("pct_mma") is None:
        return "- | "
    return (f"{r['pct_mma']:.0f}% of {r['mma_ceiling_tflops']:.0f} at {r['mma_ceiling_warps']} warps/SM; "
            f"{r['pct_mma_roofline']:.0f}% | ")


def _mma_ceiling_note(ceilings: dict) -> str:
    m = ceilings.get("mma_sync") or {}
    parts = [f"{name} " + ", ".join(f"{v:.0f} at {w}" for w, v in sorted(rates.items(), key=lambda x: int(x[0])))
             for name, rates in (("bf16 m16n8k16", m.get("bf16")), ("e4m3 m16n8k32", m.get("e4m3"))) if rates]
    text = ("Register-operand mma.sync ceilings measured in the same run (TFLOP/s at warps per SM, one CTA per SM, "
            f"{m.get('chains', '?')} accumulator chains per warp): " + "; ".join(parts) + ".")
    if m.get("e4m3_note"):
        text += f" {m['e4m3_note'][0].upper()}{m['e4m3_note'][1:]}."
    return text


def _emulate_summary(rows: list[dict], target: str) -> str:
    """One sentence of the table's figures: what the target's residency costs its product configs and the
    4-warp ones, the prefill rate and the verify share of the roofline."""
    def span(values, fmt):
        """``lo-hi``, or one figure where they agree at this precision ("1.00-1.00x" read as a loss)."""
        if not values:
            return "-"
        lo, hi = fmt.format(min(values)), fmt.format(max(values))
        return lo if lo == hi else f"{lo}-{hi}"

    products = [r for r in rows if r["product"]]
    four = [r for r in rows if not r["product"] and r["warps"] == 4 and not r.get("prefetch")]
    text = (f"At {target}'s residency its product configs take {span([r['emulated_vs_full'] for r in products], '{:.2f}')}x "
            "the time of the same config at this GPU's residency"
            + (f", the 4-warp configs {span([r['emulated_vs_full'] for r in four], '{:.2f}')}x." if four else "."))
    prefill = next((r for r in products if r["op"] == "prefill"), None)
    prefill4 = next((r for r in four if r["op"] == "prefill"), None)
    if prefill:
        text += f" Prefill {prefill['case']}: {prefill['tflops_emulated']:.0f} TFLOP/s at {target}'s residency"
        if prefill4:
            text += (f" (4 warps: {prefill4['tflops_emulated']:.0f}; 4 warps at this GPU's residency: "
                     f"{prefill4['flops'] / prefill4['us_full'] / 1e6:.0f})")
        text += "."
    if prefill and prefill.get("pct_mma") is not None:
        text += (f" Prefill at {prefill['pct_mma']:.0f}% of the bf16 mma.sync ceiling at {prefill['mma_ceiling_warps']} "
                 f"warps/SM")
        before = next((r for r in rows if r.get("previous") and r["op"] == "prefill"), None)
        if before and before.get("pct_mma") is not None:
            text += (f" (the 4-row-tile config it replaced: {before['tflops_emulated']:.0f} TFLOP/s, "
                     f"{before['pct_mma']:.0f}%)")
        text += "."
    verify = [r["pct_roofline"] for r in products if r["op"] == "verify"]
    if verify:
        text += f" Grouped verify: {span(verify, '{:.0f}')}% of max(read, matmul) time"
        verify_mma = [r["pct_mma_roofline"] for r in products if r["op"] == "verify" and r.get("pct_mma_roofline")]
        if verify_mma:
            text += f", {span(verify_mma, '{:.0f}')}% of max(read, mma.sync ceiling)"
        text += "."
    return text
