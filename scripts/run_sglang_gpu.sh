#!/usr/bin/env bash
# SGLang 0.5.23's own DeepSeek-V4 indexer code driving cupy_dsa's CUDA kernels (scripts/gpu_sglang_path.py), on
# a GPU machine without SGLang: installs the wheels of .whl_sgl/ (Python 3.12, --no-deps; how to download
# them: README, "SGLang's own code on a GPU machine without SGLang") into a throwaway --target directory put first on
# PYTHONPATH, then runs the script. Last line: "SGLANG GPU PATH: PASS ..." or "FAIL ...".
#   usage: bash scripts/run_sglang_gpu.sh [--device cuda|cpu] [--seed N] [--only fp8-cupy|fp8-rescore ...]
#   (log under $OUT, default ./out; SGLANG_WHEELS / SGLANG_SITE override .whl_sgl and /tmp/site)
#   --split [--tokens N]: instead, split invariance with SGLang's own JIT compressor kernels (c_plan.cuh, c4_v2.cuh)
#     in every mode (scripts/gpu_split_invariance.py; last line "SPLIT INVARIANCE: ..."; $OUT/split_invariance.json).
#   --issue49: the split-invariance phase, then the GPU tests of the store's FMA order, non-finite keys, the selects
#     on non-finite logits (this GPU's and sm_120's configs) and split invariance (pytest -m gpu, SGLang on the path),
#     then the long-prefill memory measurement (scripts/gpu_prefill_memory.py; $OUT/prefill_memory.json) and
#     compute-sanitizer memcheck over the store and the selects on non-finite inputs (gpu_sanitize.py nonfinite).
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
    python3 scripts/gpu_split_invariance.py 2>&1 | tee "$OUT/split_invariance.log"; RC1=${PIPESTATUS[0]}
    python3 -m pytest -q -m gpu tests/test_store.py tests/test_nonfinite.py tests/test_split_invariance.py \
      -p no:cacheprovider 2>&1 | tail -30 | tee "$OUT/pytest_issue49.log"; RC2=${PIPESTATUS[0]}
    python3 scripts/gpu_prefill_memory.py --json "$OUT/prefill_memory.json" 2>&1 | tee "$OUT/prefill_memory.log"
    RC3=${PIPESTATUS[0]}
    compute-sanitizer --tool memcheck --error-exitcode 9 python3 scripts/gpu_sanitize.py nonfinite \
      >"$OUT/memcheck-nonfinite.log" 2>&1; RC4=$?
    echo "ISSUE 49 GPU: split $(tail -1 "$OUT/split_invariance.log" | cut -c1-60) | pytest $(tail -1 \
      "$OUT/pytest_issue49.log") | memory $(tail -1 "$OUT/prefill_memory.log" | cut -c1-40) | memcheck non-finite \
      (rc=$RC4) $(grep -E "ERROR SUMMARY" "$OUT/memcheck-nonfinite.log" | tail -1)"
    exit $(( RC1 || RC2 || RC3 || RC4 )) ;;
esac
python3 scripts/gpu_sglang_path.py "$@" 2>&1 | tee "$OUT/sglang_gpu_path.log"
exit "${PIPESTATUS[0]}"
