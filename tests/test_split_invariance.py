"""Split invariance of one C4 layer's index keys (scripts/_split_invariance.py): the splits plan, SGLang's plan-row
layout, the bit-for-bit comparison and where it reports a difference, on the CPU with a torch stand-in of SGLang's
compressor; and on a GPU (marker gpu) with SGLang 0.5.23's own JIT compressor kernels, when SGLang and nvcc are
there (``bash scripts/run_sglang_gpu.sh --split`` installs SGLang's wheels and runs the same check)."""
import importlib.util
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import _split_invariance as si  # noqa: E402

from cupy_dsa import store  # noqa: E402

MODES = ("fp8", "bf16", "bf16-reference", "fp8-cupy", "fp8-rescore")


def test_splits_cover_every_residue_odd_chunks_and_verify():
    total = 1027
    splits = si.split_plans(total)
    assert splits[0].name == "one prefill" and splits[0].steps == [si.Step("prefill", 0, total)]
    decode_splits = [s for s in splits if "decodes" in s.name]
    assert sorted(s.residue for s in decode_splits) == [0, 1, 2, 3]
    for s in decode_splits:
        first, rest = s.steps[0], s.steps[1:]
        assert first.kind == "prefill" and first.length % 4 == s.residue
        assert [st.prefix for st in rest] == list(range(first.length, total)) and all(st.kind == "decode" for st in rest)
    chunks = next(s for s in splits if s.name.startswith("prefill chunks"))
    sizes = [st.length for st in chunks.steps]
    assert sum(sizes) == total and not any(n % 4 == 0 for n in sizes), sizes
    assert [st.prefix for st in chunks.steps] == [sum(sizes[:i]) for i in range(len(sizes))]
    verify = next(s for s in splits if s.name.startswith("MTP"))
    assert verify.ring == si.RING_MTP and all(st.length == si.VERIFY_N for st in verify.steps[1:])
    pos = verify.steps[0].end
    for st in verify.steps[1:]:   # each step starts after the previous one's accepted drafts
        assert st.prefix == pos and 1 <= st.accepted <= st.length
        pos += st.accepted
    assert pos == total and any(st.accepted < st.length for st in verify.steps[1:])
    with pytest.raises(ValueError, match="total"):
        si.split_plans(20)


def test_plan_rows_are_sglangs_layout():
    """The harness's CompressPlan / DecodePlan rows decode (cupy_dsa's plan reader) to the entries the step
    completes, at the slot c4_out_loc gives them."""
    step = si.Step("prefill", 6, 11)   # positions 6..16: entries 1 (pos 7), 2 (11), 3 (15)
    plan = si.prefill_plan_rows(step)
    pos, loc = store.plan_to_direct(plan, si.out_locs(step), is_decode=False)
    valid = loc >= 0
    assert (pos[valid] // 4).tolist() == [1, 2, 3] and loc[valid].tolist() == [1, 2, 3]
    assert [e for _, e in si.entries_completed(step)] == [1, 2, 3]
    for seq, want in ((16, [3]), (15, [])):
        d = si.Step("decode", seq - 1, 1)
        pos, loc = store.plan_to_direct(si.decode_plan_rows(seq), si.out_locs(d), is_decode=True)
        assert loc[loc >= 0].tolist() == want and [e for _, e in si.entries_completed(d)] == want


@pytest.mark.parametrize("layout,byte,entry,part", [("bf16", 16384 + 256 * 5 + 3, 69, "value"),
                                                    ("fp8", 8448 + 128 * 2, 66, "value"),
                                                    ("fp8", 8448 + 8192 + 4 * 9 + 1, 73, "scale")])
def test_page_bytes_map_to_their_entry(layout, byte, entry, part):
    assert si.page_entry(layout, byte) == (entry, part)


def test_compare_pages_reports_the_entry_and_bytes():
    ref = torch.zeros(2, 8448, dtype=torch.uint8)
    got = ref.clone()
    got[1, 8192 + 4 * 3 + 2] = 7          # a scale byte of entry 67
    got[0, 128 * 5] = 1                   # a value byte of entry 5
    writers = {5: {"step": 2}, 67: {"step": 9}}
    found = si.compare_pages("fp8", "fp8", ref, got, writers, entries=100)
    assert [(f["entry"], f["parts"], f["written_by"]) for f in found] == [(5, ["value"], {"step": 2}),
                                                                           (67, ["scale"], {"step": 9})]
    assert found[1]["first_byte"] == {"offset": 8448 + 8192 + 14, "reference": 0, "this_split": 7}
    assert si.compare_pages("fp8", "fp8", ref, got, writers, entries=60)[0]["entry"] == 5   # past the sequence: ignored
    assert si.compare_pages("fp8", "fp8", ref, ref.clone(), writers, entries=100) == []


def test_torch_stand_in_is_split_invariant_in_every_mode():
    """With a compressor that is split-invariant, every split gives the one-prefill run's rows, pages (every mode)
    and top-k: the plugin's store adds no dependence on how the sequence was split."""
    result = si.check_splits(si.TorchBackend(MODES, 139), 139)
    assert result["ok"], "\n".join(si.summary_lines(result))
    assert set(result["modes"]) >= set(MODES) and len(result["splits"]) == 6


def test_a_residue_dependent_compressor_is_located():
    """A planted defect (a prefill ending at 3 mod 4 drops its partial group's rows): the residue-3 split fails at the
    entry that straddles its prefill's end, written by the first decode after it; residues 0-2 stay identical."""
    total = 139
    result = si.check_splits(si.TorchBackend(("fp8", "bf16"), total, defect_residue=3), total)
    assert not result["ok"]
    by_residue = {r["residue"]: r for r in result["splits"] if "decodes" in r["name"]}
    assert all(not by_residue[r]["findings"] for r in (0, 1, 2))
    bad = by_residue[3]
    prefill_end = int(bad["name"].split()[1])
    first = bad["findings"][0]
    assert first["what"] == "compressor output" and first["entry"] == prefill_end // 4
    assert first["written_by"]["kind"] == "decode"
    assert {f["what"] for f in bad["findings"]} >= {"compressor output", "fp8 page bytes", "bf16 page bytes"}
    text = "\n".join(si.summary_lines(result))
    assert f"entry {prefill_end // 4} (raw [{prefill_end // 4 * 4}, {prefill_end // 4 * 4 + 3}]), split residue 3" in text


def test_dry_mode_of_the_gpu_script(tmp_path):
    import subprocess

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(root / "scripts" / "gpu_split_invariance.py"), "--device", "cpu",
                          "--tokens", "75", "--json", str(tmp_path / "s.json")], capture_output=True, text=True,
                         timeout=600, cwd=root)
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1].startswith("SPLIT INVARIANCE: PASS"), \
        out.stdout + out.stderr
    assert (tmp_path / "s.json").exists()
    md = subprocess.run([sys.executable, str(root / "scripts" / "gpu_split_invariance.py"), "--render",
                         str(tmp_path / "s.json")], capture_output=True, text=True, timeout=300, cwd=root)
    assert md.returncode == 0 and "| one prefill" not in md.stdout and md.stdout.count("identical, bit for bit") == 6
    assert "0 of " in md.stdout and "scale words differ" in md.stdout, md.stdout


def test_markdown_names_a_differing_split():
    result = si.check_splits(si.TorchBackend(("fp8",), 75, defect_residue=3), 75)
    md = si.markdown(result)
    assert "**differ**" in md and "entry" in md and "identical, bit for bit" in md, md


def _sglang_jit_available() -> bool:
    return importlib.util.find_spec("sglang") is not None and shutil.which("nvcc") is not None


@pytest.mark.gpu
def test_gpu_split_invariance_with_sglangs_compressor_kernels():
    """SGLang 0.5.23's own planner and C4 kernel (JIT) feeding every mode's store: every split byte-identical to one
    prefill, in every mode, and fp8-cupy's pages are SGLang's stock fp8 pages (issue 50 P4)."""
    if not _sglang_jit_available():
        pytest.skip("needs SGLang 0.5.23 (bash scripts/run_sglang_gpu.sh --split installs its wheels) and nvcc")
    import gpu_split_invariance as g

    result = g.run("cuda", total=int(os.environ.get("CUPY_DSA_SPLIT_TOKENS", "1027")))
    assert result["ok"], "\n".join(si.summary_lines(result))
    p4 = result["p4"]
    assert p4["value_bytes_differing"] == 0 and p4["scale_words_differing"] == 0, p4
