#!/usr/bin/env bash
# Issue 31's stock top-k in the benches, in one GPU call: builds DeepGEMM (.anchors/build_deepgemm.sh), installs
# SGLang 0.5.23's wheels (.whl_sgl, --no-deps) into a throwaway --target folder, loads SGLang's own v2 and v1 top-k
# (JIT-compiled by nvcc on first use, about a minute; checked against cupy_dsa's reference), then `bench serve` at
# issue 31's shapes and the full `bench rescore`, each under its own timeout. JSONs in bench/results/ and $OUT,
# logs in $OUT; the summary (the tables the README quotes) last.
#   usage: CUPY_DSA_COMMIT=<commit> bash scripts/run_gpu_topk_bench.sh   (carry .anchors and .whl_sgl; results under
#          $OUT, default ./out). SERVE_ARGS / RESCORE_ARGS replace the benches' case options, SERVE_S / RESCORE_S
#          their timeouts (s).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
SITE=${SGLANG_SITE:-/tmp/site}
SERVE_ARGS=${SERVE_ARGS:-"--batch 48 --context 24K,96K --next-n 1,3 --chunk 8192 --layouts bf16+topk,fp8,fp8+topk,fp8-rescore,fp8-rescore-dg"}
RESCORE_ARGS=${RESCORE_ARGS:-}
export PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cupy_cache}
T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >"$OUT/device.txt"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1 || tail -3 "$OUT/pip.log"
DG_LINE="not built (no .anchors/build_deepgemm.sh)"
if [ -f .anchors/build_deepgemm.sh ]; then
  bash .anchors/build_deepgemm.sh /tmp/deepgemm >"$OUT/deepgemm_build.log" 2>&1 \
    && export PYTHONPATH=/tmp/deepgemm${PYTHONPATH:+:$PYTHONPATH} && DG_LINE=$(tail -1 "$OUT/deepgemm_build.log") \
    || DG_LINE="build failed: $(tail -1 "$OUT/deepgemm_build.log")"
fi
SGL_LINE="not installed (no .whl_sgl/sglang-0.5.23-*.whl)"
if ls .whl_sgl/sglang-0.5.23-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target "$SITE" .whl_sgl/*.whl >"$OUT/sglang_wheels.log" 2>&1 \
    && export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$SITE && SGL_LINE="wheels in $SITE" \
    || SGL_LINE="wheel install failed: $(tail -1 "$OUT/sglang_wheels.log")"
fi
T1=$(date +%s)
# SGLang's top-k once before the benches: the JIT compile lands in tvm-ffi's cache, which both benches reuse
timeout ${TOPK_S:-240} python3 -c "
import time, torch
from cupy_dsa.bench import peers
for v in ('v2', 'v1'):
    t = time.time(); op, why = peers.sglang_topk(v)
    print(f'SGLang {v} top-k: {why or \"live, matches the reference\"} ({time.time() - t:.0f} s)')
" >"$OUT/sglang_topk.txt" 2>&1
T2=$(date +%s)
timeout ${SERVE_S:-200} python3 -m cupy_dsa bench serve $SERVE_ARGS --json bench/results/h200-serve-rescore.json >"$OUT/serve.log" 2>&1; SERVE_RC=$?
T3=$(date +%s)
timeout ${RESCORE_S:-240} python3 -m cupy_dsa bench rescore $RESCORE_ARGS --json bench/results/h200-rescore.json \
    >"$OUT/rescore.log" 2>&1; RESCORE_RC=$?
T4=$(date +%s)
cp bench/results/h200-serve-rescore.json bench/results/h200-rescore.json "$OUT/" 2>/dev/null
echo "================ SUMMARY ($(($(date +%s) - T0)) s; setup $((T1 - T0)) s, SGLang top-k $((T2 - T1)) s, serve $((T3 - T2)) s, rescore $((T4 - T3)) s) ================"
echo "device: $(cat "$OUT/device.txt"); commit: ${CUPY_DSA_COMMIT:-unknown}"
echo "DeepGEMM: $DG_LINE; SGLang: $SGL_LINE"
tail -3 "$OUT/sglang_topk.txt"
echo "bench serve rc=$SERVE_RC, bench rescore rc=$RESCORE_RC (124: timed out; logs in \$OUT)"
grep -iE "stock top-k|error|Traceback" "$OUT/serve.log" "$OUT/rescore.log" | head -8
[ -f "$OUT/h200-serve-rescore.json" ] && python3 -m cupy_dsa bench report "$OUT/h200-serve-rescore.json" 2>/dev/null \
    | sed -n '/^fp8-rescore, /,$p' | grep -v "^$" | cut -c1-400
[ -f "$OUT/h200-rescore.json" ] && python3 -m cupy_dsa bench report "$OUT/h200-rescore.json" 2>/dev/null \
    | grep -E "^\| (case|decode|verify|extend|prefill)|Stock top-k|Not run" | cut -c1-400
exit 0
