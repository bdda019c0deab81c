"""``opforge doctor``: one report of everything a build depends on.

The report is meant to be pasted into a bug report: interpreter, torch, nvcc,
the C++ compiler (including the static-libstdc++ trap), ninja, GPUs and target
archs, the build cache (entries, locks, permissions) and which op library would
be loaded. Each finding that can break or degrade a build is a ``Problem`` with
a fix.

It never builds or loads the op library: it must still run, and explain, when
the build is what fails (``opforge`` sets ``OPFORGE_NO_AUTOLOAD=1`` for it).
It also avoids initialising CUDA in its own process where it can (NVML), since
that is slow and not what a build does either.

The probes are in ``doctor_probes`` (interpreter, torch, toolchain, GPUs) and
``doctor_cache`` (build cache, op library); this module gathers their sections
into one report and renders it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from rich.console import Console
from rich.text import Text

import opforge
from opforge.builder.toolchain import STATIC_FIX as STATIC_FIX
from opforge.builder.toolchain import Problem
from opforge.builder.toolchain import Severity as Severity
from opforge.builder.toolchain import compare_cuda_versions as compare_cuda_versions
from opforge.builder.toolchain import parse_nvcc_version as parse_nvcc_version
from opforge.doctor.cache import CacheEntry as CacheEntry
from opforge.doctor.cache import CacheInfo, LibraryInfo, probe_cache, probe_library
from opforge.doctor.cache import LockFile as LockFile
from opforge.doctor.probes import (
    CompilerInfo,
    GpuSection,
    NinjaInfo,
    NvccInfo,
    PythonInfo,
    TorchInfo,
    probe_compiler,
    probe_gpus,
    probe_ninja,
    probe_nvcc,
    probe_python,
    probe_torch,
)
from opforge.nvml import GpuInfo as GpuInfo

#: Section titles, in the order they are rendered.
SECTIONS = ("Python", "torch", "nvcc", "C++ compiler", "ninja", "GPUs", "Cache", "Op library", "Problems")

_BUG_FIX = "report this as an opforge bug, with this output"


@dataclass
class DoctorReport:
    opforge_version: str
    python: PythonInfo
    torch: TorchInfo
    nvcc: NvccInfo
    compiler: CompilerInfo
    ninja: NinjaInfo
    gpu: GpuSection
    cache: CacheInfo
    library: LibraryInfo
    problems: list[Problem] = field(default_factory=list)

    @property
    def errors(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == "error"]


# --------------------------------------------------------------------- helpers

T = TypeVar("T")


def _guarded(problems: list[Problem], section: str, probe: Callable[[list[Problem]], T], fallback: Callable[[], T]) -> T:
    try:
        return probe(problems)
    except Exception as exc:  # noqa: BLE001 - a doctor reports a broken probe; crashing would hide the rest of the report
        problems.append(Problem("warning", f"the {section} probe failed: {type(exc).__name__}: {exc}", _BUG_FIX))
        return fallback()


def _fmt_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"  # unreachable; keeps type checkers content


# ----------------------------------------------------------------- public API


def collect() -> DoctorReport:
    """Probes everything; a failing probe becomes a problem, never an exception."""
    problems: list[Problem] = []
    gpu = _guarded(problems, "GPU", probe_gpus, GpuSection)
    cache = _guarded(problems, "cache", probe_cache, CacheInfo)
    return DoctorReport(
        opforge_version=getattr(opforge, "__version__", "?"),
        python=_guarded(problems, "Python", probe_python, PythonInfo),
        torch=_guarded(problems, "torch", probe_torch, TorchInfo),
        nvcc=_guarded(problems, "nvcc", lambda p: probe_nvcc(p, gpu.build_cuda), NvccInfo),
        compiler=_guarded(problems, "C++ compiler", probe_compiler, CompilerInfo),
        ninja=_guarded(problems, "ninja", probe_ninja, NinjaInfo),
        gpu=gpu,
        cache=cache,
        library=_guarded(problems, "op library", lambda p: probe_library(p, cache), LibraryInfo),
        # Blocking problems first: they are what to fix first.
        problems=sorted(problems, key=lambda p: p.severity != "error"),
    )


def to_json(report: DoctorReport) -> dict:
    """The report as plain JSON data (every field, problems included)."""
    return dataclasses.asdict(report)


def _yn(v: bool | None) -> str:
    return "unknown" if v is None else ("yes" if v else "no")


def _rows(report: DoctorReport) -> dict[str, list[tuple[str, str]]]:
    r = report
    py, tc, nv, cx, nj, gp, ca, lib = r.python, r.torch, r.nvcc, r.compiler, r.ninja, r.gpu, r.cache, r.library
    nvcc_match = "n/a" if nv.matches_torch is None else _yn(nv.matches_torch)
    gpus = [
        (f"GPU {g.index}", f"{g.name}, compute capability {g.capability}" + (f", {g.memory_gib} GiB" if g.memory_gib else ""))
        for g in gp.gpus
    ]
    cache_rows = [
        ("path", ca.path),
        ("size", _fmt_bytes(ca.size_bytes)),
        ("permissions", f"{ca.mode or '?'}, owner uid {ca.owner_uid}" + (" (you)" if ca.owner_uid == os.geteuid() else "")),
    ]
    cache_rows += [("entry", f"{e.name}: {e.state}, {_fmt_bytes(e.size_bytes)}" + (f"; {e.note}" if e.note else "")) for e in ca.entries]
    # One explanation for all free locks instead of one per lock.
    cache_rows += [("lock", f"{lk.name}: {lk.note if lk.held is not False else 'free'}") for lk in ca.locks]
    if any(lk.held is False for lk in ca.locks):
        cache_rows.append(("locks", "a free lock file is harmless: a kernel flock dies with its holder, so it cannot go stale"))
    if not ca.entries:
        cache_rows.append(("entries", "none"))
    return {
        "Python": [
            ("version", f"{py.version} ({py.implementation})"),
            ("executable", py.executable + (" (virtualenv)" if py.virtualenv else "")),
            ("platform", py.platform),
            ("opforge", r.opforge_version),
        ],
        "torch": [
            ("version", tc.version),
            ("build", tc.build + (f" (CUDA {tc.cuda})" if tc.cuda else "")),
            ("C++11 ABI", f"_GLIBCXX_USE_CXX11_ABI={int(tc.cxx11_abi)}" if tc.cxx11_abi is not None else "unknown"),
            ("path", tc.path),
        ],
        "nvcc": [
            ("CUDA home", nv.cuda_home or "not found"),
            ("nvcc (builds)", nv.path or "not found"),
            ("nvcc on PATH", nv.on_path or "not found"),
            ("version", nv.version or "-"),
            ("matches torch", nvcc_match if tc.cuda else "n/a (torch is a CPU build)"),
        ],
        "C++ compiler": [
            ("compiler", f"{cx.cxx} -> {cx.path or 'not found'}"),
            ("version", cx.version or "-"),
            ("libstdc++", cx.libstdcxx + (f" ({cx.note})" if cx.note else "")),
            *([("builds with", f"{cx.builds_with} (links libstdc++ dynamically)")] if cx.builds_with else []),
            ("env", ", ".join(f"{k}={v}" for k, v in cx.env.items() if v is not None) or "CXX, CC, CUDAHOSTCXX not set"),
        ],
        "ninja": [("ninja", f"{nj.path} ({nj.source})" if nj.path else "not found"), ("version", nj.version or "-")],
        "GPUs": [
            *(gpus or [("GPUs", "none found")]),
            ("found via", gp.source),
            ("driver", f"{gp.driver_version} (CUDA {gp.driver_cuda})" if gp.driver_version else "-"),
            *([("CUDA_VISIBLE_DEVICES", gp.cuda_visible_devices)] if gp.cuda_visible_devices is not None else []),
            ("target archs", f"{', '.join(gp.archs)} (from {gp.archs_source})"),
            ("CUDA kernels", f"{_yn(gp.build_cuda)} ({gp.build_cuda_reason})"),
        ],
        "Cache": cache_rows,
        "Op library": [
            ("route", lib.route),
            ("prebuilt", lib.prebuilt or "-"),
            ("entry", lib.entry or "-"),
            ("state", lib.state + (f": {lib.note}" if lib.note else "")),
            ("CUDA kernels", _yn(lib.with_cuda)),
            ("loaded", lib.loaded_path or "not loaded in this process"),
        ],
    }


def render(report: DoctorReport, console: Console) -> None:
    """The report as text, one block per section, problems last with their fixes."""
    # Plain aligned lines rather than tables: no trailing padding and no hard
    # wraps (soft_wrap), so the text pastes cleanly into a bug report.
    for title, rows in _rows(report).items():
        console.print(Text(title, style="bold cyan"))
        width = max(len(k) for k, _ in rows)
        for k, v in rows:
            # Text, not markup: paths and compiler output may contain [brackets].
            console.print(Text.assemble("  ", (k.ljust(width), "dim"), "  ", str(v)), soft_wrap=True)
        console.print()
    console.print(Text("Problems", style="bold cyan"))
    if not report.problems:
        console.print(Text("  none: everything a build needs is in place", style="green"), soft_wrap=True)
    for p in report.problems:
        style = "bold red" if p.severity == "error" else "yellow"
        console.print(Text.assemble("  ", (p.severity, style), ": ", p.message), soft_wrap=True)
        console.print(Text.assemble("    ", ("fix: ", "bold"), p.fix), soft_wrap=True)
    n_err, n_warn = len(report.errors), len(report.problems) - len(report.errors)
    console.print(f"\n{n_err} error(s), {n_warn} warning(s)", highlight=False)


def run(as_json: bool) -> int:
    """Prints the report (JSON on stdout with ``as_json``); 1 if anything blocks a build."""
    report = collect()
    if as_json:
        sys.stdout.write(json.dumps(to_json(report), indent=2) + "\n")
        sys.stdout.flush()
    else:
        # Piped into a file or bug report, rich would wrap at 80 columns.
        width = None if sys.stdout.isatty() else shutil.get_terminal_size((160, 24)).columns
        render(report, Console(width=width))
    return 1 if report.errors else 0
