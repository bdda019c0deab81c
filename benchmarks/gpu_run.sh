#!/usr/bin/env bash
# One call on the GPU machine (device tool): build with CUDA, run the tests
# (CUDA ones included), `opforge check --device cuda`, `opforge bench --device
# cuda --json`. Full logs under $OUT; a short summary last.
# Usage there: bash benchmarks/gpu_run.sh  (uses the machine's torch, PYTHONPATH=src)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OPFORGE_CACHE_DIR=${OPFORGE_CACHE_DIR:-/tmp/opforge-cache}
OUT=${OUT:-/tmp/opforge-out}
# The GPU image sets CXX/CC/CUDAHOSTCXX to a devtoolset-style GCC that links
# libstdc++ statically, which opforge refuses (see build/jit.py); use the
# system compilers.
export CXX=${OPFORGE_GPU_CXX:-g++} CC=${OPFORGE_GPU_CC:-gcc} CUDAHOSTCXX=${OPFORGE_GPU_CXX:-g++}
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  nvcc --version | tail -1
} 2>&1 | tee "$OUT/env.txt"
start=$(date +%s)
python3 -c "import opforge; print(opforge.library)" 2>&1 | tee "$OUT/build.log"
build_rc=${PIPESTATUS[0]}
echo "build rc=$build_rc in $(( $(date +%s) - start )) s"
[ "$build_rc" = 0 ] || exit 1
python3 -c "import time; t=time.perf_counter(); import torch; t1=time.perf_counter(); import opforge; print(f'second import: torch {t1-t:.2f} s, opforge {time.perf_counter()-t1:.3f} s, rebuilt={opforge.library.built_now}, CUDA initialised by it: {torch.cuda.is_initialized()}')" | tee -a "$OUT/build.log"
python3 -m pytest tests -q -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest.log" | tail -25
python3 -m opforge check --device cuda --seed 1 2>&1 | tee "$OUT/check.log" | tail -15
python3 -m opforge bench --device cuda --seed 1 --json "$OUT/bench.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -90
# Memory checker over every CUDA kernel on the reference samples (odd sizes, offsets, 2^20+3).
timeout ${SANITIZER_TIMEOUT:-300} compute-sanitizer --tool memcheck --error-exitcode 9 \
  python3 -m opforge check --device cuda --checks reference --seed 2 2>&1 | tee "$OUT/memcheck.log" | tail -4
echo "memcheck rc=${PIPESTATUS[0]}"
