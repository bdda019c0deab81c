"""Building op libraries: sources -> shared library -> ``torch.ops``.

``library_config`` describes opforge's own op library (every folder under
``csrc/ops``); ``load_library`` builds it through the JIT route when the cache
has no good copy and loads it.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from opforge.builder.archs import cuda_archs, cuda_home, gencode_flags
from opforge.builder.discover import walk
from opforge.builder.errors import BuildError, Diagnostic, parse_diagnostics
from opforge.builder.jit import BuildConfig, Library, build_library, cache_root, check_safe_to_load, load_library, load_module

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
    # The eager fast path's Python module init (opforge.fast) first:
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
