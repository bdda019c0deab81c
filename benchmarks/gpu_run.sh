#!/usr/bin/env bash
# The GPU machine's work (device tool), in two calls that each fit its 10-minute limit:
#   bash benchmarks/gpu_run.sh verify   # build with CUDA, all tests, doctor, profile add (+ --sanitize)
#   bash benchmarks/gpu_run.sh bench    # check --seeds 2, bench --sweep (JSON, CSV, PNG), bench --graph
# Uses the machine's torch with PYTHONPATH=src. Full logs and results under $OUT.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OPFORGE_CACHE_DIR=${OPFORGE_CACHE_DIR:-/tmp/opforge-cache}
OUT=${OUT:-/tmp/opforge-out}
# The GPU image sets CXX/CC/CUDAHOSTCXX to a devtoolset-style GCC that links
# libstdc++ statically, which opforge refuses (see build/jit.py); use the
# system compilers.
export CXX=${OPFORGE_GPU_CXX:-g++} CC=${OPFORGE_GPU_CC:-gcc} CUDAHOSTCXX=${OPFORGE_GPU_CXX:-g++}
mkdir -p "$OUT"
opforge() { python3 -m opforge "$@"; }

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  nvcc --version | tail -1
} 2>&1 | tee "$OUT/env.txt"
start=$(date +%s)
python3 -c "import opforge; print(opforge.library)" 2>&1 | tee "$OUT/build.log"
[ "${PIPESTATUS[0]}" = 0 ] || exit 1
echo "build: $(( $(date +%s) - start )) s"
python3 -c "import time; t=time.perf_counter(); import torch; t1=time.perf_counter(); import opforge; print(f'warm import: torch {t1-t:.2f} s, opforge {(time.perf_counter()-t1)*1e3:.0f} ms, rebuilt={opforge.library.built_now}, CUDA initialised by it: {torch.cuda.is_initialized()}')" | tee -a "$OUT/build.log"

case "${1:-verify}" in
verify)
  python3 -m pytest tests -q -p no:cacheprovider -k "${PYTEST_K:-}" 2>&1 | tee "$OUT/pytest.log" | tail -8
  opforge doctor 2>&1 | tee "$OUT/doctor.txt" | tail -40
  echo "doctor rc=${PIPESTATUS[0]}"
  opforge profile add 2>&1 | tee "$OUT/profile.txt" | tail -15
  echo "profile rc=${PIPESTATUS[0]}"
  opforge profile add --sanitize 2>&1 | tee "$OUT/sanitize.txt" | tail -15
  echo "sanitize rc=${PIPESTATUS[0]}"
  ;;
bench)
  python3 -m pytest tests/test_doctor.py -q -p no:cacheprovider 2>&1 | tail -2
  opforge check --device cuda --seed 1 --seeds 2 2>&1 | tee "$OUT/check.log" | tail -22
  opforge bench --device cuda --seed 1 --sweep --dtype ${SWEEP_DTYPES:-float32,float16,bfloat16} --budget ${BUDGET:-0.2} --json "$OUT/bench.json" --csv "$OUT/bench.csv" \
    --plot "$OUT/bench.png" 2>&1 | tee "$OUT/bench.log" | grep -E "2\^2[48] |2\^1[26] |wrote|no .* timing" | head -80
  opforge bench --device cuda --seed 1 --graph --dtype float32 --budget 0.1 --no-compile --json "$OUT/bench-graph.json" \
    2>&1 | tee "$OUT/bench-graph.log" | grep -E "2\^(16|20) "
  ;;
esac
