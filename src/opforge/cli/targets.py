"""What a command's operands name: operators, package directories of
``opforge new``'s and spec files, resolved once here for every command, with
the device they run on."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

import opforge
from opforge.builder.errors import BuildError
from opforge.cli.args import usage_error
from opforge.cli.render import err, out
from opforge.derive import describe, has_kernel_for
from opforge.project import ProjectError, TargetNotFound, names_a_path, project_library, resolve_target
from opforge.registry import get_specs

if TYPE_CHECKING:
    from opforge.builder.jit import Library
    from opforge.opspec import OpSpec


def library(*, wait_fast: bool = True) -> Library:
    """The op library, built and loaded, and the eager fast path attached (its
    first build finished), so that what a command times and checks is what a
    user's calls run; a build failure is a message, not a traceback.
    ``wait_fast=False``: the fast path attaches when its build ends (the main job
    starts its checks meanwhile and waits only before timing)."""
    try:
        return opforge.load(wait_fast=wait_fast)
    except BuildError as exc:
        err.print(str(exc), highlight=False, markup=False)
        raise SystemExit(1) from None


def pick_device(
    name: str, projects_cuda: dict[str, bool] | None = None, *, own_library: bool = True, wait_fast: bool = True
) -> torch.device:
    """``projects_cuda``: whether each package directory's library has CUDA kernels (auto picks the CPU if one has not);
    ``own_library``: opforge's op library is in play (not when every operator asked for is a package's)."""
    if own_library:
        library(wait_fast=wait_fast)
    without = sorted(d for d, cuda in (projects_cuda or {}).items() if not cuda)
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() and not without else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            usage_error("opforge: --device cuda but torch sees no GPU (torch.cuda.is_available() is False)")
        if own_library and not library(wait_fast=wait_fast).with_cuda:
            usage_error("opforge: --device cuda but the op library was built without CUDA kernels (no nvcc, or OPFORGE_BUILD_CUDA=0)")
        if without:
            what = ", ".join(without)
            usage_error(f"opforge: --device cuda but {what} has no CUDA kernels (--no-cuda, no nvcc, or OPFORGE_BUILD_CUDA=0)")
    return torch.device(name)


# The spec files and package folders resolve_targets loaded in this process, resolved, in order: what the
# checks' own process loads again (opforge.check.process).
_LOADED: list[str] = []


def loaded_targets() -> list[str]:
    return list(_LOADED)


def forget_loaded() -> None:
    """A new command starts with none: its checks' process loads what it named, not what an
    earlier command in this process (a test's, a notebook's) did."""
    _LOADED.clear()


def resolve_targets(names: Sequence[str]) -> tuple[list[str], dict[str, bool], bool]:
    """``names`` with each package directory (``opforge new``'s, a ``[tool.opforge]``
    table in its pyproject.toml) and each spec file (``FILE.py``, its ``SPECS``)
    loaded and replaced by its operators' qualified names (opforge.project.resolve_target,
    which ``opforge profile`` uses too); per directory or file, whether its operators
    have CUDA kernels; and whether opforge's own op library is needed (no names, or
    a name that is neither). A spec file's report says what was derived from the schema."""
    expanded: list[str] = []
    cuda: dict[str, bool] = {}
    for n in names:
        try:
            path, specs = resolve_target(n)
        except TargetNotFound as exc:
            usage_error(f"opforge: {exc}")
        except ProjectError as exc:
            raise SystemExit(f"opforge: {exc}") from None
        except BuildError as exc:
            err.print(str(exc), highlight=False, markup=False)
            raise SystemExit(1) from None
        if path is None:
            expanded.append(n)
            continue
        if str(path) not in _LOADED:
            _LOADED.append(str(path))
        expanded += [s.qualname for s in specs]
        if path.suffix == ".py":
            for spec in specs:
                if note := describe(spec):
                    out.print(f"{spec.qualname} ({n}): {note}", highlight=False, markup=False)
            cuda[n] = all(has_kernel_for(s.overload, "cuda") for s in specs)
        else:
            lib = project_library(path)
            cuda[n] = bool(lib and lib.with_cuda)
    return expanded, cuda, not names or len(cuda) < len(names)


def specs_of(names: Sequence[str], *, own_library: bool = True, wait_fast: bool = True) -> list[OpSpec]:
    """The specs of ``names`` (all, for none); a name of no operator is a usage error."""
    if own_library:
        library(wait_fast=wait_fast)
    try:
        return get_specs(names)
    except KeyError as exc:
        message = exc.args[0]
        # `opforge check my_op` beside a folder my_op/ means the operator; say how to name the folder.
        folders = [n for n in names if not names_a_path(n) and f"{n!r}" in message and Path(n).is_dir()]
        usage_error(f"opforge: {message}" + "".join(f" ({n}/ is a folder here: write ./{n} for the package in it)" for n in folders))


def fast_path_for_packages() -> None:
    """A package's public functions take the eager fast path, as they do in a
    user's process (where importing the package imports opforge, which loads its
    library and the fast path's module): both are loaded before the packages
    are. Without them they are timed through torch.ops."""
    try:
        opforge.load(wait_fast=True)
    except BuildError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        err.print(f"opforge bench: opforge's op library did not build ({first}); package operators are timed without the eager fast path",
                  highlight=False, markup=False, soft_wrap=True)  # fmt: skip


def device_and_specs(names: Sequence[str], device_name: str, *, wait_fast: bool = True) -> tuple[Any, list[Any]]:
    """The device and the specs of ``names`` (package directories loaded); ``wait_fast``: as ``library``'s."""
    if any(names_a_path(n) and Path(n).is_dir() for n in names):
        fast_path_for_packages()
    names, projects_cuda, own_library = resolve_targets(names)
    device = pick_device(device_name, projects_cuda, own_library=own_library, wait_fast=wait_fast)
    return device, specs_of(names, own_library=own_library, wait_fast=wait_fast)
