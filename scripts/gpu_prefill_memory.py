#!/usr/bin/env python3
"""What the plugin's prefill route allocates on a GPU for one long request, per mode, against the analytic model
(``cupy_dsa/sglang/memory.py``, which the README's long-prefill table renders).

One C4 layer's step: ``--rows`` new tokens (a prefill chunk, SGLang's default 8192) of one request that has
``--tokens`` tokens by the chunk's end (``tokens / 4`` index entries), run as the plugin's forward runs a
single-request extend without SGLang's row chunks: the logits in row chunks of the budget
(``SGLANG_CUPY_DSA_LOGITS_BUDGET_MIB``, default 2048), each block followed by the select (``paged_topk`` stands in
for SGLang's top-k; fp8-rescore runs its own two-stage select). Measured: the peak of ``torch.cuda`` allocations
above what the inputs (caches, query) hold. The stock route (SGLang's gathered keys and unchunked logits) is the
model's only: DeepGEMM is not on the GPU machine.

    python scripts/gpu_prefill_memory.py [--tokens 819200] [--rows 8192] [--budget-mib 2048,512] [--json out.json]

Needs no SGLang. Last line: ``PREFILL MEMORY: PASS ...`` when every measured peak is within the model's bound.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # this checkout's cupy_dsa when it is not pip-installed

import torch  # noqa: E402

MODES = ("bf16", "bf16-reference", "fp8-cupy", "fp8-rescore")
GIB = float(1 << 30)


def measure(mode: str, tokens: int, rows: int, budget_mib: int, index_topk: int = 512) -> dict:
    import cupy_dsa
    from cupy_dsa import layouts, rescore
    from cupy_dsa.sglang import core, memory

    dev = torch.device("cuda")
    rec = core.record(mode)
    entries = tokens // 4
    pages = (entries + 63) // 64
    width = pages * 64
    g = torch.Generator(device=dev).manual_seed(0)
    cache = torch.randint(0, 0x70, (pages, layouts.page_bytes(rec.cache_layout)), dtype=torch.uint8, device=dev,
                          generator=g)   # finite fp8 codes / bf16 halves, scales below
    if rec.cache_layout == "fp8":
        cache[:, layouts.FP8_SCALE_OFFSET:].view(torch.float32).fill_(0.01)
    lo = torch.zeros_like(cache) if rec.two_level else None
    q_dtype = torch.float8_e4m3fn if (rec.query == "fp8" or rec.two_level) else torch.bfloat16
    q = torch.randn(rows, 64, 128, device=dev, generator=g).to(q_dtype)
    w = torch.rand(rows, 64, device=dev, generator=g)
    q2 = torch.randn(rows, 64, 128, device=dev, generator=g).to(torch.bfloat16) if rec.two_level else None
    first = tokens - rows   # positions of the chunk's rows: the last `rows` tokens
    ke = ((torch.arange(rows, device=dev) + first + 1) // 4).to(torch.int32)
    ks = torch.zeros_like(ke)
    cu_rows = torch.tensor([0, rows], dtype=torch.int32, device=dev)
    bt = torch.arange(pages, dtype=torch.int32, device=dev)[None]
    core.ensure_warm(dev)
    chunks = core.row_chunks(rows, None, width, False, budget_bytes=budget_mib << 20)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for r in chunks:
        if rec.two_level:
            res = core.rescore_extend(q, w, ke, cu_rows, bt, cache, lo, r, index_topk, 4 * index_topk, None,
                                      q_rescore=q2, weights_rescore=w)
            del res
        else:
            logits = core.extend_logits(q, w, ks, ke, cu_rows, bt, cache, r, None)
            sel = cupy_dsa.paged_topk(logits, ke[r], bt.expand(r.stop - r.start, -1), index_topk)
            del logits, sel
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    model = memory.prefill_step(mode, rows=rows, entries=entries, index_topk=index_topk, budget_mib=budget_mib)
    # the model's inputs (query) are allocated before `base`: the measured peak is the rest
    bound = model["total"] - model["query"]
    return {"mode": mode, "tokens": tokens, "rows": rows, "budget_mib": budget_mib, "chunks": len(chunks),
            "measured_peak_bytes": peak, "model_bytes_without_query": bound, "model": model,
            "within_model": peak <= bound * 1.05 + (8 << 20)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=819200, help="the request's tokens by the chunk's end (800K)")
    ap.add_argument("--rows", type=int, default=8192, help="the chunk's new tokens")
    ap.add_argument("--budget-mib", default="2048,512", help="logits budgets to run (comma list of MiB)")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "prefill_memory.json"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("PREFILL MEMORY: FAIL (no CUDA GPU)")
        return 1
    from cupy_dsa.sglang import memory

    rows_out, ok = [], True
    stock = memory.prefill_step("fp8", rows=args.rows, entries=args.tokens // 4)
    print(f"stock SGLang 0.5.23 (model): {stock['total'] / GIB:.2f} GiB, logits {stock['logits'] / GIB:.2f} GiB "
          f"unchunked ({args.rows} x {args.tokens // 4} entries)")
    for budget in [int(b) for b in args.budget_mib.split(",")]:
        for mode in MODES:
            with torch.no_grad():
                r = measure(mode, args.tokens, args.rows, budget)
            rows_out.append(r)
            ok &= r["within_model"]
            print(f"{mode:15s} budget {budget:5d} MiB: {r['chunks']} chunk(s), measured peak "
                  f"{r['measured_peak_bytes'] / GIB:.2f} GiB, model {r['model_bytes_without_query'] / GIB:.2f} GiB "
                  f"{'ok' if r['within_model'] else 'ABOVE THE MODEL'}")
            torch.cuda.empty_cache()
    with open(args.json, "w") as f:
        json.dump({"schema": "cupy-dsa-prefill-memory/1", "device": torch.cuda.get_device_name(),
                   "stock_model": stock, "rows": rows_out}, f, indent=1)
    print(f"PREFILL MEMORY: {'PASS' if ok else 'FAIL'} ({len(rows_out)} runs; {args.json})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
