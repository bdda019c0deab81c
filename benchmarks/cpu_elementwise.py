"""The elementwise operators against torch on the CPU: the ratio table.

Every elementwise operator x {2^16, 2^20, transposed 1024x1024,
channels_last 16x64x32x32} x {float32, float16, bfloat16} x {one thread, all
threads}, timed by ``opforge bench``'s own code (``opforge.bench.bench_op``:
cache flushed before each call, opforge and torch timed in turns) with
``torch.set_num_threads`` set per column. A ratio is torch's median time over
opforge's (above 1: opforge is faster). The whole measurement runs
``--repeat`` times; the table shows the median ratio and the range.

Targets: contiguous cases at >= 0.9x torch, transposed and channels_last
within 1.05x (>= 0.952x); a ratio under its target is marked ``<``.

    python benchmarks/cpu_elementwise.py                       # the table
    python benchmarks/cpu_elementwise.py --repeat 3 --json     # and the JSON files

``--json`` writes one ``opforge bench`` report per thread count under
benchmarks/results/ (``cpu-<cpu>-<N>thread(s)_<date>_elementwise.json``, readable
by ``opforge bench --compare``); for each case it keeps the repeat whose
ratio was the median one. Nothing is written without it.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
from pathlib import Path

import torch

import opforge
from opforge.bench.run import BenchRow, bench_op, cpu_contention, device_name, new_report, write_json

OPS = ("add", "add_out", "square", "sigmoid", "sigmoid_backward", "axpby", "axpby_backward")
CASES = ("2^16", "2^20", "transposed 1024x1024", "channels_last 16x64x32x32")
DTYPES = ("float32", "float16", "bfloat16")
CONTIGUOUS_TARGET = 0.9
LAYOUT_TARGET = 1 / 1.05
RESULTS = Path(__file__).resolve().parent / "results"


def target(case: str) -> float:
    return CONTIGUOUS_TARGET if case.startswith("2^") else LAYOUT_TARGET


def ratio(row: BenchRow) -> float | None:
    return row.speedup("eager") if row.status == "ok" else None


def measure(
    ops: list[str], dtypes: list[torch.dtype], cases: list[str], threads: int, *, budget: float, seed: int, verify: bool
) -> list[BenchRow]:
    torch.set_num_threads(threads)
    specs = {s.name: s for s in opforge.all_specs()}
    rows: list[BenchRow] = []
    for name in ops:
        rows += bench_op(
            specs[name], torch.device("cpu"), seed=seed, dtypes=dtypes, budget_s=budget, compile=False, only=cases, verify=verify
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", default=",".join(OPS), help="comma-separated operators (default: every elementwise one)")
    p.add_argument("--dtype", default=",".join(DTYPES), help="comma-separated dtypes")
    p.add_argument("--case", default=",".join(CASES), help="comma-separated case names")
    p.add_argument("--threads", default=f"1,{os.cpu_count()}", help="comma-separated thread counts (default: 1 and all)")
    p.add_argument("--budget", type=float, default=0.3, help="seconds of timing per case and side (opforge bench's --budget)")
    p.add_argument("--repeat", type=int, default=1, help="run the whole measurement this many times")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="write the reports under benchmarks/results/")
    args = p.parse_args(argv)

    ops = args.ops.split(",")
    dtypes = [getattr(torch, d) for d in args.dtype.split(",")]
    cases = args.case.split(",")
    threads = [int(t) for t in args.threads.split(",")]
    busy = cpu_contention()
    if busy:
        print(f"warning: {busy}", file=sys.stderr)

    # runs[t][(op, dtype, case)] = the rows of each repeat
    runs: dict[int, dict[tuple[str, str, str], list[BenchRow]]] = {t: {} for t in threads}
    for rep in range(args.repeat):
        for t in threads:  # thread counts in turns, so a slow spell of the machine hits both columns
            for row in measure(ops, dtypes, cases, t, budget=args.budget, seed=args.seed + rep, verify=rep == 0):
                runs[t].setdefault((row.op, row.dtype, row.case), []).append(row)
            print(f"repeat {rep + 1}/{args.repeat}, {t} thread(s) done", file=sys.stderr, flush=True)

    keys = list(runs[threads[0]])
    head = f"{'op':17s} {'dtype':9s} {'case':26s}" + "".join(f" {f'{t} thread(s)':>22s}" for t in threads)
    print(head)
    print("-" * len(head))
    short = 0
    for key in keys:
        cells = []
        for t in threads:
            values = [r for r in (ratio(row) for row in runs[t].get(key, [])) if r is not None]
            if not values:
                cells.append(f" {'-':>22s}")
                continue
            med = statistics.median(values)
            mark = "<" if med < target(key[2]) else " "
            short += mark == "<"
            spread = f"[{min(values):.2f}-{max(values):.2f}]" if len(values) > 1 else ""
            cells.append(f" {mark}{med:6.3f} {spread:>14s}")
        print(f"{key[0]:17s} {key[1]:9s} {key[2]:26s}" + "".join(cells))
    print(f"\n{short} cell(s) under target (contiguous {CONTIGUOUS_TARGET}x, layouts {LAYOUT_TARGET:.3f}x); torch {torch.__version__}")

    if args.json:
        date = datetime.date.today().isoformat()
        cpu = device_name(torch.device("cpu")).lower().replace(" ", "-")
        for t in threads:
            torch.set_num_threads(t)
            report = new_report(torch.device("cpu"))
            for key in keys:
                rows = [r for r in runs[t].get(key, []) if ratio(r) is not None] or runs[t].get(key, [])
                rows = sorted(rows, key=lambda r: ratio(r) or 0.0)
                report.rows.append(rows[(len(rows) - 1) // 2])
            path = RESULTS / f"cpu-{cpu}-{t}thread{'s' if t > 1 else ''}_{date}_elementwise.json"
            write_json(report, path)
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
