"""What sources say, read from their text without compiling them.

``read_binding``: what a folder's C++ binds, read from its sources without compiling them:
``TORCH_LIBRARY`` blocks, ``torch::RegisterOperators``, pybind11 modules and
``PyInit__C``, with comments and string literals blanked first.

``find_foreign``: code written for another framework, kept in a PyTorch project's tree.
Tutorial repositories keep a TensorFlow (or JAX, PaddlePaddle...) version of an
operator beside the PyTorch one (``pytorch/`` and ``tensorflow/``, sharing a
``kernel/`` folder). Compiled into the PyTorch build, such sources fail on
headers that are not installed, or define the same kernels twice. ``find_foreign``
tells them apart so that ``opforge.builder.sources.walk`` leaves them out and
the description of a build names each one (nothing is left out silently):

* a source that includes another framework's headers (``<tensorflow/...>``,
  XLA's FFI ``<xla/ffi/...>``...), directly or through a header of the tree it
  includes with quotes, or that is named ``*.cu.cc`` (TensorFlow's name for a
  CUDA source), is left out;
* a folder below the root named for another framework (``tensorflow/``,
  ``jax_ops/``) in which no source includes a torch header is left out whole,
  its CUDA kernels and plain C++ included. A folder named ``tf`` only where a
  source in it shows the framework: the name alone is too short to tell.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

# String and character literals are matched so that a "//" inside one is not taken for a comment.
_COMMENT_OR_LITERAL = re.compile(r"//[^\n]*|/\*.*?\*/|\"(?:\\.|[^\"\\\n])*\"|'(?:\\.|[^'\\\n])*'", re.S)
# PYBIND11_MODULE(name, m) and pybind11 >= 2.10's PYBIND11_MODULE(name, m, options...).
_PYBIND11_MODULE = re.compile(r"\bPYBIND11_MODULE\s*\(\s*([A-Za-z_]\w*)\s*,\s*([A-Za-z_]\w*)\s*[,)]")
# TORCH_LIBRARY(ns, m), TORCH_LIBRARY_FRAGMENT(ns, m), TORCH_LIBRARY_IMPL(ns, Key, m) and their STABLE_ forms.
_TORCH_LIBRARY = re.compile(
    r"\b(?:STABLE_)?TORCH_LIBRARY(?P<kind>_FRAGMENT|_IMPL)?\s*\(\s*(?P<ns>[A-Za-z_]\w*)\s*(?:,\s*(?P<key>[A-Za-z_]\w*)\s*)?,"
)
_PYINIT_C = re.compile(r"\bPyInit__C\b")
# The registration API before TORCH_LIBRARY: torch::RegisterOperators("ns::op(...) -> ...", &fn), its .op(...)
# chains and c10::RegisterOperators::options().schema("ns::op"); a statement runs to its ";".
_REGISTER_OPERATORS = re.compile(r"\bRegisterOperators\b[^;]*", re.S)
_QUALIFIED_OP = re.compile(r'"\s*([A-Za-z_]\w*)::([A-Za-z_]\w*)')


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


class RelativePaths(Protocol):
    """What names a file the way a build's description does (``Tree.rel``)."""

    def rel(self, path: Path) -> str: ...


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
    # Per namespace, the operators registered with torch::RegisterOperators (the API before TORCH_LIBRARY).
    registered: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)

    @property
    def torch_library(self) -> bool:
        """Operators for torch.ops: TORCH_LIBRARY and its kin, or torch::RegisterOperators."""
        return bool(self.namespaces or self.impls or self.registered)

    def operator_namespaces(self, extension_name: str = "") -> list[str]:
        """Every namespace the sources register operators in, TORCH_EXTENSION_NAME
        as ``extension_name`` (what the build defines it as) where given."""
        found = {*self.namespaces, *self.impls, *self.registered}
        if extension_name and "TORCH_EXTENSION_NAME" in found:
            found = (found - {"TORCH_EXTENSION_NAME"}) | {extension_name}
        return sorted(found)

    def summary(self, tree: RelativePaths, extension_name: str = "") -> str:
        """What binds, in a line; ``tree`` (a ``opforge.builder.sources.Tree``) names the files."""
        parts = []
        for ns in sorted({*self.namespaces, *self.impls}):
            keys = self.impls.get(ns, ())
            what = "TORCH_LIBRARY" if ns in self.namespaces else "TORCH_LIBRARY_IMPL"
            notes = [f"kernels: {', '.join(keys)}"] if keys else []
            if ns == "TORCH_EXTENSION_NAME" and extension_name:
                ns, notes = extension_name, ["TORCH_EXTENSION_NAME, the library's name", *notes]
            parts.append(f"{what} {ns}" + (f" ({'; '.join(notes)})" if notes else ""))
        for ns, ops in self.registered.items():
            parts.append(f"torch::RegisterOperators {ns} ({len(ops)} operator{'s' if len(ops) != 1 else ''})")
        parts += [f"pybind11 module, PYBIND11_MODULE({p.name}, {p.var}) at {tree.rel(p.file)}:{p.line}" for p in self.pybind]
        if self.pyinit_c:
            parts.append("PyInit__C")
        return "; ".join(parts) or "none found (no TORCH_LIBRARY, torch::RegisterOperators or PYBIND11_MODULE in the sources)"


def read_binding(files: Iterable[Path]) -> Binding:
    namespaces: set[str] = set()
    impls: dict[str, set[str]] = {}
    pybind: list[PybindModule] = []
    pyinit = False
    registered: dict[str, set[str]] = {}
    for f in files:
        text = f.read_text(errors="replace")
        code = _code(text)
        if "RegisterOperators" in code:
            # The schema strings name the operators: read from the text with its literals, not its comments.
            for statement in _REGISTER_OPERATORS.finditer(strip_comments(text)):
                for ns, op in _QUALIFIED_OP.findall(statement[0]):
                    registered.setdefault(ns, set()).add(op)
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
        registered={ns: tuple(sorted(ops)) for ns, ops in sorted(registered.items())},
    )


# --------------------------------------------------------------- the package


# An include's path prefix -> the framework whose header it is.
FRAMEWORK_INCLUDES: tuple[tuple[str, str], ...] = (
    ("tensorflow/", "TensorFlow"),
    ("xla/ffi/", "JAX (XLA FFI)"),
    ("jaxlib/", "JAX"),
    ("paddle/", "PaddlePaddle"),
    ("mxnet/", "MXNet"),
    ("mindspore/", "MindSpore"),
    ("oneflow/", "OneFlow"),
)
# A word of a folder's name (split at _ - .) -> the framework it names.
FRAMEWORK_FOLDERS: dict[str, str] = {
    "tensorflow": "TensorFlow",
    "tf": "TensorFlow",
    "jax": "JAX",
    "paddle": "PaddlePaddle",
    "paddlepaddle": "PaddlePaddle",
    "mxnet": "MXNet",
    "mindspore": "MindSpore",
    "oneflow": "OneFlow",
}
# Names shown by the name alone; the others need a source that shows the framework.
_NAME_ENOUGH = {w for w in FRAMEWORK_FOLDERS if w != "tf"}
TORCH_INCLUDES = ("torch/", "ATen/", "c10/")

_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*([<"])([^>"\n]+)[>"]', re.M)


@dataclasses.dataclass(frozen=True)
class Foreign:
    """A folder (or one source) left out of the build: another framework's code."""

    path: Path  # the folder, or the source
    framework: str
    evidence: str  # why, in a few words, paths relative to the root
    sources: tuple[Path, ...]  # the sources it leaves out


@dataclasses.dataclass(frozen=True)
class _Scan:
    framework: str | None  # the first foreign framework the file includes
    evidence: str  # "<tensorflow/core/framework/op.h>" or ""
    torch: bool  # includes a torch header


def _includes(path: Path) -> list[tuple[str, str]]:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    return [(m[1], m[2].strip()) for m in _INCLUDE.finditer(text)]


def _framework_of(include: str) -> str | None:
    return next((name for prefix, name in FRAMEWORK_INCLUDES if include.startswith(prefix)), None)


def _scan(source: Path, root: Path) -> _Scan:
    """What ``source`` includes, and through its quoted includes of the tree's own headers, one level down."""
    if source.name.endswith(".cu.cc"):
        return _Scan("TensorFlow", "TensorFlow's name for a CUDA source (.cu.cc)", False)
    found: str | None = None
    evidence = ""
    torch = False
    own = _includes(source)
    for _, inc in own:
        torch = torch or inc.startswith(TORCH_INCLUDES)
        if found is None and (fw := _framework_of(inc)):
            found, evidence = fw, f"includes <{inc}>"
    for quote, inc in own:
        if quote != '"' or found is not None:
            continue
        for base in (source.parent, root):
            header = base / inc
            if header.is_file():
                for _, nested in _includes(header):
                    torch = torch or nested.startswith(TORCH_INCLUDES)
                    if found is None and (fw := _framework_of(nested)):
                        found, evidence = fw, f"includes {inc}, which includes <{nested}>"
                break
    return _Scan(found, evidence, torch)


def _named_framework(folder: Path) -> str | None:
    words = re.split(r"[_\-.]", folder.name.lower())
    return next((FRAMEWORK_FOLDERS[w] for w in words if w in FRAMEWORK_FOLDERS), None)


def find_foreign(root: Path, sources: Iterable[Path]) -> list[Foreign]:
    """The foreign folders and sources among ``sources`` (all below ``root``), sorted by path."""
    sources = list(sources)
    scans = {s: _scan(s, root) for s in sources}
    with_torch = {p for s, sc in scans.items() if sc.torch for p in s.parents if p.is_relative_to(root)}
    folders: dict[Path, Foreign] = {}
    for folder in sorted({p for s in sources for p in s.parents if p.is_relative_to(root) and p != root}, key=lambda p: len(p.parts)):
        if folder in with_torch or any(folder.is_relative_to(f) for f in folders):
            continue
        framework = _named_framework(folder)
        if framework is None:
            continue
        inside = tuple(s for s in sources if s.is_relative_to(folder))
        shown = next(((s, scans[s]) for s in inside if scans[s].framework), None)
        if shown is None and not any(w in _NAME_ENOUGH for w in re.split(r"[_\-.]", folder.name.lower())):
            continue
        evidence = f"a folder named for {framework}"
        if shown is not None:
            evidence += f"; {shown[0].relative_to(root).as_posix()} {shown[1].evidence}"
        folders[folder] = Foreign(folder, framework, evidence, inside)
    found = list(folders.values())
    for s, sc in scans.items():
        if sc.framework and not any(s.is_relative_to(f) for f in folders):
            found.append(Foreign(s, sc.framework, sc.evidence, (s,)))
    return sorted(found, key=lambda f: f.path.relative_to(root).as_posix())


__all__ = [
    "FRAMEWORK_FOLDERS",
    "FRAMEWORK_INCLUDES",
    "TORCH_INCLUDES",
    "Binding",
    "Foreign",
    "PybindModule",
    "RelativePaths",
    "find_foreign",
    "pybind_modules",
    "read_binding",
    "strip_comments",
]
