#!/usr/bin/env bash
# Compiles every pure-CUDA kernel file (no torch headers) with plain nvcc for
# sm_80 and sm_90a, prints ptxas's resource report per kernel, and fails on a
# compile error or any register spill; then compiles the tuning drivers
# (benchmarks/*_tune.cu) to sm_90a PTX. Runs on machines without a GPU (CI).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
NVCC=${NVCC:-nvcc}
command -v "$NVCC" >/dev/null || { echo "nvcc_check: nvcc not found (set NVCC)" >&2; exit 1; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
check_kernel() {
  local cu=$1 status=0
  local log="$out/$(basename "$cu").log" kernels max_regs spills what hgmma
  if ! "$NVCC" -std=c++17 -O3 -Icsrc \
      -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90a,code=sm_90a \
      -Xptxas -v -c "$cu" -o "$out/$(basename "$cu").o" >"$log" 2>&1; then
    echo "FAIL $cu: does not compile"; cat "$log"; return 1
  fi
  kernels=$(grep -c "Compiling entry function" "$log" || true)
  max_regs=$(grep -o "Used [0-9]* registers" "$log" | awk '{print $2}' | sort -n | tail -1)
  spills=$(grep -o "[0-9]* bytes spill stores" "$log" | awk '$1 > 0' | wc -l)
  if [ "$spills" -gt 0 ]; then
    echo "FAIL $cu: $spills kernel(s) spill registers"; grep -B2 "[1-9][0-9]* bytes spill stores" "$log"; status=1
  else
    echo "ok   $cu: $kernels kernel builds (sm_80, sm_90a), max $max_regs registers, 0 spills"
  fi
  # ptxas serialising wgmmas (C7520, or C7514: other instructions reading a wgmma's accumulators
  # while it may run) or injecting warpgroup arrives around them (C7519) means the pipeline the
  # kernel was written for is not the one that runs.
  if grep -q "C7520\|C7519\|C7514" "$log"; then
    echo "FAIL $cu: ptxas serialises or fences wgmmas:"; grep "C7520\|C7519\|C7514" "$log" | head -3; status=1
  fi
  # A kernel folder that writes wgmma must get Hopper's warpgroup MMA (HGMMA, IGMMA for int8) into its sm_90a
  # machine code, not a fallback: the guards (__CUDA_ARCH_FEAT_SM90_ALL) must let it through.
  # Without cuobjdump (some toolkit installs ship only the compiler), the sm_90a PTX is read instead:
  # ptxas turns every wgmma.mma_async that reaches it into [HI]GMMA.
  if grep -qs "wgmma.mma_async" "$(dirname "$cu")"/*.cu "$(dirname "$cu")"/*.cuh; then
    if command -v cuobjdump >/dev/null; then
      what="HGMMA/IGMMA instructions in the sm_90a code"
      hgmma=$(cuobjdump -sass -arch sm_90a "$out/$(basename "$cu").o" 2>/dev/null | grep -cE "[HI]GMMA" || true)
    else
      what="wgmma.mma_async instructions in the sm_90a PTX (no cuobjdump here)"
      "$NVCC" -std=c++17 -O3 -Icsrc -arch=compute_90a -ptx "$cu" -o "$out/$(basename "$cu").ptx" >>"$log" 2>&1
      hgmma=$(grep -c "wgmma.mma_async" "$out/$(basename "$cu").ptx" 2>/dev/null || true)
    fi
    if [ "${hgmma:-0}" -gt 0 ]; then
      echo "ok   $cu: $hgmma $what"
    else
      echo "FAIL $cu: its folder writes wgmma.mma_async but none reaches its sm_90a code ($what: 0)"; status=1
    fi
  fi
  return $status
}

# The tuning drivers include the kernel headers the op library is built from:
# a kernel change that breaks one fails here, not on a GPU machine. They are
# compiled to sm_90a PTX, which instantiates every variant; ptxas, whose
# register and spill counts mean nothing for their informational variants
# (register-capped shapes, several CTAs per SM), is left to the GPU machine:
# on two cores it took 70 of their 115 CPU-seconds.
check_tuning_driver() {
  local cu=$1
  local name log flags kernels
  name=$(basename "$cu" .cu)
  log="$out/$name.log"
  flags=()
  # gemm_tune compares with cuBLAS; without its headers it compiles every variant and refuses to run.
  if [ "$name" = gemm_tune ] && ! echo '#include <cublas_v2.h>' | "$NVCC" -x cu -E - >/dev/null 2>&1; then
    flags=(-DOPF_TUNE_NO_CUBLAS)
  fi
  if ! "$NVCC" -std=c++17 -O3 -Icsrc -arch=compute_90a -ptx \
      ${flags[@]+"${flags[@]}"} "$cu" -o "$out/$name.ptx" >"$log" 2>&1; then
    echo "FAIL $cu: does not compile"; cat "$log"; return 1
  fi
  kernels=$(grep -c "^[.]visible [.]entry\|^[.]entry" "$out/$name.ptx" || true)
  echo "ok   $cu: $kernels kernels in its sm_90a PTX${flags[*]:+ (${flags[*]})}"
}

# One job per file, as many at once as there are cores (one nvcc is one core: 110 s in
# a row on two cores, 66 s side by side); the reports print in a fixed order.
jobs=${NVCC_CHECK_JOBS:-$(nproc)}
files=(csrc/ops/*/*.cu benchmarks/*_tune.cu)
running=0
for i in "${!files[@]}"; do
  cu=${files[$i]}
  if [ "$running" -ge "$jobs" ]; then wait -n; running=$((running - 1)); fi
  if [[ $cu == benchmarks/* ]]; then fn=check_tuning_driver; else fn=check_kernel; fi
  ( if "$fn" "$cu" >"$out/report.$i" 2>&1; then echo 0; else echo 1; fi >"$out/status.$i" ) &
  running=$((running + 1))
done
wait
status=0
for i in "${!files[@]}"; do
  cat "$out/report.$i"
  [ "$(cat "$out/status.$i")" = 0 ] || status=1
done
exit $status
