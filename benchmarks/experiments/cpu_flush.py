"""Does the cache flush before each timed CPU call favour one side?

``opforge bench`` evicts the caches before each call by reading a buffer twice
the last-level cache. Read by ``torch.sum``, that flush also runs
TensorIterator and torch's allocation code, the code ``torch.add`` and
``torch.mul`` run next: torch's side starts with its framework code warm,
opforge's with its own cold. Read by memchr (``bytearray.find``, what the
bench does now) or by NumPy, the flush runs no torch code.

Times each side after each kind of flush, in turns, median of ``--rounds``:

* ``torch.add(a, b)`` and ``opforge.add(a, b)``: each allocates its output;
* ``torch.add(a, b, out=o)`` and ``opforge.add_out(a, b, o)``: the same
  kernels writing into a tensor allocated once;
* ``torch.mul(a, a)`` (square's reference) and ``opforge.square(a)``.

    python benchmarks/experiments/cpu_flush.py [--threads 1] [--log2n 16] [--rounds 400]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable

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
    timer = Timer(torch.device("cpu"))
    as_tensor = torch.ones(len(timer._flush) // 4)  # the same size, read by torch.sum
    flushes: dict[str, Callable[[], object]] = {"torch.sum": as_tensor.sum, "memchr (the bench's)": timer.flush}
    with contextlib.suppress(RuntimeError):  # torch without NumPy
        flushes["numpy sum"] = as_tensor.numpy().sum
    sides = {
        "torch.add": lambda: torch.add(a, b),
        "opforge.add": lambda: opforge.add(a, b),
        "torch.add(out=)": lambda: torch.add(a, b, out=o),
        "opforge.add_out": lambda: opforge.add_out(a, b, o),
        "torch.mul(a, a)": lambda: torch.mul(a, a),
        "opforge.square": lambda: opforge.square(a),
    }
    samples = {(f, s): [] for f in flushes for s in sides}
    for _ in range(args.rounds):
        for fname, flush in flushes.items():
            for name, fn in sides.items():
                flush()
                t0 = time.perf_counter()
                fn()
                samples[fname, name].append((time.perf_counter() - t0) * 1e6)
    print(f"2^{args.log2n} float32, {args.threads} thread(s), {args.rounds} rounds; median us after each flush")
    print(f"  {'':<18}" + "".join(f"{f:>22}" for f in flushes))
    for name in sides:
        print(f"  {name:<18}" + "".join(f"{statistics.median(samples[f, name][10:]):22.1f}" for f in flushes))


if __name__ == "__main__":
    main()
