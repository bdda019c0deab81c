"""Building op libraries: sources -> shared library -> ``torch.ops``.

``library_config`` describes opforge's own op library (every folder under
``csrc/ops``); ``load_library`` builds it through the JIT route when the cache
has no good copy and loads it.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch

from opforge.build.discover import walk
from opforge.build.errors import BuildError, Diagnostic, parse_diagnostics
from opforge.build.jit import BuildConfig, Library, build_library, cache_root, check_safe_to_load, load_library, load_module

__all__ = [
    "BuildConfig",
    "BuildError",
    "Diagnostic",
    "Library",
    "build_cuda_flag",
    "build_library",
    "cache_root",
    "check_safe_to_load",
    "csrc_dir",
    "cuda_archs",
    "cuda_home",
    "folder_config",
    "gencode_flags",
    "library_config",
    "load_library",
    "load_module",
    "op_sources",
    "parse_diagnostics",
    "want_cuda",
]


def csrc_dir() -> Path:
    """The C++/CUDA sources: shipped inside the wheel as ``opforge/_csrc``, or
    the repository's ``csrc/`` in a source checkout and an editable install."""
    here = Path(__file__).resolve().parent.parent
    for candidate in (here / "_csrc", here.parent.parent / "csrc"):
        if (candidate / "ops").is_dir():
            return candidate
    raise BuildError(f"opforge: the C++ sources are missing (looked in {here / '_csrc'} and {here.parent.parent / 'csrc'})")


_YES = ("1", "true", "yes", "on")
_NO = ("0", "false", "no", "off")


def build_cuda_flag() -> bool | None:
    """``OPFORGE_BUILD_CUDA``, the one place it is read: True or False when set
    (1/0, true/false, yes/no, on/off, in any case), None when unset or empty.
    Any other value is a BuildError: a typo must not quietly mean "off"."""
    raw = os.environ.get("OPFORGE_BUILD_CUDA", "")
    value = raw.strip().lower()
    if not value:
        return None
    if value in _YES or value in _NO:
        return value in _YES
    raise BuildError(
        f"opforge: OPFORGE_BUILD_CUDA={raw!r} is neither on nor off: set it to 1 or 0 (or true/false, yes/no, on/off), "
        "or unset it for the default (CUDA kernels when torch has CUDA and nvcc is found)"
    )


def want_cuda() -> bool:
    """CUDA kernels are built when torch has CUDA and nvcc is found;
    ``OPFORGE_BUILD_CUDA`` (``build_cuda_flag``) overrides, and on fails clearly if it cannot."""
    flag = build_cuda_flag()
    if flag is False:
        return False
    if flag:
        if torch.version.cuda is None:
            value = os.environ["OPFORGE_BUILD_CUDA"].strip()
            raise BuildError(f"opforge: OPFORGE_BUILD_CUDA={value} but this torch build has no CUDA (torch.version.cuda is None)")
        return True
    if torch.version.cuda is None:
        return False
    home = cuda_home()
    return home is not None and (home / "bin" / "nvcc").exists()


def cuda_home() -> Path | None:
    """Where the CUDA toolkit is, found as torch.utils.cpp_extension finds it
    (CUDA_HOME, CUDA_PATH, nvcc on PATH, /usr/local/cuda) without importing
    that module: it pulls in setuptools, about 0.5 s of every import."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            return Path(os.environ[var])
    nvcc = shutil.which("nvcc")
    if nvcc:
        return Path(nvcc).resolve().parent.parent
    default = Path("/usr/local/cuda")
    return default if default.exists() else None


def cuda_archs() -> tuple[str, ...]:
    """Target compute capabilities: ``TORCH_CUDA_ARCH_LIST`` if set, else the
    visible GPUs', else sm_80 and sm_90a (a CUDA build on a machine without GPUs).

    A 9.0 target is always built as 9.0a: Hopper's warpgroup MMA (``wgmma``)
    and ``setmaxnreg``, which the GEMM kernels use, exist only in sm_90a code,
    and an sm_90a cubin runs on every 9.0 GPU. Sorted oldest first, by number.
    """
    env = os.environ.get("TORCH_CUDA_ARCH_LIST", "").replace(";", " ").split()
    if env:
        return _normalise_archs(a.removesuffix("+PTX") for a in env)
    caps = _nvml_capabilities()
    if caps is None and torch.cuda.is_available():
        caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
    if caps:
        return _normalise_archs(f"{ma}.{mi}" for ma, mi in caps)
    return ("8.0", "9.0a")


def _arch_number(arch: str) -> tuple[int, int]:
    """(major, minor) of "9.0" or "9.0a"."""
    major, minor = arch.removesuffix("a").split(".")
    return int(major), int(minor)


def _normalise_archs(archs: Iterable[str]) -> tuple[str, ...]:
    # "9.0" and "9.0a" name one target (sm_90a SASS); numeric order, so 10.0 sorts after 9.0a.
    named = {"9.0a" if a.strip() in ("9.0", "9.0a") else a.strip() for a in archs}
    return tuple(sorted(named, key=_arch_number))


def _nvml_capabilities() -> set[tuple[int, int]] | None:
    """The machine's GPU compute capabilities through NVML, or None.

    Asking torch would initialise CUDA at ``import opforge`` (hundreds of ms,
    and a forked DataLoader worker could then no longer use CUDA). NVML lists
    every GPU, ignoring CUDA_VISIBLE_DEVICES: a superset of archs, never a
    missing one.
    """
    from opforge import nvml

    found = nvml.query()
    if found is None:
        return None
    return {(int(g.capability.split(".")[0]), int(g.capability.split(".")[1])) for g in found[0]} or None


def gencode_flags(archs: tuple[str, ...]) -> list[str]:
    """SASS for each arch ("9.0a": sm_90a), plus PTX of the newest one without
    its "a", so that a newer GPU can still JIT the kernels: arch-specific PTX
    (compute_90a) runs on no other GPU. Kernels that need sm_90a features
    compile to a trap in that portable PTX and are never launched from it (the
    launchers check the device and the loaded image first)."""
    flags = []
    for arch in archs:
        num = arch.replace(".", "")
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
    newest = max(archs, key=_arch_number).removesuffix("a").replace(".", "")
    flags.append(f"-gencode=arch=compute_{newest},code=compute_{newest}")
    return flags


_gencode_flags = gencode_flags  # the name tests and older callers use


def op_sources(op_dir: Path, *, with_cuda: bool) -> list[Path]:
    """A folder's sources, in it and in any subfolder (``discover.walk``: build
    outputs, virtualenvs, tests and hidden folders left out): every C++ source
    (.cpp, .cc, .cxx), then every .cu in a CUDA build, each in path order."""
    tree = walk(op_dir)
    return [*tree.cpp, *(tree.cuda if with_cuda else ())]


def folder_config(folder: Path, *, with_cuda: bool | None = None) -> BuildConfig:
    """A user's op folder (TORCH_LIBRARY sources, .cpp and .cu, in any subfolder)
    as a build: the folder, its include/ folders and every folder holding a
    header on the include path, then opforge's (``opforge/common.h``)."""
    cuda = want_cuda() if with_cuda is None else with_cuda
    tree = walk(folder)
    sources = [*tree.cpp, *(tree.cuda if cuda else ())]
    if not sources:
        raise BuildError(f"opforge: no C++ (.cpp, .cc, .cxx){' or CUDA (.cu)' if cuda else ''} source in {folder} or its subfolders")
    name = "".join(c if c.isalnum() else "_" for c in tree.root.name)
    root = csrc_dir()
    flags = ("-O3", "-fopenmp", *(("-DOPFORGE_WITH_CUDA",) if cuda else ()))
    cuda_flags: tuple[str, ...] = ()
    archs: tuple[str, ...] = ()
    if cuda:
        archs = cuda_archs()
        cuda_flags = ("-O3", "-DOPFORGE_WITH_CUDA", *gencode_flags(archs))
        # The current-stream helper the CUDA launchers of common.h call.
        sources = [*sources, root / "opforge" / "cuda_stream.cpp"]
    # The folder as given first: the include path of a flat folder is what it always was.
    include_dirs = (folder, *(d for d in tree.include_dirs if d != tree.root), root)
    return BuildConfig(
        name, tuple(sources), include_dirs, cflags=flags, cuda_cflags=cuda_flags, ldflags=("-fopenmp",), with_cuda=cuda, cuda_archs=archs
    )


def library_config(*, with_cuda: bool | None = None) -> BuildConfig:
    """The build of opforge's own op library: every folder under csrc/ops."""
    root = csrc_dir()
    cuda = want_cuda() if with_cuda is None else with_cuda
    # The eager fast path's Python module init (opforge.build.fast) first:
    # ninja starts jobs in this order, and it is one of the two slow ones.
    sources: list[Path] = [root / "opforge" / "fast_python.cpp"]
    for op_dir in sorted(p for p in (root / "ops").iterdir() if p.is_dir()):
        sources += op_sources(op_dir, with_cuda=cuda)
    # The ops' wrappers compile as one unit, beside the fast path's module on
    # the other core: on 2 cores, 7 wrappers took 30.2 s as 7 units on a
    # precompiled header (plus 13.6 s to build it) and 15.9 s as one unit
    # without it (benchmarks/build_speed.py).
    unity = tuple(s for s in sources if s.suffix == ".cpp" and s.parent.parent.name == "ops")
    # OPFORGE_CXXFLAGS adds host-compiler flags (part of the cache key).
    cflags = ["-O3", "-fopenmp", *os.environ.get("OPFORGE_CXXFLAGS", "").split()]
    cuda_cflags = ["-O3", "-DOPFORGE_WITH_CUDA"]
    archs: tuple[str, ...] = ()
    if cuda:
        sources.append(root / "opforge" / "cuda_stream.cpp")
        cflags.append("-DOPFORGE_WITH_CUDA")
        archs = cuda_archs()
        cuda_cflags += gencode_flags(archs)
    return BuildConfig(
        name="opforge_ops",
        sources=tuple(sources),
        include_dirs=(root,),
        cflags=tuple(cflags),
        cuda_cflags=tuple(cuda_cflags) if cuda else (),
        ldflags=("-fopenmp",),
        with_cuda=cuda,
        cuda_archs=archs,
        unity=unity,
    )
