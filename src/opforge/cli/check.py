"""``opforge list`` and ``opforge check``."""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

from rich.markup import escape
from rich.table import Table

from opforge.cli.args import pick_seed, usage_error
from opforge.cli.render import err, out
from opforge.cli.targets import pick_device, resolve_targets, specs_of


def cmd_list(args: argparse.Namespace) -> int:
    table = Table(title="opforge operators")
    table.add_column("operator")
    table.add_column("schema")
    table.add_column("autograd")
    for spec in specs_of([]):
        table.add_row(spec.qualname, str(spec.schema), "yes" if spec.differentiable else "")
    out.print(table)
    return 0


def check_ops(
    specs: Sequence[Any], device: Any, seed: int, checks: Sequence[str], seeds: int = 1, reference_on: str = "device"
) -> dict[str, list[Any]]:
    """Every check of every operator, a line per operator as each finishes;
    the results by qualified name."""
    from opforge.check import check_op
    from opforge.report import Steps, check_cell

    results: dict[str, list[Any]] = {}
    steps = Steps(err, len(specs), "checking")
    with steps.running():
        for spec in specs:
            steps.doing(spec.name)
            start = time.perf_counter()
            results[spec.qualname] = check_op(spec, device, seed, checks, seeds, reference_device="cpu" if reference_on == "cpu" else None)
            cells = ", ".join(f"{r.check} {check_cell(r)}" for r in results[spec.qualname])
            steps.line(f"check {spec.name}: {cells} ({time.perf_counter() - start:.1f} s)")
    return results


def check_failures(results: dict[str, list[Any]]) -> list[str]:
    """The failures' messages, the first five per operator and check."""
    failures: list[str] = []
    for rs in results.values():
        for r in rs:
            failures += [f"{r.check}: {f}" for f in r.failures[:5]]
            if len(r.failures) > 5:
                failures.append(f"{r.check}: ... {len(r.failures) - 5} more")
    return failures


def run_check(
    names: Sequence[str],
    device_name: str,
    seed: int | None,
    checks: Sequence[str],
    seeds: int = 1,
    report: bool = False,
    reference_on: str = "device",
) -> bool:
    from opforge.report import check_table, worst_table

    names, projects_cuda, own_library = resolve_targets(names)
    device = pick_device(device_name, projects_cuda, own_library=own_library)
    seed = pick_seed(seed)
    specs = specs_of(names, own_library=own_library)
    err.print(f"opforge check on {device}, seed {seed}{f' (+{seeds - 1} more)' if seeds > 1 else ''} (rerun with --seed {seed})")
    results = check_ops(specs, device, seed, checks, seeds, reference_on)
    out.print(check_table(f"opforge check ({device}, seed {seed}{f', {seeds} seeds' if seeds > 1 else ''})", checks, results))
    worst_rows = [(spec.name, case, e) for spec in specs for r in results[spec.qualname] for case, e in r.worst.items()]
    if worst_rows:
        out.print(worst_table(worst_rows, per_case=report))
    for f in check_failures(results):
        out.print(f"[red]x[/] {escape(f)}", highlight=False)
    # What the sharding check found valid but undeclared: what to add to the spec.
    for rs in results.values():
        for r in rs:
            if r.check == "sharding" and r.status != "n/a" and r.note:
                out.print(f"sharding: {escape(r.op)}: {escape(r.note)}", highlight=False)
    n_pass = sum(r.status == "pass" for rs in results.values() for r in rs)
    n_fail = sum(r.status == "fail" for rs in results.values() for r in rs)
    out.print(f"{n_pass} passed, {n_fail} failed")
    return n_fail == 0


def cmd_check(args: argparse.Namespace) -> int:
    checks = args.checks.split(",") if args.checks else None
    from opforge.check import CHECKS

    for c in checks or ():
        if c not in CHECKS:
            usage_error(f"opforge: unknown check {c!r}; choose from {', '.join(CHECKS)}")
    if args.seeds < 1:
        usage_error(f"opforge: --seeds must be at least 1, got {args.seeds}")
    return 0 if run_check(args.ops, args.device, args.seed, checks or CHECKS, args.seeds, args.report, args.reference_on) else 1
