"""NVRTC compile of every declared kernel config (product and experimental) for every target arch, without a
GPU; ptxas's resource report of every product config (no spills); the launch specs against the CUDA source
(argument names and types, template parameters, shared-memory formulas)."""
import contextlib
import functools
import os
import re

import pytest
import torch

import cupy_dsa
from cupy_dsa import arch as arch_limits
from cupy_dsa import launch, runtime

ARCHS = ["sm_80", "sm_89", "sm_90", "sm_100", "sm_120"]
SOURCES = ["mqa_logits.cu", "prepare_index_q.cu", "rescore_topk.cu", "store_index_k.cu", "topk.cu"]


@functools.lru_cache(maxsize=None)
def compiled(filename, arch):
    """(cubin, lowered names, ptxas resources) of every declared config of ``filename`` on ``arch``."""
    exprs = launch.declared_expressions(arch)[filename]
    cubin, lowered, log = runtime.compile_cubin(filename, exprs, arch, resource_usage=True)
    return cubin, lowered, runtime.ptxas_resources(log, lowered)


def test_every_source_declares_configs():
    for arch in ARCHS:
        product, declared = launch.product_expressions(arch), launch.declared_expressions(arch)
        assert set(product) == set(declared) == set(SOURCES)
        assert all(set(product[f]) <= set(declared[f]) for f in SOURCES)
    assert set(launch.families()) == {"store_index_k", "paged_mqa_logits", "paged_mqa_logits_plan", "mqa_logits",
                                     "mqa_logits_plan", "prepare_index_q", "rescore_topk", "paged_topk"}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("filename", SOURCES)
def test_nvrtc_compiles(filename, arch):
    cubin, lowered, resources = compiled(filename, arch)
    exprs = launch.declared_expressions(arch)[filename]
    assert cubin[:4] == b"\x7fELF"
    assert set(lowered) == set(exprs) and all(lowered.values())
    assert set(resources) == set(exprs), "ptxas reported no resources for some configs"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("filename", SOURCES)
def test_product_configs_do_not_spill(filename, arch):
    """A spill in a shipped config is a bug of its launch bounds / MinBlocks (the README lists the figures)."""
    _, _, resources = compiled(filename, arch)
    spills = {e: r for e, r in resources.items() if e in launch.product_expressions(arch)[filename]
              and (r["spill_stores"] or r["spill_loads"])}
    assert not spills, f"{arch}: product configs spill: {spills}"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("filename", SOURCES)
def test_ptxas_table_is_what_this_compile_reports(filename, arch):
    """bench/results/README.md's ptxas table is `cupy-dsa bench resources`' output for the NVRTC it names (its
    rescore_gather rows went stale); under another NVRTC the figures may differ and are not compared."""
    from pathlib import Path

    from cupy_dsa.bench import resources

    text = (Path(__file__).resolve().parents[1] / "bench" / "results" / "README.md").read_text()
    table = re.search(r"<!-- resources:ptxas -->\n(.*?)<!-- /resources:ptxas -->", text, re.S)[1]
    named = tuple(int(x) for x in re.search(r"ptxas's report \(NVRTC (\d+)\.(\d+)", text).groups())
    if tuple(runtime.cupy_module().cuda.nvrtc.getVersion()) != named:
        pytest.skip(f"the table is NVRTC {named}'s")
    configs = {c.expr: c for f in launch.families().values() for c in f.product(arch)}
    product = launch.product_expressions(arch)[filename]
    rows = [dict(r, arch=arch, config=e, dynamic_smem=configs[e].smem)
            for e, r in compiled(filename, arch)[2].items() if e in product]
    for line in resources.markdown(rows).splitlines()[2:]:
        assert line in table, f"{line} (re-run cupy-dsa bench resources into bench/results/README.md)"


# --------------------------------------------------------------------------------------------------
# Residency: every product config keeps MIN_WARPS_PER_SM warps per SM on every arch of the limits table
# --------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def product_resources(filename, arch):
    """ptxas resources of the product configs (the compile of every declared config where it is cached)."""
    if arch in ARCHS:
        return compiled(filename, arch)[2]
    exprs = launch.product_expressions(arch)[filename]
    _, lowered, log = runtime.compile_cubin(filename, exprs, arch, resource_usage=True)
    return runtime.ptxas_resources(log, lowered)


def product_residency(arch):
    """{config: Residency} of every product config on ``arch`` (ptxas's registers and static shared memory)."""
    out = {}
    for fam in launch.families().values():
        for cfg in fam.product(arch):
            r = product_resources(cfg.source, arch)[cfg.expr]
            out[cfg] = cfg.residency_on(arch, r)
    return out


# the archs of the limits table that ARCHS does not compile every declared config for: their product configs (what
# ships) are compiled here too, the README's "What ran where" claims it for every arch of the table
PRODUCT_ONLY_ARCHS = [a for a in arch_limits.ARCH_LIMITS if a not in ARCHS]


def test_every_arch_the_readme_names_is_compiled():
    assert set(ARCHS) | set(PRODUCT_ONLY_ARCHS) == set(arch_limits.ARCH_LIMITS)
    assert {"sm_86", "sm_103", "sm_121"} <= set(PRODUCT_ONLY_ARCHS)
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    row = next(ln for ln in readme.splitlines() if ln.startswith("| sm_80,"))
    assert set(re.findall(r"sm_\d+", row.split("|")[1])) == set(arch_limits.ARCH_LIMITS), row


@pytest.mark.parametrize("arch", PRODUCT_ONLY_ARCHS)
@pytest.mark.parametrize("filename", SOURCES)
def test_product_configs_compile_without_spill_on_every_arch(filename, arch):
    """sm_86, sm_103, sm_121 (and any arch of the limits table beyond ARCHS): the shipped configs compile and do
    not spill (the same compile the residency test below reads)."""
    resources = product_resources(filename, arch)
    assert set(resources) == set(launch.product_expressions(arch)[filename])
    spills = {e: r for e, r in resources.items() if r["spill_stores"] or r["spill_loads"]}
    assert not spills, f"{arch}: product configs spill: {spills}"


@pytest.mark.parametrize("arch", list(arch_limits.ARCH_LIMITS))
def test_product_configs_keep_eight_warps_resident(arch):
    low = {str(c): str(r) for c, r in product_residency(arch).items() if r.warps < arch_limits.MIN_WARPS_PER_SM}
    assert not low, (f"{arch}: product configs below {arch_limits.MIN_WARPS_PER_SM} resident warps per SM "
                     f"(config: CTAs x warps, the limit that binds): {low}")


def test_residency_names_the_binding_limit():
    kib = arch_limits.KIB
    # a 4-row tile's q (66.5 KiB) alone on sm_120's 100 KiB; three of them on sm_90, where 168 registers bind too
    r = arch_limits.residency("sm_120", threads=128, smem_bytes=66_656, registers=168)
    assert (r.ctas, r.warps, r.binding) == (1, 4, "shared memory")
    r = arch_limits.residency("sm_90", threads=128, smem_bytes=66_656, registers=168)
    assert (r.ctas, r.warps) == (3, 12) and r.by_limit["registers"] == 3 and r.by_limit["shared memory"] == 3
    r = arch_limits.residency("sm_90", threads=128, smem_bytes=16_736, registers=232)
    assert (r.ctas, r.binding) == (2, "registers")          # 232 -> 7424 per warp: 2 warps per sub-partition
    r = arch_limits.residency("sm_120", threads=1024, smem_bytes=256, registers=28)
    assert (r.ctas, r.binding) == (1, "threads")             # 1,536 threads per SM
    assert arch_limits.residency("sm_86", threads=32, smem_bytes=0).binding == "CTA slots"
    assert arch_limits.ctas_by_smem("sm_120", 99 * kib + 1) == 0   # over the per-block opt-in maximum
    assert arch_limits.residency("sm_90", threads=128, smem_bytes=0, registers=256).ctas == 0
    with pytest.raises(ValueError, match="arch: expected one of sm_80.*got 'sm_75'"):
        arch_limits.limits("sm_75")


def test_sm120_runs_eight_warp_tiles_where_a_four_warp_tile_is_alone():
    """The configs that 100 KB archs would hold at one 4-warp CTA (4-row prefill tiles, decode next_n 4) run
    8 warps there (prefill of bf16 keys: 8 rows, q in registers), and so do next_n 2-3 (faster under sm_120's residency); 4 warps on sm_90 / sm_100 and for
    next_n 1."""
    from cupy_dsa import logits as L
    for arch in ("sm_86", "sm_89", "sm_120", "sm_121"):
        assert {c.block[0] // 32 for c in L.PREFILL.product(arch)} == {8}
        # bf16 keys of one request: q in registers, one row per warp (varlen and fp8 keys: 4-row tiles)
        assert {p for p in L.PREFILL.problems if L.PREFILL.select(p, arch).kernel is L.QREG_PREFILL_KERNEL} == {
            (layout, q_fp8, 0) for layout in ("contiguous", "bf16") for q_fp8 in (1, 0)}
        assert {c.Rows: c.Warps for c in L.DECODE.product(arch)} == {1: 4, 2: 8, 3: 8, 4: 8}
    assert {c.Warps for c in L.DECODE.product("sm_90") if c.kernel is L.DECODE_KERNEL} == {4}
    assert {c.Warps for c in L.PREFILL.product("sm_100")} == {4}


@pytest.mark.gpu
def test_residency_table_agrees_with_the_driver():
    """The limits table and ptxas's counts predict the driver's CTAs per SM for every product config of this GPU."""
    idx = torch.cuda.current_device()
    arch = runtime.device_arch(idx)
    if arch not in arch_limits.ARCH_LIMITS:
        pytest.skip(f"{arch} is not in the limits table")
    cupy_dsa.warm_up(idx)
    for cfg, r in product_residency(arch).items():
        assert cfg.resident_ctas_per_sm(idx) == r.ctas, (str(cfg), str(r))


# --------------------------------------------------------------------------------------------------
# Specs vs the CUDA source
# --------------------------------------------------------------------------------------------------

def _expand_macros(src: str) -> str:
    """The source with its object-like #defines expanded (the shared argument lists of the kernels)."""
    src = src.replace("\\\n", " ")
    macros = dict(re.findall(r"^#define (\w+)[ \t]+(.+)$", src, flags=re.M))
    src = re.sub(r"^#(define|undef) .*$", "", src, flags=re.M)
    for name, body in macros.items():
        src = re.sub(rf"\b{name}\b", lambda _m: body, src)
    return src


def _split_top(text: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += ch in "(<{" and 1 or (ch in ")>}" and -1 or 0)
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return out + ([cur.strip()] if cur.strip() else [])


@functools.lru_cache(maxsize=None)
def kernel_signature(source: str, name: str):
    """(template parameter names, [(argument name, C type)]) of ``__global__ ... name(...)`` in ``source``."""
    text = runtime.read_source(source)
    for header in runtime.included_headers(source):   # their macros expand in the source too
        text = runtime.read_source(header) + text
    text = _expand_macros(text)
    m = re.search(rf"(template\s*<([^>]*)>\s*)?__global__[^;{{]*?\b{name}\s*\(([^)]*)\)", text, flags=re.S)
    assert m, f"{name} not found in {source}"
    params = [p.split()[-1] for p in _split_top(m.group(2) or "")]
    args = []
    for a in _split_top(m.group(3)):
        a = a.replace("__restrict__", " ").replace("*", " * ")
        words = a.split()
        args.append((words[-1], " ".join(words[:-1])))
    return params, args


def _matches(c_type: str, typ: str) -> bool:
    if typ == launch.PTR:
        return c_type.endswith("*")
    return c_type.replace("const ", "") in {launch.I32: ("int",), launch.I64: ("long long", "i64"),
                                              launch.F32: ("float",)}[typ]


def _kernels():
    seen = {}
    for fam in launch.families().values():
        for arch in ARCHS:
            for cfg in fam.declared(arch):
                seen[cfg.kernel.name] = cfg.kernel
    return sorted(seen.values(), key=lambda k: k.name)


@pytest.mark.parametrize("kernel", _kernels(), ids=lambda k: k.name)
def test_spec_matches_the_kernel_signature(kernel):
    params, args = kernel_signature(kernel.source, kernel.name)
    assert tuple(params) == kernel.params
    assert [n for n, _ in args] == [n for n, _ in kernel.args], "argument names / order"
    for (name, c_type), (_, typ) in zip(args, kernel.args):
        assert _matches(c_type, typ), f"{kernel.name}: {name} is {c_type!r} in the source, declared {typ}"


def test_smem_formulas_match_the_kernels():
    """Each kernel's dynamic shared memory as the Python spec computes it equals the C++ constant the kernel
    lays its buffers out with (static_asserts compiled for every declared config)."""
    checks = {}
    for fam in launch.families().values():
        for arch in ARCHS:
            for cfg in fam.declared(arch):
                if cfg.kernel.smem_check:
                    checks[cfg.kernel.smem_check.format(**cfg.values)] = (cfg.smem, cfg.kernel.source)
    assert checks
    for source in {s for _, s in checks.values()}:
        body = "".join(f'static_assert({expr} == {smem}, "smem of {expr}");\n'
                       for expr, (smem, s) in checks.items() if s == source)
        runtime.compile_cubin(f"smem_check_{source}", [], "sm_90", source=f"#include \"{source}\"\n{body}")


# --------------------------------------------------------------------------------------------------
# Launch layer (CPU): configs, argument packing, selection
# --------------------------------------------------------------------------------------------------

def test_selected_configs_serve_their_problems():
    for fam in launch.families().values():
        for arch in ARCHS:
            for p in fam.problems:
                assert fam.serves(fam.select(p, arch), p), (fam.name, arch, p)
            for cfg in fam.experimental(arch):      # no variant that no problem could launch
                assert any(fam.serves(cfg, p) for p in fam.problems), (fam.name, arch, str(cfg))


def test_pack_checks_names_and_types():
    from cupy_dsa import logits as L
    cfg = L.PLAN.select((), "sm_90")
    t = torch.zeros(3, dtype=torch.int32)
    packed = cfg.kernel.pack(lens=t, lens_2d=0, batch=3, next_n=1, plan=None)
    assert packed[0] == t.data_ptr() and packed[4] == 0 and packed[2].dtype.name == "int32"
    with pytest.raises(TypeError, match="batch"):
        cfg.kernel.pack(lens=t, lens_2d=0, next_n=1, plan=t)
    with pytest.raises(TypeError, match="bogus"):
        cfg.kernel.pack(lens=t, lens_2d=0, batch=3, next_n=1, plan=t, bogus=1)
    with pytest.raises(TypeError, match="lens"):
        cfg.launch(torch.device("cuda", 0), (1, 1, 1), lens=5, lens_2d=0, batch=3, next_n=1, plan=t)


def test_forced_config_must_be_declared_and_serve():
    from cupy_dsa import logits as L
    fp8_e4m3 = [c for c in L.DECODE.experimental("sm_89") if c.values.get("Mma8") == 1]
    assert fp8_e4m3 and not [c for c in L.DECODE.declared("sm_80") if c.values.get("Mma8") == 1]
    with pytest.raises(ValueError, match="not a declared config"):
        with L.DECODE.forced(fp8_e4m3[0], "sm_80"):
            pass
    with L.DECODE.forced(fp8_e4m3[0], "sm_89"):
        assert L.DECODE.select(("fp8", 1, fp8_e4m3[0].Rows), "sm_89") is fp8_e4m3[0]
        with pytest.raises(ValueError, match="does not serve"):
            L.DECODE.select(("bf16", 1, 1), "sm_89")
    assert L.DECODE.select(("fp8", 1, 1), "sm_89").Mma8 == 0
    with L.PREFILL.forced(L.PREFILL.select(("fp8", 1, 0), "sm_89").replace(keys_per_cta=64), "sm_89") as cfg:
        assert L.PREFILL.select(("fp8", 1, 0), "sm_89").keys_per_cta == 64 == cfg.keys_per_cta
    with pytest.raises(TypeError, match="missing"):
        L.DECODE_KERNEL.config(KeyFp8=0)


# --------------------------------------------------------------------------------------------------
# warm_up
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", ["cpu", torch.device("cpu"), "gpu0", "cuda:x"])
def test_warm_up_rejects_non_cuda_devices(device):
    with pytest.raises(ValueError, match="device"):
        cupy_dsa.warm_up(device)


@pytest.mark.parametrize("device", [None, "cuda", "cuda:1", torch.device("cuda", 0), 0, 1])
def test_warm_up_without_a_gpu_says_so(device, monkeypatch):
    """Device strings, torch.device and ints are accepted; without a GPU the error says what is missing."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="no CUDA GPU is available"):
        cupy_dsa.warm_up(device)


@pytest.mark.parametrize("device", [1.5, True, [0]])
def test_warm_up_rejects_other_types(device):
    with pytest.raises(TypeError, match="device"):
        cupy_dsa.warm_up(device)


@pytest.mark.parametrize("bad", [[1, 2], 3.0, "x", None])
def test_to_torch_and_to_cupy_name_their_argument(bad):
    """Not a DLPack object / not a tensor: an error naming the argument, not a raw DLPack one."""
    with pytest.raises(TypeError, match=r"^a: expected a CuPy array"):
        cupy_dsa.to_torch(bad)
    with pytest.raises(TypeError, match=r"^t: expected a torch.Tensor"):
        cupy_dsa.to_cupy(bad)


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["none", "str", "device", "int"])
def test_warm_up_accepts_every_device_form(form):
    idx = torch.cuda.current_device()
    arg = {"none": None, "str": f"cuda:{idx}", "device": torch.device("cuda", idx), "int": idx}[form]
    arch = runtime.device_arch(idx)
    assert cupy_dsa.warm_up(arg) == sum(len(v) for v in launch.product_expressions(arch).values())


def test_gpus_below_the_minimum_arch_are_refused_by_name(monkeypatch):
    # a Turing GPU: refused before any compile (NVRTC would print thousands of lines)
    monkeypatch.setattr(runtime, "_ARCHS", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "Tesla T4")
    with pytest.raises(RuntimeError, match=r"cuda:0 \(Tesla T4\) is sm_75; cupy_dsa's kernels need sm_80 or newer"):
        runtime.device_arch(0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (8, 0))
    assert runtime.device_arch(0) == "sm_80"


# --------------------------------------------------------------------------------------------------
# CuPy's disk cache and the headers
# --------------------------------------------------------------------------------------------------

def _sources_in(monkeypatch, folder):
    monkeypatch.setattr(runtime, "kernel_dir", lambda: folder)
    for cached in (runtime.read_source, runtime.module_source):
        cached.cache_clear()


def test_a_changed_header_changes_the_compiled_source(tmp_path, monkeypatch):
    """CuPy keys its disk cache on the source text and options, not on headers reached through -I: the source the
    runtime compiles carries a digest of the headers it includes, directly (topk.cu -> radix_select.cuh) or not
    (-> common.cuh), and of no others."""
    import shutil
    for f in runtime.kernel_dir().iterdir():
        shutil.copy(f, tmp_path / f.name)
    try:
        _sources_in(monkeypatch, tmp_path)
        assert runtime.included_headers("topk.cu") == ["common.cuh", "radix_select.cuh"]
        assert runtime.included_headers("mqa_logits.cu") == ["common.cuh", "mqa_logits_sm90.cuh"]
        before = {f: runtime.module_source(f) for f in SOURCES}
        assert all(text.startswith(runtime.read_source(f)) for f, text in before.items())
        for header, changed in (("radix_select.cuh", {"topk.cu", "rescore_topk.cu"}),
                                ("common.cuh", set(SOURCES)),
                                ("mqa_logits_sm90.cuh", {"mqa_logits.cu"})):
            (tmp_path / header).write_text((tmp_path / header).read_text() + "\n// edited\n")
            _sources_in(monkeypatch, tmp_path)
            now = {f: runtime.module_source(f) for f in SOURCES}
            assert {f for f in SOURCES if now[f] != before[f]} == changed, header
            before = now
    finally:
        monkeypatch.undo()
        for cached in (runtime.read_source, runtime.module_source):
            cached.cache_clear()


def test_run_time_compiles_hand_cupy_the_digest_carrying_source(monkeypatch):
    """warm_up_expressions gives cupy.RawModule module_source's text (what the disk cache keys on)."""
    seen = {}

    class Module:
        def __init__(self, code, options, name_expressions):
            seen["code"] = code

        def get_function(self, expr):
            return type("F", (), {"compile": lambda self: None})()

    device = staticmethod(lambda index: contextlib.nullcontext())
    fake = type("cp", (), {"RawModule": Module, "cuda": type("cuda", (), {"Device": device})})
    monkeypatch.setattr(runtime, "cupy_module", lambda: fake)
    monkeypatch.setattr(runtime, "device_arch", lambda i: "sm_90")
    monkeypatch.setattr(runtime, "_FUNCTIONS", {})
    assert runtime.warm_up_expressions(0, {"topk.cu": ["paged_topk_kernel<0>"]}) == 1
    assert seen["code"] == runtime.module_source("topk.cu")
    assert "// cupy_dsa headers: " in seen["code"]


def test_resource_report_survives_a_cached_ptxas(monkeypatch):
    """Where NVRTC takes ptxas's output from the driver's compute cache, ptxas prints no report (seen on the H100: the
    second identical compile in a process had an empty log): compile_cubin compiles with CUDA_CACHE_DISABLE=1, and
    once more with a uniquely named empty kernel added (new PTX) when the report is still missing."""
    import types

    real = runtime.cupy_module().cuda.nvrtc
    seen = []

    class CachedNvrtc:
        """The real NVRTC, except that the first compile's log comes back empty, as from the compute cache."""
        def __getattr__(self, name):
            return getattr(real, name)

        def createProgram(self, src, name, headers, include_names):
            seen.append({"src": src})
            return real.createProgram(src, name, headers, include_names)

        def compileProgram(self, prog, opts):
            seen[-1]["cache_disabled"] = os.environ.get("CUDA_CACHE_DISABLE")
            return real.compileProgram(prog, opts)

        def getProgramLog(self, prog):
            return "" if len(seen) == 1 else real.getProgramLog(prog)

    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(nvrtc=CachedNvrtc()))
    monkeypatch.setattr(runtime, "cupy_module", lambda: fake)
    monkeypatch.setenv("CUDA_CACHE_DISABLE", "0")
    exprs = launch.declared_expressions("sm_90")["prepare_index_q.cu"]
    _, lowered, log = runtime.compile_cubin("prepare_index_q.cu", exprs, "sm_90", resource_usage=True)
    assert set(runtime.ptxas_resources(log, lowered)) == set(exprs)
    assert len(seen) == 2 and [s["cache_disabled"] for s in seen] == ["1", "1"]
    first, second = seen[0]["src"], seen[1]["src"]
    assert first == runtime.module_source("prepare_index_q.cu") and second.startswith(first)
    assert re.fullmatch(r"\n__global__ void cupy_dsa_ptxas_report_\d+_\d+\(\) \{\}\n", second[len(first):])
    assert os.environ["CUDA_CACHE_DISABLE"] == "0"   # the caller's setting is back
    seen.clear()
    runtime.compile_cubin("prepare_index_q.cu", exprs, "sm_90")   # a plain compile: one, the run-time text
    assert len(seen) == 1 and seen[0]["src"] == first


def test_cache_warmer_compiles_the_runtimes_programs():
    """scripts/warm_gpu_cache.py compiles the NVRTC programs the runtime compiles (CuPy's cache keys on the name
    expressions): each source's product configs in one program, as warm_up and a source's first launch load them,
    and every other declared config alone, as a forced config's first launch; every instantiation once."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "warm_gpu_cache.py"
    spec = importlib.util.spec_from_file_location("warm_gpu_cache", path)
    warmer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(warmer)
    for arch in ARCHS:
        progs = warmer.programs(arch)
        product, declared = launch.product_expressions(arch), launch.declared_expressions(arch)
        assert all((source, tuple(exprs)) in progs for source, exprs in product.items())
        for source, exprs in declared.items():
            mine = [p[1] for p in progs if p[0] == source]
            flat = [e for group in mine for e in group]
            assert sorted(flat) == sorted(exprs), (arch, source)   # each declared instantiation exactly once
            assert all(len(g) == 1 for g in mine if g != tuple(product.get(source, ())))
        assert len(progs[0][1]) == max(len(p[1]) for p in progs)   # the largest program starts first
