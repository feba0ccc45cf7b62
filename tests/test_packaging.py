"""Packaging facts CI relies on: the README's test command is what .ci/run runs; kernels ship in the package."""
import configparser
import re

import pytest
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


def _readme_python_blocks():
    """The README's Python blocks and bench/results/README.md's (where fp8-rescore's example stands)."""
    text = (ROOT / "README.md").read_text() + "\n" + (ROOT / "bench" / "results" / "README.md").read_text()
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def test_readme_has_python_blocks():
    assert len(_readme_python_blocks()) >= 2


@pytest.mark.parametrize("index", range(len(_readme_python_blocks())))
def test_readme_python_block_runs_on_cpu(index, monkeypatch):
    """Every Python block of the README runs as written (on CPU here: the blocks pick the GPU when there is one)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code = _readme_python_blocks()[index]
    exec(compile(code, f"README.md python block {index}", "exec"), {"__name__": "__readme__"})


def test_readme_names_only_public_functions():
    """Every ``cupy_dsa.<name>`` or bare ``*_reference`` name the README mentions is exported."""
    import cupy_dsa

    text = (ROOT / "README.md").read_text() + (ROOT / "bench" / "results" / "README.md").read_text()
    names = set(re.findall(r"cupy_dsa\.([a-z_][a-z0-9_]*)\(", text)) | set(re.findall(r"`([a-z_0-9]+_reference)`", text))
    assert names, "no names found"
    missing = sorted(n for n in names if n not in cupy_dsa.__all__)
    assert not missing, missing


def test_readme_installs_from_a_checkout_or_wheel():
    """cupy-dsa is not on a package registry: the README never tells users to install it by name."""
    text = (ROOT / "README.md").read_text()
    assert not re.search(r"pip install \"?'?cupy-dsa\[", text), "README installs cupy-dsa from a registry"


def test_readme_lists_what_the_install_adds():
    """The Set up section names every requirement of the install and of the CUDA extras, as setup.cfg pins it,
    and the CPU-only install without an extra."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    text = (ROOT / "README.md").read_text()
    setup = text[text.index("## Set up"):text.index("\n## ", text.index("## Set up") + 1)]
    reqs = [r.strip() for r in cfg["options"]["install_requires"].splitlines() if r.strip()]
    for extra in ("cu12", "cu13"):
        reqs += [r.strip() for r in cfg["options.extras_require"][extra].splitlines() if r.strip()]
    cu13 = [r.strip() for r in cfg["options.extras_require"]["cu13"].splitlines() if r.strip()]
    for r in reqs:
        name = re.split(r"[<>=\[]", r)[0]
        assert f"`{name}" in setup, f"README's Set up section does not name {name}"
    for r in list(cfg["options"]["install_requires"].split()) + cu13:
        assert f"`{r}" in setup, f"README's Set up section does not give {r} as setup.cfg pins it"
    assert "`pip install -e .`" in setup and "needs no CUDA extra" in setup


def test_gpu_sessions_preload_only_when_large():
    """One selected GPU test does not compile every declared config first (about a minute cold); a full GPU run
    does; CUPY_DSA_PRELOAD forces either."""
    from conftest import PRELOAD_MIN_GPU_TESTS, preload_declared

    assert not preload_declared(1, {}) and not preload_declared(PRELOAD_MIN_GPU_TESTS - 1, {})
    assert preload_declared(PRELOAD_MIN_GPU_TESTS, {})
    assert preload_declared(1, {"CUPY_DSA_PRELOAD": "1"}) and not preload_declared(500, {"CUPY_DSA_PRELOAD": "0"})


def test_license_file_is_the_declared_license():
    """setup.cfg declares Apache-2.0; the checkout carries its full text (and the wheel picks it up)."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    assert cfg["metadata"]["license"] == "Apache-2.0"
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and len(text.splitlines()) > 150


def test_one_gpu_suite_script():
    """run_gpu_final.sh repeated run_gpu_suite.sh: its time-boxed subset is the suite's TIMEBOX=1 mode now."""
    import subprocess

    scripts = sorted(p.name for p in (ROOT / "scripts").glob("*.sh"))
    assert scripts == ["run_gpu_suite.sh", "run_sglang_gpu.sh"], scripts   # the second: the suite's SGLang step
    suite = ROOT / "scripts" / "run_gpu_suite.sh"
    assert subprocess.run(["bash", "-n", str(suite)]).returncode == 0
    text = suite.read_text()
    assert "TIMEBOX" in text and "run_sglang_gpu.sh" in text


def test_kernel_registry_is_complete_after_a_bare_import():
    """`import cupy_dsa` loads no op module (the CLI's --help stays light), so the registry's readers (warm_up,
    product_expressions, the bench's resources) import them first: every family is there in a fresh process."""
    import subprocess
    import sys

    code = ("from cupy_dsa import launch; import sys; assert 'cupy_dsa.logits' not in sys.modules; "
            "print(sorted(launch.families())); print(sorted(launch.product_expressions('sm_90')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    fams, sources = r.stdout.splitlines()
    assert eval(fams) == ["mqa_logits", "mqa_logits_plan", "paged_mqa_logits", "paged_mqa_logits_plan",
                          "paged_topk", "prepare_index_q", "rescore_topk", "store_index_k"]
    assert eval(sources) == ["mqa_logits.cu", "prepare_index_q.cu", "rescore_topk.cu", "store_index_k.cu",
                             "topk.cu"]


def test_measure_all_re_measures_every_result_the_readmes_render():
    """run_gpu_suite.sh MEASURE_ALL=1 (issue 50): every JSON and plot the re-rendering list of bench/results/README.md
    names, and the README's mode table's sources, has a step that measures it (as <gpu>-NAME) and is re-rendered."""
    suite = (ROOT / "scripts" / "run_gpu_suite.sh").read_text()
    mode = suite[suite.index('if [ -n "${MEASURE_ALL:-}" ]; then'):]
    rerender = re.search(r"```\n(cupy-dsa bench report .*?)```", (ROOT / "bench/results/README.md").read_text(), re.S)[1]
    from cupy_dsa.bench import which_mode

    rendered = set(re.findall(r"bench/results/(h200[\w-]*\.(?:json|png))", rerender)) | set(which_mode.SOURCES.values())
    assert {"h200.json", "h200-serve.json", "h200-recall.json", "h200.png"} <= rendered, rendered
    for name in sorted(rendered):
        measured = "$R/$TAG" + name[len("h200"):]
        if name == "h200-recall.json":   # the recall rows of the same `bench all` run
            assert '"$R/$TAG.json" "$R/$TAG-recall.json"' in mode
        elif name == "h200-recall.png":
            assert "$R/h200-recall.json --plot $R/h200-recall.png" in mode
        elif name.endswith(".png"):
            assert f"--plot {measured}" in mode, name
        else:
            assert f"--json {measured}" in mode, name
        assert f"$R/{name}" in mode, f"{name} is not re-rendered"
    assert "python3 -m cupy_dsa.bench.which_mode README.md" in mode and "MEASURE_S:-540" in mode
