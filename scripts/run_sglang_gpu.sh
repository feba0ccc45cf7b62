#!/usr/bin/env bash
# SGLang 0.5.23's own DeepSeek-V4 indexer code driving cupy_dsa's CUDA kernels (scripts/gpu_sglang_path.py), on
# a GPU machine without SGLang: installs the wheels of .whl_sgl/ (Python 3.12, --no-deps; how to download
# them: bench/results/README.md, "SGLang's own code on a GPU machine without SGLang") into a throwaway --target directory put first on
# PYTHONPATH, then runs the script. Last line: "SGLANG GPU PATH: PASS ..." or "FAIL ...".
#   usage: bash scripts/run_sglang_gpu.sh [--device cuda|cpu] [--seed N] [--only fp8-cupy|fp8-rescore ...]
#   (log under $OUT, default ./out; SGLANG_WHEELS / SGLANG_SITE override .whl_sgl and /tmp/site)
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
PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" python3 scripts/gpu_sglang_path.py "$@" 2>&1 | tee "$OUT/sglang_gpu_path.log"
exit "${PIPESTATUS[0]}"
