"""``opforge abi FILE...`` (and ``python -m opforge.abi``): the arguments of the stable-ABI audit."""

from __future__ import annotations

import argparse
from pathlib import Path

from opforge.abi.audit import SHOW, run


def _add_arguments(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("paths", nargs="+", type=Path, metavar="FILE", help="a shared library (.so) or a wheel (.whl: every .so inside)")
    sp.add_argument("--all", action="store_true", help=f"list every non-stable symbol (default: the first {SHOW})")
    sp.add_argument("--torch-include", type=Path, default=None, metavar="DIR",
                    help="the include directory of the torch whose shim to check against (default: the installed torch's)")  # fmt: skip


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    """Adds ``opforge abi FILE...`` to the CLI's subcommands."""
    sp = subparsers.add_parser("abi", help="audit a built library or wheel: does it use only torch's stable ABI, from which torch on")
    _add_arguments(sp)
    sp.set_defaults(fn=lambda args: run(args.paths, show_all=args.all, include=args.torch_include))


def main(argv: list[str] | None = None) -> int:
    """``python -m opforge.abi FILE``: works even where the opforge command is not installed."""
    parser = argparse.ArgumentParser(prog="python -m opforge.abi")
    _add_arguments(parser)
    ns = parser.parse_args(argv)
    return run(ns.paths, show_all=ns.all, include=ns.torch_include)
