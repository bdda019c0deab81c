"""What the ``opforge`` command prints through: one console for results
(stdout), one for progress and errors (stderr), and the tables both share."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from opforge.console import err as err  # the consoles of every command
from opforge.console import out as out


def bench_table(report) -> Any:  # noqa: ANN001
    # lazy: import time (opforge.cli.report, 37 ms): every opforge command loads this module
    from opforge.cli.report import bench_table as table

    return table(report)


def print_comparison(old, new) -> bool:  # noqa: ANN001
    """Ratio per case against an earlier run; False if anything regressed beyond the spread."""
    # lazy: import time (opforge.bench, 29 ms): every opforge command loads this module
    from opforge.bench.run import compare

    rows = compare(old, new)
    table = Table(title=f"against {old.device_name}, {old.date} (commit {(old.git_commit or '?')[:10]})")
    for col in ("operator", "dtype", "size", "old us", "new us", "new/old", "verdict"):
        table.add_column(col, justify="left" if col in ("operator", "dtype", "size", "verdict") else "right")
    colours = {"regression": "bold red", "faster": "green", "same": "dim"}
    for c in rows:
        table.add_row(
            c.op, c.dtype, c.case, f"{c.old_us:,.1f}", f"{c.new_us:,.1f}", f"{c.ratio:.3f}", f"[{colours[c.verdict]}]{c.verdict}[/]"
        )
    out.print(table)
    n_reg = sum(c.verdict == "regression" for c in rows)
    out.print(f"{len(rows)} compared, {n_reg} regressed, {sum(c.verdict == 'faster' for c in rows)} faster (beyond the measured spread)")
    return n_reg == 0
