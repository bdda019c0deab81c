"""What ``opforge bench`` measured: its rows and report, the machine they were
taken on, and the report written as JSON or CSV, read back and compared."""

from __future__ import annotations

import csv
import datetime
import json
import os
import subprocess
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from opforge import nvml
from opforge.bench.ceilings import Ceilings
from opforge.bench.machine import cpu_name
from opforge.bench.timing import Timing

# A time is an outlier against its case's cost model, and is timed again, when it
# takes more than OUTLIER_FACTOR times the case's roofline floor plus
# OUTLIER_SLACK_US (what the calls around a kernel cost: a small case is all
# call), or when its inter-quartile range passes OUTLIER_SPREAD of its median.
# On a loaded 2-core VM eager `a * b` at 2^16 elements took 8 ms, over 200x its
# floor there (its 786 KB at the machine's copy rate), at an IQR under 1 %: the
# scheduler's time slice, not the kernel, and a "166x vs eager" no one would
# believe. The committed H200 results stay well inside: eager of a fused op (two
# or three kernels for one) at 2.6x its floor, 2^12 cases (all call) at 8 us. A
# reference that does far more than the operator (qqq_gemm's dequantises the
# whole weight before its matmul: 355x) passes it, and is marked, as it should
# be: a ratio against it says little about the kernel.
OUTLIER_FACTOR = 50.0
OUTLIER_SLACK_US = 20.0
OUTLIER_SPREAD = 0.5


def outlier(t: Timing, floor_us: float | None) -> str | None:
    """Why ``t`` is an outlier against its case's cost model (``floor_us``: the
    roofline floor, None if unknown), in words; None if it is not."""
    if t.spread > OUTLIER_SPREAD:
        return f"its timings spread over {100 * t.spread:,.0f} % of their median (the inter-quartile range): other work moved them"
    if floor_us and t.median_us > OUTLIER_FACTOR * (floor_us + OUTLIER_SLACK_US):
        return (
            f"{t.median_us:,.0f} us is {t.median_us / floor_us:,.0f}x the {floor_us:,.3g} us its cost model needs at the machine's limits: "
            "it does far more than the cost model counts, or other work on the machine held up its calls"
        )
    return None


@dataclass
class BenchRow:
    op: str
    dtype: str
    case: str
    status: str  # "ok" or why it was not timed
    numel: int = 0
    bytes: int = 0
    flops: int = 0
    timings: dict[str, Timing | None] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)  # impl -> why it has no timing
    floor_us: float | None = None
    # impl -> why its time is an outlier against the case's cost model (``outlier``), timed twice:
    # every ratio built on it is marked with this.
    outliers: dict[str, str] = field(default_factory=dict)
    # impl -> why its % of limit is past what the machine's limits allow (``Roofline.beyond``):
    # that figure is marked with this.
    beyond_limit: dict[str, str] = field(default_factory=dict)

    def median(self, impl: str) -> float | None:
        t = self.timings.get(impl)
        return t.median_us if t else None

    def speedup(self, baseline: str) -> float | None:
        """How many times faster opforge is than ``baseline``."""
        ours, theirs = self.median("opforge"), self.median(baseline)
        return theirs / ours if ours and theirs else None

    def gbps(self, impl: str) -> float | None:
        m = self.median(impl)
        return self.bytes / (m * 1e3) if m else None

    def tflops(self, impl: str) -> float | None:
        m = self.median(impl)
        return self.flops / (m * 1e6) if m else None

    def pct_of_limit(self, impl: str) -> float | None:
        """Roofline floor over measured time: 100 % means at the machine's limit."""
        m = self.median(impl)
        return 100 * self.floor_us / m if m and self.floor_us else None


@dataclass
class BenchReport:
    device: str
    device_name: str
    driver: str | None
    torch_version: str
    cuda_version: str | None
    threads: int
    git_commit: str | None
    date: str
    graph: bool = False
    ceilings: dict[str, Any] | None = None
    rows: list[BenchRow] = field(default_factory=list)
    # Why the timings may not be the machine's (a busy CPU), said before them.
    warnings: list[str] = field(default_factory=list)
    # What the run changed that a reader should know: ceilings measured again and raised.
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        for row, out in zip(self.rows, d["rows"], strict=True):
            out["derived"] = {
                impl: {
                    "gbps": row.gbps(impl),
                    "tflops": row.tflops(impl),
                    "pct_of_limit": row.pct_of_limit(impl),
                    "speedup_of_opforge": row.speedup(impl) if impl != "opforge" else None,
                }
                for impl in row.timings
            }
        return d


def device_name(device: torch.device) -> str:
    """The GPU's or the CPU's model name: what a report and the ceilings' cache are named by."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_name()


def _driver_version(device: torch.device) -> str | None:
    if device.type != "cuda":
        return None
    found = nvml.query()
    return found[1] if found else None


def _git_commit() -> str | None:
    """The checkout's commit; OPFORGE_GIT_COMMIT where the tree is a copy without .git."""
    if os.environ.get("OPFORGE_GIT_COMMIT"):
        return os.environ["OPFORGE_GIT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, cwd=Path(__file__).parent, timeout=5)
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def busy_machine(load_1min: float, usable_cores: int, threads: int) -> str | None:
    """Why CPU timings taken now would measure waiting for the CPU, or None.

    torch running more threads than the process may use cores, or other work
    wanting the cores the bench's own threads need: the 1-minute load average
    above the usable cores less those threads, plus one for this process,
    which the load average counts while it probes. On a loaded 2-core machine
    every size then took ~8 ms per call, with an IQR under 1 %: a time slice,
    not the kernel."""
    if threads > usable_cores:
        return (
            f"torch runs {threads} threads on {usable_cores} usable cores: they take turns, so the CPU timings measure the "
            f"waiting (torch.set_num_threads({usable_cores}), or OMP_NUM_THREADS={usable_cores})"
        )
    if load_1min > usable_cores - threads + 1:
        return (
            f"the machine is busy: load average {load_1min:.1f} over the last minute on {usable_cores} usable cores, "
            f"and the bench runs {threads} threads of its own, so the CPU timings include waiting for a core; "
            "measure on an idle machine"
        )
    return None


def cpu_contention() -> str | None:
    """``busy_machine`` for this process now; None where the load average cannot be read."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return None
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return busy_machine(load, usable, torch.get_num_threads())


def new_report(device: torch.device, *, graph: bool = False, ceilings: Ceilings | None = None) -> BenchReport:
    busy = cpu_contention() if device.type == "cpu" else None
    return BenchReport(
        device=str(device),
        device_name=device_name(device),
        driver=_driver_version(device),
        torch_version=torch.__version__,
        cuda_version=torch.version.cuda,
        threads=torch.get_num_threads(),
        git_commit=_git_commit(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        graph=graph,
        ceilings=asdict(ceilings) if ceilings else None,
        warnings=[busy] if busy else [],
    )


CSV_FIELDS = ("op", "dtype", "case", "impl", "status", "numel", "bytes", "flops", "median_us", "p25_us", "p75_us", "reps", "stop",
              "gbps", "tflops", "pct_of_limit", "note", "doubt")  # fmt: skip


def write_json(report: BenchReport, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report.to_json(), indent=1) + "\n")


def write_csv(report: BenchReport, path: Path) -> None:
    """One line per (row, implementation); the header comment carries the machine."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as fh:
        fh.write(f"# {report.device_name}, driver {report.driver}, torch {report.torch_version}, CUDA {report.cuda_version}, "
                 f"commit {report.git_commit}, {report.date}, graph={report.graph}\n")  # fmt: skip
        w = csv.DictWriter(fh, fieldnames=CSV_FIELDS)
        w.writeheader()
        for r in report.rows:
            for impl in r.timings or {"-": None}:
                t = r.timings.get(impl)
                w.writerow({
                    "op": r.op, "dtype": r.dtype, "case": r.case, "impl": impl, "status": r.status, "numel": r.numel,
                    "bytes": r.bytes, "flops": r.flops, "median_us": t.median_us if t else "", "p25_us": t.p25_us if t else "",
                    "p75_us": t.p75_us if t else "", "reps": t.reps if t else "", "stop": t.stop if t else "",
                    "gbps": r.gbps(impl) or "", "tflops": r.tflops(impl) or "", "pct_of_limit": r.pct_of_limit(impl) or "",
                    "note": r.notes.get(impl, ""),
                    "doubt": "; ".join(d[impl] for d in (r.outliers, r.beyond_limit) if impl in d),
                })  # fmt: skip


def read_json(path: Path) -> BenchReport:
    d = json.loads(path.read_text())
    rows = []
    for r in d.pop("rows"):
        r.pop("derived", None)
        r["timings"] = {k: Timing(**t) if t else None for k, t in r.get("timings", {}).items()}
        rows.append(BenchRow(**r))
    return BenchReport(**d, rows=rows)


@dataclass
class Comparison:
    op: str
    dtype: str
    case: str
    impl: str
    old_us: float
    new_us: float
    verdict: str  # "regression", "faster" or "same"

    @property
    def ratio(self) -> float:
        """New time over old: above 1 is slower."""
        return self.new_us / self.old_us


def compare(old: BenchReport, new: BenchReport, impls: Sequence[str] = ("opforge",)) -> list[Comparison]:
    """Matches rows by (op, dtype, case). A change counts only beyond the
    measured spread: the two inter-quartile ranges must not overlap."""
    before = {(r.op, r.dtype, r.case): r for r in old.rows if r.status == "ok"}
    out = []
    for r in new.rows:
        o = before.get((r.op, r.dtype, r.case))
        if r.status != "ok" or o is None:
            continue
        for impl in impls:
            a, b = o.timings.get(impl), r.timings.get(impl)
            if not a or not b:
                continue
            if b.p25_us > a.p75_us:
                verdict = "regression"
            elif b.p75_us < a.p25_us:
                verdict = "faster"
            else:
                verdict = "same"
            out.append(Comparison(r.op, r.dtype, r.case, impl, a.median_us, b.median_us, verdict))
    return out


def compute_bound(rows: Sequence[BenchRow]) -> bool:
    """More than one FLOP per byte moved (a matmul): measured in TFLOP/s, not GB/s."""
    return bool(rows) and all(r.bytes > 0 and r.flops >= r.bytes for r in rows)
