"""``opforge profile``: what one operator's kernels do on the GPU, read off the
hardware by Nsight Compute, and whether compute-sanitizer finds anything wrong
with them.

* Profiling runs ``ncu`` over a small runner (``python -m opforge.profile
  --run-case OP CASE DTYPE``) that warms the op up and brackets exactly one call
  with ``cudaProfilerStart``/``cudaProfilerStop``; ncu runs with
  ``--profile-from-start off``, so input creation, warm-up and PyTorch's own
  kernels around it are never captured, and with ``--clock-control none``, so the
  GPU runs at the clocks it runs at in ``opforge bench`` (ncu's default locks
  them to base clocks, which makes every duration look slower than it is).
* ``--sanitize`` runs ``opforge check OP --checks reference --reference-on cpu`` under each of
  compute-sanitizer's tools (memcheck, racecheck, initcheck, synccheck).

An operator is named as ``opforge check`` takes it: by name, by the package
directory of ``opforge new``'s it is in, or by a spec file (``FILE.py`` whose
``SPECS`` name operators already in torch.ops); the runner and the checks under
the sanitizer load that package or file first.

Both need a GPU and the NVIDIA tools; without them the command says what is
missing in one line and exits 2, so scripts can tell "cannot run here" from
"found a problem" (exit 1). The operators, dtype and spec file are resolved
first, so that a mistake in them is found on any machine.
"""

from __future__ import annotations

import argparse
import csv
import glob
import os
import random
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    import torch

    from opforge.spec import OpSpec, Sample

# Tables are wide: when output is piped (CI logs), rich would assume 80 columns.
_WIDTH = None if sys.stdout.isatty() else shutil.get_terminal_size((160, 24)).columns
out = Console(width=_WIDTH)
err = Console(stderr=True)

#: Exit status when the GPU or a tool is missing: "cannot run here", not "failed".
EXIT_MISSING = 2

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

SANITIZER_TOOLS: tuple[str, ...] = ("memcheck", "racecheck", "initcheck", "synccheck")
_SANITIZER_OPTIONS: dict[str, tuple[str, ...]] = {
    # PyTorch keeps allocations alive in its caching allocator until exit: every one would be a "leak".
    "memcheck": ("--leak-check", "no"),
}
#: compute-sanitizer's exit status when its tool reported an error.
SANITIZER_ERROR_EXIT = 9

# The runner's inputs: fixed, so two profiles of one case see the same data.
_RUN_SEED = 0
_WARMUP_CALLS = 3


# ---------------------------------------------------------------- tools


def _search_dirs(name: str) -> list[Path]:
    """Where NVIDIA installs ``name`` when it is not on PATH, best first."""
    dirs = [Path(os.environ[v]) / "bin" for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    dirs.append(Path("/usr/local/cuda/bin"))
    if name == "ncu":
        # Standalone Nsight Compute installs, one folder per version: newest first.
        versions = sorted(glob.glob("/opt/nvidia/nsight-compute/*/"), key=_version_key, reverse=True)
        dirs += [Path(v) for v in versions]
    if name == "compute-sanitizer":
        dirs.append(Path("/usr/local/cuda/compute-sanitizer"))
    return dirs


def _version_key(path: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", Path(path).name))


def find_tool(name: str) -> str | None:
    """The path of an NVIDIA command-line tool (``ncu``, ``compute-sanitizer``), or None."""
    found = shutil.which(name)
    if found:
        return found
    for d in _search_dirs(name):
        candidate = d / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def _missing(tool: str) -> tuple[str | None, list[str]]:
    """The tool's path, and what is missing for a GPU run (empty when nothing is)."""
    import torch

    missing = []
    if not torch.cuda.is_available():
        missing.append("a CUDA GPU (torch.cuda.is_available() is False)")
    path = find_tool(tool)
    if path is None:
        where = "/usr/local/cuda/bin or /opt/nvidia/nsight-compute/*/" if tool == "ncu" else "/usr/local/cuda/bin"
        missing.append(f"{tool} (not on PATH, nor in {where})")
    return path, missing


def _say_missing(what: str, missing: Sequence[str], project: Path | None = None) -> int:
    # On a machine without them, a spec file's operators can still be timed: say how.
    cpu = f"; on this machine, opforge bench {project} --device cpu times them" if project is not None and project.suffix == ".py" else ""
    err.print(f"opforge {what}: cannot run, missing: {'; '.join(missing)}{cpu}", soft_wrap=True, markup=False, highlight=False)
    return EXIT_MISSING


def _library_missing(project: Path | None = None) -> list[str]:
    """Loads the op library (building it on first use), or the package's of
    ``project`` (already loaded by the caller); what is missing for CUDA.
    A spec file's operators need a CUDA kernel each."""
    if project is not None and project.suffix == ".py":
        from opforge.derive import has_kernel_for
        from opforge.project import load_spec_file

        lacking = [s.qualname for s in load_spec_file(project) if not has_kernel_for(s.overload, "cuda")]
        return [f"a CUDA kernel for {', '.join(lacking)} (none registered by what {project.name} imports)"] if lacking else []
    if project is not None:
        from opforge.project import project_library

        lib = project_library(project)
        if lib is None or not lib.with_cuda:
            return [f"the CUDA kernels of {project}'s op library (no .cu kernel, no nvcc, or OPFORGE_BUILD_CUDA=0)"]
        return []
    import opforge

    if not opforge.load().with_cuda:
        return ["the op library's CUDA kernels (it was built without nvcc, or with OPFORGE_BUILD_CUDA=0)"]
    return []


def _child_env() -> dict[str, str]:
    """This process's environment, with this opforge importable by the child
    whether it is installed or run from a checkout."""
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parent.parent)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if src not in paths:
        env["PYTHONPATH"] = os.pathsep.join([src, *paths])
    return env


def _run(cmd: Sequence[str], env: dict[str, str], status: str) -> subprocess.CompletedProcess[str]:
    with err.status(status):
        return subprocess.run(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace", env=env)


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


# ---------------------------------------------------------------- cases


@dataclass(frozen=True)
class CaseInfo:
    """A benchmark case as the profiler picks it: its name and size."""

    desc: str
    numel: int


def _sample_numel(sample: Sample) -> int:
    import torch

    return sum(a.numel() for a in sample.args if isinstance(a, torch.Tensor))


def case_infos(samples: Iterable[Sample]) -> list[CaseInfo]:
    """Names and sizes of a spec's benchmark cases; the tensors are dropped as it goes."""
    return [CaseInfo(s.desc, _sample_numel(s)) for s in samples]


def select_case(cases: Sequence[CaseInfo], requested: str | None) -> CaseInfo:
    """The case named ``requested``, or the largest one (most elements) when None."""
    if not cases:
        raise ValueError("the operator has no benchmark cases")
    if requested is None:
        return max(cases, key=lambda c: c.numel)
    for c in cases:
        if c.desc == requested:
            return c
    raise ValueError(f"no case {requested!r}; available: {', '.join(c.desc for c in cases)}")


def parse_dtype(name: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------- ncu


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


def _report_path(op: str, case: str, dtype: str) -> Path:
    slug = re.sub(r"[^A-Za-z0-9]+", "_", f"{op}_{dtype}_{case}").strip("_")
    return Path.cwd() / f"opforge-profile-{slug}.ncu-rep"


def _resolve(spec_name: str) -> OpSpec:
    from opforge.spec import get_specs

    try:
        return get_specs([spec_name])[0]
    except KeyError as exc:
        raise ValueError(exc.args[0]) from None


def profile_op(spec_name: str, case: str | None, dtype: str, full: bool, *, project: Path | None = None) -> int:
    """Profiles one call of the op on one benchmark case under ncu and prints
    a table, one row per kernel. ``project``: the op is one of that package's
    (``opforge new``'s) or spec file's, already loaded. Returns the exit status
    (1: a wrong operator, dtype or case; 2: cannot run here)."""
    import torch

    from opforge.check import generator

    ncu, missing = _missing("ncu")
    try:
        spec = _resolve(spec_name)
        torch_dtype = parse_dtype(dtype)
        if torch_dtype not in spec.dtypes:
            raise ValueError(f"{spec.name} does not take {dtype}; it takes {', '.join(_dtype_name(d) for d in spec.dtypes)}")
    except ValueError as exc:
        err.print(f"opforge profile: {spec_name}: {exc}", soft_wrap=True, markup=False, highlight=False)
        return 1
    if missing:
        return _say_missing("profile", missing, project)
    missing = _library_missing(project)
    if missing:
        return _say_missing("profile", missing, project)
    try:
        device = torch.device("cuda")
        # Sizes depend on the device (the GPU's largest case is bigger), so list them there.
        chosen = select_case(case_infos(spec.bench_cases(device, torch_dtype, generator(device, _RUN_SEED))), case)
        torch.cuda.empty_cache()
    except ValueError as exc:
        err.print(f"opforge profile: {spec_name}: {exc}", soft_wrap=True, markup=False, highlight=False)
        return 1
    assert ncu is not None
    dname = _dtype_name(torch_dtype)
    report = _report_path(spec.name, chosen.desc, dname) if full else None
    cmd = ncu_command(ncu, spec.qualname if project else spec.name, chosen.desc, dname, export=report, project=project)
    env = _child_env()
    res = _run(cmd, env, f"ncu: profiling {spec.name} {dname} [{chosen.desc}]")
    text = res.stdout
    if report is not None and res.returncode == 0 and not parse_ncu_csv(text):
        # Should an ncu print nothing when it exports (2025.3 prints both), read the results back from the report.
        imported = _run(ncu_import_command(ncu, report), env, "ncu: reading the report")
        text += "\n" + imported.stdout
    kernels = parse_ncu_csv(text)
    if res.returncode != 0 or not kernels:
        why = f"ncu exited with status {res.returncode}" if res.returncode != 0 else "ncu profiled no kernel"
        err.print(f"opforge profile: {why}; its output ends:", soft_wrap=True, markup=False, highlight=False)
        err.print(_tail(res.stdout), markup=False, highlight=False, soft_wrap=True)
        err.print("command: " + subprocess.list2cmdline(cmd), soft_wrap=True, markup=False, highlight=False)
        return 1
    device_name = torch.cuda.get_device_name()
    out.print(kernel_table(kernels, f"opforge profile: {spec.qualname} {dname} [{chosen.desc}] on {device_name}"))
    out.print("one call, profiled by ncu at the GPU's own clocks (--clock-control none); % are of peak sustained throughput")
    if report is not None:
        out.print(f"full report: {report}", soft_wrap=True, highlight=False)
    return 0


# ---------------------------------------------------------------- compute-sanitizer


@dataclass
class SanitizerReport:
    errors: int  # -1: no "ERROR SUMMARY" line (the tool did not finish)
    kernels: list[str]
    kinds: list[str]  # distinct error headlines, "Invalid __global__ write of size 4 bytes"


_SUMMARY = re.compile(r"ERROR SUMMARY:\s*([\d,]+)\s+errors?")
_RACE_SUMMARY = re.compile(r"RACECHECK SUMMARY:.*?\(([\d,]+)\s+errors?")
_PREFIX = re.compile(r"^=+\s*")
_ADDRESS = re.compile(r"^0x[0-9a-fA-F]+$")
# "kernel(float *)+0x1b0" or "kernel(float *)+0x1b0 in /src/add.cu:41": the kernel, then its offset.
_AT_OFFSET = re.compile(r"^(.+?)\+0x[0-9a-fA-F]+(?: in .+)?$")
# "add.cu:41" or, in older versions, "add.cu:41:kernel(int*)".
_SOURCE = re.compile(r"^\S+\.(?:cu|cuh|h|hpp|cpp|cc|c|py):\d+(?::(.+))?$")
# racecheck names both sides of a race on one line or two.
_ACCESS = re.compile(r"\b(?:Write|Read) access at (.+?)(?= and (?:Write|Read) access|\s*\[[\d,]+ hazards?\]|$)")
_API_ACCESS = re.compile(r"\bon access by (cuda\w+|cu\w+)")
_HEADLINE = re.compile(
    r"^((?:Invalid|Uninitialized|Barrier error|Race reported|Error:|Program hit|Host API|Malloc/Free error|Out-of-range|Potential)\b.*)"
)


def _kernel_of(location: str) -> str | None:
    """The kernel in a sanitizer location ("0x1b0 in k(float *)", "k(float *)+0x1b0 in add.cu:41",
    "0x250 in add.cu:41:k(int*)"), or None where it names only an address or a source line."""
    loc = location.strip()
    if m := _AT_OFFSET.match(loc):
        return m.group(1).strip()
    for part in (p.strip() for p in loc.split(" in ")):
        if not part or _ADDRESS.match(part):
            continue
        if src := _SOURCE.match(part):
            if src.group(1):
                return src.group(1).strip()
            continue
        return part
    return None


def _kernels_named(line: str) -> list[str | None]:
    """The kernels (or host API calls) one line of an error record names."""
    if races := _ACCESS.findall(line):
        return [_kernel_of(loc) for loc in races]
    if line.startswith("at "):
        return [_kernel_of(line[3:])]
    if line.startswith("Device Frame:"):  # older versions' device backtraces
        return [line.removeprefix("Device Frame:").split(" (", 1)[0].strip()]
    if m := _API_ACCESS.search(line):
        return [f"({m.group(1)})"]  # a host API call (a copy) read the memory, not a kernel
    return []


def _parse_sanitizer(text: str) -> SanitizerReport:
    errors = -1
    kernels: list[str] = []
    kinds: list[str] = []
    for raw in text.splitlines():
        # Every line the sanitizer writes starts with "=========": the checked program's own output does not.
        if not raw.startswith("=="):
            continue
        line = _PREFIX.sub("", raw).strip()
        if m := _SUMMARY.search(line):
            errors = int(m.group(1).replace(",", ""))
            continue
        if (m := _RACE_SUMMARY.search(line)) and errors < 0:
            errors = int(m.group(1).replace(",", ""))
            continue
        for k in _kernels_named(line):
            if k and k not in kernels:
                kernels.append(k)
        if (h := _HEADLINE.match(line)) and h.group(1) not in kinds:
            kinds.append(h.group(1))
    return SanitizerReport(errors, kernels, kinds)


def parse_sanitizer_summary(text: str) -> tuple[int, list[str]]:
    """(errors, kernels) from compute-sanitizer's output: the count on its
    "ERROR SUMMARY: N errors" line (-1 if there is none: the tool did not finish)
    and the kernels its error records name, in order of first appearance."""
    rep = _parse_sanitizer(text)
    return rep.errors, rep.kernels


def sanitizer_command(sanitizer: str, tool: str, op: str | Sequence[str], seed: int, *, python: str = sys.executable) -> list[str]:
    """The compute-sanitizer command line that runs ``opforge check OP [OP ...]``
    on CUDA under ``tool``; an OP may be a package directory (``opforge check DIR``)."""
    ops = [op] if isinstance(op, str) else list(op)
    return [
        sanitizer,
        "--tool",
        tool,
        "--error-exitcode",
        str(SANITIZER_ERROR_EXIT),
        *_SANITIZER_OPTIONS.get(tool, ()),
        python,
        "-m",
        "opforge",
        "check",
        *ops,
        "--device",
        "cuda",
        "--checks",
        "reference",
        "--reference-on",
        "cpu",
        "--seed",
        str(seed),
    ]


def _sanitizer_env() -> dict[str, str]:
    env = _child_env()
    # Without PyTorch's caching allocator each tensor is its own cudaMalloc, so
    # memcheck sees the real bounds of every buffer and initcheck cannot take
    # memory written by an earlier tensor for initialised.
    env.setdefault("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")
    return env


def sanitize_op(spec_name: str | Sequence[str], seed: int | None, *, project: Path | None = None) -> int:
    """Runs the reference check of the op (or ops: one check over all of them)
    on CUDA under each compute-sanitizer tool and prints a tool -> errors table;
    with ``project``, the check of that package or spec file (all its operators).
    Returns the exit status (1 on any error or failed run, 2: cannot run here)."""
    sanitizer, missing = _missing("compute-sanitizer")
    names = [spec_name] if isinstance(spec_name, str) else list(spec_name)
    try:
        specs = [_resolve(n) for n in names]
    except ValueError as exc:
        err.print(f"opforge profile --sanitize: {exc}", soft_wrap=True, markup=False, highlight=False)
        return 1
    if missing:
        return _say_missing("profile --sanitize", missing, project)
    missing = _library_missing(project)
    if missing:
        return _say_missing("profile --sanitize", missing, project)
    assert sanitizer is not None
    seed = random.SystemRandom().randrange(2**31) if seed is None else seed
    targets = [str(project)] if project is not None else [s.name for s in specs]
    target = " ".join(targets)
    err.print(f"opforge profile --sanitize {target}, seed {seed} (rerun with --seed {seed})", highlight=False)
    env = _sanitizer_env()
    table = Table(title=f"compute-sanitizer: opforge check {target} --device cuda --checks reference --reference-on cpu --seed {seed}")
    for col in ("tool", "errors", "result", "kernels with errors"):
        table.add_column(col, justify="right" if col == "errors" else "left")
    failed = False
    notes: list[str] = []
    for tool in SANITIZER_TOOLS:
        cmd = sanitizer_command(sanitizer, tool, targets, seed)
        res = _run(cmd, env, f"compute-sanitizer --tool {tool}: opforge check {target}")
        rep = _parse_sanitizer(res.stdout)
        ok = rep.errors == 0 and res.returncode == 0
        failed |= not ok
        if ok:
            result = "[green]pass[/]"
        elif rep.errors > 0:
            result = "[bold red]FAIL[/]"
        elif rep.errors < 0:
            result = f"[bold red]FAIL[/] (no summary; exit {res.returncode})"
        else:
            result = f"[bold red]FAIL[/] (exit {res.returncode})"  # the check itself failed under the tool
        kernels = ", ".join(short_kernel_name(k, 60) for k in rep.kernels) or ("-" if rep.errors <= 0 else "(none named)")
        table.add_row(tool, "?" if rep.errors < 0 else f"{rep.errors:,}", result, kernels)
        if not ok:
            kinds = "; ".join(rep.kinds[:3]) or "see output"
            notes.append(f"{tool}: {kinds}")
            notes.append(f"  {subprocess.list2cmdline(cmd)}")
            if rep.errors <= 0:
                notes += ["  " + ln for ln in _tail(res.stdout, 15).splitlines()]
    out.print(table)
    for n in notes:
        out.print(n, markup=False, highlight=False, soft_wrap=True)
    out.print(f"{len(SANITIZER_TOOLS)} tools, {'some failed' if failed else 'all passed'}")
    return 1 if failed else 0


# ---------------------------------------------------------------- CLI


def _package_ops(target: str) -> tuple[Path | None, list[str]] | int:
    """``target`` as (package directory or spec file, or None; operators): a
    package of ``opforge new``'s is loaded (built on first use) and stands for
    its operators, a spec file (``FILE.py``) is run and stands for those its
    ``SPECS`` name. An int is the exit status of a failed load, already reported."""
    from opforge.build import BuildError
    from opforge.project import ProjectError, find_project, load_project, load_spec_file, names_a_path, not_a_project

    path = Path(target)
    try:
        if not names_a_path(target):  # an operator's name, even where a folder of that name is here
            return None, [target]
        if target.endswith(".py"):
            return path.resolve(), [s.qualname for s in load_spec_file(path)]
        if not path.is_dir():
            raise ProjectError(f"{target}: {'not a directory' if path.exists() else 'no such directory'}")
        if find_project(path) is None:
            raise ProjectError(not_a_project(target))
        return path.resolve(), [s.qualname for s in load_project(path)]
    except (ProjectError, BuildError) as exc:
        err.print(f"opforge profile: {exc}", soft_wrap=True, markup=False, highlight=False)
        return 1


def _cmd_profile(args: argparse.Namespace) -> int:
    targets: list[tuple[Path | None, list[str]]] = []
    for target in args.op:
        found = _package_ops(target)
        if isinstance(found, int):
            return found
        targets.append(found)
    status = 0
    if args.sanitize:
        # One sanitizer run per tool checks every operator named (`opforge check A B ...`), and
        # one per package (`opforge check DIR` checks all its operators).
        names = [op for project, ops in targets if project is None for op in ops]
        if names:
            status = sanitize_op(names if len(names) > 1 else names[0], args.seed, project=None)
        for project, ops in targets:
            if project is not None:
                status = max(status, sanitize_op(ops[0], args.seed, project=project))
        return status
    for project, ops in targets:
        for op in ops:
            status = max(status, profile_op(op, args.case, args.dtype, args.full, project=project))
    return status


def register_cli(subparsers: Any) -> None:
    """Adds ``opforge profile`` to the command's subparsers."""
    sp = subparsers.add_parser(
        "profile",
        help="profile one operator's kernels with Nsight Compute, or run compute-sanitizer over its checks (--sanitize)",
    )
    sp.add_argument(
        "op",
        nargs="+",
        help="operators, package directories of opforge new's given as paths (./my_op, my_op/: each of their operators), "
        "or spec files (my_specs.py: the operators its SPECS list)",
    )
    sp.add_argument("--case", default=None, help="benchmark case to profile, by name (e.g. 2^20; default: the largest)")
    sp.add_argument("--dtype", default="float32", help="dtype of the inputs (default float32)")
    sp.add_argument("--full", action="store_true", help="also save ncu's full report (.ncu-rep) in the current folder")
    sp.add_argument("--sanitize", action="store_true", help="run memcheck, racecheck, initcheck and synccheck over `opforge check`")
    sp.add_argument("--seed", type=int, default=None, help="--sanitize: seed of the check's inputs (default: fresh, printed)")
    sp.set_defaults(fn=_cmd_profile)


# ---------------------------------------------------------------- the runner ncu runs


def run_case(op: str, case: str, dtype: str, *, seed: int = _RUN_SEED, warmup: int = _WARMUP_CALLS, project: str | None = None) -> int:
    """Builds one benchmark case on CUDA and calls the op once between
    cudaProfilerStart and cudaProfilerStop, after ``warmup`` calls. ``project``:
    the package directory or spec file whose operator ``op`` is (loaded instead of opforge's library)."""
    import torch

    import opforge
    from opforge.check import generator

    if project is not None and project.endswith(".py"):
        from opforge.project import load_spec_file

        load_spec_file(project)
    elif project is not None:
        from opforge.project import load_project

        load_project(project)
    else:
        opforge.load()
    spec = _resolve(op)
    device = torch.device("cuda")
    sample = next((s for s in spec.bench_cases(device, parse_dtype(dtype), generator(device, seed)) if s.desc == case), None)
    if sample is None:
        print(f"opforge.profile: {op} has no case {case!r}", file=sys.stderr)
        return 1
    args, kwargs = sample.args, dict(sample.kwargs)
    # Warm-up: the first calls load modules and fill allocator caches.
    for _ in range(warmup):
        spec.function(*args, **kwargs)
    torch.cuda.synchronize()
    cudart = torch.cuda.cudart()
    cudart.cudaProfilerStart()
    spec.function(*args, **kwargs)
    torch.cuda.synchronize()
    cudart.cudaProfilerStop()
    return 0


def _main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m opforge.profile", description="The runner `opforge profile` runs under ncu.")
    p.add_argument("--run-case", nargs=3, metavar=("OP", "CASE", "DTYPE"), required=True)
    p.add_argument("--seed", type=int, default=_RUN_SEED)
    p.add_argument("--warmup", type=int, default=_WARMUP_CALLS)
    p.add_argument("--project", default=None, help="the package directory of opforge new's, or the spec file, whose operator OP is")
    a = p.parse_args(argv)
    op, case, dtype = a.run_case
    return run_case(op, case, dtype, seed=a.seed, warmup=a.warmup, project=a.project)


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
