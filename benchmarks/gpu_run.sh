#!/usr/bin/env bash
# opforge's work on a GPU machine, from a checkout. Logs and result files go to $OUT
# (default /tmp/opforge-out); result files are named as benchmarks/results/ keeps them.
#   bash benchmarks/gpu_run.sh verify [PYTEST_ARGS...]  # build with CUDA, every CUDA test (scripts/test_gpu.sh), doctor
#   bash benchmarks/gpu_run.sh bench [FAMILY...]        # the results docs/performance.md is made from; families:
#                                                       # elementwise fused layouts sweep host lltm gemm qqq (default all)
#   bash benchmarks/gpu_run.sh sanitize                 # compute-sanitizer over every operator and the qqq_gemm kernels
#   bash benchmarks/gpu_run.sh tune OP [ARGS...]        # the tuning driver benchmarks/OP_tune.cu: elementwise, gemm, qqq
#   bash benchmarks/gpu_run.sh examples                 # the examples on CUDA: their tests, examples/qqq_gemm/run.py
# BUDGET: opforge bench's --budget (default 0.2); TUNE_S: the tuning driver's time limit in seconds.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
case "${1:-}" in
verify | bench | sanitize | tune | examples) ;;
*) sed -n '2,10p' "$0"; exit 2 ;;
esac
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OPFORGE_CACHE_DIR=${OPFORGE_CACHE_DIR:-/tmp/opforge-cache}
OUT=${OUT:-/tmp/opforge-out}
mkdir -p "$OUT"
# Some GPU images set CXX/CC/CUDAHOSTCXX to a GCC that links libstdc++ statically, which a torch
# extension cannot use beside torch's own: the system compilers instead.
export CXX=${OPFORGE_GPU_CXX:-g++} CC=${OPFORGE_GPU_CC:-gcc} CUDAHOSTCXX=${OPFORGE_GPU_CXX:-g++}
# A copy of the tree without git history says which commit it is in .gpu-commit (`git rev-parse HEAD`).
[ -f .gpu-commit ] && export OPFORGE_GIT_COMMIT=$(cat .gpu-commit)
opforge() { python3 -m opforge "$@"; }

gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
DEV=$(echo "${gpu:-gpu}" | tr 'A-Z ' 'a-z-')  # "NVIDIA H200" -> nvidia-h200, as the result files are named
DATE=$(date -u +%F)
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  nvcc --version | tail -1
} 2>&1 | tee "$OUT/env.txt"

# The op library, built with CUDA kernels (once per cache).
build_library() {
  python3 -c "import opforge; print(opforge.library)" 2>&1 | tee "$OUT/build.log"
  [ "${PIPESTATUS[0]}" = 0 ] || exit 1
}
# cuBLAS for gemm_tune, into the array blas: the toolkit's, else pip's nvidia-cublas.
cublas_flags() {
  blas=(-lcublas)
  if ! echo '#include <cublas_v2.h>' | nvcc -x cu -E - >/dev/null 2>&1; then
    local cu13
    cu13=$(python3 -c "import nvidia.cu13, os; print(os.path.dirname(nvidia.cu13.__file__))" 2>/dev/null) \
      || cu13=$(python3 -c "import nvidia.cu13; print(list(nvidia.cu13.__path__)[0])")
    blas=(-I"$cu13/include" -L"$cu13/lib" -l:libcublas.so.13 -Xlinker -rpath="$cu13/lib")
  fi
}
# A tuning driver, benchmarks/NAME.cu (pure CUDA, sm_90a), built into /tmp/NAME; more nvcc arguments after NAME.
build_driver() {
  local name=$1
  shift
  nvcc -std=c++17 -O3 -Icsrc -gencode=arch=compute_90a,code=sm_90a "benchmarks/$name.cu" "$@" -o "/tmp/$name"
}
# One bench run into $OUT/FILE.json (and its log), with the table's lines.
bench_to() {
  local file=$1
  shift
  timeout ${BENCH_S:-540} python3 -m opforge bench "$@" --device cuda --seed 1 --json "$OUT/$file.json" > "$OUT/$file.log" 2>&1
  echo "bench $file rc=$?"; grep -E "^│ |no .* timing|refused" "$OUT/$file.log" | cut -c1-170
}

target=${1:-}
[ $# -gt 0 ] && shift
case "$target" in
verify)
  build_library
  opforge doctor > "$OUT/doctor.txt" 2>&1; echo "doctor rc=$?"; tail -n 25 "$OUT/doctor.txt"
  bash scripts/test_gpu.sh -p no:cacheprovider "$@" > "$OUT/pytest.log" 2>&1; echo "CUDA tests rc=$?"
  grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -20; tail -n 3 "$OUT/pytest.log"
  ;;
bench)
  build_library
  budget=${BUDGET:-0.2}
  for family in ${*:-elementwise fused layouts sweep host lltm gemm qqq}; do
    case "$family" in
    elementwise)
      bench_to "${DEV}_${DATE}_elementwise" add square sigmoid --sweep --case 2^26,2^28 --no-compile --budget "$budget" ;;
    fused)  # against eager and torch.compile(dynamic=False): the fusion's gain
      bench_to "${DEV}_${DATE}_fused" axpby axpby_backward sigmoid_backward --sweep --case 2^26,2^28 --budget "$budget" ;;
    layouts)
      bench_to "${DEV}_${DATE}_layouts" add add_out square sigmoid sigmoid_backward axpby axpby_backward --no-compile \
        --case "2^26,transposed 8192x8192,channels_last 64x256x64x64" --budget "$budget" ;;
    sweep)
      bench_to "${DEV}_${DATE}_sweep-float32" add square sigmoid axpby --sweep --dtype float32 --no-compile --budget 0.02 \
        --plot "$OUT/${DEV}_${DATE}_sweep-float32.png" ;;
    host)
      python3 benchmarks/host_overhead.py --device cuda --json "$OUT/host-overhead_${DEV}_${DATE}.json" 2>&1 | tail -n 12 ;;
    lltm)
      timeout 200 python3 examples/lltm/bench.py --device cuda --budget "$budget" --json "$OUT/lltm_${DEV}_${DATE}.json" 2>&1 | tail -n 6
      timeout 120 python3 examples/lltm/bench.py --device cuda --budget "$budget" --graph --no-compile \
        --json "$OUT/lltm-graph_${DEV}_${DATE}.json" 2>&1 | tail -n 5 ;;
    gemm)  # against torch.matmul (cuBLAS) in every dtype
      bench_to "${DEV}_${DATE}_gemm" gemm --no-compile --budget 0.3 --plot "$OUT/${DEV}_${DATE}_gemm.png" ;;
    qqq)  # W4A8 against float16 torch.matmul of the same dequantised weights
      bench_to "${DEV}_${DATE}_qqq" qqq_gemm --dtype float16 --no-compile --budget 0.3
      python3 benchmarks/qqq_summary.py "$OUT/${DEV}_${DATE}_qqq.json" --markdown --plot "$OUT/${DEV}_${DATE}_qqq.png" ;;
    export)  # not in the default list: it compiles two AOTInductor packages (a minute or two)
      CXX=g++ timeout 540 python3 benchmarks/export_timing.py --device cuda --json "$OUT/export-timing_${DEV}_${DATE}.json" 2>&1 | tail -n 12 ;;
    *) echo "bench: no family '$family' (elementwise fused layouts sweep host lltm gemm qqq export)"; exit 2 ;;
    esac
  done
  ;;
sanitize)
  # The reference runs on the CPU (--sanitize): PyTorch's own kernels stay out of the reports.
  build_library
  ops="add add_out square sigmoid sigmoid_backward axpby axpby_backward lltm_forward lltm_backward"
  timeout 400 python3 -m opforge profile $ops --sanitize --seed 1 > "$OUT/sanitize-elementwise-lltm_${DEV}_${DATE}.txt" 2>&1
  echo "sanitize elementwise + lltm rc=$?"; grep -E "^│|tools" "$OUT/sanitize-elementwise-lltm_${DEV}_${DATE}.txt"
  timeout 300 python3 -m opforge profile gemm qqq_gemm --sanitize --seed 1 > "$OUT/sanitize-gemm-qqq_${DEV}_${DATE}.txt" 2>&1
  echo "sanitize gemm + qqq_gemm rc=$?"; grep -E "^│|tools" "$OUT/sanitize-gemm-qqq_${DEV}_${DATE}.txt"
  # Every qqq_gemm configuration (not only those the op's samples reach), both schemes, the launcher.
  build_driver qqq_tune || exit 1
  for tool in memcheck racecheck synccheck; do
    echo "== $tool"; timeout 300 compute-sanitizer --tool $tool /tmp/qqq_tune --sanitize 2>&1 | tail -n 3
  done > "$OUT/sanitize-qqq_${DEV}_${DATE}.txt"
  grep -E "==|ERROR SUMMARY|HAZARD|checks" "$OUT/sanitize-qqq_${DEV}_${DATE}.txt"
  ;;
tune)
  op=${1:-}
  [ $# -gt 0 ] && shift
  case "$op" in
  elementwise | qqq) build_driver "${op}_tune" -Xptxas -v > "$OUT/$op-tune-build.log" 2>&1 ;;
  gemm) cublas_flags; build_driver gemm_tune -Xptxas -v "${blas[@]}" > "$OUT/gemm-tune-build.log" 2>&1 ;;
  *) echo "tune: OP is elementwise, gemm or qqq"; exit 2 ;;
  esac || { tail -n 30 "$OUT/$op-tune-build.log"; exit 1; }
  echo "${op}_tune built: $(grep -cE '[1-9][0-9]* bytes spill stores' "$OUT/$op-tune-build.log") spilling kernels"
  log="$OUT/$op-tune_${DEV}_${DATE}.txt"
  timeout ${TUNE_S:-540} "/tmp/${op}_tune" "$@" > "$log" 2>&1
  echo "${op}_tune $* rc=$?"; grep -E "FAIL" "$log" | head -20; tail -n ${TAIL:-60} "$log"
  ;;
examples)
  build_library
  timeout 400 python3 -m pytest tests/test_examples.py -q -p no:cacheprovider -m cuda > "$OUT/pytest-examples.log" 2>&1
  echo "examples' CUDA tests rc=$?"; tail -n 3 "$OUT/pytest-examples.log"
  timeout 150 python3 examples/qqq_gemm/run.py --device cuda > "$OUT/example-qqq-cuda_${DEV}_${DATE}.txt" 2>&1
  echo "examples/qqq_gemm/run.py rc=$?"; tail -n 14 "$OUT/example-qqq-cuda_${DEV}_${DATE}.txt"
  ;;
esac
