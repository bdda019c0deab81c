"""``opforge list`` and ``opforge check``."""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from typing import Any

from rich.markup import escape
from rich.table import Table

import opforge
from opforge import fast
from opforge.cli.args import pick_seed, usage_error
from opforge.cli.render import err, out
from opforge.cli.targets import loaded_targets, pick_device, resolve_targets, specs_of


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
    specs: Sequence[Any],
    device: Any,
    seed: int,
    checks: Sequence[str],
    seeds: int = 1,
    reference_on: str = "device",
    *,
    time_limit: float | None = None,
    in_process: bool | None = None,
) -> dict[str, list[Any]]:
    """Every check of every operator, a line per operator as each finishes;
    the results by qualified name. They run in a process of their own
    (opforge.check.process), which a kernel may kill or hang without ending
    this one; ``in_process`` (default: OPFORGE_CHECK_IN_PROCESS=1 in the
    environment, as compute-sanitizer's runs set it) runs them here instead."""
    # lazy: import time (opforge.check, 20 ms; opforge.cli.report, 37 ms): every opforge command loads this module
    from opforge.check.process import DEFAULT_TIME_LIMIT_S, run_checks
    from opforge.check.run import check_op
    from opforge.cli.report import Steps, check_cell

    reference_device = "cpu" if reference_on == "cpu" else None
    if in_process is None:
        in_process = os.environ.get("OPFORGE_CHECK_IN_PROCESS") == "1"
    results: dict[str, list[Any]] = {}
    steps = Steps(err, len(specs), "checking")
    started = [time.perf_counter()]

    def done(spec: Any, rs: Sequence[Any]) -> None:
        cells = ", ".join(f"{r.check} {check_cell(r)}" for r in rs)
        steps.line(f"check {spec.name}: {cells} ({time.perf_counter() - started[0]:.1f} s)")
        started[0] = time.perf_counter()
        following = [s for s in specs if s.qualname not in results and s.qualname != spec.qualname]
        if following:
            steps.doing(following[0].name)

    with steps.running():
        if in_process:
            for spec in specs:
                steps.doing(spec.name)
                results[spec.qualname] = check_op(spec, device, seed, checks, seeds, reference_device=reference_device)
                done(spec, results[spec.qualname])
            return results
        if specs:
            steps.doing(specs[0].name)

        def on_op(spec: Any, rs: list[Any]) -> None:
            results[spec.qualname] = rs
            done(spec, rs)

        def on_note(text: str) -> None:
            err.print(f"[yellow]{escape(text)}[/]", highlight=False)

        limit = time_limit or DEFAULT_TIME_LIMIT_S
        loads = _loads()
        return run_checks(specs, device, seed, checks, seeds, reference_device, loads=loads, time_limit=limit, on_op=on_op, on_note=on_note)


def _loads() -> Any:
    """What the checks' process loads to find the operators: what this one did."""
    # lazy: import time (opforge.check, 20 ms): every opforge command loads this module
    from opforge.check.process import Loads

    return Loads(own_library=opforge.library is not None, wait_fast=fast.module() is not None, targets=loaded_targets())


def check_notes(results: dict[str, list[Any]]) -> list[str]:
    """What the checks that ran say besides their verdict: the dtype gradcheck
    ran in, the layouts an operator refused."""
    return [f"{r.op} {r.check}: {r.note}" for rs in results.values() for r in rs if r.note and r.status != "n/a"]


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
    *,
    time_limit: float | None = None,
    in_process: bool | None = None,
) -> bool:
    # lazy: import time (opforge.cli.report, 37 ms): every opforge command loads this module
    from opforge.cli.report import check_table, worst_table

    if in_process is None:
        in_process = os.environ.get("OPFORGE_CHECK_IN_PROCESS") == "1"
    crashed = [] if in_process else _trial_loads(names, time_limit)
    if crashed:
        names = [n for n in names if n not in {c.target for c in crashed}]
        for c in crashed:
            out.print(f"[red]x[/] load {escape(c.target)} ({escape(c.word)}): {escape(c.why)}", highlight=False)
        if not names:  # none left: not every operator, which no names would mean
            out.print(f"0 passed, {len(crashed)} failed")
            return False
    names, projects_cuda, own_library = resolve_targets(names)
    device = pick_device(device_name, projects_cuda, own_library=own_library)
    seed = pick_seed(seed)
    specs = specs_of(names, own_library=own_library)
    err.print(f"opforge check on {device}, seed {seed}{f' (+{seeds - 1} more)' if seeds > 1 else ''} (rerun with --seed {seed})")
    results = check_ops(specs, device, seed, checks, seeds, reference_on, time_limit=time_limit, in_process=in_process)
    out.print(check_table(f"opforge check ({device}, seed {seed}{f', {seeds} seeds' if seeds > 1 else ''})", checks, results))
    worst_rows = [(spec.name, case, e) for spec in specs for r in results[spec.qualname] for case, e in r.worst.items()]
    if worst_rows:
        out.print(worst_table(worst_rows, per_case=report))
    for note in check_notes(results):
        out.print(f"[dim]-[/] {escape(note)}", highlight=False)
    for f in check_failures(results):
        out.print(f"[red]x[/] {escape(f)}", highlight=False)
    # What the sharding check found valid but undeclared: what to add to the spec.
    for rs in results.values():
        for r in rs:
            if r.check == "sharding" and r.status != "n/a" and r.note:
                out.print(f"sharding: {escape(r.op)}: {escape(r.note)}", highlight=False)
    n_pass = sum(r.status == "pass" for rs in results.values() for r in rs)
    n_fail = sum(r.status == "fail" for rs in results.values() for r in rs) + len(crashed)
    out.print(f"{n_pass} passed, {n_fail} failed")
    return n_fail == 0


def _trial_loads(names: Sequence[str], time_limit: float | None) -> list[Any]:
    """The spec files among ``names`` whose load (the file's code, opforge.spec's first call of each operator)
    kills or hangs a process of their own (opforge.check.process.trial_load): not loaded into this one."""
    # lazy: import time (opforge.check, 20 ms): every opforge command loads this module
    from opforge.check.process import DEFAULT_TIME_LIMIT_S, trial_load
    from opforge.project import names_a_path

    files = [n for n in names if names_a_path(n) and n.endswith(".py") and os.path.isfile(n)]
    return [c for n in files if (c := trial_load(n, time_limit or DEFAULT_TIME_LIMIT_S)) is not None]


def cmd_check(args: argparse.Namespace) -> int:
    # lazy: import time (opforge.check, 20 ms): every opforge command loads this module
    from opforge.check.run import CHECKS

    checks = None if args.checks is None else [c.strip() for c in args.checks.split(",")]
    if checks is not None and not all(checks):
        usage_error(f"opforge: --checks {args.checks!r} names an empty check; give one or more of {', '.join(CHECKS)}, comma-separated")
    for c in checks or ():
        if c not in CHECKS:
            usage_error(f"opforge: unknown check {c!r}; choose from {', '.join(CHECKS)}")
    ok = run_check(args.ops, args.device, args.seed, checks or CHECKS, args.seeds, args.report, args.reference_on,
                   time_limit=args.time_limit, in_process=args.in_process or None)  # fmt: skip
    return 0 if ok else 1
