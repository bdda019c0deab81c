"""Host time per call of the elementwise operators, where dispatch and launch dominate.

For every elementwise operator (add, add_out, square, sigmoid, axpby), with and
without ``requires_grad`` on its tensor inputs, three routes are timed on the same
inputs: the public function (``opforge.add``: its eager fast path), torch's own
function (``torch.add``), and the operator through ``torch.ops`` (the route the
public function takes when the fast path may not). out= forms refuse inputs
that require grad, as torch's own do: they have no grad row.

Timings interleave: each of ``--rounds`` rounds runs ``--calls`` calls of every
route in turn (a different route first each round), with one synchronisation at
the end of each loop, so a burst of load from elsewhere on the machine hits all
routes alike. Each loop is timed by two clocks: wall time, and the thread's CPU
time (which leaves out the time other processes hold the core: on a shared
machine the steadier figure; the default on the CPU, wall time on a GPU).
A route's host time per call is its best round; the ratio
opforge/torch is that of the two best rounds, and ``ratio_median`` the median
of the per-round ratios.

On a GPU it also reports, without grad, each route's device time per call: the
durations of the kernels it launched over 2,000 calls, as the CUDA profiler
(CUPTI, through torch.profiler) records them, divided by the calls.

The JSON records the device, torch, the date, the commit, the threads and the
machine's load average (``os.getloadavg``) before and after.

Run: ``python benchmarks/host_overhead.py [--device cpu|cuda] [--threads 1] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import opforge
from opforge.bench.machine import cpu_name

ROUTES = ("opforge", "torch", "torch.ops")


def cases(n: int, dev: torch.device, grad: bool) -> list[tuple[str, str, dict[str, Callable[[], object]]]]:
    """(operator, torch's equivalent, {route: a call}) for every elementwise operator."""
    a = torch.randn(n, device=dev, requires_grad=grad)
    b = torch.randn(n, device=dev, requires_grad=grad)
    ops = torch.ops.opforge
    rows: list[tuple[str, str, dict[str, Callable[[], object]]]] = [
        (
            "add",
            "torch.add(a, b)",
            {
                "opforge": lambda: opforge.add(a, b),
                "torch": lambda: torch.add(a, b),
                "torch.ops": lambda: ops.add(a, b),
            },
        ),
        (
            "square",
            "torch.square(a)",
            {
                "opforge": lambda: opforge.square(a),
                "torch": lambda: torch.square(a),
                "torch.ops": lambda: ops.square(a),
            },
        ),
        (
            "sigmoid",
            "torch.sigmoid(a)",
            {
                "opforge": lambda: opforge.sigmoid(a),
                "torch": lambda: torch.sigmoid(a),
                "torch.ops": lambda: ops.sigmoid(a),
            },
        ),
        (
            # torch has no axpby: its one call of the same shape (two tensors, a scalar) stands in.
            "axpby",
            "torch.add(a, b, alpha=-1.0)",
            {
                "opforge": lambda: opforge.axpby(a, b, 3.0, -1.0),
                "torch": lambda: torch.add(a, b, alpha=-1.0),
                "torch.ops": lambda: ops.axpby(a, b, 3.0, -1.0),
            },
        ),
    ]
    if not grad:
        out = torch.empty(n, device=dev)
        rows.insert(
            1,
            (
                "add_out",
                "torch.add(a, b, out=out)",
                {
                    "opforge": lambda: opforge.add_out(a, b, out),
                    "torch": lambda: torch.add(a, b, out=out),
                    "torch.ops": lambda: ops.add_out(a, b, out),
                },
            ),
        )
    return rows


def interleaved(
    impls: dict[str, Callable[[], object]], sync: Callable[[], None], calls: int, rounds: int
) -> dict[str, dict[str, list[float]]]:
    """Per clock ("wall", "thread") and route, the host time per call (us) of each round."""
    names = list(impls)
    for name in names:
        for _ in range(min(calls, 500)):
            impls[name]()
    sync()
    times: dict[str, dict[str, list[float]]] = {"wall": {n: [] for n in names}, "thread": {n: [] for n in names}}
    for r in range(rounds):
        for k in range(len(names)):
            name = names[(r + k) % len(names)]
            fn = impls[name]
            wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
            for _ in range(calls):
                fn()
            sync()
            times["thread"][name].append((time.thread_time_ns() - cpu) / calls / 1e3)
            times["wall"][name].append((time.perf_counter_ns() - wall) / calls / 1e3)
    return times


def device_us_per_call(fn: Callable[[], object], sync: Callable[[], None], calls: int = 2000) -> float | None:
    """Kernel time per call from the profiler's CUDA activity, or None without it."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    for _ in range(100):
        fn()
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        sync()
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    if len(kernels) < calls:
        return None  # the profiler saw no (or not every) kernel: no device time to report
    return sum(e.device_time for e in kernels) / calls


def commit() -> str:
    """The checkout's commit (+dirty); OPFORGE_GIT_COMMIT where the tree is a copy (a GPU machine's)."""
    if os.environ.get("OPFORGE_GIT_COMMIT"):
        return os.environ["OPFORGE_GIT_COMMIT"]
    here = Path(__file__).resolve().parent
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here, capture_output=True, text=True)
        return rev + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--log2n", type=int, nargs="+", default=None, help="sizes, as powers of two (CPU: 10, CUDA: 14)")
    p.add_argument("--calls", type=int, default=20_000, help="calls per route per round")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads on the CPU")
    p.add_argument("--ops", nargs="+", default=None, help="only these operators")
    p.add_argument(
        "--clock",
        choices=("wall", "thread"),
        default=None,
        help="the clock of the reported figures (the other's best is recorded beside): thread CPU time, which leaves out "
        "the time other processes take the core, on the CPU; wall time on a GPU",
    )
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    dev = torch.device(args.device)
    if dev.type == "cpu":
        torch.set_num_threads(args.threads)
    opforge.load(wait_fast=True)
    fast_on = opforge.fast.module() is not None
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    clock = args.clock or ("thread" if dev.type == "cpu" else "wall")
    other = "wall" if clock == "thread" else "thread"
    load_before = os.getloadavg()
    rows: list[dict[str, Any]] = []
    for log2n in args.log2n or ([14] if dev.type == "cuda" else [10]):
        for grad in (False, True):
            for op, torch_call, impls in cases(2**log2n, dev, grad):
                if args.ops and op not in args.ops:
                    continue
                both = interleaved(impls, sync, args.calls, args.rounds)
                times = both[clock]
                best = {k: min(v) for k, v in times.items()}
                ratios = [o / t for o, t in zip(times["opforge"], times["torch"], strict=True)]
                row: dict[str, Any] = {
                    "op": op,
                    "torch_equivalent": torch_call,
                    "n": 2**log2n,
                    "dtype": "float32",
                    "requires_grad": grad,
                    "us_per_call": {k: round(v, 3) for k, v in best.items()},
                    "opforge_over_torch": round(best["opforge"] / best["torch"], 3),
                    "ratio_median": round(statistics.median(ratios), 3),
                    "rounds_us": {k: [round(x, 3) for x in v] for k, v in times.items()},
                    "other_clock_us_per_call": {k: round(min(v), 3) for k, v in both[other].items()},
                }
                line = f"{op:8} 2^{log2n} grad={grad!s:5} " + "  ".join(f"{k} {v:6.2f} us" for k, v in best.items())
                line += f"  opforge/torch {row['opforge_over_torch']:.2f}x (median {row['ratio_median']:.2f}x)"
                if dev.type == "cuda" and not grad:
                    dev_times = {k: device_us_per_call(impls[k], sync) for k in ("opforge", "torch")}
                    if all(v is not None for v in dev_times.values()):
                        row["device_us_per_call"] = {k: round(v, 3) for k, v in dev_times.items()}  # type: ignore[arg-type]
                        line += f" | device: opforge {dev_times['opforge']:.3f} us, torch {dev_times['torch']:.3f} us"
                rows.append(row)
                print(line, flush=True)
    load_after = os.getloadavg()
    print(
        f"{clock} clock; load average before {load_before[0]:.2f}, after {load_after[0]:.2f} (1 min); "
        f"fast path {'on' if fast_on else 'OFF'}"
    )
    if args.json:
        report = {
            "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "cpu": cpu_name(),
            "cores": os.cpu_count(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git_commit": commit(),
            "threads": torch.get_num_threads(),
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in load_after],
            "fast_path": fast_on,
            "clock": clock,
            "calls_per_round": args.calls,
            "rounds": args.rounds,
            "rows": rows,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
