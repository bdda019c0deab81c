"""How the L2 flush changes the W4A8 comparison: opforge::qqq_gemm against
float16 torch.matmul of the same dequantised weights, on the target shapes,
with the L2 flushed before each call two ways:

* dirty: a 256 MB buffer zeroed (what ``opforge bench`` does). The L2 is then
  full of dirty lines, and the timed call's reads first wait for their write-back;
* clean: a 256 MB buffer read (``sum()``). The L2 holds clean lines; the timed
  call reads its weights from DRAM without write-back in the way, as a layer
  does after a kernel that wrote little (the decode step of an LLM).

CUDA events around the call alone, median of 30 after 3 warm-ups.

    python benchmarks/experiments/qqq_flush.py
"""

from __future__ import annotations

import statistics

import torch

import opforge  # noqa: F401 - loads the op library
from opforge.ops.qqq_gemm import BENCH_M, BENCH_SHAPES, make_args
from opforge.quant import dequantize_weight_w4


def median_us(fn, flush) -> float:  # noqa: ANN001
    for _ in range(3):
        fn()
    times = []
    for _ in range(30):
        flush()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3)
    return statistics.median(times)


def main() -> None:
    dev = torch.device("cuda")
    buf = torch.ones(64 << 20, device=dev)  # 256 MB
    flushes = {"dirty": buf.zero_, "clean": buf.sum}
    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}; us per call, speedup = fp16 matmul / qqq_gemm")
    print(f"{'K x N':>12} {'M':>4} {'scheme':>11} | {'dirty: qqq':>10} {'fp16':>7} {'x':>6} | {'clean: qqq':>10} {'fp16':>7} {'x':>6}")
    for K, N in BENCH_SHAPES:
        for gs in (-1, 128):
            for M in BENCH_M:
                args = make_args(M, K, N, gs, dev, None)
                a, w_packed, s_tok, s_ch, s_group, _ = args
                x16 = (a.float() * s_tok[:, None]).half()
                w16 = dequantize_weight_w4(w_packed, s_ch, s_group, gs, dtype=torch.float32).half()
                row = []
                for flush in flushes.values():
                    ours = median_us(lambda: torch.ops.opforge.qqq_gemm(*args), flush)  # noqa: B023
                    theirs = median_us(lambda: torch.matmul(x16, w16), flush)  # noqa: B023
                    row += [ours, theirs, theirs / ours]
                scheme = "per channel" if gs == -1 else "group 128"
                print(f"{K:>5} x {N:<5} {M:>4} {scheme:>11} | {row[0]:>10.1f} {row[1]:>7.1f} {row[2]:>5.2f}x | "
                      f"{row[3]:>10.1f} {row[4]:>7.1f} {row[5]:>5.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
