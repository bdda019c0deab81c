"""``opforge cache list`` and ``opforge cache clean``."""

from __future__ import annotations

import argparse
import datetime

from rich.table import Table

from opforge.builder import store as cache
from opforge.builder.errors import BuildError
from opforge.builder.jit import cache_root
from opforge.cli.render import out


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def cmd_cache_list(args: argparse.Namespace) -> int:
    try:
        found = cache.entries()
    except BuildError as exc:
        raise SystemExit(str(exc)) from None
    table = Table(title=f"opforge build cache: {cache_root(write=False)}")
    for col in ("entry", "state", "size", "built in", "last used"):
        table.add_column(col, justify="right" if col in ("size", "built in") else "left")
    for e in found:
        if e.objects:
            state = "objects (for incremental rebuilds)"
        elif e.complete:
            state = "complete"
        else:
            state = "[yellow]incomplete[/] (a failed or killed build; the next build wipes it)"
        built = f"{e.build_seconds:.1f} s" if e.build_seconds is not None else "-"
        when = datetime.datetime.fromtimestamp(e.last_used).isoformat(sep=" ", timespec="seconds")
        table.add_row(e.path.name, state, _mib(e.size), built, when)
    out.print(table)
    out.print(f"{len(found)} entries, {_mib(sum(e.size for e in found))}")
    for log in cache.failed_build_logs():
        out.print(f"[yellow]a failed build of the eager fast path left its log: {log}[/] (opforge cache clean removes it)")
    return 0


def cmd_cache_clean(args: argparse.Namespace) -> int:
    try:
        removed, busy = cache.clean(args.older_than)
        logs = cache.clean_failed_build_logs(args.older_than)
    except BuildError as exc:
        raise SystemExit(str(exc)) from None
    for log in logs:
        out.print(f"removed {log.name} (the log of a failed build of the eager fast path)")
    for e in removed:
        out.print(f"removed {e.path.name} ({_mib(e.size)})")
    for e in busy:
        out.print(f"[yellow]kept {e.path.name}: a build holds its lock[/]")
    out.print(f"removed {len(removed)} entries, freed {_mib(sum(e.size for e in removed))}")
    return 0
