#!/usr/bin/env bash
# The GPU machine's work (device tool), in two calls that each fit its 10-minute limit:
#   bash benchmarks/gpu_run.sh verify   # build with CUDA, all tests, doctor, profile add (+ --sanitize)
#   bash benchmarks/gpu_run.sh bench    # check --seeds 2, bench --sweep (JSON, CSV, PNG), bench --graph
#   bash benchmarks/gpu_run.sh kernels  # tune the elementwise kernels, their CUDA tests, bench vs eager
#   bash benchmarks/gpu_run.sh routes   # build speed; a CUDA wheel in a venv (prebuilt library) with the
#                                       # op tests; the inline, pybind and folder routes' tests
#   bash benchmarks/gpu_run.sh memlimit # issue 6's targets in one call: sigmoid forms and small-size
#                                       # tuning, bench at 2^26/2^28 vs eager and static compile,
#                                       # host/device time of small calls, LLTM
#   bash benchmarks/gpu_run.sh cudatests # every CUDA-marked test, in groups (TESTS="..." to choose)
#   bash benchmarks/gpu_run.sh qqq      # issue 8: qqq_tune.cu (bit-exact checks, tile/split sweep), the W4A8
#                                       # op's CUDA tests, its sanitizer run, bench vs fp16 matmul, summary table
#   bash benchmarks/gpu_run.sh qqq-verify # after a qqq_gemm kernel change: checks, M <= 16 timings, CUDA tests
#   bash benchmarks/gpu_run.sh qqq-final  # the CUDA tests, compute-sanitizer over qqq_tune, the bench
#   bash benchmarks/gpu_run.sh gemm     # benchmarks/gemm_tune.cu: every GEMM kernel variant checked and timed
#                                       # against cuBLAS (GEMM_ARGS passes options, e.g. --only wgmma)
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
# A tuning driver, benchmarks/NAME.cu (pure CUDA, sm_90a), built into /tmp/NAME; more nvcc arguments after NAME.
build_driver() { local name=$1; shift; nvcc -std=c++17 -O3 -Icsrc -gencode=arch=compute_90a,code=sm_90a "benchmarks/$name.cu" "$@" -o "/tmp/$name"; }
# Nsight Compute: on PATH, else the newest under /opt/nvidia.
ncu_path() { command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1; }
# qqq_gemm's CUDA tests into $OUT/pytest-qqq.log, with their summary line.
qqq_cuda_tests() {
  timeout 200 python3 -m pytest tests/test_qqq.py -q -p no:cacheprovider -m cuda > "$OUT/pytest-qqq.log" 2>&1
  echo "pytest qqq rc=$?"; tail -n 2 "$OUT/pytest-qqq.log"
}
# compute-sanitizer's memcheck, racecheck and synccheck over qqq_tune --sanitize (built already) into
# $OUT/sanitize-qqq.txt, with their summary lines.
qqq_sanitize() {
  for tool in memcheck racecheck synccheck; do
    echo "== $tool"; timeout 300 compute-sanitizer --tool $tool /tmp/qqq_tune --sanitize 2>&1 | tail -n 3
  done > "$OUT/sanitize-qqq.txt"
  grep -E "==|ERROR SUMMARY|HAZARD|checks" "$OUT/sanitize-qqq.txt"
}
# qqq_gemm's bench against float16 matmul into $OUT/qqq.json and .png, with its markdown table.
qqq_bench() {
  timeout 300 python3 -m opforge bench qqq_gemm --device cuda --seed 1 --dtype float16 --budget ${BUDGET:-0.3} --no-compile \
    --json "$OUT/qqq.json" > "$OUT/qqq.log" 2>&1
  echo "bench qqq rc=$?"; python3 benchmarks/qqq_summary.py "$OUT/qqq.json" --markdown --plot "$OUT/qqq.png" 2>&1 | tail -20
}
# qqq_tune in one mode ($1, e.g. --fold; every op configuration and the launcher checked bit for bit
# first) into $OUT/qqq-MODE.txt, with the checks' summary and the timings.
qqq_tune_mode() {
  local log="$OUT/qqq-${1#--}.txt"
  build_driver qqq_tune && timeout 300 /tmp/qqq_tune "$1" > "$log" 2>&1; echo "qqq_tune $1 rc=$?"
  grep -E "^check|FAIL|passed" "$log" | cut -c1-60 | sort | uniq -c | head -30
  grep -E "^(op|time)" "$log" | cut -c1-118
}
# Issue 8's evidence after a kernel change: qqq_tune in mode $1, the qqq_gemm and example CUDA tests,
# compute-sanitizer over qqq_tune --sanitize, the bench; at most 8 files back.
qqq_final() {
  qqq_tune_mode "$1"
  qqq_cuda_tests
  if [ "${QQQ_EXAMPLES:-1}" = 1 ]; then  # 0: not the example's test (90 s of building its extension)
    timeout 200 python3 -m pytest tests/test_examples.py -q -p no:cacheprovider -m cuda -k qqq \
      > "$OUT/pytest-examples.log" 2>&1; echo "pytest examples rc=$?"; tail -n 2 "$OUT/pytest-examples.log"
  fi
  qqq_sanitize
  qqq_bench
  rm -f "$OUT/qqq.log" "$OUT/env.txt"
}
# gemm_tune's cuBLAS flags, into the array blas: the toolkit's headers, else pip's nvidia-cublas.
cublas_flags() {
  blas=(-lcublas)
  if ! echo '#include <cublas_v2.h>' | nvcc -x cu -E - >/dev/null 2>&1; then
    cu13=$(python3 -c "import nvidia.cu13, os; print(os.path.dirname(nvidia.cu13.__file__))" 2>/dev/null) \
      || cu13=$(python3 -c "import nvidia.cu13; print(list(nvidia.cu13.__path__)[0])")
    blas=(-I"$cu13/include" -L"$cu13/lib" -l:libcublas.so.13 -Xlinker -rpath="$cu13/lib")
  fi
}
# The device tool's copy of the tree has no history of its own: the commit it was made from
# comes along in .gpu-commit (carried; written by `git rev-parse HEAD`, +dirty for local edits).
[ -f .gpu-commit ] && export OPFORGE_GIT_COMMIT=$(cat .gpu-commit)

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  nvcc --version | tail -1
} 2>&1 | tee "$OUT/env.txt"
if [ "${1:-}" = gemm ]; then
  # Standalone CUDA + cuBLAS: no op library needed.
  cublas_flags
  build_driver gemm_tune -Xptxas -v "${blas[@]}" > "$OUT/gemm-build.log" 2>&1 || { tail -30 "$OUT/gemm-build.log"; exit 1; }
  echo "gemm_tune built; HGMMA in its SASS: $(cuobjdump -sass /tmp/gemm_tune | grep -c HGMMA)," \
    "spilling kernels: $(grep -cE '[1-9][0-9]* bytes spill stores' "$OUT/gemm-build.log")"
  timeout ${GEMM_TIMEOUT:-240} /tmp/gemm_tune ${GEMM_ARGS:-} > "$OUT/gemm-tune.txt" 2>&1
  echo "gemm_tune rc=$?"
  head -3 "$OUT/gemm-tune.txt"; grep -vE "^(ok  |device:|wgmma path)" "$OUT/gemm-tune.txt" | tail -${GEMM_TAIL:-140}
  if [ -n "${GEMM_LIB:-}" ]; then
    # The op library by the JIT route: a 9.0 GPU must get sm_90a SASS (wgmma) plus portable compute_90 PTX.
    python3 -c "import opforge, opforge.build as b; c = b.library_config(); print('archs', c.cuda_archs, [f for f in c.cuda_cflags if 'gencode' in f]); print(opforge.library)" 2>&1 | tee "$OUT/gemm-lib.log" | tail -3
    so=$(python3 -c "import opforge; print(opforge.library.path)" 2>/dev/null)
    echo "library: $(cuobjdump -lelf "$so" | grep -oE 'sm_[0-9]+a?' | sort | uniq -c | tr '\n' ' ')| PTX: $(cuobjdump -lptx "$so" | grep -oE 'sm_[0-9]+a?' | sort -u | tr '\n' ' ')| HGMMA: $(cuobjdump -sass "$so" | grep -c HGMMA)"
    python3 -m pytest tests/test_doctor.py tests/test_prebuilt.py -q -p no:cacheprovider 2>&1 | tail -2
    python3 -m pytest tests/test_build.py -q -p no:cacheprovider -k "cuda_archs or gencode or sm_90a" 2>&1 | tail -2
  fi
  if [ -n "${GEMM_SANITIZE:-}" ]; then
    timeout 120 compute-sanitizer --tool memcheck /tmp/gemm_tune --quick --no-time > "$OUT/gemm-sanitize.txt" 2>&1
    echo "sanitize rc=$?: $(tail -2 "$OUT/gemm-sanitize.txt" | tr '\n' ' ')"
  fi
  exit 0
fi
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
kernels)
  build_driver elementwise_tune \
    && /tmp/elementwise_tune 2>&1 | tee "$OUT/elementwise-tune.txt"
  python3 -m pytest tests/test_ops.py tests/test_layout.py tests/test_fast.py -q -p no:cacheprovider 2>&1 | tee "$OUT/pytest-kernels.log" | tail -3
  python3 benchmarks/host_overhead.py --json "$OUT/host-overhead.json" 2>&1 | tee "$OUT/host-overhead.log"
  opforge bench add square sigmoid axpby --device cuda --seed 1 --budget ${BUDGET:-0.15} --no-compile --json "$OUT/bench-kernels.json" \
    2>&1 | tee "$OUT/bench-kernels.log" | grep -E "2\^(16|26) |no .* timing"
  opforge bench add --device cuda --seed 1 --graph --sweep --dtype float32 --budget 0.1 --no-compile --json "$OUT/bench-graph.json" \
    2>&1 | tee "$OUT/bench-graph.log" | grep -E "2\^1[2-6] "
  for op in add square sigmoid axpby; do
    opforge profile $op --sanitize 2>&1 | tail -6 > "$OUT/sanitize-$op.txt"; echo "sanitize $op: $(grep -ci 'error' "$OUT/sanitize-$op.txt") lines with 'error'"
  done
  ;;
final)
  python3 -m pytest tests/test_fast.py tests/test_ops.py -q -p no:cacheprovider -m cuda -x 2>&1 | tee "$OUT/pytest-final.log" | tail -3
  python3 benchmarks/host_overhead.py --json "$OUT/host-overhead.json" 2>&1 | tee "$OUT/host-overhead.log"
  opforge bench sigmoid axpby --device cuda --seed 1 --budget 0.1 --json "$OUT/bench-final.json" 2>&1 | tee "$OUT/bench-final.log" \
    | grep -E "2\^(26) "
  opforge profile lltm_forward --sanitize 2>&1 | tail -8 > "$OUT/sanitize-lltm.txt"; tail -3 "$OUT/sanitize-lltm.txt"
  ;;
memlimit)
  # At most 8 files come back from $OUT: tune.txt, pytest.log, bench.json, bench.log, small.json, lltm.json, lltm-graph.json.
  build_driver elementwise_tune \
    && timeout 120 /tmp/elementwise_tune sigmoid small 2>&1 | tee "$OUT/tune.txt"
  python3 benchmarks/host_overhead.py 2>&1 | tee -a "$OUT/tune.txt"
  timeout 200 python3 -m opforge bench add add_out square sigmoid sigmoid_backward axpby axpby_backward --device cuda --seed 1 --sweep \
    --case 2^26,2^28 --budget ${BUDGET:-0.12} --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
  echo "bench rc=$?"; grep -E "^│ " "$OUT/bench.log" | cut -c1-150
  timeout 60 python3 -m opforge bench add --device cuda --seed 1 --graph --sweep --case 2^12,2^14,2^16 --dtype float32 --budget 0.1 --no-compile \
    --json "$OUT/small.json" 2>&1 | grep -E "2\^1[246] "
  timeout 90 python3 examples/lltm/bench.py --device cuda --budget 0.2 --json "$OUT/lltm.json" 2>&1 | tail -6
  timeout 60 python3 examples/lltm/bench.py --device cuda --budget 0.2 --graph --no-compile --json "$OUT/lltm-graph.json" 2>&1 | tail -5
  ;;
recheck)
  # After a kernel change: small-size device time, large sizes vs eager, then the CUDA tests.
  build_driver elementwise_tune \
    && timeout 60 /tmp/elementwise_tune small 2>&1 | tee "$OUT/tune.txt"
  python3 benchmarks/host_overhead.py --json "$OUT/host-overhead.json" 2>&1 | grep -v Warn | tee -a "$OUT/tune.txt"
  timeout 120 python3 -m opforge bench add square sigmoid axpby --device cuda --seed 1 --sweep --case 2^26,2^28 --budget 0.1 \
    --no-compile --json "$OUT/bench-recheck.json" > "$OUT/bench-recheck.log" 2>&1
  grep -E "^│ " "$OUT/bench-recheck.log" | cut -c1-120
  GROUP_TIMEOUT=${GROUP_TIMEOUT:-150} bash "$0" cudatests-only
  ;;
finalA)
  # Issue 7's bench side by side with cuBLAS, then the GEMM/qqq/op CUDA tests, then the package and examples ones.
  timeout 150 python3 -m opforge bench gemm --device cuda --seed 1 --no-compile --budget 0.3 --json "$OUT/gemm.json" \
    --plot "$OUT/gemm.png" > "$OUT/gemm.log" 2>&1
  echo "bench gemm rc=$?"; grep -E "^│ |refused|no .* timing" "$OUT/gemm.log" | cut -c1-170
  TESTS="${TESTS_A:-tests/test_gemm.py tests/test_qqq.py tests/test_ops.py}" GROUP_TIMEOUT=200 bash "$0" cudatests-only | grep -v "^NVIDIA\|^torch\|^Build\|^Library\|^build:\|^warm"
  cp "$OUT/pytest.log" "$OUT/pytest-a.log" 2>/dev/null; rm -f "$OUT/pytest.log"
  TESTS="tests/test_new.py tests/test_examples.py" GROUP_TIMEOUT=${GROUP_TIMEOUT_B:-300} bash "$0" cudatests-only | grep -v "^NVIDIA\|^torch\|^Build\|^Library\|^build:\|^warm"
  ;;
finalB)
  # The guide's GPU blocks, the seeds' examples on CUDA, every CUDA kernel under the four sanitizers,
  # ncu summaries, the elementwise sweep. Each step time-boxed so that the ones after it still run.
  timeout 170 python3 -m pytest tests/test_docs.py -q -p no:cacheprovider -m cuda 2>&1 | tee "$OUT/pytest-b.log" | tail -2
  timeout 110 python3 -m pytest tests/test_examples.py -q -p no:cacheprovider -m cuda -k "add2 or load_inline or my_op" 2>&1 \
    | tee -a "$OUT/pytest-b.log" | tail -2
  timeout 140 python3 -m opforge profile add add_out square sigmoid sigmoid_backward axpby axpby_backward lltm_forward lltm_backward \
    --sanitize --seed 1 > "$OUT/sanitize.txt" 2>&1; echo "sanitize rc=$?"; grep -E "^│|tools" "$OUT/sanitize.txt"
  timeout 80 python3 -m opforge profile gemm qqq_gemm --sanitize --seed 1 >> "$OUT/sanitize.txt" 2>&1; echo "sanitize gemm/qqq rc=$?"
  grep -E "^│|tools" "$OUT/sanitize.txt" | tail -6
  timeout 45 python3 -m opforge profile add sigmoid axpby --case 2^26 > "$OUT/profile.txt" 2>&1; grep -E "^│" "$OUT/profile.txt" | cut -c1-160
  timeout 50 python3 -m opforge bench add square sigmoid axpby --device cuda --seed 1 --sweep --dtype float32 --no-compile \
    --budget 0.02 --json "$OUT/sweep.json" --plot "$OUT/sweep.png" > "$OUT/sweep.log" 2>&1; echo "sweep rc=$?"
  ;;
examples-sanitize)
  # Issue 5-8 leftovers in one call: the examples on CUDA (started together), the sanitizer over the
  # elementwise and LLTM kernels and qqq_gemm's CUDA tests beside them (correctness, not timing), then, if
  # the call has time left, the memory-bound ops at 2^26/2^28 on a quiet GPU.
  timeout ${SANITIZE_S:-320} python3 -m opforge profile add add_out square sigmoid sigmoid_backward axpby axpby_backward \
    lltm_forward lltm_backward --sanitize --seed 1 > "$OUT/sanitize.txt" 2>&1 &
  san=$!
  timeout ${QQQ_TEST_S:-240} python3 -m pytest tests/test_qqq.py -q -p no:cacheprovider -m cuda > "$OUT/pytest-qqq.log" 2>&1 &
  qq=$!
  timeout ${EXAMPLES_S:-320} python3 -m pytest tests/test_examples.py -q -p no:cacheprovider -m cuda > "$OUT/pytest-examples.log" 2>&1
  echo "examples rc=$?"; tail -3 "$OUT/pytest-examples.log"
  wait $qq; echo "qqq tests rc=$?"; tail -2 "$OUT/pytest-qqq.log"
  wait $san; echo "sanitize rc=$?"; grep -E "^│|tools" "$OUT/sanitize.txt"
  if [ $(( $(date +%s) - start )) -lt ${BENCH_IF_BEFORE_S:-330} ]; then
    timeout 200 python3 -m opforge bench add add_out square sigmoid sigmoid_backward axpby axpby_backward --device cuda --seed 1 \
      --sweep --case 2^26,2^28 --budget ${BUDGET:-0.12} --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
    echo "bench rc=$?"; grep -E "^│ " "$OUT/bench.log" | cut -c1-150
  else
    echo "bench skipped: $(( $(date +%s) - start )) s gone"
  fi
  ;;
initcheck-each)
  # initcheck over each op's reference check on its own, the first reports with host backtraces; then the
  # memory-bound ops at 2^26/2^28 against eager (the read flush) on a quiet GPU.
  for op in ${OPS:-add add_out square sigmoid sigmoid_backward axpby axpby_backward lltm_forward lltm_backward}; do
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout ${INITCHECK_S:-200} compute-sanitizer --tool initcheck --print-limit 3 \
      --show-backtrace host python3 -m opforge check $op --device cuda --checks reference --seed 1 > "$OUT/initcheck-$op.txt" 2>&1 &
  done
  wait
  for f in "$OUT"/initcheck-*.txt; do echo "== $f: $(grep -c 'Uninitialized' "$f") reports; $(grep -E 'ERROR SUMMARY' "$f")"; done
  cat "$OUT"/initcheck-*.txt | grep -B2 -A40 -m1 "Uninitialized" | grep -vE "^\s*$" | cut -c1-200 | head -60
  tar -czf "$OUT/initcheck.tgz" -C "$OUT" $(cd "$OUT" && ls initcheck-*.txt) && rm -f "$OUT"/initcheck-*.txt
  timeout ${BENCH_S:-240} python3 -m opforge bench ${BENCH_OPS:-add square sigmoid} --device cuda --seed 1 --sweep --case 2^26,2^28 \
    --no-compile --budget ${BUDGET:-0.12} --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
  echo "bench rc=$?"; grep -E "^│ " "$OUT/bench.log" | cut -c1-150
  ;;
sanitize-tune)
  # The sanitizer over the elementwise and LLTM kernels (reference on the CPU), beside it the CUDA tests of
  # check/profile and initcheck of PyTorch's own multi-block sum alone; then add's block size at 2^26/2^28.
  timeout ${SANITIZE_S:-330} python3 -m opforge profile add add_out square sigmoid sigmoid_backward axpby axpby_backward \
    lltm_forward lltm_backward --sanitize --seed 1 > "$OUT/sanitize.txt" 2>&1 &
  san=$!
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 120 compute-sanitizer --tool initcheck --print-limit 1 python3 -c \
    "import torch; x = torch.randn(1025, 900, dtype=torch.float64, device='cuda'); print(x.sum(0).sum().item())" \
    > "$OUT/initcheck-torch-sum.txt" 2>&1
  echo "torch sum(0) alone under initcheck: $(grep -E 'ERROR SUMMARY' "$OUT/initcheck-torch-sum.txt")"; grep -m1 -A1 "Uninitialized" "$OUT/initcheck-torch-sum.txt" | cut -c1-160
  timeout 200 python3 -m pytest tests/test_check.py tests/test_profile.py -q -p no:cacheprovider -m cuda > "$OUT/pytest.log" 2>&1
  echo "check/profile CUDA tests rc=$?"; tail -2 "$OUT/pytest.log"
  wait $san; echo "sanitize rc=$?"; grep -E "^│|tools" "$OUT/sanitize.txt"
  build_driver elementwise_tune \
    && timeout 120 /tmp/elementwise_tune aligned 2>&1 | tee "$OUT/tune.txt"
  ;;
initcheck-filter)
  # Which --kernel-name-exclude form keeps initcheck off PyTorch's reduce_kernel (torch's own sum(0) alone: 2,108
  # reports), and the sanitizer run over the elementwise and LLTM kernels with the form profile.py uses.
  for f in kns=reduce_kernel kns=at::native::reduce_kernel kns=_ZN2at6native13reduce_kernel; do
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 60 compute-sanitizer --tool initcheck --kernel-name-exclude $f python3 -c \
      "import torch; x = torch.randn(1025, 900, dtype=torch.float64, device='cuda'); print(x.sum(0).sum().item())" 2>&1 \
      | grep -E "ERROR SUMMARY|rror:" | sed "s/^/$f: /"
  done
  timeout ${SANITIZE_S:-330} python3 -m opforge profile add add_out square sigmoid sigmoid_backward axpby axpby_backward \
    lltm_forward lltm_backward --sanitize --seed 1 > "$OUT/sanitize.txt" 2>&1
  echo "sanitize rc=$?"; grep -E "^│|tools|excl" "$OUT/sanitize.txt"
  ;;
gemm-splitk)
  # Issue 7's split-K and workspace: the CUDA tests of gemm beside gemm_tune's build and initcheck's kernel
  # filter forms, then gemm_tune's SIMT variants (checks + times against cuBLAS), then the op's float32 bench.
  cublas_flags
  build_driver gemm_tune -Xptxas -v "${blas[@]}" > "$OUT/gemm-build.log" 2>&1 &
  nv=$!
  for f in kns=at::native::reduce_kernel kns=_ZN2at6native13reduce_kernel; do
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 60 compute-sanitizer --tool initcheck --kernel-name-exclude $f python3 -c \
      "import torch; x = torch.randn(1025, 900, dtype=torch.float64, device='cuda'); print(x.sum(0).sum().item())" 2>&1 \
      | grep -E "ERROR SUMMARY|rror" | head -2 | sed "s/^/initcheck exclude $f: /"
  done
  timeout ${GEMM_TEST_S:-220} python3 -m pytest tests/test_gemm.py -q -p no:cacheprovider -m cuda -x > "$OUT/pytest-gemm.log" 2>&1
  echo "gemm CUDA tests rc=$?"; tail -3 "$OUT/pytest-gemm.log"
  wait $nv || { tail -20 "$OUT/gemm-build.log"; exit 1; }
  echo "gemm_tune spilling kernels: $(grep -cE '[1-9][0-9]* bytes spill stores' "$OUT/gemm-build.log")"
  timeout ${GEMM_TIMEOUT:-200} /tmp/gemm_tune --only ${GEMM_ONLY:-simt} > "$OUT/gemm-tune.txt" 2>&1
  echo "gemm_tune rc=$?"; grep -E "^FAIL|^correctness:|HANG|launch failed" "$OUT/gemm-tune.txt" | head -8
  sed -n '/== timing/,$p' "$OUT/gemm-tune.txt" | grep -E "^(16|32|64)x|float32 .*splits" | tail -70
  if [ $(( $(date +%s) - start )) -lt 470 ]; then
    timeout 100 python3 -m opforge bench gemm --device cuda --dtype float32 --seed 1 --no-compile --budget 0.3 \
      --json "$OUT/gemm-f32.json" > "$OUT/gemm-f32.log" 2>&1
    echo "bench rc=$?"; grep -E "^│ " "$OUT/gemm-f32.log" | cut -c1-170
  fi
  ;;
lltm-sanitize)
  # lltm_backward's d_bias by its own column-sum kernel: the sanitizer over every elementwise and LLTM kernel,
  # beside it LLTM's CUDA tests and examples/gemm on CUDA (allow_smem per library, 2048^3); then LLTM's bench.
  timeout ${SANITIZE_S:-330} python3 -m opforge profile add add_out square sigmoid sigmoid_backward axpby axpby_backward \
    lltm_forward lltm_backward --sanitize --seed 1 > "$OUT/sanitize.txt" 2>&1 &
  san=$!
  timeout 200 python3 -m pytest tests/test_lltm.py -q -p no:cacheprovider -m cuda > "$OUT/pytest-lltm.log" 2>&1
  echo "lltm CUDA tests rc=$?"; tail -2 "$OUT/pytest-lltm.log"
  timeout 200 python3 -m pytest tests/test_examples.py -q -p no:cacheprovider -m cuda -k gemm > "$OUT/pytest-examples.log" 2>&1
  echo "examples gemm/qqq_gemm CUDA rc=$?"; tail -2 "$OUT/pytest-examples.log"
  wait $san; echo "sanitize rc=$?"; grep -E "^│|tools" "$OUT/sanitize.txt"
  timeout 100 python3 examples/lltm/bench.py --device cuda --budget 0.2 --json "$OUT/lltm.json" 2>&1 | tail -6
  timeout 60 python3 examples/lltm/bench.py --device cuda --budget 0.2 --graph --no-compile --json "$OUT/lltm-graph.json" 2>&1 | tail -5
  ;;
benches)
  # One quiet-GPU call, every bench under the read flush: gemm against cuBLAS (all dtypes), the fused axpby and
  # backward kernels against eager and static compile at 2^26/2^28, qqq_gemm against fp16 matmul.
  timeout 170 python3 -m opforge bench gemm --device cuda --seed 1 --no-compile --budget 0.3 --json "$OUT/gemm.json" \
    --plot "$OUT/gemm.png" > "$OUT/gemm.log" 2>&1
  echo "bench gemm rc=$?"; grep -E "^│ " "$OUT/gemm.log" | cut -c1-170
  timeout 250 python3 -m opforge bench axpby axpby_backward sigmoid_backward --device cuda --seed 1 --sweep --case 2^26,2^28 \
    --budget 0.1 --json "$OUT/fused.json" > "$OUT/fused.log" 2>&1
  echo "bench fused rc=$?"; grep -E "^│ " "$OUT/fused.log" | cut -c1-150
  if [ $(( $(date +%s) - start )) -lt 500 ]; then
    timeout 80 python3 -m opforge bench qqq_gemm --device cuda --seed 1 --dtype float16 --budget 0.1 --no-compile \
      --json "$OUT/qqq.json" > "$OUT/qqq.log" 2>&1
    echo "bench qqq rc=$?"; python3 benchmarks/qqq_summary.py "$OUT/qqq.json" --markdown --plot "$OUT/qqq.png" 2>&1 | tail -20
  fi
  ;;
final-check)
  # add's cache hints (quiet GPU), ncu summaries of gemm, then the sanitizer over gemm and qqq_gemm (split-K,
  # the ATen workspace) beside the CUDA tests of every op and the fast path.
  build_driver elementwise_tune \
    && timeout 90 /tmp/elementwise_tune hints 2>&1 | tee "$OUT/tune-hints.txt"
  { timeout 60 python3 -m opforge profile gemm --case 16x8192x8192 --dtype float32
    timeout 60 python3 -m opforge profile gemm --case 4096^3 --dtype bfloat16; } > "$OUT/profile-gemm.txt" 2>&1
  echo "profile rc=$?"; grep -E "^│|^┃" "$OUT/profile-gemm.txt" | cut -c1-170 | head -30
  timeout 220 python3 -m opforge profile gemm qqq_gemm --sanitize --seed 1 > "$OUT/sanitize-gemm-qqq.txt" 2>&1 &
  san=$!
  timeout 220 python3 -m pytest tests/test_ops.py tests/test_fast.py tests/test_check.py -q -p no:cacheprovider -m cuda \
    > "$OUT/pytest-ops.log" 2>&1
  echo "ops/fast/check CUDA tests rc=$?"; tail -2 "$OUT/pytest-ops.log"
  wait $san; echo "sanitize rc=$?"; grep -E "^│|tools" "$OUT/sanitize-gemm-qqq.txt"
  ;;
drivers)
  # The three tuning drivers after sharing tune_common.cuh: build, checks, a short timing each.
  build_driver elementwise_tune \
    && timeout 60 /tmp/elementwise_tune hints 2>&1 | tail -7
  build_driver qqq_tune \
    && timeout 120 /tmp/qqq_tune > "$OUT/qqq-tune.txt" 2>&1; echo "qqq_tune rc=$?"
  grep -E "^(check|FAIL|all checks)|read" "$OUT/qqq-tune.txt" | head -12
  cublas_flags
  build_driver gemm_tune "${blas[@]}" \
    && timeout 150 /tmp/gemm_tune --only simt16x64x32 > "$OUT/gemm-tune.txt" 2>&1; echo "gemm_tune rc=$?"
  grep -E "^correctness:|^FAIL|^16x8192x8192 +float32" "$OUT/gemm-tune.txt" | head -12
  ;;
explore)
  # Session 14's questions: is the bench timing host gaps (bench_timing.py), do deeper pipelines stream
  # qqq_gemm's weights faster at small M (qqq_tune --small), does more work per thread move add's 2-byte types.
  timeout 120 python3 benchmarks/bench_timing.py 2>&1 | tee "$OUT/bench-timing.txt"
  build_driver qqq_tune \
    && timeout 200 /tmp/qqq_tune --small > "$OUT/qqq-small.txt" 2>&1; echo "qqq_tune rc=$?"
  grep -vE "^check" "$OUT/qqq-small.txt" | cut -c1-120; grep -E "FAIL" "$OUT/qqq-small.txt" | head -5
  build_driver elementwise_tune \
    && timeout 120 /tmp/elementwise_tune multi 2>&1 | tee "$OUT/elementwise-multi.txt"
  ;;
qqq-bench)
  # What the bench reports for short calls (bench_timing.py: batched vs synchronised, the input-set
  # rotation's spread), then qqq_gemm's bench vs fp16 matmul with a larger budget than `benches`.
  timeout 150 python3 benchmarks/bench_timing.py 2>&1 | tee "$OUT/bench-timing.txt"
  qqq_bench
  ;;
profile-qqq)
  # ncu summaries of qqq_gemm (issue 8's evidence) at M = 1 and 128, per channel and per group, K = N = 8192.
  for c in "M=1 K=8192 N=8192 per channel" "M=1 K=8192 N=8192 group 128" "M=128 K=8192 N=8192 per channel" \
           "M=128 K=8192 N=8192 group 128"; do
    timeout 90 python3 -m opforge profile qqq_gemm --case "$c" --dtype float16
  done > "$OUT/profile-qqq.txt" 2>&1
  echo "profile rc=$?"; grep -E "^│|^┃|case" "$OUT/profile-qqq.txt" | cut -c1-170 | head -40
  ;;
ncu-qqq)
  # Where qqq_gemm's warps wait at M = 1 (per channel, per group): ncu's warp-state, scheduler and
  # source-counter sections over the second call of each (benchmarks/qqq_once.py).
  ncu=$(ncu_path)
  timeout 240 "$ncu" -k regex:qqq_ --launch-skip 1 --launch-count 3 --section SpeedOfLight --section WarpStateStats \
    --section SchedulerStats --section SourceCounters --section Occupancy python3 benchmarks/qqq_once.py > "$OUT/ncu-qqq.txt" 2>&1
  echo "ncu rc=$?"; grep -E "qqq_(gemm|direct)_kernel|Duration|Warp Cycles Per Issued|Issue Slots Busy|No Eligible|stall|Stall|Branch Instructions Ratio|Achieved Occupancy" "$OUT/ncu-qqq.txt" | cut -c1-200 | head -60
  ;;
qqq-direct)
  # The weights straight into registers at M = 1, 8, 16 (qqq_tune --direct): bit-exact checks of the
  # direct variants, then their times beside the op's staged tiles, the op's launcher and the read-only floor.
  build_driver qqq_tune \
    && timeout 300 /tmp/qqq_tune --direct > "$OUT/qqq-direct.txt" 2>&1; echo "qqq_tune rc=$?"
  grep -E "^check|FAIL" "$OUT/qqq-direct.txt" | head -12; grep -vE "^check" "$OUT/qqq-direct.txt" | cut -c1-110
  ;;
qqq-ws)
  # The warp-specialised wgmma kernel at M = 32, 64, 128 (qqq_tune --ws): bit-exact checks of its
  # configurations, then their times (forced splits 1, 2, 4 and the model's) beside the op's launcher.
  build_driver qqq_tune \
    && timeout 400 /tmp/qqq_tune --ws > "$OUT/qqq-ws.txt" 2>&1; echo "qqq_tune rc=$?"
  grep -E "^check|FAIL" "$OUT/qqq-ws.txt" | head -20; grep -E "^(op|time)" "$OUT/qqq-ws.txt" | cut -c1-120
  ;;
fold-bulk)
  # Two experiments in one call: qqq_tune --fold (per group, the group scales folded per slot into
  # partial sums instead of applied in the conversion: checks, then M = 1 .. 64 beside the op), and
  # elementwise_tune bulk (add through TMA bulk copies against the op's kernel).
  build_driver qqq_tune \
    && timeout 300 /tmp/qqq_tune --fold > "$OUT/qqq-fold.txt" 2>&1; echo "qqq_tune rc=$?"
  grep -E "^check|FAIL" "$OUT/qqq-fold.txt" | head -20; grep -E "^(op|time)" "$OUT/qqq-fold.txt" | cut -c1-110
  build_driver elementwise_tune \
    && timeout 150 /tmp/elementwise_tune bulk > "$OUT/elementwise-bulk.txt" 2>&1; echo "elementwise_tune rc=$?"
  cat "$OUT/elementwise-bulk.txt"
  ;;
ncu-ws)
  # Kernel-only profiles (ncu) of the wgmma kernel at K = N = 8192 (qqq_tune --ncu-ws): what bounds it.
  build_driver qqq_tune || exit 1
  timeout 300 "$(ncu_path)" --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis \
    --section ComputeWorkloadAnalysis --section SchedulerStats --section Occupancy --section LaunchStats \
    -k regex:qqq_ws /tmp/qqq_tune --ncu-ws > "$OUT/ncu-ws.txt" 2>&1
  echo "ncu rc=$?"; grep -E "^  [a-z_].*\(|Duration|DRAM Throughput|Memory Throughput|L2 Cache Throughput|L1/TEX Cache Throughput|Compute \(SM\)|Warp Cycles Per Issued|Issued Ipc|No Eligible|Registers Per|Shared Memory|Executed Ipc" "$OUT/ncu-ws.txt" | cut -c1-150
  ;;
ws-probe)
  # What bounds the wgmma kernel: times without the conversion, without the wgmmas, other depths; then
  # ncu's source counters (stall reasons per instruction) over the real kernel at M = 32 and 128.
  build_driver qqq_tune -lineinfo || exit 1
  timeout 200 /tmp/qqq_tune --ws-probe > "$OUT/ws-probe.txt" 2>&1; echo "rc=$?"; grep -E "^time" "$OUT/ws-probe.txt" | cut -c1-100
  QQQ_NCU_ONLY=1 timeout 240 "$(ncu_path)" --section WarpStateStats --section SourceCounters --section SpeedOfLight \
    -k regex:qqq_ws -c 2 /tmp/qqq_tune --ws-probe > "$OUT/ncu-ws-probe.txt" 2>&1; echo "ncu rc=$?"
  grep -E "^  [a-z_].*\(|Duration|stall|Stall|Warp Cycles" "$OUT/ncu-ws-probe.txt" | cut -c1-180 | head -60
  ;;
ncu-direct)
  # Kernel-only durations (ncu) at M = 1, K = N = 8192: the read-only kernel, the staged Narrow tile and
  # the direct kernels, per channel and per group (qqq_tune --ncu).
  build_driver qqq_tune || exit 1
  ncu=$(ncu_path)
  timeout 240 "$ncu" --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis --section Occupancy \
    --section LaunchStats /tmp/qqq_tune --ncu > "$OUT/ncu-direct.txt" 2>&1
  echo "ncu rc=$?"; grep -E "^  [a-z_].*\(|Duration|DRAM Throughput|Memory Throughput|Compute \(SM\)|Warp Cycles Per Issued|Registers Per|Achieved Occupancy|Dynamic Shared" "$OUT/ncu-direct.txt" | cut -c1-150
  ;;
ws-final)
  # Issue 8 after the wgmma kernel: qqq_tune --ws (every op configuration and the launcher bit-exact, then
  # the wgmma configurations' times beside the launcher), the qqq_gemm, gemm (the shared sm90a.cuh) and
  # example CUDA tests, compute-sanitizer over qqq_tune --sanitize, the bench; at most 8 files back.
  bash "$0" qqq-ws | grep -E "rc=|FAIL|passed"
  grep -E "^check" "$OUT/qqq-ws.txt" | cut -c1-60
  qqq_cuda_tests
  timeout 240 python3 -m pytest tests/test_gemm.py tests/test_examples.py -q -p no:cacheprovider -m cuda -k "gemm or qqq" \
    > "$OUT/pytest-gemm-examples.log" 2>&1; echo "pytest gemm + examples rc=$?"; tail -n 2 "$OUT/pytest-gemm-examples.log"
  qqq_sanitize
  qqq_bench
  rm -f "$OUT/qqq.log" "$OUT/env.txt"
  ;;
m128)
  # qqq_gemm per channel at M = 80 and 128: the 128-row tiles against 64-row tiles at two and three
  # CTAs per SM, forced splits.
  qqq_tune_mode --m128
  ;;
rows32)
  # qqq_gemm at M = 64 and 128, both schemes: 32-row wgmma tiles (one or two CTAs per SM) against the op.
  qqq_tune_mode --rows32
  ;;
dfold)
  # qqq_gemm per group at M <= 16: the direct kernel with the group scales folded per block of 4 units
  # against the wgmma kernel's fold, then the op's CUDA tests.
  qqq_tune_mode --dfold
  qqq_cuda_tests
  ;;
dfold-final)
  # Issue 8 after the direct kernel's fold and the 64-row tiles to M = 128 (the checks alone).
  qqq_final --check-only
  ;;
rows32-final)
  # After the 32-row tiles per channel up to M = 64: the checks, the op's CUDA tests, sanitizer, bench.
  QQQ_EXAMPLES=0 qqq_final --check-only
  ;;
fold-final)
  # Issue 8 after the group-scale fold: per group and small-M per channel times beside the launcher.
  qqq_final --fold
  ;;
qqq-final)
  # Issue 8's evidence after a kernel change: the op's CUDA tests, compute-sanitizer's memcheck, racecheck
  # and synccheck over qqq_tune --sanitize (every op configuration, both schemes), then the bench.
  qqq_cuda_tests
  build_driver qqq_tune || exit 1
  qqq_sanitize
  bash "$0" qqq-bench | tail -n 22
  ;;
qqq-verify)
  # After a qqq_gemm kernel change: qqq_tune's bit-exact checks and the M <= 16 timings (the op's
  # launcher among them, qqq_tune --direct), then the op's CUDA tests and its example's.
  bash "$0" qqq-direct | grep -E "rc=|^check|FAIL"
  qqq_cuda_tests
  timeout 200 python3 -m pytest tests/test_examples.py -q -p no:cacheprovider -m cuda -k qqq > "$OUT/pytest-examples.log" 2>&1
  echo "examples qqq CUDA rc=$?"; tail -2 "$OUT/pytest-examples.log"
  grep -E "^(small|time|op )" "$OUT/qqq-direct.txt" | cut -c1-130
  ;;
cudatests|cudatests-only)
  # Every CUDA-marked test, in groups that each report even if a later one runs out of time.
  for t in ${TESTS:-"tests/test_ops.py tests/test_fast.py tests/test_lltm.py tests/test_layout.py" "tests/test_new.py tests/test_examples.py" \
      "tests/test_docs.py tests/test_profile.py" "tests/test_inline.py tests/test_build.py tests/test_doctor.py tests/test_cli.py"}; do
    echo "== $t"
    timeout ${GROUP_TIMEOUT:-240} python3 -m pytest $t -q -p no:cacheprovider -m cuda 2>&1 | tee -a "$OUT/pytest.log" | tail -4
  done
  ;;
routes)
  [ -n "${SKIP_SPEED:-}" ] || python3 benchmarks/build_speed.py --json "$OUT/build-speed.json" 2>&1 | tee "$OUT/build-speed.log"
  rm -rf /tmp/opforge-wheel /tmp/opforge-site
  wstart=$(date +%s)
  python3 -m pip wheel -v --no-build-isolation --no-deps -w /tmp/opforge-wheel . > "$OUT/wheel.log" 2>&1
  echo "wheel rc=$? in $(( $(date +%s) - wstart )) s: $(ls /tmp/opforge-wheel)"
  grep "opforge: building" "$OUT/wheel.log"
  # No package registry and no ensurepip here: the wheel goes into a directory of its own, and the
  # machine's python (with its torch and pytest) runs the op tests against it, the source tree off the path.
  python3 -m pip install -q --no-deps --target /tmp/opforge-site /tmp/opforge-wheel/*.whl
  (cd /tmp && OPFORGE_LIBRARY=prebuilt PYTHONPATH=/tmp/opforge-site python3 -c \
    "import opforge; print('prebuilt:', opforge.library.route, opforge.library.path, 'cuda', opforge.library.with_cuda)")
  (cd /tmp && OPFORGE_LIBRARY=prebuilt PYTHONPATH=/tmp/opforge-site python3 -m pytest -q -p no:cacheprovider \
    "$OLDPWD/tests/test_ops.py" "$OLDPWD/tests/test_layout.py" 2>&1 | tee "$OUT/pytest-prebuilt.log" | tail -3)
  [ -n "${SKIP_SPEED:-}" ] || python3 -m pytest -q -p no:cacheprovider tests/test_inline.py tests/test_cli.py tests/test_prebuilt.py \
    -k "not fresh_venv" 2>&1 | tee "$OUT/pytest-routes.log" | tail -3
  ;;
qqq)
  build_driver qqq_tune \
    && timeout ${QQQ_TUNE_S:-80} /tmp/qqq_tune > "$OUT/qqq-tune.txt" 2>&1
  echo "qqq_tune rc=$?"; grep -E "^(check|FAIL|device|all checks)" "$OUT/qqq-tune.txt" | head -20
  timeout ${QQQ_TEST_S:-75} python3 -m pytest tests/test_qqq.py tests/test_ops.py -k "qqq" -q -p no:cacheprovider \
    > "$OUT/pytest-qqq.log" 2>&1; echo "pytest rc=$?"; tail -3 "$OUT/pytest-qqq.log"
  timeout ${QQQ_BENCH_S:-60} python3 -m opforge bench qqq_gemm --device cuda --seed 1 --dtype float16 --budget ${BUDGET:-0.1} \
    --no-compile --json "$OUT/bench-qqq.json" > "$OUT/bench-qqq.log" 2>&1
  echo "bench rc=$?"
  timeout ${QQQ_FLUSH_S:-40} python3 benchmarks/qqq_flush.py >> "$OUT/qqq-tune.txt" 2>&1; echo "flush rc=$?"
  for tool in memcheck racecheck synccheck; do
    timeout ${QQQ_SANITIZE_S:-15} compute-sanitizer --tool $tool /tmp/qqq_tune --sanitize 2>&1 | tail -3 | sed "s/^/$tool: /"
  done > "$OUT/sanitize-qqq.txt"; cat "$OUT/sanitize-qqq.txt"
  timeout ${QQQ_EXAMPLE_S:-85} python3 examples/qqq_gemm/run.py --device cuda > "$OUT/example-qqq-cuda.log" 2>&1
  echo "example rc=$?"; grep -E "^(built|check|MLP|  time|qqq_gemm:|FAILED)" "$OUT/example-qqq-cuda.log" | tail -14
  grep -E "^(op |device copy)|\| " "$OUT/qqq-tune.txt"
  python3 benchmarks/qqq_summary.py "$OUT/bench-qqq.json"
  ;;
esac
