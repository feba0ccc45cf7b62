#!/usr/bin/env python3
"""Split invariance of one C4 layer's index keys with SGLang 0.5.23's own JIT compressor kernels, in every mode.

The compressor is SGLang's: its plan builder (``c_plan.cuh``: ``CompressorPrefillPlan.generate`` /
``CompressorDecodePlan.generate``, the production planner with the state-ring translation) and its C4 kernel
(``c4_v2.cuh``: ``compress_forward``), JIT-compiled by SGLang's loader with the machine's nvcc, on SGLang's fp32 state
ring (cleared as its pool clears it: kv 0, score -inf). Its output goes to every mode's store: stock SGLang's
(``compress_norm_rope_store``, its JIT ``fused_norm_rope_v2`` fp8 store) and the plugin's
(``cupy_dsa.sglang.core.store_index_k_bf16``, the body of the store hook: bf16, bf16-fp4sim, bf16-reference,
fp8-cupy, fp8-rescore's hi and lo pages), each with SGLang's plan rows and ``c4_out_loc``.

The splits (``scripts/_split_invariance.py``): one prefill; a prefill to each residue mod 4 then decodes; prefill
chunks of sizes that are not multiples of 4; MTP verify (ring of 16, the planner's MTP path) with rejected drafts.
Checked bit for bit against the one-prefill run: the compressor's output rows, every mode's page bytes, and the
top-k of a fixed query. Where a split differs, the finding names the entry, its raw positions, the step that wrote
it (kind, where it ended, mod 4) and the bytes. Also checked (issue 50 P4): fp8-cupy's pages = SGLang's stock fp8
pages, byte for byte, from the same compressor rows.

    bash scripts/run_sglang_gpu.sh --split        (installs .whl_sgl, then runs this; JSON under $OUT)
    python scripts/gpu_split_invariance.py --device cpu     (the dry mode: torch stand-in compressor, CPU stores)
    python scripts/gpu_split_invariance.py --render out/split_invariance.json   (its markdown block)

Last line: ``SPLIT INVARIANCE: PASS ...`` or ``FAIL ...``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))  # this checkout's cupy_dsa when it is not pip-installed

os.environ.setdefault("SGLANG_FP8_PAGED_MQA_LOGITS_TORCH", "1")

import torch  # noqa: E402

import _split_invariance as si  # noqa: E402

MODES = ("fp8", "bf16", "bf16-fp4sim", "bf16-reference", "fp8-cupy", "fp8-rescore")
SWA_PAGE_SIZE = 256   # SGLang's sliding-window page; the state ring keeps `ring` rows of each


SCHEMA = "cupy-dsa-split-invariance/1"

def import_sglang_compress():
    """SGLang's compressor module, with the kernel packages this machine lacks stubbed (they raise if called)."""
    import _sglang_env

    _sglang_env.install()
    _sglang_env.install_kernel_stubs()
    from sglang.kernels.ops.attention.dsv4 import compress

    _sglang_env.strict_kernel_stubs()
    return compress


class SGLangBackend:
    """SGLang's planner + C4 kernel on its state ring, then every mode's store (see the module docstring)."""

    def __init__(self, modes, total: int, *, seed: int = 0):
        self.C = import_sglang_compress()
        self.dev = torch.device("cuda")
        g = torch.Generator().manual_seed(seed + 2)
        self.ape = torch.randn(si.WINDOW, si.HEAD_DIM, generator=g).to(self.dev)   # SGLang's [8, 128] view
        self.total = total
        span = total + 2 * si.VERIFY_N + si.RING_MTP
        self.req_pool_indices = torch.zeros(1, dtype=torch.int64, device=self.dev)
        self.req_to_token = torch.arange(span, dtype=torch.int32, device=self.dev)[None].contiguous()
        self.full_to_state = torch.arange(span, dtype=torch.int64, device=self.dev)
        self.side = si.StoreSide(modes, total // si.RATIO, self.dev, self._stock_store, seed=seed)
        self.pages_of_state = span // SWA_PAGE_SIZE + 1
        self.ring = si.RING
        self.plan = None

    def reset(self, ring: int) -> None:
        self.ring = ring
        state = torch.empty(self.pages_of_state * ring, 2 * 2 * si.HEAD_DIM, dtype=torch.float32, device=self.dev)
        state[:, :2 * si.HEAD_DIM] = 0                        # kv (overlap | current)
        state[:, 2 * si.HEAD_DIM:] = float("-inf")            # their scores
        self.state = state
        self.side.reset()

    def _stock_store(self, kv, plan_rows, is_decode, out_loc, cache):
        self.C.compress_norm_rope_store(kv, self.plan, norm_weight=self.side.norm_weight, norm_eps=1e-6,
                                        freq_cis=self.side.freq_cis, out_loc=out_loc, kvcache=cache, page_size=64)

    def step(self, step: si.Step, kv_score: torch.Tensor) -> torch.Tensor:
        C = self.C
        if step.kind == "decode":
            seq = torch.tensor([step.end], dtype=torch.int64, device=self.dev)
            self.plan = C.CompressorDecodePlan.generate(
                compress_ratio=4, req_pool_indices=self.req_pool_indices, req_to_token=self.req_to_token,
                full_to_state=self.full_to_state, seq_lens=seq, swa_page_size=SWA_PAGE_SIZE, ring_size=self.ring)
        else:
            # prefill as SGLang plans it from host lengths; verify (MTP) from device lengths, as under its graphs
            where = self.dev if step.kind == "verify" else torch.device("cpu")
            self.plan = C.CompressorPrefillPlan.generate(
                compress_ratio=4, req_pool_indices=self.req_pool_indices,
                seq_lens=torch.tensor([step.end], dtype=torch.int64, device=where),
                extend_lens=torch.tensor([step.length], dtype=torch.int64, device=where),
                req_to_token=self.req_to_token, full_to_state=self.full_to_state, swa_page_size=SWA_PAGE_SIZE,
                ring_size=self.ring, num_q_tokens=step.length)
        kv = C.compress_forward(self.state.view(-1, si.RATIO, 4 * si.HEAD_DIM), kv_score.to(self.dev).contiguous(),
                                self.ape, self.plan, head_dim=si.HEAD_DIM, compress_ratio=4)
        plan_rows = self.plan[1]
        out_loc = si.out_locs(step).to(self.dev)
        self.side.store(kv, plan_rows, step.kind == "decode", out_loc)
        # the compressed rows in the order the harness expects (the planner's order is its atomics')
        seq = plan_rows[:, 0:4].cpu().contiguous().view(torch.int32).flatten().to(torch.int64) & 0xFFFFFFFF
        by_entry = {}
        for i, s in enumerate(seq.tolist()):
            if s != si.PLAN_INVALID and s % si.RATIO == 0 and (step.kind != "decode" or i == 0):
                by_entry[s // si.RATIO - 1] = kv[i]
        want = [e for _, e in si.entries_completed(step)]
        missing = [e for e in want if e not in by_entry]
        if missing:
            raise RuntimeError(f"SGLang's plan for {step} has no row for entries {missing}")
        return torch.stack([by_entry[e] for e in want]) if want else torch.zeros(0, si.HEAD_DIM, device=self.dev)

    def pages(self) -> dict:
        return self.side.pages()

    def topk(self) -> dict:
        return self.side.topk()


def p4_comparison(backend, total: int, seed: int) -> dict:
    """fp8-cupy's pages against SGLang's stock fp8 pages after one prefill of the same compressor rows: differing
    value bytes and scale words (issue 50 P4: SGLang's store fuses its multiply-adds; ours now spells them)."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(total, si.KV_SCORE_DIM, generator=g)
    backend.reset(si.RING)
    backend.step(si.Step("prefill", 0, total), rows)
    pages = backend.pages()
    a, b = pages["fp8"][1].cpu(), pages["fp8-cupy"][1].cpu()
    n = total // si.RATIO
    vals_a = a[:, :64 * 128].reshape(-1, 128)[:n]
    vals_b = b[:, :64 * 128].reshape(-1, 128)[:n]
    sc_a = a[:, 64 * 128:].reshape(-1, 4)[:n].contiguous().view(torch.int32).flatten()
    sc_b = b[:, 64 * 128:].reshape(-1, 4)[:n].contiguous().view(torch.int32).flatten()
    return {"keys": n, "value_bytes_differing": int((vals_a != vals_b).sum()), "value_bytes": vals_a.numel(),
            "scale_words_differing": int((sc_a != sc_b).sum()),
            "max_scale_ulp": int((sc_a - sc_b).abs().max()) if n else 0}


def run(device: str = "cuda", total: int = 1027, seed: int = 0, modes=MODES) -> dict:
    t0 = time.time()
    if device == "cpu":
        backend = si.TorchBackend(modes, total, seed=seed)
        source = "torch stand-in compressor, CPU stores (dry mode)"
    else:
        backend = SGLangBackend(modes, total, seed=seed)
        import sglang

        source = f"SGLang {sglang.__version__} JIT c_plan.cuh + c4_v2.cuh, stock fused_norm_rope_v2 store"
    result = si.check_splits(backend, total, seed=seed)
    result["p4"] = p4_comparison(backend, total, seed + 7)
    result.update(device=torch.cuda.get_device_name() if device != "cpu" else "cpu", compressor=source,
                  elapsed_s=round(time.time() - t0, 1))
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    ap.add_argument("--tokens", type=int, default=1027, help="the sequence's raw tokens (default 1027 = 3 mod 4)")
    ap.add_argument("--seed", type=int, default=int(os.environ.get("CUPY_DSA_SEED", "0")))
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "split_invariance.json"))
    ap.add_argument("--render", metavar="JSON", help="print a result file as bench/results/README.md's markdown block")
    args = ap.parse_args()
    if args.render:
        with open(args.render) as f:
            print(si.markdown(json.load(f)), end="")
        return 0
    try:
        result = run(args.device, args.tokens, args.seed)
    except Exception as e:  # noqa: BLE001 - the last line must say what failed
        import traceback

        traceback.print_exc()
        print(f"SPLIT INVARIANCE: FAIL ({type(e).__name__}: {e})")
        return 1
    # the run it holds, for the writers' guard (bench/output_guard.py): the schema, and the GPU where one ran it
    result = {"schema": SCHEMA, "measured": args.device != "cpu", **result}
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(f"{result['compressor']} on {result['device']}: {result['total_tokens']} tokens, {result['entries']} "
          f"entries, modes {', '.join(result['modes'])}")
    print("\n".join(si.summary_lines(result)))
    p4 = result["p4"]
    p4_ok = p4["value_bytes_differing"] == 0 and p4["scale_words_differing"] == 0
    print(f"  P4 (fp8-cupy pages vs SGLang's stock fp8 pages, {p4['keys']} keys): {p4['value_bytes_differing']} of "
          f"{p4['value_bytes']} value bytes and {p4['scale_words_differing']} scale words differ "
          f"(max {p4['max_scale_ulp']} ulp)")
    ok = result["ok"] and p4_ok
    failing = [r["name"] for r in result["splits"] if r["findings"]]
    print(f"SPLIT INVARIANCE: {'PASS' if ok else 'FAIL'} ({len(result['splits'])} splits against one prefill"
          + (f"; differ: {', '.join(failing)}" if failing else "") + ("" if p4_ok else "; P4 bytes differ")
          + f"; {result['elapsed_s']} s; {args.json})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
