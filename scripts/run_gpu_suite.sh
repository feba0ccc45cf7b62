#!/usr/bin/env bash
# The whole GPU suite in one call (used on the H200): GPU tests, the fuzz test, compute-sanitizer memcheck,
# racecheck and initcheck over every kernel family (small shapes incl. out-of-range indices), then
# `cupy-dsa bench all` and `cupy-dsa bench variants`. Prints a short summary last.
#   usage: bash scripts/run_gpu_suite.sh [pytest -k expression]     (results under $OUT, default ./out)
#   SKIP_PYTEST, SKIP_FUZZ, SKIP_SANITIZE, SKIP_SGLANG, SKIP_STARTUP (start-up compile, timing method), SKIP_BENCH,
#   SKIP_EMULATE, SKIP_VARIANTS leave a part out; SKIP_WARM_CACHE: no parallel fill of CuPy's kernel cache before
#   the GPU tests (scripts/warm_gpu_cache.py; a fresh machine otherwise compiles on first use, one program at a time).
#   TIMEBOX=1: the subset for a short device lease: the GPU tests, memcheck / racecheck / initcheck over the logits
#   kernels and the sm_120 emulation, each step under its own timeout (PYTEST_S 270, SANITIZE_S 60 per tool,
#   EMULATE_S 150 seconds) so a slow step cannot take the others' time; the other parts are left out.
#   RESCORE_BENCH=1: issue 31's benches alone: SGLang 0.5.23's wheels of .whl_sgl installed (as run_sglang_gpu.sh
#   does) so that the stock step's top-k is SGLang's own (v2 and v1 JIT-compiled and checked once first), then
#   `bench serve` at issue 31's shapes (SERVE_ARGS) and the full `bench rescore` (RESCORE_ARGS), each under its own
#   timeout (TOPK_S 150, SERVE_S 150, RESCORE_S 180 seconds), their JSONs in $OUT (for bench/results/); the rest
#   left out.
#   QUERY_BENCH=1: issue 32's runs alone: `bench recall --suite diverse`, `bench serve --query fp8,bf16` with this GPU's
#   configs and with sm_120's forced, and the query setting's GPU tests (their JSONs in $OUT, for bench/results/).
#   MEASURE_ALL=1: re-measure every result the two READMEs render, in one call of at most MEASURE_S (540) seconds,
#   and re-render them (blocks, plots, the README's mode table): the runs go straight into bench/results/ as
#   <gpu>-*.json (h200 on an H200, h100 on an H100; the writers' guard refuses to replace another GPU's or another
#   kind of run, so a step that cannot write says why), most-read first: the mode table's cost and recall runs,
#   then the H200 tables, fp8-rescore's op, the sm_120 emulation, the diverse suite and the query's cost. Each step
#   gets the time left (at most its own cap, MA_*_S below); a step that runs out keeps the committed file, and the
#   summary lists every file as re-measured or kept. Re-rendered only on an H200 (the READMEs render the H200's
#   files). Then: git add bench/results README.md && git commit (the summary prints the line). The rest is left out.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-$PWD/.cupy_cache}
SANITIZE_PARTS="logits rescore"   # racecheck / initcheck; memcheck runs over every family ("" = all)
MEMCHECK_PART=""
if [ -n "${TIMEBOX:-}" ]; then
  SKIP_FUZZ=1 SKIP_SGLANG=1 SKIP_STARTUP=1 SKIP_BENCH=1 SKIP_VARIANTS=1 SANITIZE_PARTS=logits MEMCHECK_PART=logits
fi
if [ -n "${RESCORE_BENCH:-}${QUERY_BENCH:-}${MEASURE_ALL:-}" ]; then
  SKIP_PYTEST=1 SKIP_FUZZ=1 SKIP_SANITIZE=1 SKIP_SGLANG=1 SKIP_STARTUP=1 SKIP_BENCH=1 SKIP_EMULATE=1 SKIP_VARIANTS=1
fi
# run "$@" under `timeout SECONDS` with TIMEBOX, plainly otherwise
step() { local s=$1; shift; if [ -n "${TIMEBOX:-}" ]; then timeout "$s" "$@"; else "$@"; fi; }
T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1 || { echo "pip install failed"; tail -5 "$OUT/pip.log"; }
python3 -c "import torch, cupy; print('torch', torch.__version__, 'cupy', cupy.__version__)"
echo "commit ${CUPY_DSA_COMMIT:-$(git rev-parse --short=12 HEAD 2>/dev/null)}"

# DeepGEMM (the peer the bench measures live) when its source was carried in .anchors
if [ -f .anchors/build_deepgemm.sh ]; then
  bash .anchors/build_deepgemm.sh /tmp/deepgemm >"$OUT/deepgemm_build.log" 2>&1 \
    && export PYTHONPATH=/tmp/deepgemm${PYTHONPATH:+:$PYTHONPATH} && echo "DeepGEMM: $(tail -1 "$OUT/deepgemm_build.log")" \
    || { echo "DeepGEMM build failed"; tail -5 "$OUT/deepgemm_build.log"; }
fi
K=${1:-}
WARM_LINE="not run"
if [ -z "${SKIP_PYTEST:-}${SKIP_WARM_CACHE:-}" ]; then
  step ${WARM_S:-240} python3 scripts/warm_gpu_cache.py >"$OUT/warm_cache.log" 2>&1
  WARM_LINE="rc=$?: $(tail -1 "$OUT/warm_cache.log")"
fi
if [ -z "${SKIP_PYTEST:-}" ]; then
step ${PYTEST_S:-270} python3 -m pytest -q -m gpu tests ${K:+-k "$K"} -p no:cacheprovider --maxfail=5 2>&1 | tail -40 \
  | tee "$OUT/pytest_gpu.log"
fi
touch "$OUT/pytest_gpu.log"
PYTEST_LINE=$(tail -1 "$OUT/pytest_gpu.log")
# the fuzz test at full size (thousands of random valid / invalid calls per op on poisoned buffers)
FUZZ_LINE="not run (SKIP_FUZZ)"; SAN_LINE="not run (SKIP_SANITIZE)"; SAN_RC=-
touch "$OUT/sanitizers.txt"
if [ -z "${SKIP_FUZZ:-}" ]; then
  CUPY_DSA_FUZZ_N=3000 python3 -m pytest -q tests/test_fuzz.py -p no:cacheprovider 2>&1 | tee "$OUT/pytest_fuzz.log"
  FUZZ_LINE=$(tail -1 "$OUT/pytest_fuzz.log")
fi
if [ -z "${SKIP_SANITIZE:-}" ]; then
  step ${SANITIZE_S:-60} compute-sanitizer --tool memcheck --error-exitcode 9 python3 scripts/gpu_sanitize.py \
      $MEMCHECK_PART >"$OUT/sanitizer.log" 2>&1
  SAN_RC=$?
  SAN_LINE=$(grep -E "ERROR SUMMARY" "$OUT/sanitizer.log" | tail -1)
  tail -5 "$OUT/sanitizer.log"
  # racecheck (shared memory) and initcheck (reads of unwritten device memory) over the logits kernels
  # (decode, the plans, prefill and varlen prefill) and the rescoring kernels (fp8-rescore)
  for part in $SANITIZE_PARTS; do
    for tool in racecheck initcheck; do
      step ${SANITIZE_S:-60} compute-sanitizer --tool $tool --error-exitcode 9 python3 scripts/gpu_sanitize.py $part >"$OUT/$tool-$part.log" 2>&1
      echo "compute-sanitizer $tool $part (rc=$?): $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/$tool-$part.log" | tail -1)" \
        | tee -a "$OUT/sanitizers.txt"
    done
  done
fi

# SGLang 0.5.23's own indexer code driving our kernels, when its wheels were carried in .whl_sgl
SGL_LINE="not run (no .whl_sgl)"
[ -n "${SKIP_SGLANG:-}" ] && SGL_LINE="not run (SKIP_SGLANG)"
if [ -z "${SKIP_SGLANG:-}" ] && ls .whl_sgl/sglang-0.5.23-*.whl >/dev/null 2>&1; then
  OUT="$OUT" timeout 300 bash scripts/run_sglang_gpu.sh >"$OUT/sglang_path.txt" 2>&1
  SGL_LINE=$(grep -E "SGLANG GPU PATH" "$OUT/sglang_path.txt" | tail -1)
  tail -3 "$OUT/sglang_path.txt"
fi
if [ -z "${SKIP_STARTUP:-}" ]; then
# Start-up compile time of the kernels an SGLang server warms (bf16 keys, next_n 1 and 2): cold = empty CuPy
# cache (NVRTC compiles), warm = the cache filled by the cold run (module loads only); one process each.
WARM_CACHE=$(mktemp -d)
for kind in cold warm; do
  CUPY_CACHE_DIR=$WARM_CACHE SGLANG_CUPY_DSA_INDEX_K=bf16 python3 -c "
import time, torch
from cupy_dsa.sglang import core
core.configure_warm(next_ns=(1, 2))
torch.cuda.init(); t = time.perf_counter(); core.ensure_warm(torch.device('cuda'))
print('start-up compile ($kind CuPy cache): %.1f s' % (time.perf_counter() - t))" 2>&1 | tail -1 | tee -a "$OUT/startup.txt"
done
rm -rf "$WARM_CACHE"
# The bench's timing method on one batch (64 x 32K bf16, next_n 1): one call per replay after 3 warm-up replays
# (the method before), the same after 50 ms of warm-up, 1 ms replays without the long warm-up, and both (now).
python3 - <<'PY' 2>&1 | tee "$OUT/timing_method.txt"
import torch, cupy_dsa
from cupy_dsa.bench import sweeps
from cupy_dsa.bench.timing import time_calls
dev = torch.device("cuda"); g = torch.Generator(device=dev); g.manual_seed(0)
b = sweeps.DecodeBatch("64 x 32K", [32 * 1024] * 64, 32 * 1024)
cache, tables, q, w, lens = sweeps._decode_inputs(dev, b, 1, "bf16", "fp8", 1, g)
plan = cupy_dsa.paged_mqa_logits_plan(lens, 1)
call = lambda: cupy_dsa.paged_mqa_logits(q, cache, w, lens, tables[0], b.width, plan=plan)
for name, kw in (("1 call/replay, 3 warm-up replays (before)", dict(min_replay_s=0, min_warmup_s=0)),
                 ("1 call/replay, 50 ms warm-up", dict(min_replay_s=0)),
                 ("1 ms replays, 3 warm-up replays", dict(min_warmup_s=0)),
                 ("1 ms replays, 50 ms warm-up (now)", {})):
    for trial in range(2):
        torch.cuda.synchronize(); import time; time.sleep(0.5)   # idle first, as between bench cases
        t = time_calls([call], dev, reps=30, **kw)
        print(f"timing method: {name}, trial {trial}: {t.seconds * 1e6:.1f} us (p10 {t.p10 * 1e6:.1f}, p90 {t.p90 * 1e6:.1f}, {t.calls} calls/replay)")
PY
fi
if [ -z "${SKIP_BENCH:-}" ]; then
  python3 -m cupy_dsa bench ${BENCH:-all} --backend cuda --json "$OUT/h200.json" --plot "$OUT/h200.png" \
      --markdown "$OUT/headline.md" 2>&1 | tee "$OUT/bench.log" | tail -60
fi
# sm_120's product configs on this GPU under sm_120's CTAs per SM (padded shared memory)
if [ -z "${SKIP_EMULATE:-}" ]; then
  step ${EMULATE_S:-150} python3 -m cupy_dsa bench variants --emulate sm_120 --json "$OUT/h200-emulate-sm120.json" \
      --markdown "$OUT/emulate-sm120.md" >"$OUT/emulate.log" 2>&1 || tail -20 "$OUT/emulate.log"
fi
if [ -z "${SKIP_BENCH:-}${SKIP_VARIANTS:-}" ]; then
  python3 -m cupy_dsa bench variants --json "$OUT/variants.json" 2>&1 | tee "$OUT/variants.log" | tail -80
fi
# Issue 31: the stock step (fp8 logits + the stock top-k) with SGLang's own top-k, in bench serve and bench rescore
RESCORE_LINE="not run (RESCORE_BENCH unset)"
if [ -n "${RESCORE_BENCH:-}" ]; then
  SITE=${SGLANG_SITE:-/tmp/site}
  if ls .whl_sgl/sglang-0.5.23-*.whl >/dev/null 2>&1 && [ ! -f "$SITE/sglang/version.py" ]; then
    python3 -m pip install -q --no-index --no-deps --target "$SITE" .whl_sgl/*.whl >"$OUT/sglang_wheels.log" 2>&1 \
      || tail -3 "$OUT/sglang_wheels.log"
  fi
  [ -f "$SITE/sglang/version.py" ] && export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$SITE
  T1=$(date +%s)
  # once before the benches: the JIT compile lands in tvm-ffi's cache, which both benches then load
  timeout ${TOPK_S:-150} python3 -c "
import time
from cupy_dsa.bench import peers
for v in ('v2', 'v1'):
    t = time.time(); op, why = peers.sglang_topk(v)
    print(f'SGLang {v} top-k: {why or \"live, selects what the reference does\"} ({time.time() - t:.0f} s)')
" >"$OUT/sglang_topk.txt" 2>&1
  T2=$(date +%s)
  SERVE_ARGS=${SERVE_ARGS:-"--batch 48 --context 24K,96K --next-n 1,3 --chunk 8192 --layouts bf16+topk,fp8,fp8+topk,fp8-rescore,fp8-rescore-dg"}
  timeout ${SERVE_S:-150} python3 -m cupy_dsa bench serve $SERVE_ARGS --json "$OUT/h200-serve-rescore.json" \
      >"$OUT/serve.log" 2>&1; SERVE_RC=$?
  T3=$(date +%s)
  timeout ${RESCORE_S:-180} python3 -m cupy_dsa bench rescore ${RESCORE_ARGS:-} --json "$OUT/h200-rescore.json" \
      >"$OUT/rescore.log" 2>&1; RESCORE_RC=$?
  RESCORE_LINE="SGLang top-k $((T2 - T1)) s; bench serve rc=$SERVE_RC ($((T3 - T2)) s), bench rescore rc=$RESCORE_RC \
($(($(date +%s) - T3)) s) (124: timed out; logs serve.log, rescore.log)"
fi
# Issue 32: the query setting's recall (the diverse suite) and cost, and its GPU tests
QUERY_LINE="not run (QUERY_BENCH unset)"
if [ -n "${QUERY_BENCH:-}" ]; then
  timeout ${RECALL_S:-240} python3 -m cupy_dsa bench recall --suite diverse --json "$OUT/h200-recall-diverse.json" \
      >"$OUT/recall-diverse.log" 2>&1; RECALL_RC=$?
  [ -f "$OUT/h200-recall-diverse.json" ] && python3 -m cupy_dsa bench report "$OUT/h200-recall-diverse.json" \
      >"$OUT/recall-diverse.md" 2>&1
  timeout ${SERVE_S:-180} python3 -m cupy_dsa bench serve --batch 48 --context 24K,96K --next-n 1,3 --chunk 8192 \
      --layouts bf16 --query fp8,bf16 --json "$OUT/h200-serve-query.json" >"$OUT/serve-query.log" 2>&1; QSERVE_RC=$?
  [ -f "$OUT/h200-serve-query.json" ] && python3 -m cupy_dsa bench report "$OUT/h200-serve-query.json" \
      --markdown "$OUT/serve-query.md" >/dev/null 2>&1
  # the same with sm_120's product configs forced on this GPU (issue 32's target holds there too)
  timeout ${SERVE_S:-180} python3 -m cupy_dsa bench serve --batch 48 --context 24K,96K --next-n 1,3 --chunk 8192 \
      --layouts bf16 --query fp8,bf16 --arch-configs sm_120 --json "$OUT/h200-serve-query-sm120.json" \
      >"$OUT/serve-query-sm120.log" 2>&1; QSERVE120_RC=$?
  timeout ${PYTEST_S:-150} python3 -m pytest -q -m gpu -p no:cacheprovider -rfE \
      "tests/test_sglang_gpu.py::test_gpu_bf16_query_path_graph" "tests/test_sglang_check.py::test_gpu_check_self_test" \
      "tests/test_cli.py::test_recall_suite_diverse_on_gpu" >"$OUT/pytest_gpu_query.log" 2>&1
  QUERY_LINE="bench recall --suite diverse rc=$RECALL_RC, bench serve --query rc=$QSERVE_RC, with sm_120's configs \
rc=$QSERVE120_RC (124: timed out), pytest: $(tail -1 "$OUT/pytest_gpu_query.log")"
fi
# MEASURE_ALL: every result the READMEs render, re-measured into bench/results/ and re-rendered
MEASURE_LINES=""
if [ -n "${MEASURE_ALL:-}" ]; then
  GPU=$(head -1 "$OUT/device.txt" | tr 'A-Z' 'a-z')
  case "$GPU" in *h200*) TAG=h200 ;; *h100*) TAG=h100 ;; *) TAG=$(echo "$GPU" | awk '{print $NF}' | tr -cd 'a-z0-9') ;; esac
  R=bench/results
  DEADLINE=$((T0 + ${MEASURE_S:-540}))
  SITE=${SGLANG_SITE:-/tmp/site}   # SGLang's own top-k for the stock step (as RESCORE_BENCH)
  if ls .whl_sgl/sglang-0.5.23-*.whl >/dev/null 2>&1 && [ ! -f "$SITE/sglang/version.py" ]; then
    python3 -m pip install -q --no-index --no-deps --target "$SITE" .whl_sgl/*.whl >"$OUT/sglang_wheels.log" 2>&1 \
      || tail -3 "$OUT/sglang_wheels.log"
  fi
  [ -f "$SITE/sglang/version.py" ] && export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$SITE
  # measure NAME CAP FILE CMD...: CMD under the time left (at most CAP s, 15 s kept for the re-render); the line
  # says whether FILE was re-measured (its commit now this checkout's) or kept
  measure() {
    local name=$1 cap=$2 file=$3; shift 3
    local left=$((DEADLINE - 15 - $(date +%s))); [ "$left" -gt "$cap" ] && left=$cap
    if [ "$left" -lt 20 ]; then MEASURE_LINES+="$name: kept $file (no time left)"$'\n'; return; fi
    local t=$(date +%s)
    timeout "$left" "$@" >"$OUT/measure-$name.log" 2>&1; local rc=$?
    local what="re-measured"; [ $rc -ne 0 ] && what="kept (rc=$rc$([ $rc -eq 124 ] && echo ', out of time'): $(grep -E 'Error|Invalid' "$OUT/measure-$name.log" | tail -1 | cut -c1-200))"
    MEASURE_LINES+="$name: $file $what in $(($(date +%s) - t)) s"$'\n'
  }
  # the README's mode table first: the cost of a step (bf16, fp8-cupy; fp8-rescore against the stock top-k), recall
  measure serve ${MA_SERVE_S:-120} $R/$TAG-serve.json python3 -m cupy_dsa bench serve --batch 64 \
      --context 8K,16K,32K,128K --next-n 1,2,4 --chunk 4096,16K --layouts bf16,fp8-cupy,fp8 \
      --json $R/$TAG-serve.json --plot $R/$TAG-serve.png
  measure serve-rescore ${MA_RESCORE_SERVE_S:-150} $R/$TAG-serve-rescore.json python3 -m cupy_dsa bench serve \
      --batch 48 --context 24K,96K --next-n 1,3 --chunk 8192 --layouts bf16+topk,fp8,fp8+topk,fp8-rescore,fp8-rescore-dg \
      --json $R/$TAG-serve-rescore.json
  # the H200 tables and the recall study from one `bench all` run; the recall study's file holds that run's recall
  # rows (the same run, so the environment line describes every block)
  measure all ${MA_ALL_S:-200} $R/$TAG.json python3 -m cupy_dsa bench all --backend cuda --json $R/$TAG.json \
      --plot $R/$TAG.png
  if grep -q "re-measured" <<<"$(echo "$MEASURE_LINES" | grep '^all:')"; then
    python3 - "$R/$TAG.json" "$R/$TAG-recall.json" <<'PY' >>"$OUT/measure-all.log" 2>&1 \
      && MEASURE_LINES+="recall: $R/$TAG-recall.json re-measured (the recall rows of $R/$TAG.json)"$'\n'
import json, sys
doc = json.load(open(sys.argv[1]))
doc.update(sections=["recall"], derived_from=sys.argv[1].rsplit("/", 1)[-1],
           **{s: [] for s in ("bytes", "store", "query", "logits")})
open(sys.argv[2], "w").write(json.dumps(doc, indent=1, default=str) + "\n")
PY
  fi
  measure rescore ${MA_RESCORE_S:-90} $R/$TAG-rescore.json python3 -m cupy_dsa bench rescore --quick \
      --json $R/$TAG-rescore.json
  measure emulate ${MA_EMULATE_S:-90} $R/$TAG-emulate-sm120.json python3 -m cupy_dsa bench variants \
      --emulate sm_120 --json $R/$TAG-emulate-sm120.json
  measure recall-diverse ${MA_DIVERSE_S:-120} $R/$TAG-recall-diverse.json python3 -m cupy_dsa bench recall \
      --suite diverse --json $R/$TAG-recall-diverse.json
  QUERY_ARGS="--batch 48 --context 24K,96K --next-n 1,3 --chunk 8192 --layouts bf16 --query fp8,bf16"
  measure serve-query ${MA_QUERY_S:-60} $R/$TAG-serve-query.json python3 -m cupy_dsa bench serve $QUERY_ARGS \
      --json $R/$TAG-serve-query.json
  measure serve-query-sm120 ${MA_QUERY_S:-60} $R/$TAG-serve-query-sm120.json python3 -m cupy_dsa bench serve \
      $QUERY_ARGS --arch-configs sm_120 --json $R/$TAG-serve-query-sm120.json
  if [ "$TAG" = h200 ]; then   # the READMEs render the H200's files: every block, plot and the mode table
    {
      for f in $R/h200.json "$R/h200-rescore.json --allow-cpu-or-quick" $R/h200-emulate-sm120.json \
               $R/h200-recall.json $R/h200-serve.json $R/h200-serve-rescore.json $R/h200-recall-diverse.json \
               $R/h200-serve-query.json $R/h200-serve-query-sm120.json; do
        python3 -m cupy_dsa bench report $f --readme $R/README.md
      done
      python3 -m cupy_dsa bench report $R/h200.json --plot $R/h200.png
      python3 -m cupy_dsa bench report $R/h200-recall.json --plot $R/h200-recall.png
      python3 -m cupy_dsa bench report $R/h200-serve.json --plot $R/h200-serve.png
      python3 -m cupy_dsa.bench.which_mode README.md
    } >"$OUT/rerender.log" 2>&1
    MEASURE_LINES+="re-rendered: $(grep -cE 'rewrote|unchanged' "$OUT/rerender.log") blocks / tables, $(grep -c '^wrote' "$OUT/rerender.log") plots; errors: $(grep -cE 'Error' "$OUT/rerender.log") ($OUT/rerender.log)"$'\n'
    MEASURE_LINES+="commit: git add bench/results README.md && git commit -m 'Re-measured at $(git rev-parse --short=12 HEAD 2>/dev/null) on the H200 (MEASURE_ALL)'"$'\n'
  else
    MEASURE_LINES+="not re-rendered: the READMEs render the H200's files; these runs are $R/$TAG-*.json"$'\n'
  fi
fi
echo "================ SUMMARY ($(($(date +%s) - T0)) s) ================"
echo "device: $(cat "$OUT/device.txt")"
echo "commit: ${CUPY_DSA_COMMIT:-$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}"
echo "kernel cache fill: $WARM_LINE"
echo "pytest -m gpu: $PYTEST_LINE"
echo "fuzz (3000 calls per op): $FUZZ_LINE"
echo "compute-sanitizer memcheck (rc=$SAN_RC): $SAN_LINE"
cat "$OUT/sanitizers.txt"
echo "SGLang path: $SGL_LINE"
[ -f "$OUT/startup.txt" ] && cat "$OUT/startup.txt"
[ -f "$OUT/timing_method.txt" ] && grep "timing method" "$OUT/timing_method.txt"
[ -f "$OUT/headline.md" ] && cat "$OUT/headline.md"
[ -f "$OUT/emulate-sm120.md" ] && cat "$OUT/emulate-sm120.md"
echo "issue-31 benches: $RESCORE_LINE"
echo "issue-32 runs: $QUERY_LINE"
[ -n "${MEASURE_ALL:-}" ] && printf "MEASURE_ALL:\n%s" "$MEASURE_LINES"
if [ -n "${QUERY_BENCH:-}" ]; then
  grep -vE "^\s*$" "$OUT/recall-diverse.md" 2>/dev/null | head -40 | cut -c1-300
  awk '/bf16 q \/ fp8 q/{on=1} on && /^\| (decode|verify|prefill)/' "$OUT/serve-query.md" 2>/dev/null | head -12
  grep -h "^Target (issue 32)" "$OUT/recall-diverse.md" "$OUT/serve-query.md" "$OUT/serve-query-sm120.log" 2>/dev/null | cut -c1-400
  grep -E "^(FAILED|ERROR) " "$OUT/pytest_gpu_query.log" | head -10
fi
if [ -n "${RESCORE_BENCH:-}" ]; then
  cat "$OUT/sglang_topk.txt" | tail -3
  grep -hE "^stock top-k|Traceback|Error" "$OUT/serve.log" "$OUT/rescore.log" | cut -c1-300 | head -8
  [ -f "$OUT/h200-serve-rescore.json" ] && python3 -m cupy_dsa bench report "$OUT/h200-serve-rescore.json" 2>/dev/null \
      | sed -n '/^fp8-rescore, /,$p' | grep -v "^$" | cut -c1-400
  [ -f "$OUT/h200-rescore.json" ] && python3 -m cupy_dsa bench report "$OUT/h200-rescore.json" 2>/dev/null \
      | grep -E "^\| (case|decode|verify|extend|prefill)|Stock top-k|Floor of|Not run" | cut -c1-400
fi
exit 0
