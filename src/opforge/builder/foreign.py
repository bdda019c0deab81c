"""Code written for another framework, kept in a PyTorch project's tree.

Tutorial repositories keep a TensorFlow (or JAX, PaddlePaddle...) version of an
operator beside the PyTorch one (``pytorch/`` and ``tensorflow/``, sharing a
``kernel/`` folder). Compiled into the PyTorch build, such sources fail on
headers that are not installed, or define the same kernels twice. ``find_foreign``
tells them apart so that ``opforge.builder.discover.walk`` leaves them out and
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


__all__ = ["FRAMEWORK_FOLDERS", "FRAMEWORK_INCLUDES", "TORCH_INCLUDES", "Foreign", "find_foreign"]
