"""Packaging facts CI relies on: the README's test command is what .ci/run runs; kernels ship in the package."""
import configparser
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _ci_command():
    lines = [ln for ln in (ROOT / ".ci" / "run").read_text().splitlines() if ln.startswith("pip install")]
    assert len(lines) == 1, lines
    return lines[0]


def test_readme_test_command_is_the_ci_command():
    assert _ci_command() in (ROOT / "README.md").read_text()


def test_kernels_and_bench_are_packaged():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    pkg_dir = cfg["options"]["package_dir"]
    assert re.search(r"cupy_dsa\.kernels\s*=\s*kernels", pkg_dir)
    assert re.search(r"cupy_dsa\.bench\s*=\s*bench", pkg_dir)
    assert "*.cu" in cfg["options.package_data"]["cupy_dsa.kernels"]
    assert "cupy_dsa = cupy_dsa.sglang.plugin:register" in cfg["options.entry_points"]["sglang.srt.plugins"]


def test_kernel_dir_found():
    from cupy_dsa import runtime

    d = runtime.kernel_dir()
    assert (d / "common.cuh").is_file() and (d / "store_index_k.cu").is_file() and (d / "mqa_logits.cu").is_file()
