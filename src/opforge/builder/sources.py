"""The sources of a folder, found before anything compiles: ``walk`` finds every
C++ and CUDA source and the include folders in any subfolder, and leaves out what
is not the library's code (build outputs, tests, caches, hidden folders, vendored
libraries' sources, another framework's code and programs that define ``main``).
The build's own recipes (``opforge.builder.config.folder_config``) and every
route that reads a user's folder (``opforge.folders``) start from it."""

from __future__ import annotations

import dataclasses
import errno
import os
import re
from collections.abc import Iterable
from pathlib import Path

from opforge.builder.source_text import Foreign, find_foreign, read_binding, strip_comments

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


# A program's entry point at file scope: `int main(`, `auto main(` (a test or example program, not library code).
_MAIN = re.compile(r"^[ \t]*(?:(?:static|extern|inline)\s+)*(?:int|auto|signed)\s+main\s*\(", re.M)


class SourceKinds:
    """``cpp`` and ``cuda``: the C++ and the CUDA files among a dataclass's ``sources``
    (a folder's tree, a setup.py's extension)."""

    sources: tuple[Path, ...]

    @property
    def cpp(self) -> tuple[Path, ...]:
        return tuple(s for s in self.sources if s.suffix in CPP_SUFFIXES)

    @property
    def cuda(self) -> tuple[Path, ...]:
        return tuple(s for s in self.sources if s.suffix in CUDA_SUFFIXES)


class DiscoveryError(ValueError):
    """The path cannot be built as given: the message names it and says why."""


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
class Tree(SourceKinds):
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
    Another framework's code (``opforge.builder.source_text``) is left out, its
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


def library_name(root: Path) -> str:
    """The name a folder's library is built under (and TORCH_EXTENSION_NAME, as
    torch's ``load(name=)`` takes it): the folder's name, made an identifier."""
    return "".join(c if c.isalnum() else "_" for c in root.name)


__all__ = [
    "CPP_SUFFIXES",
    "CUDA_SUFFIXES",
    "HEADER_SUFFIXES",
    "SKIPPED_NAMES",
    "SOURCE_SUFFIXES",
    "VENDORED",
    "VENDORED_NAMES",
    "DiscoveryError",
    "Tree",
    "defines_main",
    "headers_under",
    "include_folders",
    "library_name",
    "shown_path",
    "skip_reason",
    "unusable_reason",
    "walk",
]
