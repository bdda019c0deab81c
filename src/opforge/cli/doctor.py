"""``opforge doctor [--json]`` (and ``python -m opforge.doctor``)."""

from __future__ import annotations

import argparse

from opforge.doctor.report import run


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    """Adds ``opforge doctor [--json]`` to the CLI's subcommands."""
    sp = subparsers.add_parser("doctor", help="check the toolchain, GPUs and build cache; print a report for bug reports")
    sp.add_argument("--json", action="store_true", help="print the report as JSON")
    sp.set_defaults(fn=lambda args: run(args.json))


def main(argv: list[str] | None = None) -> int:
    """``python -m opforge.doctor [--json]``: works even where the opforge command is not installed."""
    parser = argparse.ArgumentParser(prog="python -m opforge.doctor")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    return run(parser.parse_args(argv).json)
