"""The builds opforge knows by heart: its own op library (every folder under
``csrc/ops``), the eager fast path, a user's op folder; and the environment
switches every build reads (``OPFORGE_BUILD_CUDA``, ``OPFORGE_CXXFLAGS``)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from opforge.builder.archs import cuda_archs, cuda_home, gencode_flags
from opforge.builder.errors import BuildError
from opforge.builder.flags import build_cuda_flag
from opforge.builder.recipe import BuildConfig
from opforge.builder.sources import library_name, walk
from opforge.builder.stable import FLOOR, target_flag

#: opforge's own op library is on PyTorch's stable ABI: one build for every torch from this one on.
LIBRARY_TARGET = FLOOR


def csrc_dir() -> Path:
    """The C++/CUDA sources: shipped inside the wheel as ``opforge/_csrc``, or
    the repository's ``csrc/`` in a source checkout and an editable install."""
    here = Path(__file__).resolve().parent.parent
    for candidate in (here / "_csrc", here.parent.parent / "csrc"):
        if (candidate / "ops").is_dir():
            return candidate
    raise BuildError(f"opforge: the C++ sources are missing (looked in {here / '_csrc'} and {here.parent.parent / 'csrc'})")


def want_cuda(*, stable: bool = False) -> bool:
    """CUDA kernels are built when torch has CUDA and nvcc is found;
    ``OPFORGE_BUILD_CUDA`` (``build_cuda_flag``) overrides, and on fails clearly if it cannot.
    A ``stable`` build (opforge.builder.stable) needs nvcc alone: a CPU build of
    torch can build a library whose CUDA kernels run under a CUDA one."""
    flag = build_cuda_flag()
    if flag is False:
        return False
    if flag and stable:
        home = cuda_home()
        if home is None or not (home / "bin" / "nvcc").exists():
            value = os.environ["OPFORGE_BUILD_CUDA"].strip()
            raise BuildError(f"opforge: OPFORGE_BUILD_CUDA={value} but nvcc was not found (CUDA_HOME={home}; set CUDA_HOME)")
        return True
    if flag:
        if torch.version.cuda is None:
            value = os.environ["OPFORGE_BUILD_CUDA"].strip()
            raise BuildError(f"opforge: OPFORGE_BUILD_CUDA={value} but this torch build has no CUDA (torch.version.cuda is None)")
        return True
    if torch.version.cuda is None:
        return False
    home = cuda_home()
    return home is not None and (home / "bin" / "nvcc").exists()


def env_cxxflags() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``OPFORGE_CXXFLAGS``, split at whitespace (torch's ninja file quotes
    nothing, so a flag holds no space), for every build: the host compiler's
    extra flags, and those of them nvcc takes too (``-D``, ``-U``, ``-I``: a
    macro a project needs reaches its .cu files as well). Both are part of the
    cache key."""
    flags = tuple(os.environ.get("OPFORGE_CXXFLAGS", "").split())
    both: list[str] = []
    for i, f in enumerate(flags):
        if f.startswith(("-D", "-U", "-I")) and len(f) > 2:
            both.append(f)
        elif f in ("-D", "-U", "-I") and i + 1 < len(flags):
            both += [f, flags[i + 1]]
    return flags, tuple(both)


def op_sources(op_dir: Path, *, with_cuda: bool) -> list[Path]:
    """A folder's sources, in it and in any subfolder (``discover.walk``: build
    outputs, virtualenvs, tests and hidden folders left out): every C++ source
    (.cpp, .cc, .cxx), then every .cu in a CUDA build, each in path order."""
    tree = walk(op_dir)
    return [*tree.cpp, *(tree.cuda if with_cuda else ())]


def folder_config(folder: Path, *, with_cuda: bool | None = None, stable: str | None = None) -> BuildConfig:
    """A user's op folder (TORCH_LIBRARY sources, .cpp and .cu, in any subfolder)
    as a build: the folder, its include/ folders and every folder holding a
    header on the include path, then opforge's (``opforge/aten/common.h``).

    ``stable``: the folder is on PyTorch's stable ABI, for every torch from
    this version on ("2.10"; opforge.builder.stable); None: so when its C++
    sources include the stable headers and none of ATen's (``is_stable_folder``),
    for the target they define or else the first versioned one."""
    tree = walk(folder)
    if stable is None and is_stable_folder(tree.cpp):
        stable = FLOOR
    cuda = want_cuda(stable=bool(stable)) if with_cuda is None else with_cuda
    sources = [*tree.cpp, *(tree.cuda if cuda else ())]
    if not sources:
        raise BuildError(f"opforge: no C++ (.cpp, .cc, .cxx){' or CUDA (.cu)' if cuda else ''} source in {folder} or its subfolders")
    name = library_name(tree.root)
    env_host, env_both = env_cxxflags()
    root = csrc_dir()
    if stable:
        # No OpenMP: a stable library's CPU loops run on torch's thread pool through the shim.
        flags: tuple[str, ...] = ("-O3",)
        if not any("define TORCH_TARGET_VERSION" in _text(s) for s in tree.cpp):
            flags += (target_flag(stable),)
        ldflags: tuple[str, ...] = ()
    else:
        flags, ldflags = ("-O3", "-fopenmp"), ("-fopenmp",)
    flags += (*(("-DOPFORGE_WITH_CUDA",) if cuda else ()), *env_host)
    cuda_flags: tuple[str, ...] = ()
    archs: tuple[str, ...] = ()
    if cuda:
        archs = cuda_archs()
        cuda_flags = ("-O3", "-DOPFORGE_WITH_CUDA", *gencode_flags(archs), *env_both)
        if not stable:
            # The current-stream helper the CUDA launchers of common.h call (ATen's; a stable
            # folder asks the shim for the stream).
            sources = [*sources, root / "opforge" / "aten" / "cuda_stream.cpp"]
    # The folder as given first: the include path of a flat folder is what it always was.
    include_dirs = (folder, *(d for d in tree.include_dirs if d != tree.root), root)
    return BuildConfig(
        name,
        tuple(sources),
        include_dirs,
        cflags=flags,
        cuda_cflags=cuda_flags,
        ldflags=ldflags,
        with_cuda=cuda,
        cuda_archs=archs,
        stable=stable or "",
        # TORCH_EXTENSION_NAME is the folder's name, as torch's load(name=) and setuptools give it: a
        # TORCH_LIBRARY(TORCH_EXTENSION_NAME, m) lands in torch.ops.<folder name>.
        extension_name=name,
    )


def _text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def is_stable_folder(cpp_sources: list[Path]) -> bool:
    """Whether C++ sources are on the stable ABI: some include torch/csrc/stable,
    none includes ATen, c10 (outside torch/headeronly) or torch/extension.h."""
    texts = [_text(s) for s in cpp_sources]
    stable = any("#include <torch/csrc/stable/" in t or '#include "torch/csrc/stable/' in t for t in texts)
    unstable = ("#include <ATen/", "#include <c10/", "#include <torch/extension.h>", "#include <torch/library.h>")
    return stable and not any(u in t for t in texts for u in unstable)


def library_config(*, with_cuda: bool | None = None) -> BuildConfig:
    """The build of opforge's own op library: every folder under csrc/ops, on
    the stable ABI (``LIBRARY_TARGET``). The eager fast path, which needs
    torch's private headers, is a library of its own (``fast_config``)."""
    root = csrc_dir()
    cuda = want_cuda(stable=True) if with_cuda is None else with_cuda
    sources: list[Path] = []
    for op_dir in sorted(p for p in (root / "ops").iterdir() if p.is_dir()):
        sources += op_sources(op_dir, with_cuda=cuda)
    # The ops' wrappers compile as one unit: the stable headers are parsed
    # once, and the CUDA kernels take the other cores.
    unity = tuple(s for s in sources if s.suffix == ".cpp")
    # OPFORGE_CXXFLAGS adds host-compiler flags (part of the cache key).
    cflags = ["-O3", target_flag(LIBRARY_TARGET), *env_cxxflags()[0]]
    cuda_cflags = ["-O3"]
    archs: tuple[str, ...] = ()
    if cuda:
        cflags.append("-DOPFORGE_WITH_CUDA")
        archs = cuda_archs()
        cuda_cflags += gencode_flags(archs)
    return BuildConfig(
        name="opforge_ops",
        sources=tuple(sources),
        include_dirs=(root,),
        cflags=tuple(cflags),
        cuda_cflags=tuple(cuda_cflags) if cuda else (),
        with_cuda=cuda,
        cuda_archs=archs,
        unity=unity,
        stable=LIBRARY_TARGET,
    )


def fast_config() -> BuildConfig:
    """The eager fast path (opforge.fast): a Python module built for this torch
    alone, as it uses torch's private autograd headers; optional, the
    operators work without it."""
    root = csrc_dir()
    return BuildConfig(
        name="opforge_fast",
        sources=(root / "fast" / "fast_python.cpp",),
        include_dirs=(root,),
        cflags=("-O3", *env_cxxflags()[0]),
        python_module=True,
    )
