"""Fill CuPy's kernel cache for this GPU in parallel, before the GPU suite (a contributor's tool).

A fresh GPU machine compiles every kernel the GPU tests touch on first use, one NVRTC program at a time. On an H100
that cold start ate the suite's time: 494 of the 600 GPU tests passed in 280 s with the cache cold, all 600 in 51 s
with it warm. CuPy keys its disk cache on the source text, the options and the name expressions, so this compiles
exactly the programs the runtime compiles: each source's product configs together (``cupy_dsa.warm_up``, or the
first launch of a source) and every other declared config alone (a forced config's first launch: the experimental
configs and the emulated archs' product configs), spread over worker processes.
    usage: python3 scripts/warm_gpu_cache.py [--workers N]    (after pip install -e .; the suite's CUPY_CACHE_DIR)
"""
import argparse
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed


def programs(arch: str) -> list[tuple[str, tuple[str, ...]]]:
    """The NVRTC programs the runtime compiles on ``arch``: (source, name expressions), largest first."""
    from cupy_dsa import launch

    product = launch.product_expressions(arch)
    out = [(source, tuple(exprs)) for source, exprs in product.items()]
    for source, exprs in launch.declared_expressions(arch).items():
        out += [(source, (e,)) for e in exprs if e not in product.get(source, ())]
    return sorted(out, key=lambda p: -len(p[1]))


def _compile(program: tuple[str, tuple[str, ...]]) -> float:
    import torch

    from cupy_dsa import runtime

    t = time.perf_counter()
    runtime.warm_up_expressions(torch.cuda.current_device(), {program[0]: list(program[1])})
    return time.perf_counter() - t


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=min(12, os.cpu_count() or 1))
    args = parser.parse_args()
    import torch

    from cupy_dsa import runtime

    arch = runtime.device_arch(torch.cuda.current_device())
    todo = programs(arch)
    t0 = time.perf_counter()
    spent = 0.0
    # spawn: a forked child must not inherit this process's CUDA state
    with ProcessPoolExecutor(args.workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        for done in as_completed([pool.submit(_compile, p) for p in todo]):
            spent += done.result()
    print(f"warm_gpu_cache: {len(todo)} programs ({sum(len(p[1]) for p in todo)} instantiations) for {arch} in "
          f"{time.perf_counter() - t0:.0f} s with {args.workers} workers ({spent:.0f} s of compile and load in all)")


if __name__ == "__main__":
    main()
