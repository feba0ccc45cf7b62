#!/usr/bin/env bash
# A time-boxed GPU run for a short device lease: the sm_120 emulation, every GPU test, compute-sanitizer
# memcheck / racecheck / initcheck over the logits kernels (this GPU's and the emulated archs' product configs),
# each step under its own timeout so a slow step cannot take the others' time. Summary last.
#   usage: bash scripts/run_gpu_final.sh      (results under $OUT, default ./out)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cupy_cache}
T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >"$OUT/device.txt"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1 || tail -3 "$OUT/pip.log"
timeout ${EMULATE_S:-150} python3 -m cupy_dsa bench variants --emulate sm_120 --json "$OUT/h200-emulate-sm120.json" \
    --markdown "$OUT/emulate-sm120.md" >"$OUT/emulate.log" 2>&1; EMU_RC=$?
T1=$(date +%s)
timeout ${PYTEST_S:-270} python3 -m pytest -q -m gpu tests -p no:cacheprovider -rfE >"$OUT/pytest_gpu.log" 2>&1; PY_RC=$?
T2=$(date +%s)
for tool in memcheck racecheck initcheck; do
  timeout ${SANITIZE_S:-60} compute-sanitizer --tool $tool --error-exitcode 9 python3 scripts/gpu_sanitize.py logits \
      >"$OUT/$tool.log" 2>&1
  echo "compute-sanitizer $tool (rc=$?): $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/$tool.log" | tail -1)" \
      >>"$OUT/sanitizers.txt"
done
echo "================ SUMMARY ($(($(date +%s) - T0)) s; emulate $((T1 - T0)) s, pytest $((T2 - T1)) s) ================"
echo "device: $(cat "$OUT/device.txt")"
echo "commit: ${CUPY_DSA_COMMIT:-unknown}"
echo "emulate rc=$EMU_RC; pytest -m gpu (rc=$PY_RC): $(tail -1 "$OUT/pytest_gpu.log")"
grep -E "^(FAILED|ERROR) " "$OUT/pytest_gpu.log" | head -20
cat "$OUT/sanitizers.txt"
grep "launches\|gpu_sanitize" "$OUT/racecheck.log" | tail -3
[ -f "$OUT/emulate-sm120.md" ] && grep "^|" "$OUT/emulate-sm120.md" | cut -d'|' -f2-9
exit 0
