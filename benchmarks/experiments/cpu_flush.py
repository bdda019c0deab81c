"""What does a cache flush before each timed CPU call measure?

Until 2026-11-25 ``opforge bench`` evicted the caches before each CPU call by
reading a buffer twice the last-level cache (with memchr, after a ``torch.sum``
flush was found to warm torch's own code for torch's side). Such a flush evicts
the code as well as the inputs: the Python binding, the dispatcher, the
allocator, TensorIterator or the stable ABI's shim, which in a model stay in
cache because every operator runs them. The bench now rotates through input
sets that fill twice the last-level cache instead: each call's inputs come from
DRAM, the code does not.

Times each call both ways, in turns, median of ``--rounds``:

* ``--log2n 0`` (one element): what a flush adds to a call that does no work;
* ``--log2n 16``: the smallest case of ``benchmarks/cpu_elementwise.py``.

The sides: ``torch.add(a, b)`` and ``opforge.add(a, b)`` (each allocates its
output), ``torch.add(a, b, out=o)`` and ``opforge.add_out(a, b, o)``,
``torch.mul(a, a)`` (square's reference) and ``opforge.square(a)``.

    python benchmarks/experiments/cpu_flush.py [--threads 1] [--log2n 16] [--rounds 200]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

import opforge
from opforge.bench.timing import Timer, input_sets
from opforge.opspec import Sample

Call = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], object]

SIDES: dict[str, Call] = {
    "torch.add": lambda a, b, o: torch.add(a, b),
    "opforge.add": lambda a, b, o: opforge.add(a, b),
    "torch.add(out=)": lambda a, b, o: torch.add(a, b, out=o),
    "opforge.add_out": lambda a, b, o: opforge.add_out(a, b, o),
    "torch.mul(a, a)": lambda a, b, o: torch.mul(a, a),
    "opforge.square": lambda a, b, o: opforge.square(a),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--log2n", type=int, default=16)
    p.add_argument("--rounds", type=int, default=200)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    n = 1 << args.log2n
    cache = Timer(torch.device("cpu")).l2_bytes
    g = torch.Generator().manual_seed(0)
    # The (a, b, out) sets the bench would rotate through.
    sets = [s.args for s in input_sets(Sample(tuple(torch.randn(n, generator=g) for _ in range(3)), {}, ""), cache, g)]
    k = len(sets)
    flush_buffer = bytearray(b"\x01") * (2 * cache)  # ones: untouched zero pages would evict nothing

    samples: dict[tuple[str, str], list[float]] = {(m, s): [] for m in ("flush", "rotation") for s in SIDES}
    calls = 0
    for _ in range(args.rounds):
        for name, fn in SIDES.items():
            # After a flush, always the same inputs: the flush evicts them.
            flush_buffer.find(0)
            a, b, o = sets[0]
            t0 = time.perf_counter()
            fn(a, b, o)
            samples["flush", name].append((time.perf_counter() - t0) * 1e6)
            # Rotation: the next set of one sequence that every side shares.
            for _ in range(k // len(SIDES) + 1):
                calls += 1
                a, b, o = sets[calls % k]
                t0 = time.perf_counter()
                fn(a, b, o)
                samples["rotation", name].append((time.perf_counter() - t0) * 1e6)

    print(f"2^{args.log2n} float32, {args.threads} thread(s), {args.rounds} rounds, {k} input sets; median us")
    print(f"  {'':<18}{'after a flush':>16}{'rotation':>12}")
    for name in SIDES:
        print(f"  {name:<18}" + "".join(f"{statistics.median(samples[m, name][5:]):14.1f}  " for m in ("flush", "rotation")))
    for m in ("flush", "rotation"):
        med = {s: statistics.median(samples[m, s][5:]) for s in SIDES}
        print(
            f"  torch over opforge, {m}: add {med['torch.add'] / med['opforge.add']:.2f}, "
            f"add_out {med['torch.add(out=)'] / med['opforge.add_out']:.2f}, "
            f"square {med['torch.mul(a, a)'] / med['opforge.square']:.2f}"
        )


if __name__ == "__main__":
    main()
