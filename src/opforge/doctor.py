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
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import json
import os
import platform
import re
import shutil
import stat
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TypeVar

import torch
from rich.console import Console
from rich.text import Text

from opforge.build import BuildError, build_cuda_flag, cache_root, cuda_archs, cuda_home, library_config, toolchain, want_cuda
from opforge.build import cache as build_cache
from opforge.build.store import CacheDirError
from opforge.build.toolchain import STATIC_FIX, Problem, compare_cuda_versions, parse_nvcc_version
from opforge.build.toolchain import first_line as _first_line
from opforge.build.toolchain import run as _run
from opforge.nvml import GpuInfo
from opforge.nvml import query as _nvml_gpus

Severity = Literal["error", "warning"]

#: Section titles, in the order they are rendered.
SECTIONS = ("Python", "torch", "nvcc", "C++ compiler", "ninja", "GPUs", "Cache", "Op library", "Problems")

_BUG_FIX = "report this as an opforge bug, with this output"


@dataclass
class PythonInfo:
    version: str = ""
    implementation: str = ""
    executable: str = ""
    platform: str = ""
    virtualenv: bool = False


@dataclass
class TorchInfo:
    version: str = ""
    build: str = ""  # "CPU" or "CUDA"
    cuda: str | None = None
    cxx11_abi: bool | None = None
    path: str = ""


@dataclass
class NvccInfo:
    cuda_home: str | None = None
    path: str | None = None  # cuda_home()/bin/nvcc: the one builds use
    on_path: str | None = None  # shutil.which("nvcc"): the one a user runs by hand
    version: str | None = None
    matches_torch: bool | None = None  # None: nothing to compare (no nvcc or a CPU torch)


@dataclass
class CompilerInfo:
    cxx: str = ""  # $CXX or "c++", as torch resolves it
    path: str | None = None
    version: str | None = None
    libstdcxx: str = "unknown"  # "shared", "static", "libc++", "none", "skipped", "unknown" (opforge.build.toolchain.Verdict)
    builds_with: str | None = None  # the compiler builds fall back to when this one links libstdc++ statically
    note: str = ""
    env: dict[str, str | None] = field(default_factory=dict)


@dataclass
class NinjaInfo:
    path: str | None = None
    version: str | None = None
    source: str | None = None  # "PATH" or "pip package"


@dataclass
class GpuSection:
    gpus: list[GpuInfo] = field(default_factory=list)
    source: str = "none"  # "NVML", "torch.cuda" or "none"
    driver_version: str | None = None
    driver_cuda: str | None = None  # newest CUDA the driver supports
    cuda_visible_devices: str | None = None
    archs: list[str] = field(default_factory=list)
    archs_source: str = ""
    build_cuda: bool | None = None
    build_cuda_env: str | None = None
    build_cuda_reason: str = ""


@dataclass
class CacheEntry:
    name: str
    state: str  # "complete", "objects", "building" or "incomplete"
    size_bytes: int
    note: str = ""


@dataclass
class LockFile:
    name: str
    held: bool | None  # None: could not be tested
    holder: str | None = None
    note: str = ""


@dataclass
class CacheInfo:
    path: str = ""
    exists: bool = False
    size_bytes: int = 0
    mode: str | None = None
    owner_uid: int | None = None
    entries: list[CacheEntry] = field(default_factory=list)
    locks: list[LockFile] = field(default_factory=list)


@dataclass
class LibraryInfo:
    route: str = "JIT"  # "prebuilt" (opforge._C from pip install), "JIT" (built into the cache) or "OPFORGE_LIBRARY"
    prebuilt: str = ""  # why the prebuilt library is, or is not, the one loaded
    key: str | None = None
    entry: str | None = None
    entry_path: str | None = None
    state: str = "unknown"  # "built", "building", "incomplete", "corrupt", "not built", "unknown"
    with_cuda: bool | None = None
    loaded_path: str | None = None
    note: str = ""


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


def _version_tuple(v: str) -> tuple[int, int] | None:
    m = re.match(r"^\s*(\d+)\.(\d+)", v)
    return (int(m[1]), int(m[2])) if m else None


def _fmt_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"  # unreachable; keeps type checkers content


def _tree_size(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            # A file removed while we walk it is a build cleaning up.
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, f)).st_size
    return total


# ---------------------------------------------------------------------- probes


def _python(problems: list[Problem]) -> PythonInfo:
    return PythonInfo(
        version=platform.python_version(),
        implementation=platform.python_implementation(),
        executable=sys.executable,
        platform=platform.platform(),
        virtualenv=sys.prefix != sys.base_prefix,
    )


def _torch(problems: list[Problem]) -> TorchInfo:
    abi = getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", None)
    return TorchInfo(
        version=torch.__version__,
        build="CUDA" if torch.version.cuda else "CPU",
        cuda=torch.version.cuda,
        cxx11_abi=bool(abi) if abi is not None else None,
        path=str(Path(torch.__file__).parent),
    )


def _nvcc(problems: list[Problem], building_cuda: bool | None) -> NvccInfo:
    home = cuda_home()
    info = NvccInfo(cuda_home=str(home) if home else None, on_path=shutil.which("nvcc"))
    nvcc = home / "bin" / "nvcc" if home else None
    if nvcc is not None and nvcc.exists():
        info.path = str(nvcc)
        res = _run([str(nvcc), "--version"])
        info.version = parse_nvcc_version(res.stdout) if res else None
        if info.version is None:
            problems.append(
                Problem("warning", f"could not read the version of {nvcc} (`nvcc --version`)", "check the CUDA toolkit install")
            )
    if torch.version.cuda is None:
        return info
    if info.path is None:
        where = f"CUDA_HOME={os.environ['CUDA_HOME']}" if os.environ.get("CUDA_HOME") else "not on PATH, no CUDA_HOME"
        if building_cuda:
            problems.append(
                Problem(
                    "error",
                    f"CUDA kernels are asked for (OPFORGE_BUILD_CUDA=1) but nvcc was not found ({where})",
                    f"install the CUDA {torch.version.cuda} toolkit and set CUDA_HOME to it, or unset OPFORGE_BUILD_CUDA",
                )
            )
        else:
            problems.append(
                Problem(
                    "warning",
                    f"torch has CUDA {torch.version.cuda} but nvcc was not found ({where}): the op library is built without CUDA kernels",
                    f"install the CUDA {torch.version.cuda} toolkit and set CUDA_HOME to it",
                )
            )
        return info
    if info.version is not None:
        problem = compare_cuda_versions(info.version, torch.version.cuda, building_cuda=bool(building_cuda))
        info.matches_torch = problem is None
        if problem is not None:
            problems.append(problem)
    if info.on_path and Path(info.on_path).resolve() != Path(info.path).resolve():
        res = _run([info.on_path, "--version"])
        other = parse_nvcc_version(res.stdout) if res else None
        if other and other != info.version:
            problems.append(
                Problem(
                    "warning",
                    f"the nvcc on PATH ({info.on_path}, {other}) is not the one builds use ({info.path}, {info.version})",
                    "make CUDA_HOME and PATH agree, so what you test by hand is what builds",
                )
            )
    return info


def _compiler(problems: list[Problem]) -> CompilerInfo:
    cxx = os.environ.get("CXX", "c++")
    info = CompilerInfo(cxx=cxx, env={v: os.environ.get(v) for v in ("CXX", "CC", "CUDAHOSTCXX")})
    info.path = shutil.which(cxx)
    if info.path is None:
        problems.append(
            Problem(
                "error",
                f"no C++ compiler: '{cxx}' is not found" + (" (from CXX)" if "CXX" in os.environ else " (CXX is not set)"),
                "install g++ (e.g. `apt-get install g++`) or set CXX to a C++ compiler: export CXX=g++ CC=gcc CUDAHOSTCXX=g++",
            )
        )
        info.libstdcxx, info.note = "skipped", "no compiler to probe"
        return info
    # Probed now, never from the cache: the doctor writes nothing, and a bug report wants what is true today.
    v = toolchain.verdict(cxx, cache=False)
    info.version, info.libstdcxx, info.note = v.version, v.libstdcxx, v.note
    if info.libstdcxx == "skipped":
        return info
    if info.libstdcxx == "unknown":
        problems.append(
            Problem(
                "error",
                f"the C++ compiler '{cxx}' could not build a tiny shared library (`{cxx} -shared -fPIC`): {info.note}",
                "fix or reinstall the compiler, or use another: export CXX=g++ CC=gcc CUDAHOSTCXX=g++",
            )
        )
    elif info.libstdcxx == "static":
        who = f"'{cxx}'" + (f" ({info.path})" if info.path != cxx else "")
        try:
            info.builds_with = toolchain.choose(cxx, cache=False).use
        except BuildError:
            info.builds_with = None
        if info.builds_with is not None:
            problems.append(
                Problem(
                    "warning",
                    f"the C++ compiler {who} links libstdc++ statically into shared libraries, which breaks torch's "
                    f"exceptions; builds use {info.builds_with} instead, which links it dynamically",
                    STATIC_FIX,
                )
            )
        else:
            problems.append(
                Problem(
                    "error",
                    f"the C++ compiler {who} links libstdc++ statically into shared libraries; torch loads the shared "
                    "libstdc++, and two copies in one process crash on the op library's first error message "
                    f"(the build refuses it, and found no compiler to use instead among {', '.join(toolchain.fallbacks()) or 'none'})",
                    STATIC_FIX,
                )
            )
    elif info.libstdcxx == "none":
        problems.append(
            Problem(
                "warning",
                f"'{cxx}' does not link libstdc++ into a C++ shared library: is it a C compiler (gcc rather than g++)?",
                "export CXX=g++ CC=gcc CUDAHOSTCXX=g++",
            )
        )
    elif info.libstdcxx == "libc++":
        problems.append(
            Problem(
                "warning",
                f"the C++ compiler '{cxx}' links libc++ while torch uses libstdc++: the op library may fail to load or link",
                "use GCC or clang with libstdc++: export CXX=g++ CC=gcc CUDAHOSTCXX=g++",
            )
        )
    return info


def _ninja(problems: list[Problem]) -> NinjaInfo:
    info = NinjaInfo()
    found = shutil.which("ninja")
    if found:
        info.path, info.source = found, "PATH"
    else:
        # The build puts the PyPI package's ninja on PATH itself (jit._check_toolchain).
        try:
            import ninja

            candidate = Path(ninja.BIN_DIR) / "ninja"
            if candidate.exists():
                info.path, info.source = str(candidate), "pip package"
        except ImportError:
            pass
    if info.path is None:
        problems.append(Problem("error", "ninja is not installed (torch builds extensions with it)", "pip install ninja"))
        return info
    res = _run([info.path, "--version"])
    info.version = _first_line(res.stdout) if res and res.returncode == 0 else None
    return info


def _gpus(problems: list[Problem]) -> GpuSection:
    sec = GpuSection(cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"), build_cuda_env=os.environ.get("OPFORGE_BUILD_CUDA"))
    nvml = _nvml_gpus()
    if nvml is not None:
        sec.gpus, sec.driver_version, sec.driver_cuda = nvml
        sec.source = "NVML"
    elif torch.version.cuda is not None and torch.cuda.device_count() > 0:
        # Last resort: this initialises CUDA in the doctor's process, harmless for a one-shot command.
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            sec.gpus.append(GpuInfo(i, props.name, f"{props.major}.{props.minor}", round(props.total_memory / 2**30, 1)))
        sec.source = "torch.cuda"

    try:
        flag = build_cuda_flag()
    except BuildError:
        problems.append(
            Problem(
                "error",
                f"OPFORGE_BUILD_CUDA={sec.build_cuda_env!r} is neither on nor off",
                "set it to 1 or 0 (or true/false, yes/no, on/off), or unset it",
            )
        )
        flag = None
    else:
        try:
            sec.build_cuda = want_cuda()
        except BuildError as exc:
            problems.append(
                Problem("error", str(exc).removeprefix("opforge: "), "unset OPFORGE_BUILD_CUDA, or install a CUDA build of torch")
            )
    if flag is not None:
        sec.build_cuda_reason = f"OPFORGE_BUILD_CUDA={(sec.build_cuda_env or '').strip()}"
    elif torch.version.cuda is None:
        sec.build_cuda_reason = "torch is a CPU build"
    else:
        sec.build_cuda_reason = "torch has CUDA and nvcc was found" if sec.build_cuda else "torch has CUDA but nvcc was not found"

    if os.environ.get("TORCH_CUDA_ARCH_LIST", "").replace(";", " ").split():
        sec.archs_source = "TORCH_CUDA_ARCH_LIST"
    elif sec.gpus:
        sec.archs_source = f"the GPUs found ({sec.source})"
    else:
        sec.archs_source = "default: no GPU found"
    sec.archs = list(cuda_archs())

    if sec.gpus and torch.version.cuda is None:
        problems.append(
            Problem(
                "warning",
                f"{len(sec.gpus)} GPU(s) found but torch {torch.__version__} is a CPU build: everything runs on the CPU",
                "install a CUDA build of torch (see https://pytorch.org/get-started/locally/)",
            )
        )
    if sec.build_cuda:
        for g in sec.gpus:
            # "9.0a" (arch-specific features) is built for, and runs on, a 9.0 GPU.
            if g.capability not in {a.removesuffix("a") for a in sec.archs}:
                problems.append(
                    Problem(
                        "warning",
                        f"GPU {g.index} ({g.name}, compute capability {g.capability}) is not among the target archs {sec.archs}",
                        f"add {g.capability} to TORCH_CUDA_ARCH_LIST, or unset it to target the GPUs found",
                    )
                )
    if torch.version.cuda and sec.driver_cuda:
        drv, tv = _version_tuple(sec.driver_cuda), _version_tuple(torch.version.cuda)
        if drv and tv and drv < tv:
            problems.append(
                Problem(
                    "warning",
                    f"the NVIDIA driver {sec.driver_version} supports CUDA up to {sec.driver_cuda}, "
                    f"but torch was built with {torch.version.cuda}",
                    f"update the NVIDIA driver, or install a torch built for CUDA {sec.driver_cuda} or older",
                )
            )
    return sec


def _lock_state(path: Path) -> LockFile:
    lock = LockFile(name=path.name, held=None)
    try:
        # flock works on a read-only descriptor, so testing never needs (or
        # changes) write access to someone's lock file.
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        lock.note = f"cannot open it to test: {exc.strerror}"
        return lock
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.held = True
            text = os.pread(fd, 200, 0).decode(errors="replace").strip()
            lock.holder = text or None
            lock.note = f"held: a build is in progress ({text or 'holder unknown'}{_pid_note(text)})"
            return lock
        fcntl.flock(fd, fcntl.LOCK_UN)
        lock.held = False
        lock.note = "free: harmless (a kernel flock dies with its holder, so it cannot go stale)"
        return lock
    finally:
        os.close(fd)


def _pid_note(holder: str) -> str:
    m = re.fullmatch(r"pid (\d+)", holder)
    if not m:
        return ""
    try:
        os.kill(int(m[1]), 0)
    except ProcessLookupError:
        return ", not a process here: another container or machine sharing the cache"
    except PermissionError:
        return ", another user's process"
    return ""


def _cache(problems: list[Problem]) -> CacheInfo:
    env = os.environ.get("OPFORGE_CACHE_DIR")
    info = CacheInfo(path=env or str(Path.home() / ".cache" / "opforge"))
    try:
        # The call a build makes (creates the directory, mode 0700, if missing);
        # whether it can be written is said below, with its owner and mode.
        root = cache_root(write=False)
    except CacheDirError as exc:
        problems.append(Problem("error", exc.problem, exc.fix))
        return info
    info.path, info.exists = str(root), root.is_dir()
    st = root.stat()
    info.mode, info.owner_uid = f"{stat.S_IMODE(st.st_mode):04o}", st.st_uid
    if st.st_uid != os.geteuid():
        problems.append(
            Problem(
                "error",
                f"the cache directory {root} belongs to uid {st.st_uid}, not you (uid {os.geteuid()}): "
                "its owner controls the libraries this process loads",
                f"use a cache of your own: export OPFORGE_CACHE_DIR=~/.cache/opforge (or chown {os.geteuid()} {root} && chmod 700 {root})",
            )
        )
    elif st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        # An error, not a warning: `import opforge` refuses to load from it (check_safe_to_load).
        problems.append(
            Problem(
                "error",
                f"the cache directory {root} is writable by {'others' if st.st_mode & stat.S_IWOTH else 'its group'} "
                f"(mode {info.mode}): they could replace the libraries this process loads, so opforge refuses to load them",
                f"chmod 700 {root}",
            )
        )
    if not os.access(root, os.W_OK | os.X_OK):
        problems.append(
            Problem("error", f"the cache directory {root} is not writable by you", f"chmod 700 {root}, or set OPFORGE_CACHE_DIR")
        )

    locks = {p.name: _lock_state(p) for p in sorted(root.glob("*.lock")) if p.is_file()}
    info.locks = list(locks.values())
    for e in build_cache.entries(root):
        entry = CacheEntry(name=e.path.name, state="complete", size_bytes=e.size)
        lock = locks.get(f"{e.path.name}.lock")
        if lock is not None and lock.held:
            # Builds lock the object directory they compile in.
            entry.state, entry.note = "building", f"being built now ({lock.holder or 'holder unknown'})"
        elif e.objects:
            entry.state, entry.note = "objects", "object files kept for incremental rebuilds"
        elif not e.complete:
            entry.state = "incomplete"
            entry.note = "debris of a failed or killed build; the next build of it wipes it"
        if entry.state != "complete" and (e.path / "build.log").is_file():
            entry.note += f"; the failure is in {e.path / 'build.log'}"
        info.entries.append(entry)
    info.size_bytes = _tree_size(root)
    return info


def _library(problems: list[Problem], cache: CacheInfo) -> LibraryInfo:
    info = LibraryInfo()
    mod = sys.modules.get("opforge")
    loaded = getattr(mod, "library", None)
    if loaded is not None:
        info.loaded_path = str(loaded.path)
    from opforge.build.prebuilt import choose_prebuilt, library_file

    try:
        so, info.prebuilt = choose_prebuilt()
        named = library_file()
    except BuildError as exc:
        problems.append(
            Problem("error", str(exc).removeprefix("opforge: "), "set OPFORGE_LIBRARY to auto, prebuilt, jit or the path of an op library")
        )
        so, info.prebuilt, named = None, str(exc), None
    if named is not None:
        info.route, info.entry, info.entry_path = "OPFORGE_LIBRARY", named.name, str(named)
        info.state = "built" if named.is_file() else "missing"
        if not named.is_file():
            problems.append(
                Problem("error", f"OPFORGE_LIBRARY={named} names no file", "build it (cmake --build build), or unset OPFORGE_LIBRARY")
            )
        if info.loaded_path and Path(info.loaded_path) != named:
            info.note = "the loaded library is not the one a new process would load: the environment changed since"
        return info
    if so is not None:
        info.route, info.state, info.entry, info.entry_path = "prebuilt", "built", so.name, str(so)
        info.with_cuda = "CUDA kernels" in info.prebuilt
        if info.loaded_path and Path(info.loaded_path) != so:
            info.note = "the loaded library is not the one a new process would load: the sources or environment changed since"
        return info
    try:
        cfg = library_config()
        key = cfg.key()
    except BuildError as exc:
        # want_cuda()'s refusal is already reported by the GPU section.
        if "OPFORGE_BUILD_CUDA" not in str(exc):
            problems.append(Problem("error", str(exc).removeprefix("opforge: "), "reinstall opforge, or fix the source tree"))
        info.note = "cannot say which library would be loaded"
        return info
    info.key, info.with_cuda = key, cfg.with_cuda
    info.entry = f"{cfg.name}-{key[:16]}"
    entry = Path(cache.path) / info.entry
    info.entry_path = str(entry)
    state = {e.name: e for e in cache.entries}.get(info.entry)
    if state is None:
        info.state, info.note = "not built", "the next `import opforge` (or `opforge build`) builds it"
    elif state.state == "complete":
        from opforge.build.jit import _is_complete, module_name

        # The checksum is what load_library checks too: a library changed after
        # its build is rebuilt, not loaded.
        if _is_complete(entry, entry / f"{module_name(cfg)}.so"):
            info.state = "built"
        else:
            info.state, info.note = "corrupt", "its library does not match its checksum; the next build replaces it"
    else:
        info.state, info.note = state.state, state.note
    if info.loaded_path and Path(info.loaded_path).parent != entry:
        info.note = "the loaded library is not the one a new process would load: the sources or environment changed since"
    return info


# ----------------------------------------------------------------- public API


def collect() -> DoctorReport:
    """Probes everything; a failing probe becomes a problem, never an exception."""
    import opforge

    problems: list[Problem] = []
    gpu = _guarded(problems, "GPU", _gpus, GpuSection)
    cache = _guarded(problems, "cache", _cache, CacheInfo)
    return DoctorReport(
        opforge_version=getattr(opforge, "__version__", "?"),
        python=_guarded(problems, "Python", _python, PythonInfo),
        torch=_guarded(problems, "torch", _torch, TorchInfo),
        nvcc=_guarded(problems, "nvcc", lambda p: _nvcc(p, gpu.build_cuda), NvccInfo),
        compiler=_guarded(problems, "C++ compiler", _compiler, CompilerInfo),
        ninja=_guarded(problems, "ninja", _ninja, NinjaInfo),
        gpu=gpu,
        cache=cache,
        library=_guarded(problems, "op library", lambda p: _library(p, cache), LibraryInfo),
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


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    """Adds ``opforge doctor [--json]`` to the CLI's subcommands."""
    sp = subparsers.add_parser("doctor", help="check the toolchain, GPUs and build cache; print a report for bug reports")
    sp.add_argument("--json", action="store_true", help="print the report as JSON")
    sp.set_defaults(fn=lambda args: run(args.json))


if __name__ == "__main__":
    # `python -m opforge.doctor [--json]`: works even where the opforge command is not installed.
    parser = argparse.ArgumentParser(prog="python -m opforge.doctor")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    sys.exit(run(parser.parse_args().json))
