#!/usr/bin/env bash
# What a new user does first, on a GPU machine with no package index, from a
# clean checkout: the main job with an empty cache and the image's own
# compilers (its CXX links libstdc++ statically: the build must fall back by
# itself), then the elementwise layout cases, the stable-ABI scaffold's tests
# and the build speed. Logs and JSON under $OUT; a short summary last.
#   bash benchmarks/experiments/frontdoor.sh          # main job, layouts, stable ABI, build speed
#   bash benchmarks/experiments/frontdoor.sh main     # the main job alone
#   bash benchmarks/experiments/frontdoor.sh tests    # every CUDA test in parallel (scripts/test_gpu.sh)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT=${OUT:-/tmp/opforge-out}
mkdir -p "$OUT"
export PIP_NO_INDEX=1 PYTHONUNBUFFERED=1 OPFORGE_CACHE_DIR=${OPFORGE_CACHE_DIR:-/tmp/opforge-frontdoor}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "CXX=${CXX:-unset} CC=${CC:-unset} CUDAHOSTCXX=${CUDAHOSTCXX:-unset}"

seconds() { echo $(( $(date +%s) - $1 )); }
# Each line of a log with the seconds since its command started.
stamp() { python3 -u -c 'import sys, time
t = time.time()
for line in sys.stdin: print(f"{time.time() - t:6.1f} {line}", end="", flush=True)'; }

if [ "${1:-}" = tests ]; then
  start=$(date +%s)
  timeout 570 bash scripts/test_gpu.sh -p no:cacheprovider > "$OUT/test-gpu.log" 2>&1
  echo "test_gpu rc=$? in $(seconds "$start") s"
  grep -E "^(FAILED|ERROR)" "$OUT/test-gpu.log" | head -20
  tail -n 25 "$OUT/test-gpu.log"
  exit 0
fi

rm -rf .venv "$OPFORGE_CACHE_DIR"
start=$(date +%s)
timeout 400 bash scripts/main.sh 2>&1 | stamp > "$OUT/main.log"
echo "main job (venv, build, check, bench) rc=${PIPESTATUS[0]} in $(seconds "$start") s"
grep -nE "building opforge_ops|built opforge_ops|opforge run on|check add:|measuring the machine|bench add |opforge run: " "$OUT/main.log" | head -12
grep -nE "instead|statically" "$OUT/main.log" | head -3
if [ "${1:-}" = main ]; then tail -n 24 "$OUT/main.log"; exit 0; fi

source scripts/env.sh >/dev/null 2>&1
start=$(date +%s)
timeout 300 opforge bench add add_out square sigmoid sigmoid_backward axpby axpby_backward --device cuda --no-compile \
  --case "2^26,transposed 8192x8192,channels_last 64x256x64x64" --json "$OUT/layouts.json" > "$OUT/layouts.log" 2>&1
echo "layout bench rc=$? in $(seconds "$start") s"
start=$(date +%s)
timeout 300 python -m pytest -q -p no:cacheprovider -n 4 tests/test_abi.py tests/test_new_stable.py > "$OUT/stable.log" 2>&1
echo "stable-ABI tests rc=$? in $(seconds "$start") s"; tail -n 3 "$OUT/stable.log"
timeout 200 python benchmarks/build_speed.py --cases cold,warm --repeat 1 --json "$OUT/build-speed.json" > "$OUT/build-speed.log" 2>&1
echo "build speed rc=$?"; tail -n 4 "$OUT/build-speed.log"
echo "== main job's summary"
tail -n 30 "$OUT/main.log"
echo "== layouts"
grep -E "transposed|channels_last" "$OUT/layouts.log" | head -30
