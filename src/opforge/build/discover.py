"""What a folder of someone's C++/CUDA code is, found before anything compiles.

``opforge build PATH`` takes the layouts people bring as they are: sources in
any subfolder, headers in ``include/`` or beside their sources, a Python
package whose ``__init__`` imports a compiled ``_C``, a pybind11 module, a
``setup.py`` or a ``CMakeLists.txt``. ``walk`` finds the sources and the
include folders, ``discover`` reads how the code binds to Python or torch and
picks the route, ``describe`` says all of it in a few lines, CUDA sources
that cannot be built here included. Nothing here compiles anything.

The package route lives here too, since only a layout has it: the package's
sources built by the JIT engine (cache, lock, progress, compiler errors) into
a library named ``_C``, copied into the package as ``_C<EXT_SUFFIX>`` where
``build_ext --inplace`` would put it (``package_config``, ``place_in_package``).
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import hashlib
import os
import re
import shutil
import sysconfig
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from opforge.build.jit import BuildConfig

CPP_SUFFIXES = (".cpp", ".cc", ".cxx")
CUDA_SUFFIXES = (".cu",)
SOURCE_SUFFIXES = (*CPP_SUFFIXES, *CUDA_SUFFIXES)
HEADER_SUFFIXES = (".h", ".hpp", ".cuh")
# Build outputs, tests and caches: what they hold is not the library's code,
# and a test's or an old build's copy of a source would be compiled twice.
SKIPPED_NAMES = {"build": "build output", "dist": "build output", "_skbuild": "build output", "tests": "tests", "test": "tests",
                 "__pycache__": "Python cache"}  # fmt: skip

# String and character literals are matched so that a "//" inside one is not taken for a comment.
_COMMENT_OR_LITERAL = re.compile(r"//[^\n]*|/\*.*?\*/|\"(?:\\.|[^\"\\\n])*\"|'(?:\\.|[^'\\\n])*'", re.S)
# PYBIND11_MODULE(name, m) and pybind11 >= 2.10's PYBIND11_MODULE(name, m, options...).
_PYBIND11_MODULE = re.compile(r"\bPYBIND11_MODULE\s*\(\s*([A-Za-z_]\w*)\s*,\s*([A-Za-z_]\w*)\s*[,)]")
# TORCH_LIBRARY(ns, m), TORCH_LIBRARY_FRAGMENT(ns, m), TORCH_LIBRARY_IMPL(ns, Key, m) and their STABLE_ forms.
_TORCH_LIBRARY = re.compile(
    r"\b(?:STABLE_)?TORCH_LIBRARY(?P<kind>_FRAGMENT|_IMPL)?\s*\(\s*(?P<ns>[A-Za-z_]\w*)\s*(?:,\s*(?P<key>[A-Za-z_]\w*)\s*)?,"
)
_PYINIT_C = re.compile(r"\bPyInit__C\b")
_SETUP_EXTENSION = re.compile(r"\b(?:CppExtension|CUDAExtension)\b")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


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

    @property
    def cpp(self) -> tuple[Path, ...]:
        return tuple(s for s in self.sources if s.suffix in CPP_SUFFIXES)

    @property
    def cuda(self) -> tuple[Path, ...]:
        return tuple(s for s in self.sources if s.suffix in CUDA_SUFFIXES)

    @property
    def include_dirs(self) -> tuple[Path, ...]:
        """The root (an include written from it, "kernels/x.h", finds its file),
        every include/ folder, then every folder that holds a header."""
        return tuple(dict.fromkeys((self.root, *self.include_named, *self.header_dirs)))

    def headers(self) -> list[Path]:
        """Every header in the header folders (those below a skipped folder are not among them)."""
        return sorted(p for d in self.header_dirs for p in d.iterdir() if p.suffix in HEADER_SUFFIXES and p.is_file())

    def rel(self, path: Path) -> str:
        return path.relative_to(self.root).as_posix() if path != self.root else "."


def walk(root: Path) -> Tree:
    """Every C++ (.cpp, .cc, .cxx) and CUDA (.cu) source under ``root``, and the
    folders that hold headers (.h, .hpp, .cuh), in any subfolder; build outputs,
    virtualenvs, tests, caches and hidden folders are skipped (``skip_reason``).
    ``root`` itself is never skipped, whatever its name."""
    root = Path(root).resolve()
    sources: list[Path] = []
    header_dirs: list[Path] = []
    include_named: list[Path] = []
    skipped: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        kept = []
        for d in sorted(dirnames):
            if skip_reason(here / d) is None:
                kept.append(d)
            else:
                skipped.append(here / d)
        dirnames[:] = kept  # os.walk descends into what is left
        if here.name == "include" and here != root:
            include_named.append(here)
        names = sorted(filenames)
        sources += [here / f for f in names if Path(f).suffix in SOURCE_SUFFIXES]
        if any(Path(f).suffix in HEADER_SUFFIXES for f in names):
            header_dirs.append(here)

    def by_rel(p: Path) -> str:
        return p.relative_to(root).as_posix()

    return Tree(
        root=root,
        sources=tuple(sorted(sources, key=by_rel)),
        header_dirs=tuple(sorted(header_dirs, key=by_rel)),
        include_named=tuple(sorted(include_named, key=by_rel)),
        skipped=tuple(sorted(skipped, key=by_rel)),
    )


def headers_under(folders: Iterable[Path]) -> list[Path]:
    """Every header in and below ``folders``, walked as ``walk`` walks (the
    cache key hashes them: a virtualenv's or a build's copy of torch's headers
    below a project would make every key cost seconds)."""
    found: set[Path] = set()
    for folder in folders:
        for dirpath, dirnames, filenames in os.walk(folder):
            dirnames[:] = [d for d in dirnames if skip_reason(Path(dirpath) / d) is None]
            found.update(Path(dirpath) / f for f in filenames if Path(f).suffix in HEADER_SUFFIXES)
    return sorted(p for p in found if p.is_file())


# --------------------------------------------------------------- the binding


def strip_comments(text: str) -> str:
    """``text`` without C/C++ comments, line numbers kept."""

    def blank(m: re.Match[str]) -> str:
        s = m.group(0)
        return s if s[0] in "\"'" else "\n" * s.count("\n") or " "

    return _COMMENT_OR_LITERAL.sub(blank, text)


def _code(text: str) -> str:
    """``text`` without comments and with string and character literals emptied,
    line numbers kept: a schema string or a message that names a macro is not one."""

    def blank(m: re.Match[str]) -> str:
        s = m.group(0)
        return s[0] + " " * (len(s) - 2) + s[-1] if s[0] in "\"'" else "\n" * s.count("\n") or " "

    return _COMMENT_OR_LITERAL.sub(blank, text)


def pybind_modules(text: str) -> list[tuple[str, str, int]]:
    """Each PYBIND11_MODULE in ``text``: (module name, variable, line)."""
    code = strip_comments(text)
    return [(m[1], m[2], code.count("\n", 0, m.start()) + 1) for m in _PYBIND11_MODULE.finditer(code)]


@dataclasses.dataclass(frozen=True)
class PybindModule:
    file: Path
    name: str
    var: str
    line: int


@dataclasses.dataclass(frozen=True)
class Binding:
    """How the sources reach torch or Python, as their text says."""

    # Namespaces a TORCH_LIBRARY or TORCH_LIBRARY_FRAGMENT defines operators in.
    namespaces: tuple[str, ...] = ()
    # Per namespace, the dispatch keys of its TORCH_LIBRARY_IMPL blocks (CPU, CUDA, ...).
    impls: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    pybind: tuple[PybindModule, ...] = ()
    # A source defines PyInit__C itself: the library is importable as a module named _C.
    pyinit_c: bool = False

    @property
    def torch_library(self) -> bool:
        return bool(self.namespaces or self.impls)

    def summary(self, tree: Tree) -> str:
        parts = []
        for ns in sorted({*self.namespaces, *self.impls}):
            keys = self.impls.get(ns, ())
            what = "TORCH_LIBRARY" if ns in self.namespaces else "TORCH_LIBRARY_IMPL"
            parts.append(f"{what} {ns}" + (f" (kernels: {', '.join(keys)})" if keys else ""))
        parts += [f"pybind11 module, PYBIND11_MODULE({p.name}, {p.var}) at {tree.rel(p.file)}:{p.line}" for p in self.pybind]
        if self.pyinit_c:
            parts.append("PyInit__C")
        return "; ".join(parts) or "none found (no TORCH_LIBRARY or PYBIND11_MODULE in the sources)"


def read_binding(files: Iterable[Path]) -> Binding:
    namespaces: set[str] = set()
    impls: dict[str, set[str]] = {}
    pybind: list[PybindModule] = []
    pyinit = False
    for f in files:
        code = _code(f.read_text(errors="replace"))
        for m in _TORCH_LIBRARY.finditer(code):
            if m["kind"] == "_IMPL":
                if m["key"]:
                    impls.setdefault(m["ns"], set()).add(m["key"])
            else:
                namespaces.add(m["ns"])
        for m in _PYBIND11_MODULE.finditer(code):
            pybind.append(PybindModule(f, m[1], m[2], code.count("\n", 0, m.start()) + 1))
        pyinit = pyinit or bool(_PYINIT_C.search(code))
    return Binding(
        namespaces=tuple(sorted(namespaces)),
        impls={ns: tuple(sorted(keys)) for ns, keys in sorted(impls.items())},
        pybind=tuple(pybind),
        pyinit_c=pyinit,
    )


# --------------------------------------------------------------- the package


@dataclasses.dataclass(frozen=True)
class Package:
    """A Python package whose ``__init__.py`` imports a compiled ``_C``."""

    name: str
    directory: Path
    statement: str  # the import, as written
    line: int

    def target(self) -> Path:
        """Where ``build_ext --inplace`` puts the library: ``<package>/_C<EXT_SUFFIX>``."""
        return self.directory / f"_C{extension_suffix()}"


def extension_suffix() -> str:
    """This Python's suffix for extension modules (".cpython-311-x86_64-linux-gnu.so")."""
    return sysconfig.get_config_var("EXT_SUFFIX") or ".so"


def imports_c(init: Path, package: str) -> tuple[str, int] | None:
    """How ``init`` (a package's ``__init__.py``) brings in its compiled ``_C``:
    the statement and its line, or None. ``from . import _C``, ``from ._C import f``,
    ``import pkg._C``, ``from pkg import _C``, ``importlib.import_module`` of it,
    or ``torch.ops.load_library`` of a path that names ``_C``."""
    text = init.read_text(errors="replace")
    try:
        tree = ast.parse(text)
    except SyntaxError:
        # Still recognised by its words: the build comes first, the import's error later.
        for i, line in enumerate(text.splitlines(), 1):
            if re.search(r"\bimport\s+(?:[\w.]+\s*,\s*)*_C\b|\b_C\b.*\bimport\b|load_library\(.*_C", line):
                return line.strip(), i
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            names = {a.name for a in node.names}
            relative = node.level == 1 and ((node.module is None and "_C" in names) or node.module == "_C")
            absolute = node.level == 0 and ((node.module == package and "_C" in names) or node.module == f"{package}._C")
            if relative or absolute:
                return _statement(text, node), node.lineno
        elif isinstance(node, ast.Import) and any(a.name == f"{package}._C" for a in node.names):
            return _statement(text, node), node.lineno
        elif isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if called in ("load_library", "import_module") and "_C" in (ast.get_source_segment(text, node) or ""):
                return _statement(text, node), node.lineno
    return None


def _statement(text: str, node: ast.AST) -> str:
    """The node's source on one line, cut at 80 characters (it is quoted in one line of output)."""
    segment = " ".join((ast.get_source_segment(text, node) or "").split())
    return segment if len(segment) <= 80 else segment[:77] + "..."


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

    def other_routes(self) -> list[str]:
        """Build files the chosen route does not use, each with the flag that would."""
        also = []
        if self.setup_py is not None and self.route != "setuptools":
            also.append("setup.py (--route setuptools)")
        if self.cmakelists is not None and self.route != "cmake":
            also.append("CMakeLists.txt (--route cmake)")
        return also


def discover(path: str | os.PathLike[str]) -> Layout:
    """What the folder at ``path`` holds and the route ``opforge build`` takes.

    The sources decide where opforge can build them itself, the build files only
    where they cannot: a package importing ``_C`` is built in place (package);
    TORCH_LIBRARY code is loaded into torch.ops (jit); a
    ``PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)`` module is imported (pybind);
    then a CMakeLists.txt (cmake); a pybind11 module with its name written out,
    which only the pybind route's check explains (pybind); a setup.py with
    CppExtension/CUDAExtension (setuptools); anything else is tried as
    TORCH_LIBRARY code (jit), whose load says when it registered nothing.
    Raises DiscoveryError for a path that is no folder, holds nothing to build,
    or holds two packages that import ``_C``."""
    given = Path(path)
    root = given.resolve()
    if not root.exists():
        raise DiscoveryError(f"{given} is not a folder: nothing is there")
    if not root.is_dir():
        raise DiscoveryError(f"{given} is not a folder: give the folder that holds the sources")
    tree = walk(root)
    setup = root / "setup.py"
    setup_py = setup if setup.is_file() and _SETUP_EXTENSION.search(setup.read_text(errors="replace")) else None
    cmakelists = root / "CMakeLists.txt" if (root / "CMakeLists.txt").is_file() else None
    if not tree.sources and setup_py is None and cmakelists is None:
        skipped = f" (skipped: {', '.join(tree.rel(s) + '/' for s in tree.skipped)})" if tree.skipped else ""
        raise DiscoveryError(
            f"{given}: nothing to build: no C++ (.cpp, .cc, .cxx) or CUDA (.cu) source in it or its subfolders{skipped}, "
            "and no setup.py or CMakeLists.txt"
        )
    binding = read_binding([*tree.sources, *tree.headers()])
    packages = find_packages(root)
    if len(packages) > 1:
        named = ", ".join(f"{tree.rel(p.directory)} ({tree.rel(p.directory / '__init__.py')}:{p.line}: {p.statement})" for p in packages)
        raise DiscoveryError(
            f"{given}: {len(packages)} packages import a compiled _C: {named}; build one at a time (opforge build PACKAGE_FOLDER)"
        )
    package = packages[0] if packages else None
    te_name = [p for p in binding.pybind if p.name == "TORCH_EXTENSION_NAME"]
    if package is not None:
        route = "package"
        why = f"{package.name}/__init__.py imports _C: its library is built in place, as {tree.rel(package.target())}"
    elif binding.torch_library:
        route, why = "jit", "TORCH_LIBRARY operators: built into the cache, then loaded for torch.ops"
    elif te_name:
        route, why = "pybind", "a pybind11 module: built into the cache and imported"
    elif cmakelists is not None:
        route, why = "cmake", "CMakeLists.txt (the sources declare no binding opforge builds itself)"
    elif binding.pybind:
        # Its name written out: the pybind route's check says why that cannot import, before compiling.
        route, why = "pybind", "a pybind11 module"
    elif setup_py is not None:
        route, why = "setuptools", "a setup.py with CppExtension/CUDAExtension, and no binding found in the sources: built by build_ext"
    else:
        route, why = "jit", "no binding found in the sources: built as TORCH_LIBRARY code, then its load says what it registers"
    return Layout(tree, binding, package, setup_py, cmakelists, route, why)


def cuda_unavailable() -> str | None:
    """Why this machine builds no CUDA kernels (as ``opforge.build.want_cuda``
    decides), or None when it does."""
    import torch

    from opforge.build import build_cuda_flag, cuda_home, want_cuda

    if want_cuda():
        return None
    if build_cuda_flag() is False:
        return f"OPFORGE_BUILD_CUDA={os.environ['OPFORGE_BUILD_CUDA'].strip()}"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} has no CUDA"
    return f"nvcc was not found{f' in {cuda_home()}' if cuda_home() else ''} (set CUDA_HOME)"


def _listed(names: Sequence[str], most: int = 8) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def describe(layout: Layout, *, route: str, cuda_reason: str | None, cuda_archs: Sequence[str] = ()) -> list[str]:
    """What was found and what will be built, one line each: sources, include
    folders, binding, package, route, CUDA, and the CUDA sources left out."""
    tree = layout.tree
    cpp, cuda = tree.cpp, tree.cuda
    kinds = ", ".join(f"{n} {what}" for n, what in ((len(cpp), "C++"), (len(cuda), "CUDA")) if n)
    lines = [f"opforge build: {tree.root}"]
    listed = _listed([tree.rel(s) for s in tree.sources])
    lines.append(f"  sources: {len(tree.sources)} ({kinds}): {listed}" if tree.sources else "  sources: none")
    lines.append(f"  include: {_listed([tree.rel(d) for d in tree.include_dirs])}")
    lines.append(f"  binding: {layout.binding.summary(tree)}")
    if layout.package is not None and route == "package":
        p = layout.package
        made = "" if layout.binding.pyinit_c else " (no source defines PyInit__C: an empty one is added, so the import loads it)"
        lines.append(f"  package: {p.name} ({tree.rel(p.directory / '__init__.py')}:{p.line}: {p.statement}){made}")
    how = layout.why if route == layout.route else "asked for with --route"
    lines.append(f"  route: {route} ({how})")
    if layout.other_routes():
        lines.append(f"  also here: {', '.join(layout.other_routes())}")
    if route == "cmake":
        lines.append("  CUDA: as CMakeLists.txt says")
    elif not cuda:
        lines.append("  CUDA: no CUDA sources")
    elif cuda_reason is None:
        lines.append(f"  CUDA: yes (sm {', '.join(cuda_archs)})" if cuda_archs else "  CUDA: yes")
    else:
        lines.append(f"  CUDA: no ({cuda_reason})")
        lines.append(f"  left out: {_listed([tree.rel(s) for s in cuda])} ({cuda_reason})")
    if tree.skipped:
        lines.append(f"  skipped: {_listed([tree.rel(s) + '/' for s in tree.skipped])}")
    return lines


# --------------------------------------------------------------- the package route

# The module init a TORCH_LIBRARY-only _C lacks: importing the package runs
# `from . import _C`, and Python needs PyInit__C in the file to load it (the
# registrations run as the file loads). TORCH_EXTENSION_NAME is _C here.
_PYINIT = """\
// Generated by opforge: an empty Python module, so that `from . import _C` loads
// this library (its TORCH_LIBRARY registrations run as it loads).
#include <Python.h>

#define OPFORGE_STR2(x) #x
#define OPFORGE_STR(x) OPFORGE_STR2(x)
#define OPFORGE_CONCAT2(a, b) a##b
#define OPFORGE_CONCAT(a, b) OPFORGE_CONCAT2(a, b)

static PyModuleDef opforge_empty_module = {PyModuleDef_HEAD_INIT, OPFORGE_STR(TORCH_EXTENSION_NAME), nullptr, -1, nullptr};

PyMODINIT_FUNC OPFORGE_CONCAT(PyInit_, TORCH_EXTENSION_NAME)() { return PyModule_Create(&opforge_empty_module); }
"""


def package_config(layout: Layout, *, with_cuda: bool | None = None) -> BuildConfig:
    """The package's sources as a build of the JIT engine named ``_C``
    (TORCH_EXTENSION_NAME too, so a ``PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)``
    defines PyInit__C), with an empty PyInit__C added where no source defines one.
    A pybind11 module with another name is refused: Python would not find its init."""
    from opforge.build import BuildError, cache_root, cuda_archs, gencode_flags, want_cuda
    from opforge.build.jit import BuildConfig

    package = layout.package
    if package is None:
        raise DiscoveryError(f"{layout.root}: no package here imports a compiled _C (from . import _C in its __init__.py)")
    tree = layout.tree
    for p in layout.binding.pybind:
        if p.name not in ("TORCH_EXTENSION_NAME", "_C"):
            raise BuildError(
                f"opforge: {package.name} imports _C, but {tree.rel(p.file)}:{p.line} declares PYBIND11_MODULE({p.name}, {p.var}): "
                f"Python would look for PyInit__C in {package.name}/_C and find PyInit_{p.name}. "
                f"Write PYBIND11_MODULE(TORCH_EXTENSION_NAME, {p.var}) (opforge names it _C)"
            )
    cuda = bool(tree.cuda) and want_cuda() if with_cuda is None else with_cuda
    sources = list(tree.cpp) + (list(tree.cuda) if cuda else [])
    if not sources:
        raise BuildError(f"opforge: {package.name}: no C++ source to build under {layout.root}, and CUDA sources cannot be built here")
    if not layout.binding.pyinit_c and not any(p.name in ("TORCH_EXTENSION_NAME", "_C") for p in layout.binding.pybind):
        sources.append(_write_generated(cache_root(), "pyinit", "pyinit.cpp", _PYINIT))
    flags = ("-O3", "-fopenmp", *(("-DOPFORGE_WITH_CUDA",) if cuda else ()))
    archs = cuda_archs() if cuda else ()
    return BuildConfig(
        name=f"{package.name}_C",
        sources=tuple(sources),
        include_dirs=tree.include_dirs,
        cflags=flags,
        cuda_cflags=("-O3", "-DOPFORGE_WITH_CUDA", *gencode_flags(archs)) if cuda else (),
        ldflags=("-fopenmp",),
        with_cuda=cuda,
        cuda_archs=archs,
        extension_name="_C",
    )


def _write_generated(root: Path, kind: str, filename: str, text: str) -> Path:
    """``text`` as ``root/inline/<kind>-<hash>/<filename>``, beside inline's
    generated sources (``opforge cache`` lists and cleans them alike), written
    once: a rewrite would change its mtime, and ninja would compile it again."""
    folder = root / "inline" / f"{kind}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"
    target = folder / filename
    if not (target.is_file() and target.read_text() == text):
        folder.parent.mkdir(mode=0o700, exist_ok=True)
        folder.mkdir(mode=0o700, exist_ok=True)
        tmp = folder / f".{filename}.{os.getpid()}.tmp"
        tmp.write_text(text)
        os.replace(tmp, target)
    # The folder's mtime is its last use, for `opforge cache clean --older-than`.
    with contextlib.suppress(OSError):
        os.utime(folder)
    return target


def place_in_package(library: Path, package: Package) -> tuple[Path, bool]:
    """Copies the built library to ``package.target()`` (a new file moved into
    place: a process that has the old one loaded keeps its copy intact); returns
    the path and whether it changed. A copy, not a link: stripping or editing it
    must not touch the cache's entry."""
    target = package.target()
    if target.is_file() and target.stat().st_size == library.stat().st_size and _sha256(target) == _sha256(library):
        return target, False
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        shutil.copy2(library, tmp)
        os.replace(tmp, target)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise DiscoveryError(f"cannot write {target}: {exc.strerror or exc}") from None
    return target, True


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


__all__ = [
    "CPP_SUFFIXES",
    "CUDA_SUFFIXES",
    "HEADER_SUFFIXES",
    "SKIPPED_NAMES",
    "Binding",
    "DiscoveryError",
    "Layout",
    "Package",
    "PybindModule",
    "Tree",
    "cuda_unavailable",
    "describe",
    "discover",
    "extension_suffix",
    "find_packages",
    "headers_under",
    "imports_c",
    "package_config",
    "place_in_package",
    "pybind_modules",
    "read_binding",
    "skip_reason",
    "strip_comments",
    "walk",
]
