#!/usr/bin/env bash
# Where qqq_gemm's kernels spend their time, by Nsight Compute, on a GPU machine
# (sm_90a). One profile per call; output into $OUT (default /tmp/opforge-out).
#   bash benchmarks/experiments/qqq_ncu.sh calls   # the op's second call at M = 1, per channel and per group:
#                                                  # warp state, scheduler, source counters (qqq_once.py)
#   bash benchmarks/experiments/qqq_ncu.sh direct  # M = 1, K = N = 8192: read-only kernel, staged and direct tiles
#                                                  # (qqq_tune --ncu), kernel-only durations
#   bash benchmarks/experiments/qqq_ncu.sh ws      # the wgmma kernel at K = N = 8192 (qqq_tune --ncu-ws)
#   bash benchmarks/experiments/qqq_ncu.sh probe   # the wgmma kernel without its conversion or its wgmmas
#                                                  # (qqq_tune --ws-probe), then ncu's source counters over it
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/opforge-out}
mkdir -p "$OUT"
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)
[ -n "$ncu" ] || { echo "qqq_ncu: ncu not found" >&2; exit 1; }
build_tune() {
  nvcc -std=c++17 -O3 -Icsrc -gencode=arch=compute_90a,code=sm_90a "$@" benchmarks/qqq_tune.cu -o /tmp/qqq_tune
}
case "${1:-}" in
calls)
  timeout 240 "$ncu" -k regex:qqq_ --launch-skip 1 --launch-count 3 --section SpeedOfLight --section WarpStateStats \
    --section SchedulerStats --section SourceCounters --section Occupancy python3 benchmarks/experiments/qqq_once.py \
    > "$OUT/ncu-qqq.txt" 2>&1
  echo "ncu rc=$?"
  grep -E "qqq_(gemm|direct)_kernel|Duration|Warp Cycles Per Issued|Issue Slots Busy|No Eligible|Stall|Achieved Occupancy" \
    "$OUT/ncu-qqq.txt" | cut -c1-200 | head -60
  ;;
direct)
  build_tune || exit 1
  timeout 240 "$ncu" --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis --section Occupancy \
    --section LaunchStats /tmp/qqq_tune --ncu > "$OUT/ncu-direct.txt" 2>&1
  echo "ncu rc=$?"
  grep -E "^  [a-z_].*\(|Duration|DRAM Throughput|Memory Throughput|Compute \(SM\)|Warp Cycles Per Issued|Registers Per|Achieved Occupancy" \
    "$OUT/ncu-direct.txt" | cut -c1-150
  ;;
ws)
  build_tune || exit 1
  timeout 300 "$ncu" --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis \
    --section ComputeWorkloadAnalysis --section SchedulerStats --section Occupancy --section LaunchStats \
    -k regex:qqq_ws /tmp/qqq_tune --ncu-ws > "$OUT/ncu-ws.txt" 2>&1
  echo "ncu rc=$?"
  grep -E "^  [a-z_].*\(|Duration|DRAM Throughput|L2 Cache Throughput|Compute \(SM\)|Warp Cycles Per Issued|Issued Ipc|No Eligible|Registers Per" \
    "$OUT/ncu-ws.txt" | cut -c1-150
  ;;
probe)
  build_tune -lineinfo || exit 1
  timeout 200 /tmp/qqq_tune --ws-probe > "$OUT/ws-probe.txt" 2>&1
  echo "qqq_tune rc=$?"; grep -E "^time" "$OUT/ws-probe.txt" | cut -c1-100
  QQQ_NCU_ONLY=1 timeout 240 "$ncu" --section WarpStateStats --section SourceCounters --section SpeedOfLight \
    -k regex:qqq_ws -c 2 /tmp/qqq_tune --ws-probe > "$OUT/ncu-ws-probe.txt" 2>&1
  echo "ncu rc=$?"; grep -E "^  [a-z_].*\(|Duration|Stall|Warp Cycles" "$OUT/ncu-ws-probe.txt" | cut -c1-180 | head -60
  ;;
*)
  sed -n '2,11p' "$0"; exit 2
  ;;
esac
