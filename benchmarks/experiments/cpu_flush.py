"""Where the CPU add loses to torch.add at 2^16 elements: the kernel, or the
output's allocation?

Times, as ``opforge bench`` does on the CPU (the last-level cache read before
each call, the sides in turns, median), on the same inputs:

* ``torch.add(a, b)`` and ``opforge.add(a, b)``: each allocates its output;
* ``torch.add(a, b, out=o)`` and ``opforge.add_out(a, b, o)``: the same
  kernels writing into a tensor allocated once;
* ``torch.empty_strided`` alone, as the stable ABI's allocation
  (``aoti_torch_empty_strided``) reaches it: through the dispatcher.

    python benchmarks/experiments/cpu_alloc.py [--threads 1] [--log2n 16] [--rounds 400]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import opforge
from opforge.bench_timing import Timer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--log2n", type=int, default=16)
    p.add_argument("--rounds", type=int, default=400)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    n = 1 << args.log2n
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, generator=g), torch.randn(n, generator=g)
    o = torch.empty_like(a)
    flush = Timer(torch.device("cpu"))._flush  # the bench's own buffer: twice the last-level cache
    sides = {
        "torch.add": lambda: torch.add(a, b),
        "opforge.add": lambda: opforge.add(a, b),
        "torch.add(out=)": lambda: torch.add(a, b, out=o),
        "opforge.add_out": lambda: opforge.add_out(a, b, o),
        "torch.empty_strided": lambda: torch.empty_strided((n,), (1,)),
        "an empty lambda": lambda: None,
    }
    samples: dict[str, list[float]] = {s: [] for s in sides}
    for _ in range(args.rounds):
        for name, fn in sides.items():
            flush.sum()
            t0 = time.perf_counter()
            fn()
            samples[name].append((time.perf_counter() - t0) * 1e6)
    print(f"2^{args.log2n} float32, {args.threads} thread(s), {args.rounds} rounds, cache read before each call")
    for name, s in samples.items():
        print(f"  {name:<22} {statistics.median(s[10:]):8.1f} us")


if __name__ == "__main__":
    main()
