"""Nsight Compute's side of ``opforge profile``: the ncu command line, the
parser of the CSV it prints (per kernel, its metrics in microseconds and
bytes whatever units ncu used) and the table of kernels."""

from __future__ import annotations

import csv
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rich.table import Table

# metric -> column heading. Raw metric names, not the labels of ncu's sections,
# so what is printed is exactly what was asked for whatever ncu's version.
METRICS: dict[str, str] = {
    "gpu__time_duration.sum": "duration",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "DRAM % of peak",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "SM % of peak",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "achieved occupancy %",
    "launch__registers_per_thread": "registers/thread",
    "launch__shared_mem_per_block_static": "static shared memory/block",
    "launch__shared_mem_per_block_dynamic": "dynamic shared memory/block",
    "launch__grid_size": "grid size",
    "launch__block_size": "block size",
}

# The labels ncu's own sections give these metrics: a report imported with
# section labels instead of metric names still parses.
_LABELS: dict[str, str] = {
    "Duration": "gpu__time_duration.sum",
    "DRAM Throughput": "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "Compute (SM) Throughput": "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "Achieved Occupancy": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "Registers Per Thread": "launch__registers_per_thread",
    "Static Shared Memory Per Block": "launch__shared_mem_per_block_static",
    "Dynamic Shared Memory Per Block": "launch__shared_mem_per_block_dynamic",
    "Grid Size": "launch__grid_size",
    "Block Size": "launch__block_size",
}


@dataclass(frozen=True)
class Metric:
    value: float
    unit: str


@dataclass
class KernelProfile:
    """One kernel launch as ncu measured it. Durations are in microseconds and
    sizes in bytes whatever units ncu printed."""

    id: int
    name: str
    metrics: dict[str, Metric] = field(default_factory=dict)
    grid: str = ""  # ncu's "Grid Size" column, "(65536, 1, 1)"; empty if absent
    block: str = ""

    def value(self, metric: str) -> float | None:
        m = self.metrics.get(metric)
        return m.value if m is not None else None

    @property
    def duration_us(self) -> float | None:
        return self.value("gpu__time_duration.sum")

    @property
    def dram_pct(self) -> float | None:
        return self.value("dram__throughput.avg.pct_of_peak_sustained_elapsed")

    @property
    def sm_pct(self) -> float | None:
        return self.value("sm__throughput.avg.pct_of_peak_sustained_elapsed")

    @property
    def occupancy_pct(self) -> float | None:
        return self.value("sm__warps_active.avg.pct_of_peak_sustained_active")

    @property
    def registers(self) -> float | None:
        return self.value("launch__registers_per_thread")

    @property
    def shared_bytes(self) -> float | None:
        """Static plus dynamic shared memory per block."""
        parts = [self.value("launch__shared_mem_per_block_static"), self.value("launch__shared_mem_per_block_dynamic")]
        known = [p for p in parts if p is not None]
        return sum(known) if known else None


# unit -> factor to microseconds; ncu 2025 prints "ns", older versions "nsecond".
_TIME_UNITS: dict[str, float] = {
    "nsecond": 1e-3,
    "ns": 1e-3,
    "usecond": 1.0,
    "us": 1.0,
    "µs": 1.0,
    "msecond": 1e3,
    "ms": 1e3,
    "second": 1e6,
    "s": 1e6,
}
# ncu scales bytes by powers of 1000 (Kbyte) unless it prints the binary prefixes (KiB).
_BYTE_UNITS: dict[str, float] = {
    "byte": 1.0,
    "Kbyte": 1e3,
    "Mbyte": 1e6,
    "Gbyte": 1e9,
    "KB": 1e3,
    "MB": 1e6,
    "GB": 1e9,
    "Kibyte": 1024.0,
    "Mibyte": 1024.0**2,
    "KiB": 1024.0,
    "MiB": 1024.0**2,
}


def normalise(value: float, unit: str) -> Metric:
    """Durations to microseconds, sizes to bytes (a ``/block`` or ``/thread`` suffix kept)."""
    unit = unit.strip()
    if unit in _TIME_UNITS:
        return Metric(value * _TIME_UNITS[unit], "us")
    base, sep, per = unit.partition("/")
    if base in _BYTE_UNITS:
        return Metric(value * _BYTE_UNITS[base], "byte" + sep + per)
    return Metric(value, unit)


def parse_number(text: str) -> float | None:
    """A metric value as ncu prints it ("1,234.5"), or None for "n/a", "" and the like."""
    try:
        return float(text.strip().replace(",", ""))
    except ValueError:
        return None


def _csv_rows(text: str) -> list[list[str]]:
    # ncu quotes every field; anything else on its stdout (==PROF== lines, the
    # profiled program's own output) is not part of the table.
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    return list(csv.reader(lines))


def parse_ncu_csv(text: str) -> list[KernelProfile]:
    """Kernel launches from ``ncu --csv`` output, in launch order.

    Reads both layouts: the details page (one row per metric: ``"ID",...,
    "Kernel Name",...,"Metric Name","Metric Unit","Metric Value"``) and the raw
    page (a header of metric names, a row of units, then one row per launch)."""
    kernels: dict[tuple[int, str], KernelProfile] = {}
    header: list[str] = []
    units: list[str] | None = None
    for row in _csv_rows(text):
        if row and row[0] == "ID":
            header, units = row, None
            continue
        if not header:
            continue
        rec = dict(zip(header, row, strict=False))
        if "Metric Name" not in header and units is None and not rec.get("ID", "").strip():
            units = row  # the raw page's second line: units under the metric names
            continue
        launch = int(parse_number(rec.get("ID", "")) or 0)
        name = rec.get("Kernel Name", "")
        k = kernels.setdefault((launch, name), KernelProfile(launch, name, grid=rec.get("Grid Size", ""), block=rec.get("Block Size", "")))
        if "Metric Name" in header:
            pairs = [(rec.get("Metric Name", ""), rec.get("Metric Unit", ""), rec.get("Metric Value", ""))]
        else:
            unit_of = dict(zip(header, units or [], strict=False))
            pairs = [(col, unit_of.get(col, ""), rec.get(col, "")) for col in header if col in METRICS or col in _LABELS]
        for metric, unit, raw in pairs:
            metric = _LABELS.get(metric, metric)
            value = parse_number(raw)
            if value is not None:
                k.metrics[metric] = normalise(value, unit)
    return list(kernels.values())


def ncu_command(
    ncu: str, op: str, case: str, dtype: str, *, export: Path | None = None, project: Path | None = None, python: str = sys.executable
) -> list[str]:
    """The ncu command line that profiles one call of ``op`` on one case
    (an operator of the package or spec file at ``project``, which the runner loads first)."""
    cmd = [
        ncu,
        "--clock-control",
        "none",  # never touch clocks: measure at the clocks the op really runs at
        "--profile-from-start",
        "off",  # only what the runner brackets with cudaProfilerStart/Stop
        "--csv",
        "--page",
        "details",
        "--print-units",
        "base",  # nanoseconds and bytes: no scaled units to undo
        "--metrics",
        ",".join(METRICS),
    ]
    if export is not None:
        cmd += ["--export", str(export), "--force-overwrite"]
    runner = [python, "-m", "opforge.profile", "--run-case", op, case, dtype]
    return [*cmd, *runner, *(("--project", str(project)) if project is not None else ())]


def ncu_import_command(ncu: str, report: Path) -> list[str]:
    """Prints a saved report as the CSV that ``parse_ncu_csv`` reads."""
    return [ncu, "--import", str(report), "--csv", "--page", "details", "--print-units", "base"]


def short_kernel_name(name: str, limit: int = 72) -> str:
    """``void binary_kernel<float, unnamed>::AddOp>(T1 *, const T1 *, const T1 *, long, T2)`` (as ncu
    prints it) or ``void opforge::cuda::binary_kernel<float, opforge::(anonymous namespace)::AddOp>(float *, ...)``
    -> ``binary_kernel<float, AddOp>``: no return type, arguments or namespaces."""
    s = name.strip()
    s = re.sub(r"^void\s+", "", s)
    if s.endswith(")"):
        depth = 0
        for i in range(len(s) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(s[i], 0)
            if depth == 0:
                if i > 0:  # keep a name that is all parentheses as it is
                    s = s[:i]
                break
    # "(anonymous namespace)::" as C++ spells it; ncu prints "<unnamed>::" or, in a template argument, "unnamed>::".
    s = re.sub(r"\(anonymous namespace\)::|<?unnamed>::", "", s)
    s = re.sub(r"\b[A-Za-z_]\w*::", "", s)
    s = re.sub(r"\s+", " ", s).strip()
    return s if len(s) <= limit else s[: limit - 1] + "…"


def _fmt(value: float | None, spec: str = ",.1f") -> str:
    return "-" if value is None else format(value, spec)


def _dims(text: str, fallback: float | None) -> str:
    """ "(65536, 1, 1)" -> "65,536"; "(32, 8, 1)" -> "32x8"."""
    nums = [int(n) for n in re.findall(r"\d+", text)] if text else []
    if not nums:
        return "-" if fallback is None else f"{int(fallback):,}"
    while len(nums) > 1 and nums[-1] == 1:
        nums.pop()
    return "x".join(f"{n:,}" for n in nums)


def kernel_table(kernels: Sequence[KernelProfile], title: str) -> Table:
    table = Table(title=title)
    for col, just in [
        ("kernel", "left"),
        ("duration us", "right"),
        ("DRAM % peak", "right"),
        ("SM % peak", "right"),
        ("occupancy %", "right"),
        ("regs/thread", "right"),
        ("smem B/block", "right"),
        ("grid x block", "right"),
    ]:
        # A kernel's name is what the reader searches for: folded onto more lines, never cut short.
        table.add_column(col, justify=just, overflow="fold" if col == "kernel" else "ellipsis")
    for k in kernels:
        table.add_row(
            short_kernel_name(k.name),
            _fmt(k.duration_us, ",.2f"),
            _fmt(k.dram_pct),
            _fmt(k.sm_pct),
            _fmt(k.occupancy_pct),
            _fmt(k.registers, ",.0f"),
            _fmt(k.shared_bytes, ",.0f"),
            f"{_dims(k.grid, k.value('launch__grid_size'))} x {_dims(k.block, k.value('launch__block_size'))}",
        )
    if len(kernels) > 1:
        total = sum(k.duration_us or 0.0 for k in kernels)
        table.add_row("[bold]total[/]", f"[bold]{total:,.2f}[/]", "", "", "", "", "", "")
    return table
