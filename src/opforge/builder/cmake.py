"""The CMake route: a folder's own CMakeLists.txt configured and built into
the cache, with torch's CMake package found and the same compiler choice as
the JIT route (a compiler that links libstdc++ statically is replaced), and
``OPFORGE_CXXFLAGS`` as CMAKE_CXX_FLAGS (its -D, -U, -I as CMAKE_CUDA_FLAGS too)."""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from opforge.builder import toolchain
from opforge.builder.child import run_bounded
from opforge.builder.config import env_cxxflags
from opforge.builder.errors import BuildError
from opforge.builder.store import cache_root


def build_cmake(folder: Path, *, say: Callable[[str], None] = print) -> list[Path]:
    """Configures and builds ``folder``'s CMakeLists.txt; the shared libraries it
    made, none carrying its own libstdc++. ``say`` gets each step and each
    toolchain note. Raises BuildError with the tools' output on a failure."""
    if not (folder / "CMakeLists.txt").is_file():
        raise BuildError(f"opforge build: {folder} has no CMakeLists.txt (--route cmake)")
    if shutil.which("cmake") is None:
        raise BuildError("opforge build: cmake is not on PATH (apt-get install cmake, or pip install cmake)")
    build = cache_root() / f"cmake-{folder.name}-{hashlib.sha256(str(folder).encode()).hexdigest()[:16]}"
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
    ]
    for cmd in (configure, ["cmake", "--build", str(build), "-j", str(os.cpu_count() or 2)]):
        say(f"opforge build: {' '.join(cmd[:2])} ...")
        res = run_bounded(cmd, timeout=None, env=env)
        if res.returncode != 0:
            raise BuildError(res.stdout[-4000:] + res.stderr[-4000:])
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


__all__ = ["build_cmake"]
