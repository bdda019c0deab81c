"""What a folder of someone's C++/CUDA code is, found before anything compiles.

``opforge build PATH`` takes the layouts people bring as they are: sources in
any subfolder, headers in ``include/`` or beside their sources, a Python
package whose ``__init__`` imports a compiled ``_C``, a pybind11 module, a
``setup.py`` or a ``CMakeLists.txt``. ``walk`` finds the sources and the
include folders, ``discover`` reads how the code binds to Python or torch and
picks the route (``opforge.builder.describe`` says all of it in a few lines,
CUDA sources that cannot be built here included). Nothing here compiles anything.
Another framework's code kept beside the PyTorch code (a ``tensorflow/`` folder)
is left out and said (``opforge.builder.foreign``).

The package route's build is ``opforge.builder.package``'s.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import re
from collections.abc import Iterable
from pathlib import Path

from opforge.builder.binding import Binding, PybindModule, pybind_modules, read_binding, strip_comments
from opforge.builder.foreign import Foreign, find_foreign
from opforge.builder.package_init import Package, extension_suffix, imports_c

CPP_SUFFIXES = (".cpp", ".cc", ".cxx")
CUDA_SUFFIXES = (".cu",)
SOURCE_SUFFIXES = (*CPP_SUFFIXES, *CUDA_SUFFIXES)
HEADER_SUFFIXES = (".h", ".hpp", ".cuh")
# Build outputs, tests and caches: what they hold is not the library's code,
# and a test's or an old build's copy of a source would be compiled twice.
SKIPPED_NAMES = {"build": "build output", "dist": "build output", "_skbuild": "build output", "tests": "tests", "test": "tests",
                 "__pycache__": "Python cache"}  # fmt: skip
# Someone else's library kept in the tree (cutlass, json, a submodule): its own
# sources, tests and examples are not this library's, but the code includes its
# headers, so the include/ folders inside stay on the include path.
VENDORED_NAMES = ("third_party", "thirdparty", "3rdparty", "external", "extern", "vendor")
VENDORED = "vendored"

_SETUP_EXTENSION = re.compile(r"\b(?:CppExtension|CUDAExtension)\b")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# [torch], [torch.<key>] or [kernel.<name>] at the start of a line: a kernel-builder build.toml.
_KERNEL_BUILDER_SECTION = re.compile(r"^\s*\[\s*(?:torch\s*[].]|kernel\s*\.)", re.M)
# A program's entry point at file scope: `int main(`, `auto main(` (a test or example program, not library code).
_MAIN = re.compile(r"^[ \t]*(?:(?:static|extern|inline)\s+)*(?:int|auto|signed)\s+main\s*\(", re.M)
# CMake's commands are case-insensitive, package names are not (torch ships TorchConfig.cmake).
_FIND_TORCH = re.compile(r"(?i:\bfind_package)\s*\(\s*Torch\b")
# A bracket comment #[[...]] / #[==[...]==], then a line comment.
_CMAKE_COMMENT = re.compile(r"#\[(=*)\[.*?\]\1\]|#[^\n]*", re.S)


class DiscoveryError(ValueError):
    """The path cannot be built as given: the message names it and says why."""


# --------------------------------------------------------------- the tree


def skip_reason(folder: Path) -> str | None:
    """Why ``walk`` leaves ``folder`` out (its name, or a ``pyvenv.cfg`` in it), or None."""
    name = folder.name
    if name.startswith("."):
        return "hidden"
    if name in SKIPPED_NAMES:
        return SKIPPED_NAMES[name]
    if name in VENDORED_NAMES:
        return VENDORED
    if name.endswith(".egg-info"):
        return "build output"
    if (folder / "pyvenv.cfg").is_file():
        return "virtualenv"
    return None


@dataclasses.dataclass(frozen=True)
class Tree:
    """The sources and include folders under ``root``, skipped folders left out."""

    root: Path
    sources: tuple[Path, ...]  # sorted by path relative to root
    header_dirs: tuple[Path, ...]  # folders holding a header, sorted
    include_named: tuple[Path, ...]  # folders named include/, sorted
    skipped: tuple[Path, ...]  # folders left out, each once (not what is below them)
    vendored_include: tuple[Path, ...] = ()  # include/ folders inside vendored folders, sorted
    # Another framework's code (a tensorflow/ folder beside pytorch/): left out, said by describe.
    foreign: tuple[Foreign, ...] = ()
    # Sources, headers and folders that cannot be built or read (a dangling symbolic link, a link loop, a
    # name that is not UTF-8), each with why: left out, and said by describe.
    unusable: tuple[tuple[Path, str], ...] = ()
    # Sources that define main() and register nothing: a test's or an example's program, left out (linked into
    # one library with the others, each main would clash), and said by describe.
    programs: tuple[Path, ...] = ()

    @property
    def cpp(self) -> tuple[Path, ...]:
        return tuple(s for s in self.sources if s.suffix in CPP_SUFFIXES)

    @property
    def cuda(self) -> tuple[Path, ...]:
        return tuple(s for s in self.sources if s.suffix in CUDA_SUFFIXES)

    @property
    def include_dirs(self) -> tuple[Path, ...]:
        """The root (an include written from it, "kernels/x.h", finds its file),
        every include/ folder, every folder that holds a header, then the
        include/ folders of vendored libraries (``third_party/cutlass/include``)."""
        return tuple(dict.fromkeys((self.root, *self.include_named, *self.header_dirs, *self.vendored_include)))

    def headers(self) -> list[Path]:
        """Every header in the header folders (those below a skipped folder are not among them)."""
        return sorted(p for d in self.header_dirs for p in d.iterdir() if p.suffix in HEADER_SUFFIXES and p.is_file())

    def rel(self, path: Path) -> str:
        return shown_path(path.relative_to(self.root).as_posix()) if path != self.root else "."


def shown_path(path: str | os.PathLike[str]) -> str:
    """A path as text that prints anywhere: the bytes of a name that is not UTF-8 as \\x escapes."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def unusable_reason(path: Path) -> str | None:
    """Why ``path`` (a file or folder found by a walk) cannot be built from, or None:
    a name that is not UTF-8 (the compiler's command line and the cache key need text),
    a symbolic link to nothing or a loop of links."""
    try:
        os.fsencode(path).decode("utf-8")
    except UnicodeDecodeError:
        return "its name is not UTF-8: rename it"
    if not path.is_symlink():
        return None
    try:
        path.stat()
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "a loop of symbolic links"
        return f"a symbolic link to {shown_path(os.readlink(path))}, which is not there"
    return None


def walk(root: Path) -> Tree:
    """Every C++ (.cpp, .cc, .cxx) and CUDA (.cu) source under ``root``, and the
    folders that hold headers (.h, .hpp, .cuh), in any subfolder; build outputs,
    virtualenvs, tests, caches and hidden folders are skipped (``skip_reason``),
    and so are vendored libraries (``third_party/``, ``vendor/``...), whose
    include/ folders are kept for the include path (``vendored_include``).
    Another framework's code (``opforge.builder.foreign``) is left out, its
    headers' folders too, and listed in ``foreign``; so is a program (a source
    that defines ``main`` and registers nothing, ``defines_main``), listed in
    ``programs``. ``root`` itself is never skipped, whatever its name."""
    root = Path(root).resolve()
    sources: list[Path] = []
    header_dirs: list[Path] = []
    include_named: list[Path] = []
    skipped: list[Path] = []
    vendored_include: list[Path] = []
    unusable: list[tuple[Path, str]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        kept = []
        for d in sorted(dirnames):
            if (bad := unusable_reason(here / d)) is not None:
                unusable.append((here / d, bad))
                continue
            why = skip_reason(here / d)
            if why is None:
                kept.append(d)
            else:
                skipped.append(here / d)
                if why == VENDORED:
                    vendored_include += include_folders(here / d)
        dirnames[:] = kept  # os.walk descends into what is left
        if here.name == "include" and here != root:
            include_named.append(here)
        names = []
        for f in sorted(filenames):
            if Path(f).suffix in (*SOURCE_SUFFIXES, *HEADER_SUFFIXES) and (bad := unusable_reason(here / f)) is not None:
                unusable.append((here / f, bad))
            else:
                names.append(f)
        sources += [here / f for f in names if Path(f).suffix in SOURCE_SUFFIXES]
        if any(Path(f).suffix in HEADER_SUFFIXES for f in names):
            header_dirs.append(here)

    def by_rel(p: Path) -> str:
        return p.relative_to(root).as_posix()

    foreign = find_foreign(root, sources)
    left_out = {s for f in foreign for s in f.sources}
    folders = [f.path for f in foreign if f.path.is_dir()]
    programs = [s for s in sources if s not in left_out and defines_main(s)]
    left_out.update(programs)

    def kept(paths: list[Path]) -> tuple[Path, ...]:
        return tuple(sorted((p for p in paths if p not in left_out and not any(p.is_relative_to(f) for f in folders)), key=by_rel))

    return Tree(
        root=root,
        sources=kept(sources),
        header_dirs=kept(header_dirs),
        include_named=kept(include_named),
        skipped=tuple(sorted(skipped, key=by_rel)),
        vendored_include=tuple(sorted(set(vendored_include), key=by_rel)),
        foreign=tuple(foreign),
        unusable=tuple(sorted(unusable, key=lambda u: by_rel(u[0]))),
        programs=tuple(sorted(programs, key=by_rel)),
    )


def defines_main(source: Path) -> bool:
    """Whether ``source`` is a program rather than library code: it defines ``main``
    at file scope and declares no binding (a source that registers operators or
    a module is the library's, whatever else it holds)."""
    try:
        if _MAIN.search(strip_comments(source.read_text(errors="replace"))) is None:
            return False
        binding = read_binding([source])
    except OSError:
        return False
    return not (binding.torch_library or binding.pybind or binding.pyinit_c)


def finds_torch(cmakelists: Path) -> bool:
    """Whether a CMakeLists.txt calls ``find_package(Torch ...)`` (comments left out):
    the project's own build is CMake's, against torch."""
    try:
        text = cmakelists.read_text(errors="replace")
    except OSError:
        return False
    return _FIND_TORCH.search(_CMAKE_COMMENT.sub(" ", text)) is not None


def include_folders(folder: Path) -> list[Path]:
    """The folders named include/ in and below a vendored ``folder`` (not
    below one found: a library's include/ holds its headers, whatever nests
    there), its build outputs, tests and hidden folders passed over."""
    found = []
    for dirpath, dirnames, _ in os.walk(folder):
        here = Path(dirpath)
        if here.name == "include" and here != folder:
            found.append(here)
            dirnames[:] = []
            continue
        dirnames[:] = [d for d in dirnames if skip_reason(here / d) in (None, VENDORED)]
    return found


def headers_under(folders: Iterable[Path]) -> list[Path]:
    """Every header in and below ``folders``, walked as ``walk`` walks (the
    cache key hashes them: a virtualenv's or a build's copy of torch's headers
    below a project would make every key cost seconds)."""
    found: set[Path] = set()
    for folder in folders:
        for dirpath, dirnames, filenames in os.walk(folder):
            dirnames[:] = [d for d in dirnames if skip_reason(Path(dirpath) / d) is None]
            found.update(Path(dirpath) / f for f in filenames if Path(f).suffix in HEADER_SUFFIXES)
    return sorted(p for p in found if p.is_file() and unusable_reason(p) is None)


# --------------------------------------------------------------- the binding


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


# --------------------------------------------------------------- the layout


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
    section: a Hugging Face kernel-builder project (opforge.builder.kernel_builder),
    told from its text, so that a malformed one still takes that route, whose
    reading says what is wrong with it."""
    path = Path(root) / "build.toml"
    try:
        return path if _KERNEL_BUILDER_SECTION.search(path.read_text(errors="replace")) else None
    except OSError:
        return None


def library_name(root: Path) -> str:
    """The name a folder's library is built under (and TORCH_EXTENSION_NAME, as
    torch's ``load(name=)`` takes it): the folder's name, made an identifier."""
    return "".join(c if c.isalnum() else "_" for c in root.name)


def foreign_name(tree: Tree, found: Foreign) -> str:
    """Another framework's folder or source as ``describe`` names it, with why it is that framework's."""
    return f"{tree.rel(found.path)}{'/' if found.path.is_dir() else ''} ({found.framework}: {found.evidence})"


def skipped_name(tree: Tree, folder: Path) -> str:
    """A skipped folder as ``describe`` names it: a vendored one with what of it is kept."""
    if skip_reason(folder) != VENDORED:
        return tree.rel(folder) + "/"
    kept = [tree.rel(d) for d in tree.vendored_include if d.is_relative_to(folder)]
    return f"{tree.rel(folder)}/ (vendored: its sources are not built{'; on the include path: ' + ', '.join(kept) if kept else ''})"


__all__ = [
    "CPP_SUFFIXES",
    "CUDA_SUFFIXES",
    "HEADER_SUFFIXES",
    "SKIPPED_NAMES",
    "VENDORED_NAMES",
    "Binding",
    "DiscoveryError",
    "Layout",
    "Package",
    "PybindModule",
    "Tree",
    "defines_main",
    "discover",
    "extension_suffix",
    "find_build_toml",
    "find_packages",
    "finds_torch",
    "foreign_name",
    "headers_under",
    "imports_c",
    "include_folders",
    "library_name",
    "pybind_modules",
    "read_binding",
    "shown_path",
    "skip_reason",
    "skipped_name",
    "strip_comments",
    "unusable_reason",
    "walk",
]
