"""What a folder of someone's C++/CUDA code is, found before anything compiles.

``opforge build PATH`` takes the layouts people bring as they are: sources in
any subfolder, headers in ``include/`` or beside their sources, a Python
package whose ``__init__`` imports a compiled ``_C``, a pybind11 module, a
``setup.py`` or a ``CMakeLists.txt``. ``opforge.builder.sources.walk`` finds the sources and the
include folders, ``discover`` reads how the code binds to Python or torch and
picks the route (``opforge.folders.describe`` says all of it in a few lines,
CUDA sources that cannot be built here included). Nothing here compiles anything.
Another framework's code kept beside the PyTorch code (a ``tensorflow/`` folder)
is left out and said (``opforge.builder.source_text``).

The package route's build is ``opforge.folders.package``'s.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

from opforge.builder.source_text import Binding, Foreign, read_binding
from opforge.builder.sources import VENDORED, DiscoveryError, Tree, shown_path, skip_reason, unusable_reason, walk
from opforge.folders.package_init import Package, imports_c

_SETUP_EXTENSION = re.compile(r"\b(?:CppExtension|CUDAExtension)\b")


_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


# [torch], [torch.<key>] or [kernel.<name>] at the start of a line: a kernel-builder build.toml.
_KERNEL_BUILDER_SECTION = re.compile(r"^\s*\[\s*(?:torch\s*[].]|kernel\s*\.)", re.M)


# CMake's commands are case-insensitive, package names are not (torch ships TorchConfig.cmake).
_FIND_TORCH = re.compile(r"(?i:\bfind_package)\s*\(\s*Torch\b")


# A bracket comment #[[...]] / #[==[...]==], then a line comment.
_CMAKE_COMMENT = re.compile(r"#\[(=*)\[.*?\]\1\]|#[^\n]*", re.S)


def finds_torch(cmakelists: Path) -> bool:
    """Whether a CMakeLists.txt calls ``find_package(Torch ...)`` (comments left out):
    the project's own build is CMake's, against torch."""
    try:
        text = cmakelists.read_text(errors="replace")
    except OSError:
        return False
    return _FIND_TORCH.search(_CMAKE_COMMENT.sub(" ", text)) is not None


def find_packages(root: Path) -> list[Package]:
    """The packages at ``root``, in its subfolders and in ``root/src`` whose
    ``__init__.py`` imports ``_C``."""
    candidates = [root]
    for base in (root, root / "src"):
        if base.is_dir():
            candidates += [d for d in sorted(base.iterdir()) if d.is_dir() and skip_reason(d) is None]
    found = []
    for d in candidates:
        init = d / "__init__.py"
        if init.is_file() and _IDENTIFIER.fullmatch(d.name) and (how := imports_c(init, d.name)):
            found.append(Package(d.name, d, *how))
    return found


@dataclasses.dataclass(frozen=True)
class Layout:
    """What ``discover`` found at a path, and the route it builds by."""

    tree: Tree
    binding: Binding
    package: Package | None
    setup_py: Path | None  # a setup.py that makes a CppExtension or CUDAExtension
    cmakelists: Path | None
    route: str
    why: str  # why that route, in a few words

    @property
    def root(self) -> Path:
        return self.tree.root

    def other_routes(self, route: str = "") -> list[str]:
        """Build files the route taken (``route``, else the one found) does not use, each with the flag that would."""
        route = route or self.route
        also = []
        if self.setup_py is not None and route not in ("setup.py", "setuptools"):
            also.append("setup.py (--route setup.py)")
        if self.package is not None and route != "package":
            also.append(f"a package importing _C, {self.package.name} (--route package)")
        if self.cmakelists is not None and route != "cmake":
            also.append("CMakeLists.txt (--route cmake)")
        return also


def discover(path: str | os.PathLike[str]) -> Layout:
    """What the folder at ``path`` holds and the route ``opforge build`` takes.

    A setup.py that makes a CppExtension or CUDAExtension says how its author
    builds the code (names, macros, flags): its extensions are read by running it and
    built in place (setup.py). A package importing ``_C`` is built in place
    (package). A root CMakeLists.txt that finds Torch (``find_package(Torch)``)
    is the project's own build against torch, whatever its sources register:
    configured and built by cmake (cmake). Otherwise the sources decide where
    opforge can build them itself, the build files only where they cannot:
    TORCH_LIBRARY code is loaded into torch.ops (jit); a
    ``PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)`` module is imported (pybind);
    then any other CMakeLists.txt (cmake); a pybind11 module with
    its name written out, which only the pybind route's check explains
    (pybind); anything else is tried as TORCH_LIBRARY code (jit), whose load
    says when it registered nothing. Raises DiscoveryError for a path that is
    no folder, holds nothing to build, or holds two packages that import
    ``_C`` and no setup.py that says how to build them."""
    given = Path(path)
    if (bad := unusable_reason(given)) is not None:
        raise DiscoveryError(f"{shown_path(given)} cannot be built: {bad}")
    root = given.resolve()
    if not root.exists():
        raise DiscoveryError(f"{given} is not a folder: nothing is there")
    if not root.is_dir():
        raise DiscoveryError(f"{given} is not a folder: give the folder that holds the sources")
    tree = walk(root)
    setup = root / "setup.py"
    setup_py = setup if setup.is_file() and _SETUP_EXTENSION.search(setup.read_text(errors="replace")) else None
    cmakelists = root / "CMakeLists.txt" if (root / "CMakeLists.txt").is_file() else None
    build_toml = find_build_toml(root)
    if not tree.sources and setup_py is None and cmakelists is None and build_toml is None:
        skipped = f" (skipped: {', '.join(skipped_name(tree, s) for s in tree.skipped)})" if tree.skipped else ""
        if tree.foreign:
            skipped += f" (left out, not PyTorch code: {', '.join(foreign_name(tree, f) for f in tree.foreign)})"
        if tree.programs:
            skipped += f" (left out, programs that define main(): {', '.join(tree.rel(p) for p in tree.programs)})"
        raise DiscoveryError(
            f"{given}: nothing to build: no C++ (.cpp, .cc, .cxx) or CUDA (.cu) source in it or its subfolders{skipped}, "
            "and no setup.py or CMakeLists.txt"
        )
    binding = read_binding([*tree.sources, *tree.headers()])
    packages = find_packages(root)
    if len(packages) > 1 and setup_py is None:
        named = ", ".join(f"{tree.rel(p.directory)} ({tree.rel(p.directory / '__init__.py')}:{p.line}: {p.statement})" for p in packages)
        raise DiscoveryError(
            f"{given}: {len(packages)} packages import a compiled _C: {named}; build one at a time (opforge build PACKAGE_FOLDER)"
        )
    package = packages[0] if len(packages) == 1 else None
    te_name = [p for p in binding.pybind if p.name == "TORCH_EXTENSION_NAME"]
    if build_toml is not None:
        route = "kernel-builder"
        why = "build.toml names a torch extension and its kernels (Hugging Face kernel-builder)"
    elif setup_py is not None:
        route = "setup.py"
        why = (
            "setup.py makes a CppExtension/CUDAExtension: each extension is read by running it (setup() replaced) "
            "and built in place, as build_ext --inplace"
        )
    elif package is not None:
        route = "package"
        why = f"{package.name}/__init__.py imports _C: its library is built in place, as {tree.rel(package.target())}"
    elif cmakelists is not None and finds_torch(cmakelists):
        route, why = "cmake", "CMakeLists.txt finds Torch (find_package(Torch)): the project's own build, configured and built by cmake"
    elif binding.torch_library:
        api = "TORCH_LIBRARY" if binding.namespaces or binding.impls else "torch::RegisterOperators"
        route, why = "jit", f"{api} operators: built into the cache, then loaded for torch.ops"
    elif te_name:
        route, why = "pybind", "a pybind11 module: built into the cache and imported"
    elif cmakelists is not None:
        route, why = "cmake", "CMakeLists.txt (the sources declare no binding opforge builds itself)"
    elif binding.pybind:
        # Its name written out: the pybind route's check says why that cannot import, before compiling.
        route, why = "pybind", "a pybind11 module"
    else:
        route, why = "jit", "no binding found in the sources: built as TORCH_LIBRARY code, then its load says what it registers"
    return Layout(tree, binding, package, setup_py, cmakelists, route, why)


def find_build_toml(root: Path) -> Path | None:
    """``root/build.toml`` where it has a ``[torch]`` or ``[kernel.<name>]``
    section: a Hugging Face kernel-builder project (opforge.folders.kernel_builder),
    told from its text, so that a malformed one still takes that route, whose
    reading says what is wrong with it."""
    path = Path(root) / "build.toml"
    try:
        return path if _KERNEL_BUILDER_SECTION.search(path.read_text(errors="replace")) else None
    except OSError:
        return None


def foreign_name(tree: Tree, found: Foreign) -> str:
    """Another framework's folder or source as ``describe`` names it, with why it is that framework's."""
    return f"{tree.rel(found.path)}{'/' if found.path.is_dir() else ''} ({found.framework}: {found.evidence})"


def skipped_name(tree: Tree, folder: Path) -> str:
    """A skipped folder as ``describe`` names it: a vendored one with what of it is kept."""
    if skip_reason(folder) != VENDORED:
        return tree.rel(folder) + "/"
    kept = [tree.rel(d) for d in tree.vendored_include if d.is_relative_to(folder)]
    return f"{tree.rel(folder)}/ (vendored: its sources are not built{'; on the include path: ' + ', '.join(kept) if kept else ''})"


__all__ = ["Layout", "discover", "find_build_toml", "find_packages", "finds_torch", "foreign_name", "skipped_name"]
