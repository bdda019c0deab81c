"""A model of an LLTM step, a gemm and a W4A8 linear (examples/deploy/model.py) run four ways:
eager, ``torch.compile``, an AOTInductor package whose compiled code calls the operators
through AOTInductor's proxy executor, and one that calls opforge's C shims generated from
their schemas (``opforge.export.package``, ``shims=False`` / ``True``).

Two times per way and batch size, each the median of ``--reps`` samples:

* per call: one call, timed alone (CUDA events around it on a GPU, the clock on the CPU,
  synchronised after each): what a request of one step waits;
* per step: ``--steps`` calls back to back, one synchronisation at the end, divided by the
  calls: the throughput of a loop of steps, where the host's time per call hides behind
  the device's unless it is the larger.

Run: ``python benchmarks/export_timing.py --json results/export-timing_<device>_<date>.json``
(``--device cpu|cuda``, default cuda where there is one; ``--batch 1,64``; ``--features 512``).
The packages are built into ``--dir`` (a temporary folder by default).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples" / "deploy"))

from model import StepModel  # noqa: E402 - examples/deploy/model.py

import opforge  # noqa: E402
import opforge.export  # noqa: E402


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    import platform

    return f"cpu {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


def timer(device: str) -> tuple[Callable[[Callable[[], Any]], float], Callable[[], None]]:
    """(time one call in ms, synchronise)."""
    if device == "cuda":
        sync = torch.cuda.synchronize

        def one(fn: Callable[[], Any]) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)

        return one, sync

    def one_cpu(fn: Callable[[], Any]) -> float:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3

    return one_cpu, lambda: None


def measure(fn: Callable[[], Any], device: str, reps: int, steps: int) -> dict[str, float]:
    one, sync = timer(device)
    for _ in range(20):
        fn()
    sync()
    per_call = statistics.median(one(fn) for _ in range(reps))
    samples = []
    for _ in range(max(3, reps // 20)):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(steps):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / steps)
        else:
            t = time.perf_counter()
            for _ in range(steps):
                fn()
            samples.append((time.perf_counter() - t) * 1e3 / steps)
    return {"per_call_ms": per_call, "per_step_ms": statistics.median(samples)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    ap.add_argument("--batch", default="1,64", help="comma-separated batch sizes (default 1,64)")
    ap.add_argument("--features", type=int, default=512, help="input, state and output features (a multiple of 32)")
    ap.add_argument("--reps", type=int, default=200, help="calls timed alone, per way and batch")
    ap.add_argument("--steps", type=int, default=200, help="calls back to back in one per-step sample")
    ap.add_argument("--dir", type=Path, default=None, help="where the packages go (default: a temporary folder)")
    ap.add_argument("--json", type=Path, required=True, help="result file")
    args = ap.parse_args()
    device, f = args.device, args.features
    batches = [int(b) for b in args.batch.split(",")]
    torch.manual_seed(0)
    model = StepModel(f, f, f).to(device).eval()
    folder = args.dir or Path(tempfile.mkdtemp(prefix="export-timing-"))

    def inputs(batch: int) -> tuple[torch.Tensor, ...]:
        return tuple(torch.randn(batch, f, device=device) for _ in range(3))

    b = torch.export.Dim("batch", min=1, max=4096)
    dynamic = {"x": {0: b}, "h": {0: b}, "c": {0: b}}
    example = inputs(max(2, batches[0]))
    ways: dict[str, Callable[..., Any]] = {"eager": model, "torch.compile": torch.compile(model, dynamic=True)}
    compile_s: dict[str, float] = {}
    for name, shims in (("aoti proxy", False), ("aoti C shims", True)):
        t = time.perf_counter()
        packaged = opforge.export.package(model, example, folder / f"{name.replace(' ', '_')}.pt2", dynamic_shapes=dynamic, shims=shims)
        compile_s[name] = time.perf_counter() - t
        ways[name] = opforge.export.load(packaged.path)
        print(f"{name}: {packaged.path} (shims: {', '.join(packaged.shims) or 'none'}) in {compile_s[name]:.0f} s", flush=True)

    results = []
    with torch.no_grad():
        for batch in batches:
            args_b = inputs(batch)
            want = model(*args_b)
            for name, fn in ways.items():
                try:
                    got = fn(*args_b)
                except RuntimeError as exc:  # a way that cannot run here is a row saying why, not the end of the table
                    why = str(exc).strip().splitlines()[0][:300]
                    results.append({"way": name, "batch": batch, "error": why})
                    print(f"batch {batch:5d}  {name:14s} failed: {why}", flush=True)
                    continue
                equal = all(torch.equal(w, g) for w, g in zip(want, got, strict=True))
                timing = measure(lambda fn=fn, a=args_b: fn(*a), device, args.reps, args.steps)
                results.append({"way": name, "batch": batch, "equal_to_eager": equal, **timing})
                print(f"batch {batch:5d}  {name:14s} per call {timing['per_call_ms']:.4f} ms  per step {timing['per_step_ms']:.4f} ms"
                      f"{'' if equal else '  (differs from eager)'}", flush=True)  # fmt: skip
    report = {
        "what": "LLTM step + gemm + W4A8 linear (examples/deploy/model.py), float32",
        "device": device_name(device),
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "features": f,
        "reps": args.reps,
        "steps": args.steps,
        "aoti_compile_s": compile_s,
        "results": results,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
