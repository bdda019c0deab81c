"""``opforge build``: opforge's own op library, a package of ``opforge new``'s,
or a user's folder of sources by any route. The route and the build are
``opforge.folders.route``'s; this module parses and prints."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from opforge.cli.args import usage_error
from opforge.cli.render import err, out
from opforge.cli.targets import library, resolve_targets
from opforge.folders.cmake import parse_definition
from opforge.project import ProjectError, project_library


def cmake_definition(text: str) -> str:
    """-D: a CMake cache definition, NAME=VALUE (opforge.folders.cmake.parse_definition)."""
    try:
        return parse_definition(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def cmd_build(args: argparse.Namespace) -> int:
    # lazy: import time (opforge.folders.route and the routes it imports, setuptools among them): every opforge command loads this module
    from opforge.folders.route import project_route

    dry_run = getattr(args, "dry_run", False)
    defines: list[str] = getattr(args, "defines", None) or []
    if args.path is None:
        if dry_run:
            usage_error("opforge build: --dry-run needs the folder to plan (opforge build PATH --dry-run)")
        if defines:
            usage_error(f"opforge build: -D {defines[0]} is a CMake definition: give the folder (opforge build PATH -D NAME=VALUE)")
        return print_library()
    try:
        target = project_route(args.path, args.route, dry_run=dry_run, defines=defines)
    except ProjectError as exc:
        raise SystemExit(f"opforge build: {exc}") from None
    if target.project:  # a package of opforge new's: its import builds (JIT) and loads it
        return build_project(target.folder)
    # --all-archs is for the folder given; a package's sources folder builds for this machine's GPUs.
    all_archs = args.all_archs and target.folder == args.path
    return build_folder(target.folder, target.route, all_archs=all_archs, dry_run=dry_run, defines=defines)


def build_project(path: Path) -> int:
    # Resolved: `opforge build NAME` names a folder, where check and bench read a bare word as an operator.
    names, _, _ = resolve_targets([str(path.resolve())])
    lib = project_library(path)
    if lib is not None:
        how = "prebuilt" if lib.route == "prebuilt" else f"built in {lib.build_seconds:.1f} s" if lib.built_now else "cached"
        out.print(f"{path}: {lib.path} ({how}; CUDA kernels: {'yes' if lib.with_cuda else 'no'})")
    out.print(f"{path}: operators {', '.join(names)} loaded into torch.ops, specs registered")
    return 0


def print_library(*, wait_fast: bool = True) -> int:
    lib = library(wait_fast=wait_fast)
    how = "named by OPFORGE_LIBRARY" if lib.route == "file" else f"built now in {lib.build_seconds:.1f} s" if lib.built_now else "cached"
    out.print(f"op library: {lib.path} ({how}; CUDA kernels: {'yes' if lib.with_cuda else 'no'})")
    return 0


def _say(line: str) -> None:
    out.print(line, highlight=False, markup=False)


def _warn(line: str) -> None:
    err.print(line, highlight=False, markup=False)


def build_folder(path: Path, route: str = "auto", *, all_archs: bool = False, dry_run: bool = False, defines: Sequence[str] = ()) -> int:
    """A user's folder of sources built by ``opforge.folders.route.build_folder``,
    what it says printed; a route the folder cannot take is a usage error."""
    # lazy: import time (opforge.folders.route and the routes it imports, setuptools among them): every opforge command loads this module
    from opforge.folders.route import RouteError
    from opforge.folders.route import build_folder as build_by_route

    try:
        return build_by_route(path, route, say=_say, warn=_warn, all_archs=all_archs, dry_run=dry_run, defines=defines)
    except RouteError as exc:
        usage_error(str(exc))
