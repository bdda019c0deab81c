"""The CMake route: a folder's own CMakeLists.txt configured and built into
the cache, with torch's CMake package found and the same compiler choice as
the JIT route (a compiler that links libstdc++ statically is replaced),
``OPFORGE_CXXFLAGS`` as CMAKE_CXX_FLAGS (its -D, -U, -I as CMAKE_CUDA_FLAGS too),
the project's own cache definitions (``opforge build DIR -D NAME=VALUE``, as
``cmake -D`` takes them) and ``MAX_JOBS`` parallel jobs, as torch's builds run."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from opforge.builder import toolchain
from opforge.builder.child import run_bounded
from opforge.builder.config import env_cxxflags
from opforge.builder.errors import BuildError
from opforge.builder.many import jobs
from opforge.builder.store import cache_root

# NAME or NAME:TYPE, as `cmake -D NAME[:TYPE]=VALUE` takes it; the types are CMake's cache entry types.
_DEFINITION = re.compile(r"(?P<name>[A-Za-z_][A-Za-z0-9_.+\-]*)(?::(?P<type>BOOL|FILEPATH|PATH|STRING|INTERNAL))?", re.I)
# option(NAME "help" [ON|OFF]) in a CMakeLists.txt: what -D can set, said when a build fails.
_OPTION = re.compile(r"(?i:\boption)\s*\(\s*([A-Za-z_][\w.+\-]*)\s+\"([^\"]*)\"\s*([^)\s]*)\s*\)")


def parse_definition(text: str) -> str:
    """``NAME=VALUE`` (or ``NAME:TYPE=VALUE``) as given to ``-D``, checked; raises
    ValueError naming what is wrong with it. The value may be empty or hold
    anything (a path, a list with ``;``), as cmake takes it."""
    name, eq, _ = text.partition("=")
    if not eq:
        raise ValueError(f"expected NAME=VALUE (a CMake cache definition, as cmake -D takes it), got {text!r}: no '='")
    if not _DEFINITION.fullmatch(name):
        raise ValueError(
            f"expected NAME=VALUE or NAME:TYPE=VALUE (TYPE one of BOOL, FILEPATH, PATH, STRING, INTERNAL), got {text!r}: "
            f"{name!r} is not a CMake variable name"
        )
    return text


def definitions(given: Sequence[str]) -> list[str]:
    """``given`` as cmake gets them: each name once, the last value given for it (as
    cmake keeps the last -D of a name), in the order of the names' first mention."""
    by_name: dict[str, str] = {}
    for d in given:
        by_name[d.partition("=")[0].partition(":")[0]] = d
    return list(by_name.values())


def build_dir(folder: Path, defines: Sequence[str] = ()) -> Path:
    """The cache folder ``folder`` is configured and built in: one per folder and
    set of definitions, so that another set is another build (CMake keeps every
    -D in its cache: a definition dropped from the command line would stay)."""
    key = "\0".join([str(folder), *sorted(definitions(defines))])
    return cache_root() / f"cmake-{folder.name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def options(cmakelists: Path) -> list[str]:
    """The ``option()``s a CMakeLists.txt declares, each as ``NAME (default ON: help)``."""
    try:
        text = cmakelists.read_text(errors="replace")
    except OSError:
        return []
    return [f"{m[1]} (default {m[3] or 'OFF'}{': ' + m[2] if m[2] else ''})" for m in _OPTION.finditer(text)]


def build_cmake(folder: Path, *, defines: Sequence[str] = (), say: Callable[[str], None] = print) -> list[Path]:
    """Configures and builds ``folder``'s CMakeLists.txt with the cache
    definitions ``defines`` (``NAME=VALUE``, as ``cmake -D`` takes them), in
    ``jobs()`` parallel jobs (``MAX_JOBS``, else the cores); the shared libraries
    it made, none carrying its own libstdc++. ``say`` gets each step and each
    toolchain note. Raises BuildError with the tools' output on a failure, and
    the project's options that ``-D`` can set."""
    if not (folder / "CMakeLists.txt").is_file():
        raise BuildError(f"opforge build: {folder} has no CMakeLists.txt (--route cmake)")
    if shutil.which("cmake") is None:
        raise BuildError("opforge build: cmake is not on PATH (apt-get install cmake, or pip install cmake)")
    defines = definitions(defines)
    build = build_dir(folder, defines)
    # CUDA sources may live outside the folder (add_library over ../csrc): a CUDA torch means nvcc may run.
    tc = toolchain.resolve(with_cuda=torch.version.cuda is not None)
    compilers = []
    # The environment too: CMake's CUDA detection reads CUDAHOSTCXX and adds
    # that compiler's library folders to every link (a libstdc++.a found there
    # first is linked in, whatever compiler links).
    env = dict(os.environ)
    for note in tc.notes():
        say(note)
    if tc.cxx.fell_back:
        compilers.append(f"-DCMAKE_CXX_COMPILER={tc.cxx.use}")
        env["CXX"] = tc.cxx.use
        cc = Path(tc.cxx.use).with_name(Path(tc.cxx.use).name.replace("g++", "gcc"))
        if env.get("CC") and cc.is_file():
            env["CC"] = str(cc)
    if tc.cuda_host is not None and tc.cuda_host.fell_back:
        compilers.append(f"-DCMAKE_CUDA_HOST_COMPILER={tc.cuda_host.use}")
        env["CUDAHOSTCXX"] = tc.cuda_host.use
    configure = [
        *("cmake", "-S", str(folder), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release"),
        f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
        # The interpreter whose torch that is: left to FindPython, an activated
        # virtualenv or PATH can name another one (seen in CI run from a second venv).
        f"-DPython_EXECUTABLE={sys.executable}",
        f"-DPython3_EXECUTABLE={sys.executable}",
        *compilers,
    ]
    # Given at every configure, as CMake would take them from CXXFLAGS and CUDAFLAGS at the first one
    # only: a flag dropped from OPFORGE_CXXFLAGS must not stay in the build folder's cache.
    host, both = env_cxxflags()
    configure += [
        f"-DCMAKE_CXX_FLAGS={' '.join([*os.environ.get('CXXFLAGS', '').split(), *host])}",
        f"-DCMAKE_CUDA_FLAGS={' '.join([*os.environ.get('CUDAFLAGS', '').split(), *both])}",
        # Last: cmake keeps the last -D of a name, so the user's own win over opforge's.
        *(f"-D{d}" for d in defines),
    ]
    given = "".join(f" -D {d}" for d in defines)
    # As many jobs as torch's own builds run (MAX_JOBS, else the cores), as opforge's other builds do.
    make = ["cmake", "--build", str(build), "--parallel", str(jobs())]
    for cmd, shown in ((configure, f"cmake -S ...{given}"), (make, "cmake --build ...")):
        say(f"opforge build: {shown}")
        res = run_bounded(cmd, timeout=None, env=env)
        if res.returncode != 0:
            raise BuildError((res.stdout[-4000:] + res.stderr[-4000:]).rstrip() + _failed(folder, cmd is configure, defines))
    libs = sorted(p for p in build.glob("*.so") if p.is_file())
    for so in libs:
        if toolchain.links_libstdcxx_statically(so):
            # Loading it would abort the process at the first C++ exception.
            raise BuildError(
                f"opforge build: {so.name} carries its own copy of libstdc++ (linked statically): torch's exceptions would "
                f"abort the process. Its link command is in {build}; look for -static-libstdc++ or a -L folder holding "
                "only libstdc++.a, and build with a compiler that links libstdc++ dynamically (CXX=g++ CUDAHOSTCXX=g++)"
            )
    if not libs:
        raise BuildError(f"opforge build: cmake built no shared library in {build}")
    return libs


def _failed(folder: Path, configuring: bool, defines: Sequence[str]) -> str:
    """The line after a failed configure or build: which step of whose CMakeLists.txt, the
    definitions given, and the project's options that ``-D`` sets (a default that needs
    what this machine lacks, ENABLE_CUDA ON on a CPU machine, is a common cause)."""
    step = "configuring" if configuring else "building"
    given = f" with {', '.join(f'-D {d}' for d in defines)}" if defines else ""
    line = f"\nopforge build: {step} {folder / 'CMakeLists.txt'}{given} failed (cmake's output above)"
    if found := options(folder / "CMakeLists.txt"):
        line += f"; its options: {', '.join(found)}; set one with `opforge build {folder} -D NAME=VALUE`"
    return line


__all__ = ["build_cmake", "build_dir", "definitions", "options", "parse_definition"]
