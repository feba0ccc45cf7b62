#!/usr/bin/env bash
# SGLang 0.5.23's own DeepSeek-V4 indexer code driving cupy_dsa's CUDA kernels (scripts/gpu_sglang_path.py), on
# a GPU machine without SGLang: installs the wheels of .whl_sgl/ (Python 3.12, --no-deps; how to download
# them: bench/results/README.md, "SGLang's own code on a GPU machine without SGLang") into a throwaway --target directory put first on
# PYTHONPATH, then runs the script. Last line: "SGLANG GPU PATH: PASS ..." or "FAIL ...".
#   usage: bash scripts/run_sglang_gpu.sh [--device cuda|cpu] [--seed N] [--only fp8-cupy|fp8-rescore ...]
#   (log under $OUT, default ./out; SGLANG_WHEELS / SGLANG_SITE override .whl_sgl and /tmp/site)
#   --split [--tokens N]: instead, split invariance with SGLang's own JIT compressor kernels (c_plan.cuh, c4_v2.cuh)
#     in every mode (scripts/gpu_split_invariance.py; last line "SPLIT INVARIANCE: ..."; $OUT/split_invariance.json).
#   --issue49 [parts]: CuPy's cache filled, the split-invariance phase, the GPU tests of the store's FMA order,
#     non-finite keys, the selects on non-finite logits (this GPU's and sm_120's configs) and split invariance (pytest
#     -m gpu, SGLang on the path), the long-prefill memory measurement (scripts/gpu_prefill_memory.py;
#     $OUT/prefill_memory.json) and compute-sanitizer memcheck over the store and the selects on non-finite inputs
#     (gpu_sanitize.py nonfinite). Last line: "ISSUE 49 GPU: ...".
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
SITE=${SGLANG_SITE:-/tmp/site}
WHEELS=${SGLANG_WHEELS:-.whl_sgl}
export PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-$PWD/.cupy_cache}
if ! ls "$WHEELS"/sglang-0.5.23-*.whl >/dev/null 2>&1; then
  echo "SGLANG GPU PATH: FAIL (no $WHEELS/sglang-0.5.23-*.whl in $PWD)"; exit 1
fi
if [ ! -f "$SITE/sglang/version.py" ]; then
  python3 -m pip install -q --no-index --no-deps --target "$SITE" "$WHEELS"/*.whl >"$OUT/sglang_wheels.log" 2>&1 \
    || { tail -5 "$OUT/sglang_wheels.log"; echo "SGLANG GPU PATH: FAIL (wheel install into $SITE)"; exit 1; }
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
case "${1:-}" in
  --split)
    shift
    python3 scripts/gpu_split_invariance.py "$@" 2>&1 | tee "$OUT/split_invariance.log"
    exit "${PIPESTATUS[0]}" ;;
  --issue49)
    # parts (comma list, default all): warm (CuPy's kernel cache in parallel), split, pytest, memory, memcheck; each
    # under its own timeout so a slow one cannot take the others' time (three calls fit 10-minute device calls:
    # --issue49 warm,split then --issue49 pytest,memory then --issue49 memcheck)
    PARTS=",${2:-warm,split,pytest,memory,memcheck},"; SUMMARY="ISSUE 49 GPU:"; RC=0
    part() { case "$PARTS" in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
    python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1 \
      || { echo "pip install -e . failed"; tail -5 "$OUT/pip.log"; }   # the tests import cupy_dsa.bench
    if part warm; then
      timeout ${WARM_S:-90} python3 scripts/warm_gpu_cache.py >"$OUT/warm_cache.log" 2>&1
      SUMMARY="$SUMMARY warm rc=$? |"
    fi
    if part split; then
      timeout ${SPLIT_S:-270} python3 scripts/gpu_split_invariance.py 2>&1 | tee "$OUT/split_invariance.log"
      RC=$(( RC || PIPESTATUS[0] )); SUMMARY="$SUMMARY $(tail -1 "$OUT/split_invariance.log" | cut -c1-80) |"
    fi
    if part pytest; then
      timeout ${PYTEST_S:-240} python3 -m pytest -q -m gpu tests/test_store.py tests/test_nonfinite.py \
        tests/test_split_invariance.py -p no:cacheprovider 2>&1 | tail -30 | tee "$OUT/pytest_issue49.log"
      RC=$(( RC || PIPESTATUS[0] )); SUMMARY="$SUMMARY pytest: $(tail -1 "$OUT/pytest_issue49.log") |"
    fi
    if part memory; then
      timeout ${MEMORY_S:-150} python3 scripts/gpu_prefill_memory.py --json "$OUT/prefill_memory.json" 2>&1 \
        | tee "$OUT/prefill_memory.log"
      RC=$(( RC || PIPESTATUS[0] )); SUMMARY="$SUMMARY $(tail -1 "$OUT/prefill_memory.log" | cut -c1-60) |"
    fi
    if part memcheck; then
      timeout ${MEMCHECK_S:-240} compute-sanitizer --tool memcheck --error-exitcode 9 python3 scripts/gpu_sanitize.py \
        nonfinite >"$OUT/memcheck-nonfinite.log" 2>&1
      R=$?; RC=$(( RC || R ))
      SUMMARY="$SUMMARY memcheck non-finite rc=$R $(grep -E "ERROR SUMMARY" "$OUT/memcheck-nonfinite.log" | tail -1)"
    fi
    echo "$SUMMARY"
    exit $RC ;;
esac
python3 scripts/gpu_sglang_path.py "$@" 2>&1 | tee "$OUT/sglang_gpu_path.log"
exit "${PIPESTATUS[0]}"
