"""Host time per call of small ops, where launch and dispatch dominate.

Each implementation is called 10^4 times in a Python loop with one
synchronisation at the end; the best of 5 such runs, divided by 10^4, is its
host time per call. Compared: ``opforge.add`` (the public function: its eager
fast path), ``torch.add``, and the operator through ``torch.ops`` (the path the
public function takes when the fast path may not), with and without
``requires_grad`` on the first input.

On a GPU it also reports each implementation's device time per call: the
durations of the kernels it launched over 2,000 calls, as the CUDA profiler
(CUPTI, through torch.profiler) records them, divided by the calls. That is the
kernels' own time, free of the launch gaps that CUDA events around one call
would add.

Run: ``python benchmarks/host_overhead.py [--device cuda] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

import opforge

CALLS = 10_000


def per_call_us(fn: Callable[[], object], sync: Callable[[], None]) -> float:
    for _ in range(200):
        fn()
    sync()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(CALLS):
            fn()
        sync()
        best = min(best, time.perf_counter() - t)
    return best / CALLS * 1e6


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    rows = []
    for log2n in (12, 14, 16):
        for grad in (False, True):
            a = torch.randn(2**log2n, device=dev, requires_grad=grad)
            b = torch.randn(2**log2n, device=dev)
            impls = {
                "opforge.add": lambda a=a, b=b: opforge.add(a, b),
                "torch.add": lambda a=a, b=b: torch.add(a, b),
                "torch.ops.opforge.add": lambda a=a, b=b: torch.ops.opforge.add(a, b),
            }
            times = {name: per_call_us(fn, sync) for name, fn in impls.items()}
            row = {"n": 2**log2n, "requires_grad": grad, "us_per_call": {k: round(v, 2) for k, v in times.items()}}
            ratio = times["opforge.add"] / times["torch.add"]
            line = f"2^{log2n} float32 requires_grad={grad!s:5}  " + "  ".join(f"{k} {v:6.2f} us" for k, v in times.items())
            line += f"  opforge/torch {ratio:.2f}x"
            if dev.type == "cuda" and not grad:
                dev_times = {name: device_us_per_call(impls[name], sync) for name in ("opforge.add", "torch.add")}
                if all(v is not None for v in dev_times.values()):
                    row["device_us_per_call"] = {k: round(v, 3) for k, v in dev_times.items()}  # type: ignore[arg-type]
                    line += f" | device: opforge {dev_times['opforge.add']:.3f} us, torch {dev_times['torch.add']:.3f} us"
                    line += f" ({dev_times['opforge.add'] / dev_times['torch.add']:.3f}x)"  # type: ignore[operator]
            rows.append(row)
            print(line)
    if args.json:
        report = {
            "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "calls_per_run": CALLS,
            "rows": rows,
        }
        args.json.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
