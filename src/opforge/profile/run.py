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

import glob
import os
import random
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from rich.table import Table

import opforge

# The parsers and command lines live in their own modules; `X as X` names the
# ones this module re-exports without using them, for `from opforge.profile.run import ...`.
from opforge.console import err, out
from opforge.derive import has_kernel_for
from opforge.profile.ncu import METRICS as METRICS
from opforge.profile.ncu import kernel_table, ncu_command, ncu_import_command, parse_ncu_csv, short_kernel_name
from opforge.profile.sanitizer import SANITIZER_TOOLS, parse_sanitizer, sanitizer_command
from opforge.profile.sanitizer import parse_sanitizer_summary as parse_sanitizer_summary
from opforge.project import load_project, load_spec_file, project_library
from opforge.registry import get_specs

if TYPE_CHECKING:
    from opforge.opspec import OpSpec, Sample


#: Exit status when the GPU or a tool is missing: "cannot run here", not "failed".
EXIT_MISSING = 2
#: Exit status of a usage error (an operator, dtype or case that is not there), as argparse's own.
EXIT_USAGE = 2

# The runner's inputs: fixed, so two profiles of one case see the same data.
RUN_SEED = 0
WARMUP_CALLS = 3


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
        lacking = [s.qualname for s in load_spec_file(project) if not has_kernel_for(s.overload, "cuda")]
        return [f"a CUDA kernel for {', '.join(lacking)} (none registered by what {project.name} imports)"] if lacking else []
    if project is not None:
        lib = project_library(project)
        if lib is None or not lib.with_cuda:
            return [f"the CUDA kernels of {project}'s op library (no .cu kernel, no nvcc, or OPFORGE_BUILD_CUDA=0)"]
        return []
    if not opforge.load().with_cuda:
        return ["the op library's CUDA kernels (it was built without nvcc, or with OPFORGE_BUILD_CUDA=0)"]
    return []


def _cannot_run(what: str, missing: list[str], project: Path | None) -> int | None:
    """The exit status when a tool (``missing``) or the operators' CUDA kernels
    are missing here, said in one message; None when the run can go ahead."""
    if not missing:
        missing = _library_missing(project)
    return _say_missing(what, missing, project) if missing else None


def _child_env() -> dict[str, str]:
    """This process's environment, with this opforge importable by the child
    whether it is installed or run from a checkout."""
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[2])  # src/ (or site-packages): above the opforge package
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
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------- ncu


def _report_path(op: str, case: str, dtype: str) -> Path:
    slug = re.sub(r"[^A-Za-z0-9]+", "_", f"{op}_{dtype}_{case}").strip("_")
    return Path.cwd() / f"opforge-profile-{slug}.ncu-rep"


def _resolve(spec_name: str, project: Path | None = None) -> OpSpec:
    """The spec of ``spec_name``: a package's or spec file's (``project``, loaded
    by the caller), else one of opforge's library, which this loads first."""
    if project is None:
        opforge.load()
    try:
        return get_specs([spec_name])[0]
    except KeyError as exc:
        raise ValueError(exc.args[0]) from None


def profile_op(spec_name: str, case: str | None, dtype: str, full: bool, *, project: Path | None = None) -> int:
    """Profiles one call of the op on one benchmark case under ncu and prints
    a table, one row per kernel. ``project``: the op is one of that package's
    (``opforge new``'s) or spec file's, already loaded. Returns the exit status
    (2: a wrong operator, dtype or case, or cannot run here)."""
    # lazy: import time (opforge.check, 20 ms; the opforge command loads this module)
    from opforge.check.run import generator

    ncu, missing = _missing("ncu")
    try:
        spec = _resolve(spec_name, project)
        torch_dtype = parse_dtype(dtype)
        if torch_dtype not in spec.dtypes:
            raise ValueError(f"{spec.name} does not take {dtype}; it takes {', '.join(_dtype_name(d) for d in spec.dtypes)}")
    except ValueError as exc:
        err.print(f"opforge profile: {spec_name}: {exc}", soft_wrap=True, markup=False, highlight=False)
        return EXIT_USAGE
    if (status := _cannot_run("profile", missing, project)) is not None:
        return status
    try:
        device = torch.device("cuda")
        # Sizes depend on the device (the GPU's largest case is bigger), so list them there.
        chosen = select_case(case_infos(spec.bench_cases(device, torch_dtype, generator(device, RUN_SEED))), case)
        torch.cuda.empty_cache()
    except ValueError as exc:
        err.print(f"opforge profile: {spec_name}: {exc}", soft_wrap=True, markup=False, highlight=False)
        return EXIT_USAGE
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


def _sanitizer_env() -> dict[str, str]:
    env = _child_env()
    # Without PyTorch's caching allocator each tensor is its own cudaMalloc, so
    # memcheck sees the real bounds of every buffer and initcheck cannot take
    # memory written by an earlier tensor for initialised.
    env.setdefault("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")
    # The checks in the process the sanitizer starts, not in a child of it (opforge.check.process).
    env["OPFORGE_CHECK_IN_PROCESS"] = "1"
    return env


def sanitize_op(spec_name: str | Sequence[str], seed: int | None, *, project: Path | None = None) -> int:
    """Runs the reference check of the op (or ops: one check over all of them)
    on CUDA under each compute-sanitizer tool and prints a tool -> errors table;
    with ``project``, the check of that package or spec file (all its operators).
    Returns the exit status (1 on any error or failed run, 2: an unknown operator, or cannot run here)."""
    sanitizer, missing = _missing("compute-sanitizer")
    names = [spec_name] if isinstance(spec_name, str) else list(spec_name)
    try:
        specs = [_resolve(n, project) for n in names]
    except ValueError as exc:
        err.print(f"opforge profile --sanitize: {exc}", soft_wrap=True, markup=False, highlight=False)
        return EXIT_USAGE
    if (status := _cannot_run("profile --sanitize", missing, project)) is not None:
        return status
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
        rep = parse_sanitizer(res.stdout)
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


# ---------------------------------------------------------------- the runner ncu runs


def run_case(op: str, case: str, dtype: str, *, seed: int = RUN_SEED, warmup: int = WARMUP_CALLS, project: str | None = None) -> int:
    """Builds one benchmark case on CUDA and calls the op once between
    cudaProfilerStart and cudaProfilerStop, after ``warmup`` calls. ``project``:
    the package directory or spec file whose operator ``op`` is (loaded instead of opforge's library)."""
    # lazy: import time (opforge.check, 20 ms; the opforge command loads this module)
    from opforge.check.run import generator

    if project is not None and project.endswith(".py"):
        load_spec_file(project)
    elif project is not None:
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
