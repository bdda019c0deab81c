"""``opforge profile``: its arguments, and the runner's (``python -m opforge.profile --run-case``) that ncu starts."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opforge.builder.errors import BuildError
from opforge.cli.args import Parser, call_count, seed
from opforge.console import err
from opforge.profile.run import EXIT_USAGE, RUN_SEED, WARMUP_CALLS, profile_op, run_case, sanitize_op
from opforge.project import ProjectError, TargetNotFound, resolve_target


def _package_ops(target: str) -> tuple[Path | None, list[str]] | int:
    """``target`` as (package directory or spec file, or None; operators), by the
    resolution every command shares (opforge.project.resolve_target): an
    operator's name stands for itself. An int is the exit status of a failed
    load, already reported."""
    try:
        path, specs = resolve_target(target)
    except TargetNotFound as exc:
        err.print(f"opforge profile: {exc}", soft_wrap=True, markup=False, highlight=False)
        return EXIT_USAGE
    except (ProjectError, BuildError) as exc:
        err.print(f"opforge profile: {exc}", soft_wrap=True, markup=False, highlight=False)
        return 1
    return (None, [target]) if path is None else (path, [s.qualname for s in specs])


def _cmd_profile(args: argparse.Namespace) -> int:
    targets: list[tuple[Path | None, list[str]]] = []
    for target in args.op:
        found = _package_ops(target)
        if isinstance(found, int):
            return found
        targets.append(found)
    status = 0
    if args.sanitize:
        # One sanitizer run per tool checks every operator named (`opforge check A B ...`), and
        # one per package (`opforge check DIR` checks all its operators).
        names = [op for project, ops in targets if project is None for op in ops]
        if names:
            status = sanitize_op(names if len(names) > 1 else names[0], args.seed, project=None)
        for project, ops in targets:
            if project is not None:
                status = max(status, sanitize_op(ops[0], args.seed, project=project))
        return status
    for project, ops in targets:
        for op in ops:
            status = max(status, profile_op(op, args.case, args.dtype, args.full, project=project))
    return status


def register_cli(subparsers: Any) -> None:
    """Adds ``opforge profile`` to the command's subparsers."""
    sp = subparsers.add_parser(
        "profile",
        help="profile one operator's kernels with Nsight Compute, or run compute-sanitizer over its checks (--sanitize)",
    )
    sp.add_argument(
        "op",
        nargs="+",
        help="operators, package directories of opforge new's given as paths (./my_op, my_op/: each of their operators), "
        "or spec files (my_specs.py: the operators its SPECS list)",
    )
    sp.add_argument("--case", default=None, help="benchmark case to profile, by name (e.g. 2^20; default: the largest)")
    sp.add_argument("--dtype", default="float32", help="dtype of the inputs (default float32)")
    sp.add_argument("--full", action="store_true", help="also save ncu's full report (.ncu-rep) in the current folder")
    sp.add_argument("--sanitize", action="store_true", help="run memcheck, racecheck, initcheck and synccheck over `opforge check`")
    sp.add_argument("--seed", type=seed, default=None, help="--sanitize: seed of the check's inputs (default: fresh, printed)")
    sp.set_defaults(fn=_cmd_profile)


def runner_main(argv: Sequence[str] | None = None) -> int:
    p = Parser(prog="python -m opforge.profile", description="The runner `opforge profile` runs under ncu.")
    p.add_argument("--run-case", nargs=3, metavar=("OP", "CASE", "DTYPE"), required=True)
    p.add_argument("--seed", type=seed, default=RUN_SEED)
    p.add_argument("--warmup", type=call_count, default=WARMUP_CALLS)
    p.add_argument("--project", default=None, help="the package directory of opforge new's, or the spec file, whose operator OP is")
    a = p.parse_args(argv)
    op, case, dtype = a.run_case
    return run_case(op, case, dtype, seed=a.seed, warmup=a.warmup, project=a.project)
