"""``opforge bench`` and ``opforge run`` (build, check, then time)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from rich.markup import escape

from opforge import fast
from opforge.cli.args import output_file, pick_seed, usage_error
from opforge.cli.build import print_library
from opforge.cli.check import check_failures, check_notes, check_ops
from opforge.cli.render import bench_table, err, out, print_comparison
from opforge.cli.targets import device_and_specs


@dataclass
class BenchOptions:
    """What ``bench`` and ``run`` time. ``dtypes`` None: each op's own
    (opforge.bench.default_dtypes); ``largest``: only each op's largest case;
    ``compile`` None: the torch.compile baseline on a GPU, not on the CPU."""

    dtypes: Sequence[str] | None = ("float32", "float16", "bfloat16")
    budget: float = 0.3
    graph: bool = False
    compile: bool | None = True
    sweep: bool = False
    cases: Sequence[str] | None = None
    largest: bool = False
    remeasure: bool = False
    json_path: Path | None = None
    csv_path: Path | None = None
    plot_path: Path | None = None
    compare_path: Path | None = None


def _case_key(name: str) -> tuple[int, str]:
    """Cases named 2^N sort by N; others after them, by name."""
    return (int(name[2:]), "") if name.startswith("2^") and name[2:].isdigit() else (1 << 30, name)


def bench_ops(specs: Sequence[Any], device: Any, seed: int, opts: BenchOptions, *, verified: Sequence[str] = ()) -> Any:
    """The report of every op's cases, a line per case as each is timed.
    ``verified``: qualified names whose reference and bad-input checks have just passed (not run again)."""
    # lazy: import time (opforge.bench, 29 ms; opforge.cli.report, 37 ms): every opforge command loads this module
    from opforge.bench import ceilings
    from opforge.bench import run as bench
    from opforge.cli.report import COMPILE_NOT_ON_CPU, Steps, row_line

    name = bench.device_name(device)
    if opts.remeasure or not ceilings.cache_path(name).is_file():
        err.print(f"measuring the machine's ceilings (once per machine; cached in {ceilings.cache_path(name)})", highlight=False)

    def busy() -> str | None:  # a ceiling measured on a busy CPU is recorded as such, and measured again when it is idle
        return bench.cpu_contention() if device.type == "cpu" else None

    def say(text: str) -> None:
        err.print(f"[yellow]{escape(text)}[/]", highlight=False)

    roof = ceilings.roofline(device, name, remeasure=opts.remeasure, busy=busy, say=say)
    report = bench.new_report(device, graph=opts.graph, ceilings=roof.ceilings)
    for warning in report.warnings:
        err.print(f"[yellow]warning: {escape(warning)}[/]", highlight=False)
    if opts.cases:
        known = {n for s in specs for n in bench.case_names(s, device, sweep=opts.sweep)}
        unknown = [c for c in opts.cases if c not in known]
        if unknown:
            what = "sweep cases" if opts.sweep else "cases"
            usage_error(f"opforge bench: no {what} named {', '.join(unknown)}; they are: {', '.join(sorted(known, key=_case_key))}")
    compile_ = opts.compile if opts.compile is not None else device.type != "cpu"
    compile_note = "not asked (--no-compile)" if opts.compile is not None else COMPILE_NOT_ON_CPU
    plan = []
    for spec in specs:
        dtypes = [getattr(torch, d) for d in opts.dtypes] if opts.dtypes else bench.default_dtypes(spec, device)
        plan.append((spec, dtypes, bench.count_cases(spec, device, dtypes, sweep=opts.sweep, only=opts.cases, largest=opts.largest)))
    steps = Steps(err, sum(p[2] for p in plan), "benchmarking")
    with steps.running():
        for spec, dtypes, _ in plan:
            started = [time.perf_counter()]

            def on_row(row: Any, started: list[float] = started) -> None:
                steps.line(row_line(row, time.perf_counter() - started[0]))
                started[0] = time.perf_counter()

            report.rows += bench.bench_op(
                spec, device, seed=seed, dtypes=dtypes, budget_s=opts.budget, graph=opts.graph, compile=compile_, sweep=opts.sweep,
                only=opts.cases, largest=opts.largest, ceilings=roof, progress=steps.doing, verify=spec.qualname not in verified,
                compile_note=compile_note, on_row=on_row,
            )  # fmt: skip
    # The ceilings every row was floored against: measured again during the run if a result beat them.
    report.ceilings = asdict(roof.ceilings)
    report.notes += roof.news
    return report


def write_outputs(report: Any, opts: BenchOptions) -> bool:
    """The files asked for (JSON, CSV, plot) and the comparison with an earlier
    run; False if that comparison found a regression."""
    # lazy: import time (opforge.bench, 29 ms): every opforge command loads this module
    from opforge.bench import ceilings
    from opforge.bench import run as bench

    plot_path = opts.plot_path or (Path(f"opforge-bench-{ceilings.slug(report.device_name)}.png") if opts.sweep else None)
    for path, writer in ((opts.json_path, bench.write_json), (opts.csv_path, bench.write_csv), (plot_path, bench.plot)):
        if path:
            try:
                writer(report, path)
            except OSError as exc:  # writable when the run began (check_before_running), no longer: a full disk
                err.print(f"opforge: cannot write {path}: {exc.strerror or exc}", highlight=False, markup=False)
                return False
            out.print(f"wrote {path}")
    if opts.compare_path:
        return print_comparison(bench.read_json(opts.compare_path), report)
    return True


def print_notes(report: Any) -> None:
    """Why a baseline has no timing, once per op, where it is not simply left out; what
    the run changed (ceilings measured again); then the report's warnings (a busy CPU)."""
    # lazy: import time (opforge.cli.report, 37 ms): every opforge command loads this module
    from opforge.cli.report import COMPILE_NOT_ON_CPU

    notes = {(r.op, impl, note) for r in report.rows for impl, note in r.notes.items() if note != COMPILE_NOT_ON_CPU}
    for op, impl, note in sorted(notes):
        out.print(f"[yellow]{op}: no {impl} timing: {escape(note)}[/]", highlight=False)
    for note in report.notes:
        out.print(f"[yellow]{escape(note)}[/]", highlight=False)
    for warning in report.warnings:
        out.print(f"[yellow]warning: {escape(warning)}[/]", highlight=False)


def check_before_running(device: Any, opts: BenchOptions) -> None:
    """What the run cannot do, said before it starts rather than after it timed
    everything: a CUDA graph off a GPU; the current folder unwritable where
    --sweep's plot goes by default (the files named are checked as parsed)."""
    if opts.graph and device.type != "cuda":
        usage_error(f"opforge: --graph replays CUDA graphs, which run on a GPU only; the device is {device.type} (drop --graph)")
    if opts.sweep and opts.plot_path is None:
        try:
            output_file("opforge-bench.png")
        except argparse.ArgumentTypeError as exc:
            usage_error(f"opforge: --sweep's plot goes in the current folder by default, and {exc}; name another with --plot")


def run_bench(names: Sequence[str], device_name: str, seed: int | None, opts: BenchOptions) -> bool:
    device, specs = device_and_specs(names, device_name)
    check_before_running(device, opts)
    seed = pick_seed(seed)
    err.print(f"opforge bench on {device}, seed {seed}")
    report = bench_ops(specs, device, seed, opts)
    out.print(bench_table(report))
    out.print(
        "medians per call, ± the inter-quartile range (~: stopped by --budget before it fell under 1 %); "
        "GB/s and TFLOP/s (opforge / eager, for ops of more than one FLOP per byte) from the op's cost model; "
        "% of limit = roofline floor (measured copy and matmul ceilings) / time; (N): a figure not to take as it stands, "
        "the note under the table says why"
    )
    print_notes(report)
    ok = all(r.status == "ok" for r in report.rows)
    return write_outputs(report, opts) and ok


def _bench_options(args: argparse.Namespace) -> BenchOptions:
    return BenchOptions(
        dtypes=args.dtype.split(","), budget=args.budget, graph=args.graph, compile=not args.no_compile, sweep=args.sweep,
        cases=args.case.split(",") if args.case else None,
        remeasure=args.remeasure, json_path=args.json, csv_path=args.csv, plot_path=args.plot, compare_path=args.compare,
    )  # fmt: skip


def cmd_bench(args: argparse.Namespace) -> int:
    return 0 if run_bench(args.ops, args.device, args.seed, _bench_options(args)) else 1


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _run_options(args: argparse.Namespace) -> BenchOptions:
    """The main job's cases: by default each op's largest case in the dtypes
    that matter on the device, torch.compile on a GPU only; ``--full``: every
    case of the sweeps, every dtype, torch.compile everywhere."""
    # lazy: import time (opforge.bench, 29 ms): every opforge command loads this module
    from opforge.bench.run import BENCH_DTYPES

    full = args.full
    dtypes = args.dtype.split(",") if args.dtype else [str(d).removeprefix("torch.") for d in BENCH_DTYPES] if full else None
    return BenchOptions(
        dtypes=dtypes, budget=args.budget, graph=args.graph, compile=False if args.no_compile else True if full else None,
        sweep=args.sweep or full, cases=args.case.split(",") if args.case else None, largest=not (full or args.case or args.sweep),
        remeasure=args.remeasure, json_path=args.json, csv_path=args.csv, plot_path=args.plot, compare_path=args.compare,
    )  # fmt: skip


def cmd_run(args: argparse.Namespace) -> int:
    """The main job: build, check, benchmark; one summary table at the end."""
    # lazy: import time (opforge.check, 20 ms; opforge.cli.report, 37 ms): every opforge command loads this module
    from opforge.check.run import CHECKS
    from opforge.cli.report import SummaryOp, summary_table

    start = time.perf_counter()
    # The checks start while the fast path's first build runs; the bench waits for it.
    device, specs = device_and_specs(args.ops, args.device, wait_fast=False)
    opts = _run_options(args)
    check_before_running(device, opts)
    print_library(wait_fast=False)
    seed = pick_seed(args.seed)
    err.print(
        f"opforge run on {device}, seed {seed} (rerun with --seed {seed}): check {len(specs)} operators, then time them", highlight=False
    )
    checked = check_ops(specs, device, seed, CHECKS, time_limit=args.time_limit, in_process=args.in_process or None)
    verified = [q for q, rs in checked.items() if all(r.ok for r in rs if r.check in ("reference", "bad inputs"))]
    fast.attach(wait=True)  # the calls timed are the calls users make
    # An operator that killed the checks' process or hung in it would do the same to this one: not timed.
    timed = [s for s in specs if not any(r.crashed for r in checked[s.qualname])]
    report = bench_ops(timed, device, seed, opts, verified=verified)
    by_op = {s.qualname: [r for r in report.rows if r.op == s.name] for s in specs}
    out.print(summary_table(report, [SummaryOp(q, checked[q], by_op[q]) for q in checked]))
    for note in check_notes(checked):
        out.print(f"[dim]-[/] {escape(note)}", highlight=False)
    failures = check_failures(checked)
    for f in failures:
        out.print(f"[red]x[/] {escape(f)}", highlight=False)
    print_notes(report)
    written_ok = write_outputs(report, opts)
    n_fail = sum(any(not r.ok for r in rs) for rs in checked.values())
    n_refused = sum(r.status != "ok" for r in report.rows)
    ok = written_ok and not n_fail and not n_refused
    n_timed = len(report.rows) - n_refused
    out.print(
        f"{_count(len(specs), 'operator')}: {len(specs) - n_fail} passed every check, {n_fail} failed; "
        f"{_count(n_timed, 'case')} timed, {n_refused} refused ({time.perf_counter() - start:.0f} s)"
        + ("" if args.full else "; --full: every case and dtype, torch.compile everywhere")
    )
    return 0 if ok else 1
