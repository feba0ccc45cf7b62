"""The checks of ``scripts/gpu_sglang_path.py``: the device path's caches, logits and top-k against the CPU path's
(and fp8-cupy's top-k against SGLang's own fp8 forward's, up to ties); each failed check is one line of
:data:`PROBLEMS`.
"""
from __future__ import annotations

import torch

from _sglang_path_world import TOPK, log

PROBLEMS: list[str] = []


def ulp_diff(a, b):
    a, b = a.float(), b.float()
    ulp = torch.maximum(a.abs(), b.abs()) * 2.0 ** -7
    d = (a - b).abs()
    return torch.where(d <= 1e-6, torch.zeros_like(d), d / ulp.clamp_min(1e-30)).ceil()


def check(cond, msg):
    if not cond:
        PROBLEMS.append(msg)
        log(f"  FAIL {msg}")
    return cond


def compare_caches(name, dev, ref):
    got, exp = dev.cache.cpu(), ref.cache.cpu()
    if got.shape[1] == FP8_PAGE:
        if dev.lo is not None:
            compare_two_level(name, got, dev.lo.cpu(), exp, ref.lo.cpu())
        return compare_fp8_caches(name, got, exp)
    d = ulp_diff(got.view(torch.bfloat16), exp.view(torch.bfloat16))
    w_got = set((got.view(-1, 256) != 0).any(1).nonzero().flatten().tolist())
    w_exp = set((exp.view(-1, 256) != 0).any(1).nonzero().flatten().tolist())
    check(w_got == w_exp, f"{name}: written slots differ ({len(w_got ^ w_exp)} of {len(w_exp)})")
    check(int(d.max()) <= 1, f"{name}: cache max {int(d.max())} bf16 ulp from the CPU path, {int((d > 0).sum())} differ")
    log(f"  {name}: {len(w_exp)} slots written, max {int(d.max())} ulp")


FP8_PAGE = 8448


def e4m3_steps(a, b):
    """Code steps between e4m3 bytes (uint8 tensors): the magnitude codes are monotone, so steps are their
    difference for one sign and their sum across signs."""
    a, b = a.long(), b.long()
    ma, mb = a & 0x7F, b & 0x7F
    return torch.where((a >> 7) == (b >> 7), (ma - mb).abs(), ma + mb)


def compare_fp8_caches(name, got, exp):
    """SGLang's fp8 rows: the same slots written, codes at most one e4m3 step and scales a few fp32 ulp from the
    CPU path (the device's rsqrtf against torch's), most slots byte-identical."""
    sg_, se_ = got[:, 8192:].contiguous().view(torch.float32).reshape(-1), exp[:, 8192:].contiguous().view(torch.float32).reshape(-1)
    w_got, w_exp = set(sg_.nonzero().flatten().tolist()), set(se_.nonzero().flatten().tolist())
    check(w_got == w_exp, f"{name}: written slots differ ({len(w_got ^ w_exp)} of {len(w_exp)})")
    steps = e4m3_steps(got[:, :8192].reshape(-1, 128), exp[:, :8192].reshape(-1, 128))
    rel = ((sg_.double() - se_.double()).abs() / se_.double().abs().clamp_min(1e-30)).max().item()
    check(int(steps.max()) <= 1, f"{name}: an e4m3 code {int(steps.max())} steps from the CPU path")
    check(rel <= 1e-6, f"{name}: an fp8 scale {rel:.2e} (relative) from the CPU path")
    idx = torch.tensor(sorted(w_exp), dtype=torch.long)
    same = int(((steps[idx] == 0).all(1) & (sg_[idx] == se_[idx])).sum()) if len(idx) else 0
    log(f"  {name}: {len(w_exp)} fp8 slots written, {same} byte-identical to the CPU path, max {int(steps.max())} "
        f"code step, scales within {rel:.1e}")


def compare_two_level(name, hi, lo, hi_ref, lo_ref):
    """fp8-rescore: the keys the two pages hold (``e4m3(hi) * scale + lo * lo_scale``) against the CPU path's, within
    1e-3 of the key's largest element (a key whose fp8 code sits one step from the CPU path's has another residual,
    the same sum), at the same slots."""
    from cupy_dsa.rescore import lo_views, two_level_dequant_reference

    def keys(h, l):
        codes, scales = lo_views(l)
        return two_level_dequant_reference(h[:, :8192].reshape(-1, 128), h[:, 8192:].contiguous().view(torch.float32)
                                           .reshape(-1), codes.reshape(-1, 128), scales.reshape(-1))

    written = lo_ref[:, 8192:].contiguous().view(torch.float32).reshape(-1) != 0
    got_written = lo[:, 8192:].contiguous().view(torch.float32).reshape(-1) != 0
    check(torch.equal(written, got_written), f"{name}: residual slots written differ "
          f"({int((written ^ got_written).sum())} of {int(written.sum())})")
    k, k_ref = keys(hi, lo)[written], keys(hi_ref, lo_ref)[written]
    err = ((k - k_ref).abs().amax(1) / k_ref.abs().amax(1).clamp_min(1e-30)).max().item() if k.numel() else 0.0
    check(err <= 1e-3, f"{name}: two-level keys {err:.2e} (relative to the key's largest element) from the CPU path")
    log(f"  {name}: {int(written.sum())} residual slots, two-level keys within {err:.1e} of the CPU path")


def compare_logits(name, got, ref, lens, tol=2e-3):
    bad, worst = 0, 0.0
    for r in range(ref.shape[0]):
        n = int(lens[r])
        if n == 0:
            continue
        g, e = got[r, :n].double().cpu(), ref[r, :n].double().cpu()
        err = (g - e).abs()
        lim = tol * (e.abs().max().item() + 1e-6)
        bad += int((err > lim).sum())
        worst = max(worst, err.max().item() / lim)
    check(bad == 0, f"{name}: {bad} logits outside tolerance (worst {worst:.2f}x the limit)")
    return worst


def compare_topk(name, dev_md, ref_md, page_table, lens):
    raw_g = dev_md.c4_sparse_raw_indices.cpu().long()
    raw_r = ref_md.c4_sparse_raw_indices.cpu().long()
    rec = []
    for r in range(raw_r.shape[0]):
        sg, sr = set(raw_g[r].tolist()) - {-1}, set(raw_r[r].tolist()) - {-1}
        check(len(sg) == min(int(lens[r]), TOPK), f"{name}: row {r} selected {len(sg)} keys, expected "
              f"{min(int(lens[r]), TOPK)}")
        rec.append(len(sg & sr) / len(sr) if sr else float(not sg))  # a row that sees nothing selects nothing
    low = [(r, round(x, 3)) for r, x in enumerate(rec) if x < 0.99]
    check(not low, f"{name}: top-{TOPK} overlap with the CPU path below 0.99 in {len(low)} rows (row, overlap): "
          f"{low[:8]}")
    pt = page_table.cpu().long()
    exp = torch.where(raw_g >= 0, pt.gather(1, raw_g.clamp(min=0) // 64) * 64 + raw_g % 64, -1)
    check(torch.equal(dev_md.c4_sparse_page_indices.cpu().long(), exp),
          f"{name}: page indices are not the slot transform of the raw indices")
    return min(rec)


# SGLang's torch fp8 logits round each head's dot product to bf16 (torch.bmm of bf16): 2^-9 relative per head
SGLANG_TIE = 4e-3


def fp8_oracle(cache, q, w, pt):
    """fp64 logits over an fp8 cache's keys as stored (dequantized), [rows, width]."""
    values = cache[:, :8192].reshape(cache.shape[0], 64, 128).view(torch.float8_e4m3fn).double()
    scales = cache[:, 8192:].contiguous().view(torch.float32).double()
    k = (values * scales[..., None])[pt.long()].reshape(pt.shape[0], -1, 128)
    return (torch.relu(torch.einsum("rhd,rnd->rhn", q.double(), k)) * w.double()[:, :, None]).sum(1)


def compare_with_sglang_fp8(name, ours, theirs, oracle, lens):
    """fp8-cupy's top-k against SGLang's own fp8 forward's, on the same keys: equal up to ties at SGLang's bf16
    precision (a key one selects and the other does not scores within SGLANG_TIE of the oracle's k-th)."""
    overlap = 1.0
    for r, n in enumerate(lens.tolist()):
        a = set(ours.c4_sparse_raw_indices[r].cpu().tolist()) - {-1}
        b = set(theirs.c4_sparse_raw_indices[r].cpu().tolist()) - {-1}
        k = min(TOPK, n)
        if not check(len(a) == len(b) == k, f"{name}: row {r} selected {len(a)} (cupy_dsa) / {len(b)} (SGLang), "
                                            f"expected {k}"):
            continue
        if n <= TOPK or n == 0:
            check(a == b, f"{name}: row {r} (len {n} <= top-k) selections differ")
            continue
        scores = oracle[r, :n]
        kth = scores.topk(k).values[-1].item()
        tol = SGLANG_TIE * scores.abs().max().item()
        far = [i for i in sorted(a ^ b) if abs(scores[i].item() - kth) > tol]
        check(not far, f"{name}: row {r}: cupy_dsa's and SGLang's fp8 top-k differ beyond ties at {far[:8]}")
        overlap = min(overlap, len(a & b) / k)
    log(f"  {name}: top-k equals SGLang's own fp8 forward's up to ties (min overlap {overlap:.4f})")
