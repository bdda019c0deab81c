"""What ``opforge check``, ``bench`` and ``run`` print: a plain line per step
as it happens, and the tables.

Progress is a line per operator checked and per case timed, on stderr, printed
whether or not it is a terminal: a CI log or ``| tee`` shows each as it
happens. A live progress bar is drawn only on a terminal, under those lines
(in a log it would show nothing until the end).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from opforge.bench.results import BenchReport, BenchRow, compute_bound
from opforge.bench.timing import Timing
from opforge.check.run import CheckResult
from opforge.check.values import ErrorStats

# The torch.compile baseline on the CPU: inductor writes and compiles C++ for
# each case (10-30 s apiece on two cores), longer than the rest of the main job.
COMPILE_NOT_ON_CPU = "not run on the CPU; --full runs it"


class Steps:
    """Progress of one phase: ``line`` prints a finished step; on a terminal a
    bar (``total`` steps) stays under the lines while the phase runs."""

    def __init__(self, console: Console, total: int, what: str) -> None:
        self.console = console
        self.total = total
        self.what = what
        self._progress: Progress | None = None
        self._task = None

    @contextmanager
    def running(self) -> Iterator[Steps]:
        if not self.console.is_terminal:
            yield self
            return
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=self.console, transient=True) as progress:
            self._progress = progress
            self._task = progress.add_task(self.what, total=self.total)
            try:
                yield self
            finally:
                self._progress = None

    def doing(self, description: str) -> None:
        """What runs now (the bar's label; nothing in a log)."""
        if self._progress is not None:
            self._progress.update(self._task, description=f"{self.what} {description}")  # type: ignore[arg-type]

    def line(self, text: str, *, advance: int = 1) -> None:
        self.console.print(text, highlight=False, soft_wrap=True)
        if self._progress is not None:
            self._progress.advance(self._task, advance)  # type: ignore[arg-type]


# --- cells ---


def fmt_us(t: Timing | None) -> str:
    if t is None:
        return "n/a"
    flag = "" if t.stop == "stable" else "~"  # "~": the budget ran out before the spread fell under 1 %
    return f"{flag}{t.median_us:,.1f} ±{100 * t.spread:.1f}%"


def fmt_x(x: float | None) -> str:
    if x is None:
        return "-"
    colour = "green" if x >= 1.0 else "yellow"
    return f"[{colour}]{x:.2f}x[/]"


class Footnotes:
    """Numbered notes under a table, saying why a figure marked with one is not
    to be taken as it stands (an outlier time, a % of limit past the machine's)."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def mark(self, cell: str, row: BenchRow, *reasons: str | None) -> str:
        """``cell`` with a mark per reason given (None: none), each note naming the row's case."""
        for reason in reasons:
            if reason:
                text = f"{row.op} {row.dtype} {row.case}, {reason}"
                if text not in self.texts:
                    self.texts.append(text)
                cell += f" [yellow]({self.texts.index(text) + 1})[/]"
        return cell

    def lines(self) -> list[str]:
        return [f"({i}) {escape(t)}" for i, t in enumerate(self.texts, 1)]


def vs_cell(row: BenchRow, baseline: str, notes: Footnotes) -> str:
    """opforge's speedup over ``baseline``, marked where either time is an outlier."""
    x = row.speedup(baseline)
    return notes.mark(fmt_x(x), row, row.outliers.get("opforge"), row.outliers.get(baseline)) if x is not None else fmt_x(x)


def limit_cell(row: BenchRow, notes: Footnotes) -> str:
    """opforge's % of limit, marked where it is past what the machine's limits allow."""
    pct = row.pct_of_limit("opforge")
    return notes.mark(f"{pct:.0f}%", row, row.beyond_limit.get("opforge")) if pct is not None else "-"


def fmt_tflops(row: BenchRow) -> str:
    """opforge's TFLOP/s / eager's, for rows that compute more than they move
    (a matmul: more than one FLOP per byte); "-" for streaming ops, whose
    measure is GB/s."""
    if not compute_bound([row]):
        return "-"
    ours, eager = row.tflops("opforge"), row.tflops("eager")
    return f"{ours:,.3g}" + (f" / {eager:,.3g}" if eager else "")


def check_cell(r: CheckResult) -> str:
    """A check's verdict in a cell: pass or FAIL with its counts, and its tag (the dtype
    gradcheck ran in, the layouts refused, the signal that ended the process), or n/a and why."""
    tag = f" [dim]{escape(r.tag)}[/]" if r.tag else ""
    if r.status == "pass":
        return f"[green]pass[/] ({r.count}){tag}"
    if r.status == "n/a":
        return f"[dim]n/a[/] [dim]{escape(r.note)}[/]"
    if r.crashed:
        return f"[bold red]FAIL[/] [red]{escape(r.tag)}[/]"
    return f"[bold red]FAIL[/] ({len(r.failures)}/{r.count}){tag}"


def check_verdict(results: Sequence[CheckResult]) -> str:
    """One operator's checks in a word: pass, or FAIL and the checks that failed."""
    failed = [r.check for r in results if not r.ok]
    return f"[bold red]FAIL[/] {escape(', '.join(failed))}" if failed else "[green]pass[/]"


def row_line(row: BenchRow, seconds: float) -> str:
    """A timed case in one line, for the progress log."""
    head = f"bench {row.op} {row.dtype} {row.case}:"
    if row.status != "ok":
        return f"{head} [red]{escape(row.status)}[/]"
    parts = [f"opforge {fmt_us(row.timings.get('opforge'))} us"]
    for impl in row.timings:
        if impl == "opforge":
            continue
        x = row.speedup(impl)
        parts.append(f"{fmt_x(x)} vs {impl}" if x is not None else f"{impl}: {escape(row.notes.get(impl, 'n/a'))}")
    pct = row.pct_of_limit("opforge")
    if pct is not None:
        parts.append(f"{pct:.0f}% of limit")
    doubted = [f"{impl}'s time" for impl in row.outliers] + (["% of limit"] if "opforge" in row.beyond_limit else [])
    if doubted:
        parts.append(f"[yellow]not to be taken as it stands: {', '.join(doubted)} (the table's notes say why)[/]")
    return f"{head} {', '.join(parts)} ({seconds:.1f} s)"


# --- tables ---


def bench_title(report: BenchReport, command: str = "opforge bench") -> str:
    ceil = report.ceilings
    limit = f", copy {ceil['copy_gbps']:,.0f} GB/s" if ceil else ""
    return (
        f"{command}: {report.device_name} ({report.device}, torch {report.torch_version}, "
        f"{report.threads} threads{', CUDA graphs' if report.graph else ''}{limit})"
    )


def bench_table(report: BenchReport) -> Table:
    table = Table(title=bench_title(report))
    # Baselines a spec adds (OpSpec.baselines), each with its own two columns.
    extra = list(dict.fromkeys(k for r in report.rows for k in r.timings if k not in ("opforge", "eager", "compiled")))
    cols = ["operator", "dtype", "size", "opforge us", "eager us", "compiled us", *(f"{b} us" for b in extra), "vs eager", "vs compiled"]
    cols += [*(f"vs {b}" for b in extra), "GB/s", "TFLOP/s", "% of limit"]
    for col in cols:
        table.add_column(col, justify="left" if col in ("operator", "dtype", "size") else "right")
    notes = Footnotes()
    for r in report.rows:
        if r.status != "ok":
            table.add_row(r.op, r.dtype, r.case, f"[red]{escape(r.status)}[/]", *[""] * (len(cols) - 4))
            continue
        times = [notes.mark(fmt_us(r.timings.get(i)), r, r.outliers.get(i)) for i in ("opforge", "eager", "compiled", *extra)]
        table.add_row(
            r.op,
            r.dtype,
            r.case,
            *times,
            *(vs_cell(r, b, notes) for b in ("eager", "compiled", *extra)),
            f"{r.gbps('opforge'):,.0f}",
            fmt_tflops(r),
            limit_cell(r, notes),
        )
    if notes.texts:
        table.caption = "\n".join(notes.lines())
        table.caption_justify = "left"
    return table


def check_table(title: str, checks: Sequence[str], results: Mapping[str, Sequence[CheckResult]]) -> Table:
    """One row per operator (qualified name -> its results), one column per check."""
    table = Table(title=title)
    table.add_column("operator")
    for c in checks:
        table.add_column(c, justify="center")
    for op, rs in results.items():
        table.add_row(op, *(check_cell(r) for r in rs))
    return table


def worst_table(rows: Sequence[tuple[str, str, ErrorStats]], *, per_case: bool) -> Table:
    """The largest error against the float64 reference: per op and dtype, or
    (``--report``) per op and case, with the first mismatching index."""
    grouped: dict[tuple[str, str], ErrorStats] = {}
    for op, case, e in rows:
        key = (op, case if per_case else case.split(" ")[0])
        grouped[key] = grouped[key].worse(e) if key in grouped else e
    table = Table(title="worst error against the float64 reference" + (" per case" if per_case else " per dtype (--report: per case)"))
    for col in ("operator", "case" if per_case else "dtype", "max abs err", "max rel err", "out of tolerance", "first mismatch"):
        table.add_column(col, justify="left" if col in ("operator", "case", "dtype", "first mismatch") else "right")
    for (op, case), e in grouped.items():
        first = "-" if e.first_bad is None else f"{list(e.first_bad)}: got {e.got:.6g} want {e.want:.6g}"
        bad = f"[red]{e.n_bad}[/]/{e.numel}" if e.n_bad else f"0/{e.numel}"
        table.add_row(op, escape(case), f"{e.max_abs:.3g}", f"{e.max_rel:.3g}", bad, escape(first))
    return table


@dataclass
class SummaryOp:
    """One operator in the main job's table: its checks and its timed cases."""

    qualname: str
    checks: Sequence[CheckResult]
    rows: Sequence[BenchRow]


def summary_table(report: BenchReport, ops: Sequence[SummaryOp]) -> Table:
    """The main job's table: per operator and timed case, the check verdict,
    the time against eager PyTorch and torch.compile, and the share of the
    roofline limit reached."""
    table = Table(title=bench_title(report, "opforge run"))
    cols = ("operator", "check", "dtype", "case", "opforge us", "vs eager", "vs torch.compile", "% of limit")
    for col in cols:
        table.add_column(col, justify="left" if col in ("operator", "check", "dtype", "case") else "right")
    cpu_skipped = False
    marks = Footnotes()
    for op in ops:
        verdict = check_verdict(op.checks)
        if not op.rows:
            table.add_row(op.qualname, verdict, "-", "-", "[dim]not timed[/]", "-", "-", "-")
        for i, r in enumerate(op.rows):
            name, cell = (op.qualname, verdict) if i == 0 else ("", "")
            if r.status != "ok":
                table.add_row(name, cell, r.dtype, escape(r.case), f"[red]{escape(r.status)}[/]", "-", "-", "-")
                continue
            compiled = r.speedup("compiled")
            if compiled is not None:
                vs_compiled = vs_cell(r, "compiled", marks)
            elif r.notes.get("compiled") == COMPILE_NOT_ON_CPU:
                vs_compiled, cpu_skipped = "[dim]not run[/]", True
            else:
                vs_compiled = "[dim]not run[/]" if r.notes.get("compiled", "").startswith("not asked") else "[yellow]failed[/]"
            ours = marks.mark(fmt_us(r.timings.get("opforge")), r, r.outliers.get("opforge"))
            table.add_row(
                name, cell, r.dtype, escape(r.case), ours, vs_cell(r, "eager", marks), vs_compiled, limit_cell(r, marks),
            )  # fmt: skip
    notes = [
        "medians per call, ± the inter-quartile range (~: stopped by --budget before it fell under 1 %); "
        "vs: how many times faster opforge is; % of limit: the roofline floor (measured copy and matmul ceilings) / opforge's time"
    ]
    if cpu_skipped:
        notes.append(f"torch.compile: {COMPILE_NOT_ON_CPU} (inductor compiles C++ for each case, 10-30 s apiece)")
    notes += marks.lines()
    table.caption = "\n".join(notes)
    table.caption_justify = "left"
    return table


__all__ = [
    "COMPILE_NOT_ON_CPU",
    "Footnotes",
    "Steps",
    "SummaryOp",
    "bench_table",
    "bench_title",
    "check_cell",
    "check_table",
    "check_verdict",
    "fmt_tflops",
    "fmt_us",
    "fmt_x",
    "limit_cell",
    "row_line",
    "summary_table",
    "vs_cell",
    "worst_table",
]
