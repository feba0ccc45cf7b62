"""README blocks: the figures the README (and ``bench/results/README.md``) quote, rendered from a results document
(``<!-- results:NAME -->`` ... ``<!-- /results:NAME -->``). A block whose run predates a change of ``kernels/``
says so under its figures (:func:`stale_note`): its commit, and the last kernel commit since."""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .provenance import commit_label, commit_text
from .report import (_decode_pairs, _f, _margin, _md_verdict, _ok, _pct, _recall_rows, _route_pairs, _si,
                     _target_pct, prefill_shape, prefill_target, route_target)


README_BLOCK = re.compile(r"(<!-- results:(?P<name>[a-z0-9-]+) -->\n)(?P<body>.*?)(<!-- /results:(?P=name) -->)", re.S)

KERNEL_PATHS = (":(top)kernels",)   # what a GPU figure measures: a change here makes older figures another commit's
STALE_MARK = "**Stale:**"


def _git(*args) -> str | None:
    root = Path(__file__).resolve().parent
    try:
        r = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def kernel_changes_since(commit: str) -> tuple[int, str, list[str]] | None:
    """(commits that changed ``kernels/`` after ``commit`` up to HEAD, the last of them, the files they changed) or
    None where git cannot say (no checkout, or a history without ``commit``: a shallow clone)."""
    commit = commit.removesuffix("-dirty")
    if _git("cat-file", "-e", f"{commit}^{{commit}}") is None:
        return None
    count = _git("rev-list", "--count", f"{commit}..HEAD", "--", *KERNEL_PATHS)
    last = _git("log", "-1", "--format=%h", "--abbrev=12", f"{commit}..HEAD", "--", *KERNEL_PATHS)
    files = _git("diff", "--name-only", f"{commit}..HEAD", "--", *KERNEL_PATHS)
    if count is None or last is None or files is None:
        return None
    return int(count), last, files.split()


def stale_note(doc: dict) -> str | None:
    """The line a block carries when its run's commit predates a kernel change ("" when none does), or None when
    git cannot tell (the check of the committed README then leaves the line out of the comparison)."""
    commit = doc.get("git_commit") if isinstance(doc, dict) else None
    if not commit:
        return None
    since = kernel_changes_since(commit)
    if since is None:
        return None
    n, last, files = since
    if n == 0:
        return ""
    short = commit_label(doc)
    return (f"\n\n{STALE_MARK} measured at `{short}`; {n} later commit{'s' if n > 1 else ''} changed the kernels "
            f"({', '.join(f'`{f}`' for f in files)}; the last: `{last}`), so these figures are `{short}`'s until a GPU "
            "run re-measures them.")


def plot_caption(doc: dict) -> str:
    """What a plot's title says of its run: the commit, and a stale mark when kernel commits came after it (a plot
    is read apart from the README block that says so)."""
    caption = commit_text(doc, code=False)
    commit = doc.get("git_commit") if isinstance(doc, dict) else None
    since = kernel_changes_since(commit) if commit else None
    if since and since[0]:
        caption += (f" — STALE: {since[0]} later commit{'s' if since[0] > 1 else ''} changed the kernels (the last: "
                    f"{since[1]})")
    return caption


def without_stale_note(body: str) -> str:
    """``body`` without its stale line (where git cannot tell whether it holds)."""
    return re.sub(r"\n\n" + re.escape(STALE_MARK) + r"[^\n]*", "", body)


def _range(values, fmt="{:.2f}", unit="x") -> str:
    """``lo-hi`` of the values (one figure when they agree at that precision)."""
    lo, hi = fmt.format(min(values)), fmt.format(max(values))
    return f"{lo}{unit}" if lo == hi else f"{lo}-{hi}{unit}"


def _md_target(r, text):
    return f"{text}: {_md_verdict(r)}" if r.get("verdict") else "—"


def readme_decode(doc) -> str:
    lines = ["| batch | next_n | entries | ours, bf16 keys | ours, fp8 keys | DeepGEMM fp8 | bf16 / DG | fp8 / DG "
             "| bf16 % of read | target |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for b, n, bf, f8 in _decode_pairs(doc):
        tgt = (_target_pct(bf["target_pct_read"]) if bf.get("target_pct_read")
               else (f"<= {bf['target_us']:g} us" if bf.get("target_us") else ""))
        lines.append(f"| {b} | {n} | {_si(bf['entries'])} | {bf['time_us']:.1f} us | {f8['time_us']:.1f} us | "
                     f"{_f(bf.get('deepgemm_us'), '{:.1f} us')} | {_f(bf.get('vs_deepgemm'), '{:.2f}x')} | "
                     f"{_f(f8.get('vs_deepgemm'), '{:.2f}x')} | {_pct(bf.get('pct_read'))} | "
                     f"{_md_target(bf, tgt) if tgt else '—'} |")
    return "\n".join(lines)


def _us_or_ms(us):
    return f"{us / 1e3:.2f} ms" if us >= 1e3 else f"{us:.1f} us"


def readme_verify_extend(doc) -> str:
    lines = ["| case | ours, rows | ours, grouped / varlen | DG rows (fp8) | DG grouped (fp8) | ours / DG rows "
             "| target |",
             "|---|---|---|---|---|---|---|"]
    for m, b, n, rows, served in _route_pairs(doc):
        if m == "verify":
            shares = [f"{_pct(served[f'pct_{c}'])} of {c}" for c in ("read", "roofline") if served.get(f"pct_{c}")]
            extra = f" ({', '.join(shares)})" if shares else ""
        else:
            extra = f" ({served['tflops']:.0f} TF/s)" if served.get("tflops") else ""
        tgt = route_target(served)
        dg_grouped = served.get("deepgemm_grouped_us")
        lines.append(f"| {m} {b}{f', n {n}' if m == 'verify' else ''} | {_us_or_ms(rows['time_us'])} | "
                     f"{_us_or_ms(served['time_us'])}{extra} | {_us_or_ms(served['deepgemm_rows_us'])} | "
                     f"{_us_or_ms(dg_grouped) if dg_grouped else '—'} | "
                     f"{_f(served.get('vs_deepgemm_rows'), '{:.2f}x')} | {_md_target(served, tgt) if tgt else '—'} |")
    return "\n".join(lines)


def readme_prefill(doc) -> str:
    lines = ["| T x S | keys | time | TFLOP/s | % of bf16 matmul | DeepGEMM fp8 | ours / DG | vs contiguous | target |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in _ok(doc, "prefill"):
        tgt = prefill_target(r)
        lines.append(f"| {prefill_shape(r)} | {r['kv']} {r['layout']} | {r['time_us'] / 1e3:.2f} ms | "
                     f"{r['tflops']:.0f} | {_pct(r['pct_matmul'])} | "
                     f"{_f(r.get('deepgemm_us') and r['deepgemm_us'] / 1e3, '{:.2f} ms')} | "
                     f"{_f(r.get('vs_deepgemm'), '{:.2f}x')} | {_f(r.get('vs_contiguous'), '{:.3f}x')} | "
                     f"{_md_target(r, tgt) if tgt else '—'} |")
    return "\n".join(lines)


def readme_headline(doc) -> str:
    """The ranges the README's prose quotes, each over the rows it names."""
    pairs = [p for p in _decode_pairs(doc) if p[2].get("vs_deepgemm") and p[3].get("vs_deepgemm")]
    n1 = [p for p in pairs if p[1] == 1]
    big = [p for p in n1 if p[2]["entries"] >= 2**18]
    served = _route_pairs(doc)
    out = []
    if pairs:
        key_ratio = pairs[0][2]["key_bytes"] / pairs[0][3]["key_bytes"]
        out.append(f"- bf16 index keys are {key_ratio:.2f}x the key bytes of fp8 (256 B vs 132 B per entry).")
    if big:
        out.append(f"- decode, next_n 1, batches of 256K entries or more: bf16 keys take "
                   f"{_range([p[2]['vs_deepgemm'] for p in big])} DeepGEMM's fp8 time at "
                   f"{_range([100 * p[2]['pct_read'] for p in big], '{:.0f}', '%')} of the read stream; "
                   f"our fp8 layout takes {_range([p[3]['vs_deepgemm'] for p in big])}.")
    if n1:
        out.append(f"- decode, next_n 1, every batch: bf16 keys {_range([p[2]['vs_deepgemm'] for p in n1])} "
                   f"DeepGEMM, fp8 layout {_range([p[3]['vs_deepgemm'] for p in n1])}.")
    for n in sorted({p[1] for p in pairs} - {1}):
        at = [p for p in pairs if p[1] == n]
        out.append(f"- decode, next_n {n}: bf16 keys {_range([p[2]['vs_deepgemm'] for p in at])} DeepGEMM, "
                   f"fp8 layout {_range([p[3]['vs_deepgemm'] for p in at])}.")
    for n in sorted({p[2] for p in served if p[0] == "verify"}):
        at = [p[4] for p in served if p[0] == "verify" and p[2] == n and p[4].get("vs_deepgemm_rows")]
        out.append(f"- verify, next_n {n}, grouped launch: {_range([r['vs_deepgemm_rows'] for r in at])} "
                   f"DeepGEMM's rows time, {_range([100 * r['pct_roofline'] for r in at], '{:.0f}', '%')} of roofline.")
    ext = [p[4] for p in served if p[0] == "extend" and p[4].get("vs_deepgemm_rows")]
    if ext:
        out.append(f"- extend, varlen launch: {_range([r['vs_deepgemm_rows'] for r in ext])} DeepGEMM's rows time, "
                   f"{_range([r['tflops'] for r in ext], '{:.0f}', ' TFLOP/s')} useful.")
    qb = [r for m in ("decode", "extend") for r in _ok(doc, m) if r.get("vs_fp8_query")]
    if qb:
        out.append(f"- bf16-reference's bf16 query on bf16 keys (decode 64 x 32K and every extend case): "
                   f"{_range([r['vs_fp8_query'] for r in qb], '{:.2f}')} the fp8 query's time.")
    pre = [r for r in _ok(doc, "prefill") if r.get("vs_deepgemm")]
    if pre:
        out.append(f"- prefill, bf16 keys: {_range([r['vs_deepgemm'] for r in pre])} DeepGEMM's fp8 time, "
                   f"{_range([100 * r['pct_matmul'] for r in pre], '{:.0f}', '%')} of the bf16 matmul.")
    return "\n".join(out)


def readme_environment(doc) -> str:
    c = doc["ceilings"]
    ceil = (f" Ceilings measured in the same run: read-only {c['read_gbps']:.0f} GB/s, d2d copy {c['copy_gbps']:.0f} "
            f"GB/s, bf16 matmul {c['matmul_tflops']:.0f} TFLOP/s." if c.get("copy_gbps") else "")
    driver = doc.get("driver") or "driver not recorded"
    return (f"{doc['device']} ({doc['backend']}, {driver}), torch {doc['torch_version']}, cupy-dsa "
            f"{doc.get('cupy_dsa_version') or '?'} at {commit_text(doc)}, {doc['date'][:10]}"
            f"{', quick sizes' if doc['quick'] else ''}.{ceil}")


def readme_recall(doc) -> str:
    """The recall study at its largest context, one row per format: needle resolution, recall vs the exact top-k
    and overlap with the reference numerics' top-k, at each k."""
    rows = [r for r in _recall_rows(doc) if not r.get("error")]
    if not rows:
        return "No recall run in this results file."
    ctx = max(r["context_tokens"] for r in rows)
    at = [r for r in rows if r["context_tokens"] == ctx]
    ks = sorted({r["k"] for r in at})
    head = ("| format | " + " | ".join(f"needle resolution, k {k}" for k in ks) + " | "
            + " | ".join(f"recall vs exact, k {k}" for k in ks) + " | "
            + " | ".join(f"overlap with reference, k {k}" for k in ks) + " |")
    lines = [f"At {_si(ctx)} tokens ({at[0]['queries']} needles per format; synthetic keys):", "", head,
             "|---|" + "---|" * (3 * len(ks))]
    for fmt in dict.fromkeys(r["format"] for r in at):
        by_k = {r["k"]: r for r in at if r["format"] == fmt}
        cells = ([_margin(by_k[k]["resolution"]) if k in by_k else "—" for k in ks]
                 + [_pct(by_k[k]["recall_mean"]) if k in by_k else "—" for k in ks]
                 + [_pct(by_k[k]["ref_overlap_mean"]) if k in by_k else "—" for k in ks])
        lines.append(f"| {fmt} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def readme_query(doc) -> str:
    """prepare_index_q (what ``bf16-reference`` adds before each C4 layer's logits), with the run it came from:
    a `bench query` run may be newer than the run the other blocks quote."""
    rows = [r for r in doc.get("query", []) if not r.get("error")]
    lines = [f"{doc['device']} ({doc['backend']}{', quick sizes' if doc['quick'] else ''}), {commit_text(doc)}, "
             f"{doc['date'][:10]}: `prepare_index_q` per C4 layer and call (`fp4sim`: the bf16 query "
             "`bf16-reference` serves; `fp8`: the same preparation to an fp8 query, for comparison).", "",
             "| T tokens | query | time | GB/s | % of read stream |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {_si(r['n_tokens'])} | {r['numerics']} | {_us_or_ms(r['time_us'])} | {r['gbps']:.0f} | "
                     f"{_pct(r.get('pct_read'))} |")
    return "\n".join(lines)


# the steps the README's cost block shows; a serve run that did not time one of them says so under its table
README_SERVE_STEPS = ("decode", "verify, next_n 2", "verify, next_n 4", "prefill chunk of 4,096",
                      "prefill chunk of 16,384")


def _serve_block(doc) -> str:
    from .serve import markdown, step_label

    text = markdown(doc, with_rescore=False).rstrip("\n")
    timed = {step_label(r) for r in doc["timings"] if r.get("bf16_ms") is not None}
    missing = [step for step in README_SERVE_STEPS if step not in timed]
    if missing:
        text += (f"\n\nNot measured yet: {'; '.join(missing)} (not in this run; the `cupy-dsa bench serve` command "
                 "under this table times every step the README shows).")
    return text


# --------------------------------------------------------------------------------------------------
# which blocks a results document holds data for
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Block:
    """A README block: ``render(doc)`` its text; ``missing(doc)`` why ``doc`` holds no data for it (None: it does)."""
    render: Callable[[dict], str]
    missing: Callable[[dict], str | None]


def _none_if(rows, why):
    return None if rows else why


def _environment_missing(doc):
    """The environment line describes the run every other block quotes: rewritten only with all of them."""
    lacking = [n for n, b in README_BLOCKS.items() if n != "environment" and b.missing(doc)]
    return (f"the JSON holds no data for results:{', results:'.join(lacking)}, which stay from the run this line "
            "describes" if lacking else None)


README_BLOCKS = {
    "environment": Block(readme_environment, _environment_missing),
    "recall": Block(readme_recall, lambda d: _none_if([r for r in _recall_rows(d) if not r.get("error")],
                                                      "no recall rows")),
    "headline": Block(readme_headline, lambda d: _none_if(_decode_pairs(d) or _route_pairs(d) or _ok(d, "prefill"),
                                                          "no decode / verify / extend / prefill rows")),
    "decode": Block(readme_decode, lambda d: _none_if(_decode_pairs(d), "no decode rows with both key layouts")),
    "verify-extend": Block(readme_verify_extend, lambda d: _none_if(_route_pairs(d), "no verify / extend rows")),
    "prefill": Block(readme_prefill, lambda d: _none_if(_ok(d, "prefill"), "no prefill rows")),
    "query": Block(readme_query, lambda d: _none_if([r for r in d.get("query", []) if not r.get("error")],
                                                    "no query rows (`cupy-dsa bench query` / `bench all` makes them)")),
}

def _rescore_block(doc) -> str:
    from .rescore import markdown

    return markdown(doc).rstrip("\n")


# blocks rendered from a `bench rescore` JSON
RESCORE_README_BLOCKS = {
    "rescore": Block(_rescore_block, lambda d: _none_if([r for r in d.get("rows", []) if any(
        v is not None for v in r.get("us", {}).values())], "no timed rows")),
}

# blocks rendered from a `bench recall --suite diverse` JSON (a `bench` JSON with recall_diverse rows)
def _recall_diverse_block(doc) -> str:
    from .recall_diverse import readme_markdown

    return readme_markdown(doc)


RECALL_DIVERSE_README_BLOCKS = {
    "recall-diverse": Block(_recall_diverse_block, lambda d: _none_if(
        [r for r in d.get("recall_diverse") or [] if not r.get("error") and not r.get("trivial")],
        "no diverse recall rows (`cupy-dsa bench recall --suite diverse` makes them)")),
}


def _emulate_block(doc) -> str:
    from .variants import emulate_markdown

    return emulate_markdown(doc).strip()


def _rtx_model_block(doc) -> str:
    from .roofline import readme_block

    return readme_block(doc).strip()


def _rtx_model_missing(doc) -> str | None:
    from .roofline import measured_shares

    if doc.get("target") != "sm_120":
        return "not an sm_120 emulation"
    try:
        measured_shares(doc)
    except ValueError as exc:
        return str(exc)
    return None


# blocks rendered from a `bench variants --emulate` JSON
EMULATE_README_BLOCKS = {
    "emulate-sm120": Block(_emulate_block, lambda d: None if d.get("target") == "sm_120" and d.get("rows") else
                           "not an sm_120 emulation with rows"),
    "model-rtx-pro-6000": Block(_rtx_model_block, _rtx_model_missing),
}

# blocks rendered from a `bench serve` JSON (the other blocks: from a `bench` JSON)
def _serve_rescore_block(doc) -> str:
    from .serve import rescore_markdown

    return "\n".join(rescore_markdown(doc)).strip("\n")


def _serve_missing(doc, key, what, against=None, rows="timings", configs_of=None):
    """Why ``doc`` holds no data for a serve block: unmeasured, another arch's configs than ``configs_of`` (None:
    this GPU's own), or no row of ``rows`` with ``key`` (and ``against``, when given)."""
    if not (doc.get("measured") and (doc.get("timings") or doc.get(rows))):
        return f"no timings ({doc.get('not_measured') or 'nothing measured'})"
    if doc.get("arch_configs") != configs_of:
        return (f"a run with {doc['arch_configs']}'s configs forced" if doc.get("arch_configs")
                else "a run with this GPU's own configs")
    return _none_if([r for r in doc.get(rows) or [] if r.get(key) is not None and (against is None or any(
        r.get(k) is not None for k in against))], f"no {what} timings")


def _serve_query_block(doc) -> str:
    from .serve import query_markdown

    return "\n".join(query_markdown(doc)).strip("\n")


def _query_missing(doc, configs_of=None):
    return _serve_missing(doc, "bf16_q_vs_fp8_q", "bf16 query / fp8 query (`bench serve --query fp8,bf16`)",
                          rows="query_timings", configs_of=configs_of) or _none_if(
        [r for r in doc["query_timings"] if r["bf16_q_vs_fp8_q"]], "no step timed with both queries")


SERVE_README_BLOCKS = {
    # bf16 keys against fp8 (DeepGEMM or fp8-cupy): a run of the bf16 layout alone (--query's) has no ratio to show
    "serve": Block(_serve_block, lambda d: _serve_missing(d, "bf16_ms", "bf16 and fp8", against=("fp8_ms", "fp8_cupy_ms"))),
    "serve-rescore": Block(_serve_rescore_block, lambda d: _serve_missing(d, "fp8_rescore_ms", "fp8-rescore")),
    "serve-query": Block(_serve_query_block, _query_missing),
    "serve-query-sm120": Block(_serve_query_block, lambda d: _query_missing(d, "sm_120")),
}


def not_gpu_figures(doc: dict) -> str | None:
    """Why ``doc`` is not a full-size GPU run (the README's figures are H200 runs), or None."""
    from .rescore import is_rescore

    if is_rescore(doc) or doc.get("schema") == "cupy-dsa-emulate/1":  # GPU-only commands
        return "a --quick run (smaller sizes)" if doc.get("quick") else None
    if doc.get("schema", "").startswith("cupy-dsa-serve"):
        return None if doc.get("measured") else "a run without a GPU (nothing measured)"
    if doc.get("backend") != "cuda":
        return f"a {doc.get('backend')}-backend run on {doc.get('device')}"
    if doc.get("quick"):
        return "a --quick run (smaller sizes)"
    return None


def readme_update(text: str, doc: dict, blocks: dict | None = None) -> tuple[str, list[str], dict[str, str]]:
    """(``text`` with the blocks of ``blocks`` (default :data:`README_BLOCKS`) that ``doc`` holds data for
    re-rendered, the names rewritten, {name: why kept} of the others). Blocks of the other results file are
    left as they are (and not listed); an unknown block name is a ValueError."""
    blocks = README_BLOCKS if blocks is None else blocks
    known = {**README_BLOCKS, **SERVE_README_BLOCKS, **RESCORE_README_BLOCKS, **EMULATE_README_BLOCKS,
             **RECALL_DIVERSE_README_BLOCKS}
    rewritten, kept = [], {}

    def render(m):
        name = m["name"]
        if name not in known:
            raise ValueError(f"README block 'results:{name}': expected one of {', '.join(known)}")
        if name not in blocks:
            return m[0]
        why = blocks[name].missing(doc)
        if why:
            kept[name] = why
            return m[0]
        rewritten.append(name)
        note = stale_note(doc)
        if note is None:  # git cannot tell: the block keeps the line it had
            kept_note = re.search(r"\n\n" + re.escape(STALE_MARK) + r"[^\n]*", m["body"])
            note = kept_note[0] if kept_note else ""
        return f"{m[1]}{blocks[name].render(doc)}{note}\n{m[4]}"

    return README_BLOCK.sub(render, text), rewritten, kept


def readme_with_results(text: str, doc: dict, blocks: dict | None = None) -> str:
    """``text`` with every block of ``blocks`` that ``doc`` holds data for re-rendered (:func:`readme_update`)."""
    return readme_update(text, doc, blocks)[0]
