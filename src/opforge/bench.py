"""``opforge bench``: time each operator against its PyTorch reference, on the
same inputs, after checking that it is right.

* It verifies first: every sample of the op against the float64 reference, and
  each benchmark case's own output. A wrong kernel is refused, never timed.
* GPU: CUDA events around each call, the L2 cache flushed before each timed
  call (a buffer twice the L2 size is zeroed), warm-up first, the median kept.
* CPU: ``time.perf_counter`` around each call, warm-up first, the median kept.
* Achieved GB/s and TFLOP/s come from the op's cost model (bytes it must move,
  FLOPs it must do), never from what a particular kernel happens to do.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from opforge.check import check_reference, generator, run_reference
from opforge.spec import OpSpec

BENCH_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)


@dataclass
class Timing:
    """Per-call times in microseconds."""

    median_us: float
    p25_us: float
    p75_us: float
    reps: int

    @classmethod
    def of(cls, samples_us: Sequence[float]) -> Timing:
        q = statistics.quantiles(samples_us, n=4) if len(samples_us) >= 2 else [samples_us[0]] * 3
        return cls(statistics.median(samples_us), q[0], q[2], len(samples_us))


def time_cuda(fn: Callable[[], Any], *, budget_s: float, min_reps: int = 10, max_reps: int = 10_000) -> Timing:
    device = torch.cuda.current_device()
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    flush = torch.empty(max(2 * l2, 1 << 20), dtype=torch.uint8, device="cuda")
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(times) < max_reps and (len(times) < min_reps or time.perf_counter() < deadline):
        batch = []
        for _ in range(10):
            flush.zero_()  # evict the inputs: time the op from DRAM, as in a model
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            batch.append((start, end))
        torch.cuda.synchronize()
        times += [s.elapsed_time(e) * 1e3 for s, e in batch]
    return Timing.of(times)


def time_cpu(fn: Callable[[], Any], *, budget_s: float, min_reps: int = 5, max_reps: int = 10_000) -> Timing:
    for _ in range(2):
        fn()
    times: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(times) < max_reps and (len(times) < min_reps or time.perf_counter() < deadline):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return Timing.of(times)


@dataclass
class BenchRow:
    op: str
    dtype: str
    case: str
    status: str  # "ok" or why it was not timed
    numel: int = 0
    bytes: int = 0
    flops: int = 0
    opforge: Timing | None = None
    torch: Timing | None = None

    @property
    def speedup(self) -> float | None:
        if self.opforge and self.torch:
            return self.torch.median_us / self.opforge.median_us
        return None

    def gbps(self, t: Timing | None) -> float | None:
        return self.bytes / (t.median_us * 1e3) if t else None


@dataclass
class BenchReport:
    device: str
    device_name: str
    torch_version: str
    cuda_version: str | None
    threads: int
    git_commit: str | None
    date: str
    rows: list[BenchRow] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        for row, out in zip(self.rows, d["rows"], strict=True):
            out["speedup"] = row.speedup
            out["opforge_gbps"] = row.gbps(row.opforge)
            out["torch_gbps"] = row.gbps(row.torch)
        return d


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit() -> str | None:
    """The checkout's commit; OPFORGE_GIT_COMMIT where the tree is a copy without .git."""
    if os.environ.get("OPFORGE_GIT_COMMIT"):
        return os.environ["OPFORGE_GIT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, cwd=Path(__file__).parent, timeout=5)
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def new_report(device: torch.device) -> BenchReport:
    return BenchReport(
        device=str(device),
        device_name=_device_name(device),
        torch_version=torch.__version__,
        cuda_version=torch.version.cuda,
        threads=torch.get_num_threads(),
        git_commit=_git_commit(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )


def bench_op(
    spec: OpSpec,
    device: torch.device,
    *,
    seed: int,
    dtypes: Sequence[torch.dtype] = BENCH_DTYPES,
    budget_s: float = 0.3,
    progress: Callable[[str], None] = lambda _: None,
) -> list[BenchRow]:
    """Rows for every (dtype, case) of the op: timed if right, refused if not."""
    progress(f"{spec.name}: verifying")
    verdict = check_reference(spec, device, seed)
    if not verdict.ok:
        first = verdict.failures[0]
        return [BenchRow(spec.name, "-", "-", f"refused: fails its reference check ({first})")]
    timer = time_cuda if device.type == "cuda" else time_cpu
    rows = []
    gen = generator(device, seed + 1)
    for dtype in (d for d in dtypes if d in spec.dtypes):
        dname = str(dtype).removeprefix("torch.")
        for sample in spec.bench_cases(device, dtype, gen):
            progress(f"{spec.name} {dname} {sample.desc}")
            problem = run_reference(spec, sample, dtype)
            if problem:
                rows.append(BenchRow(spec.name, dname, sample.desc, f"refused: wrong at this size ({problem})"))
                continue
            args, kwargs = sample.args, dict(sample.kwargs)
            cost = spec.cost(*args, **kwargs)
            rows.append(
                BenchRow(
                    spec.name,
                    dname,
                    sample.desc,
                    "ok",
                    numel=args[0].numel(),
                    bytes=cost.bytes,
                    flops=cost.flops,
                    opforge=timer(functools.partial(spec.function, *args, **kwargs), budget_s=budget_s),
                    torch=timer(functools.partial(spec.reference, *args, **kwargs), budget_s=budget_s),
                )
            )
    return rows


def write_json(report: BenchReport, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report.to_json(), indent=1) + "\n")
