"""Does the bench time the device or the host? opforge bench's Timer on calls
from ~10 us to ~100 us of device time, three ways:

* batched: the bench as it is (batches of 10 calls, one synchronisation). If
  queuing a call cost the host more than the flush before it takes on the GPU,
  the start event would be reached before the call's kernel is queued, and
  the wait would be timed;
* hold: the same batches queued behind a 2 ms spin kernel (torch.cuda._sleep),
  so that the GPU cannot catch up with the host inside a batch;
* sync: one call at a time, synchronised after each (qqq_flush.py beside this file):
  the host queues the call while the flush runs.

Prints the median per call (us, 30 calls after warm-up) and the host time to
queue one timed call. Then the spread the bench reports for qqq_gemm and the
float16 matmul at M = 1, K = N = 8192 (quartiles of 200 calls), with one input
set and rotated over the bench's input sets (opforge.bench.input_sets: a case
that fits in L2 gets several permuted copies): is the rotation what makes the
bench's samples of these calls bimodal?

    python benchmarks/experiments/bench_timing.py
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from qqq_flush import median_us as synced_median_us  # one call at a time, synchronised after each

import opforge
from opforge.bench.run import Timer, input_sets
from opforge.check.run import generator
from opforge.ops.qqq_gemm import make_args
from opforge.opspec import Sample
from opforge.quant import dequantize_weight_w4


def main() -> None:
    dev = torch.device("cuda")
    timer = Timer(dev)
    torch.cuda._sleep(1000)  # module load outside the timed spin
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    torch.cuda._sleep(1_000_000)
    e.record()
    e.synchronize()
    spin_2ms = int(2e9 / (s.elapsed_time(e) * 1e3))  # cycles of a 2 ms spin
    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}; us per call (median of 30)")
    cases: list[tuple[str, Callable[[], Any]]] = []
    for M in (1, 16):
        args = make_args(M, 8192, 8192, -1, dev, None)
        a, w, s_tok, s_ch, s_group, _ = args
        x16 = (a.float() * s_tok[:, None]).half()
        w16 = dequantize_weight_w4(w, s_ch, s_group, -1, dtype=torch.float32).half()
        cases.append((f"qqq_gemm M={M} 8192^2 (torch.ops)", lambda args=args: torch.ops.opforge.qqq_gemm(*args)))
        cases.append((f"qqq_gemm M={M} 8192^2 (opforge.)", lambda args=args: opforge.qqq_gemm(*args)))
        cases.append((f"fp16 matmul M={M} 8192^2", lambda x16=x16, w16=w16: torch.matmul(x16, w16)))
    for log2n in (14, 20, 26):
        x, y = torch.randn(2, 1 << log2n, device=dev)
        cases.append((f"opforge.add 2^{log2n}", lambda x=x, y=y: opforge.add(x, y)))
        cases.append((f"torch.add 2^{log2n}", lambda x=x, y=y: torch.add(x, y)))
    print(f"{'case':34} {'batched':>8} {'hold':>8} {'sync':>8} {'host/call':>9}")
    for name, fn in cases:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        run = timer.batch(lambda i, fn=fn: fn())
        run(10)  # warm-up
        t0 = time.perf_counter()
        batched = run(10) + run(10) + run(10)
        host_us = (time.perf_counter() - t0) * 1e6 / 30  # queuing and waiting: an upper bound
        held = []
        for _ in range(3):
            torch.cuda._sleep(spin_2ms)
            held += run(10)
        row = [statistics.median(batched), statistics.median(held), synced_median_us(fn, timer.flush)]
        print(f"{name:34} {row[0]:8.2f} {row[1]:8.2f} {row[2]:8.2f} {host_us:9.1f}")

    print(f"\n{'M = 1, K = N = 8192, 200 calls':40} {'p25':>8} {'median':>8} {'p75':>8}")
    sample = Sample(make_args(1, 8192, 8192, -1, dev, None), desc="")
    sets = input_sets(sample, timer.l2_bytes, generator(dev, 2))
    fp16 = []
    for st in sets:
        a, w, s_tok, s_ch, s_group, _ = st.args
        fp16.append(((a.float() * s_tok[:, None]).half(), dequantize_weight_w4(w, s_ch, s_group, -1, dtype=torch.float32).half()))
    calls = {
        "qqq_gemm": lambda i, rot: opforge.qqq_gemm(*sets[i % len(sets) if rot else 0].args),
        "fp16 matmul": lambda i, rot: torch.matmul(*fp16[i % len(sets) if rot else 0]),
    }
    for name, call in calls.items():
        for rot in (False, True):
            run = timer.batch(lambda i, call=call, rot=rot: call(i, rot))
            run(10)
            samples = sorted(x for _ in range(20) for x in run(10))
            q = statistics.quantiles(samples, n=4)
            label = f"{name}, {'rotated over ' + str(len(sets)) + ' input sets' if rot else 'one input set'}"
            print(f"{label:40} {q[0]:8.2f} {q[1]:8.2f} {q[2]:8.2f}")


if __name__ == "__main__":
    main()
