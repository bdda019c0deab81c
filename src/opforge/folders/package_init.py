"""A Python package's compiled modules: how its ``__init__.py`` imports ``_C``
(``imports_c``, read without running it) and the file names Python imports
extension modules from (``extension_suffix``, ``abi3_suffix``)."""

from __future__ import annotations

import ast
import dataclasses
import importlib.machinery
import re
import sysconfig
from pathlib import Path


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


def abi3_suffix() -> str:
    """The suffix setuptools gives a ``py_limited_api=True`` extension (".abi3.so"),
    found as setuptools finds it; this Python's own where it imports no abi3 file."""
    return next((s for s in importlib.machinery.EXTENSION_SUFFIXES if ".abi3" in s), extension_suffix())


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


__all__ = ["Package", "abi3_suffix", "extension_suffix", "imports_c"]
