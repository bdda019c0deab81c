"""What ``opforge build PATH`` says it found, one line each, before anything
compiles: sources, include folders, binding, route, the precompiled header,
CUDA (and the CUDA sources that cannot be built here), another framework's
code left out, skipped folders."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from opforge.builder.archs import cuda_home
from opforge.builder.config import build_cuda_flag, want_cuda
from opforge.builder.pch import plan
from opforge.builder.sources import library_name
from opforge.folders.discover import Layout, foreign_name, skipped_name


def cuda_unavailable() -> str | None:
    """Why this machine builds no CUDA kernels (as ``opforge.builder.want_cuda``
    decides), or None when it does."""
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
    # What the build defines TORCH_EXTENSION_NAME as, where one name is built (setup.py names one per extension).
    named = {"jit": library_name(tree.root), "setuptools": library_name(tree.root), "package": "_C"}.get(route, "")
    lines.append(f"  binding: {layout.binding.summary(tree, named)}")
    if layout.package is not None and route == "package":
        p = layout.package
        made = "" if layout.binding.pyinit_c else " (no source defines PyInit__C: an empty one is added, so the import loads it)"
        lines.append(f"  package: {p.name} ({tree.rel(p.directory / '__init__.py')}:{p.line}: {p.statement}){made}")
    how = layout.why if route == layout.route else "asked for with --route"
    lines.append(f"  route: {route} ({how})")
    if route in ("jit", "pybind", "package") and cpp:
        lines.append(f"  precompiled header: {plan(cpp, tree.include_dirs).summary(tree.root, len(cpp))}")
    if layout.other_routes(route):
        lines.append(f"  also here: {', '.join(layout.other_routes(route))}")
    if route == "cmake":
        lines.append("  CUDA: as CMakeLists.txt says")
    elif not cuda:
        lines.append("  CUDA: no CUDA sources")
    elif cuda_reason is None:
        lines.append(f"  CUDA: yes (sm {', '.join(cuda_archs)})" if cuda_archs else "  CUDA: yes")
    else:
        lines.append(f"  CUDA: no ({cuda_reason})")
        lines.append(f"  left out: {_listed([tree.rel(s) for s in cuda])} ({cuda_reason})")
    if tree.foreign:
        shown = _listed([foreign_name(tree, f) for f in tree.foreign], most=4)
        lines.append(f"  left out, not PyTorch code: {shown}")
    if tree.programs and route in ("jit", "inline", "setuptools", "pybind", "package"):
        # Linked into the one library these routes make, each program's main would clash with the next.
        shown = _listed([tree.rel(p) for p in tree.programs])
        lines.append(f"  left out, programs (each defines main(), not library code): {shown}")
    if tree.unusable:
        shown = _listed([f"{tree.rel(p)} ({why})" for p, why in tree.unusable])
        lines.append(f"  left out, cannot be used: {shown}")
    if tree.skipped:
        lines.append(f"  skipped: {_listed([skipped_name(tree, s) for s in tree.skipped])}")
    return lines


__all__ = ["cuda_unavailable", "describe"]
