"""What a folder's C++ binds, read from its sources without compiling them:
``TORCH_LIBRARY`` blocks, ``torch::RegisterOperators``, pybind11 modules and
``PyInit__C``, with comments and string literals blanked first."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from opforge.builder.discover import Tree

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

    def summary(self, tree: Tree, extension_name: str = "") -> str:
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
