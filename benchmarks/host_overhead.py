"""Host time per call of small ops, where launch and dispatch dominate.

Each implementation is called 10^4 times in a Python loop with one
synchronisation at the end; the best of 5 such runs, divided by 10^4, is its
host time per call. Compared: ``opforge.add`` (the public function: its eager
fast path), ``torch.add``, and the operator through ``torch.ops`` (the path the
public function takes when the fast path may not), with and without
``requires_grad`` on the first input.

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
            rows.append({"n": 2**log2n, "requires_grad": grad, "us_per_call": {k: round(v, 2) for k, v in times.items()}})
            ratio = times["opforge.add"] / times["torch.add"]
            print(
                f"2^{log2n} float32 requires_grad={grad!s:5}  "
                + "  ".join(f"{k} {v:6.2f} us" for k, v in times.items())
                + f"  opforge/torch {ratio:.2f}x"
            )
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
