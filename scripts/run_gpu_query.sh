#!/usr/bin/env bash
# Issue 32 on one GPU lease (<= 10 min): the diverse recall suite (both queries, every format, the error budget),
# bench serve with both queries (the bf16-key layout and fp8-cupy, q prep included) and the GPU tests of the bf16
# query (plugin path through CUDA-graph capture and replay, the check's self-test per mode and query, the diverse
# suite through the kernels). Each step under its own timeout; summary last.
#   usage: bash scripts/run_gpu_query.sh      (results under $OUT, default ./out)
#   RECALL_S / SERVE_S / PYTEST_S: the steps' timeouts (s)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cupy_cache}
T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >"$OUT/device.txt"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1 || tail -3 "$OUT/pip.log"
timeout ${RECALL_S:-240} python3 -m cupy_dsa bench recall --suite diverse --json "$OUT/h200-recall-diverse.json" \
    >"$OUT/recall-diverse.log" 2>&1; RECALL_RC=$?
[ -f "$OUT/h200-recall-diverse.json" ] && python3 -m cupy_dsa bench report "$OUT/h200-recall-diverse.json" \
    >"$OUT/recall-diverse.md" 2>&1
T1=$(date +%s)
timeout ${SERVE_S:-180} python3 -m cupy_dsa bench serve --batch 48 --context 24K,96K --next-n 1,3 --chunk 8192 \
    --layouts bf16 --query fp8,bf16 --json "$OUT/h200-serve-query.json" >"$OUT/serve-query.log" 2>&1; SERVE_RC=$?
[ -f "$OUT/h200-serve-query.json" ] && python3 -m cupy_dsa bench report "$OUT/h200-serve-query.json" \
    --markdown "$OUT/serve-query.md" >/dev/null 2>&1
T2=$(date +%s)
timeout ${PYTEST_S:-150} python3 -m pytest -q -m gpu -p no:cacheprovider -rfE \
    "tests/test_sglang_plugin.py::test_gpu_bf16_query_path_graph" "tests/test_sglang_plugin.py::test_gpu_check_self_test" \
    "tests/test_cli.py::test_recall_suite_diverse_on_gpu" >"$OUT/pytest_gpu_query.log" 2>&1; PY_RC=$?
T3=$(date +%s)
echo "================ SUMMARY ($(($(date +%s) - T0)) s; recall $((T1 - T0)) s, serve $((T2 - T1)) s, pytest $((T3 - T2)) s) ================"
echo "device: $(cat "$OUT/device.txt")"
echo "commit: $(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)"
echo "recall --suite diverse rc=$RECALL_RC (124 = timed out): $(grep -c '"format"' "$OUT/h200-recall-diverse.json" 2>/dev/null || echo 0) rows"
python3 - "$OUT/h200-recall-diverse.json" <<'PY' 2>/dev/null
import json, sys
rows = [r for r in json.load(open(sys.argv[1]))["recall_diverse"] if not r["trivial"]]
print("missed share of the exact top-k (key only / query only / both) per context and k:")
for r in rows:
    if r["format"] in ("exact", "reference"):
        continue
    b = "" if r["missed_both"] is None else (f"  [{100 * r['missed_key_only']:.2f} / {100 * r['missed_query_only']:.2f} / "
                                             f"{100 * r['missed_both']:.2f}]")
    err = f"  ERROR {r['error']}" if r["error"] else ""
    print(f"  {r['index_entries']:>6} keys k={r['k']:<4} {r['format']:<22} {100 * (r['missed_share'] or 0):6.3f}%{b}{err}")
PY
echo "serve --query rc=$SERVE_RC:"
grep -E "bf16 q / fp8 q" "$OUT/serve-query.md" 2>/dev/null | head -1
awk '/bf16 q \/ fp8 q/{on=1} on && /^\| (decode|verify|prefill)/' "$OUT/serve-query.md" 2>/dev/null | head -12
echo "pytest (rc=$PY_RC): $(tail -1 "$OUT/pytest_gpu_query.log")"
grep -E "^(FAILED|ERROR) " "$OUT/pytest_gpu_query.log" | head -10
exit 0
