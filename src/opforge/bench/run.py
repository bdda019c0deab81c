"""``opforge bench``: time each operator against PyTorch, on the same inputs,
after checking that it is right, and against what the machine can do.

* Verification first: every sample of the op against the float64 reference
  and every bad input of its spec, then each benchmark case's own output. A
  wrong kernel, or one that takes bad inputs without a word, is refused, never timed.
* Timing (opforge.bench.timing): CUDA events with the L2 flushed on a GPU,
  ``time.perf_counter`` on the CPU, warm-up first, repetitions until the
  spread is under 1 % or the budget is spent, inputs rotated when they fit in cache.
* Baselines side by side: the op's PyTorch reference eager and under
  ``torch.compile`` (if it compiles; if not, the reason is in the row).
* Limits: achieved GB/s and TFLOP/s from the op's cost model, and the fraction
  of the roofline floor from the machine's measured ceilings (``ceilings.py``).
* Doubt: a time that beats its floor has the ceilings measured again (once a
  run, ``ceilings.Roofline``); a time that is an outlier against the cost model
  (``bench_results.outlier``: far slower than its floor, or widely spread) is
  timed again; what stays past either is kept, marked, with the reason in the row
  (``BenchRow.outliers``, ``BenchRow.beyond_limit``) for the tables to say.

This module chooses the cases and runs them; ``bench_timing`` times a call,
``bench_results`` holds the rows and reports (and their JSON and CSV files),
``bench_plot`` draws them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from opforge.bench.ceilings import Ceilings, Roofline
from opforge.bench.plot import plot
from opforge.bench.results import CSV_FIELDS as CSV_FIELDS
from opforge.bench.results import (
    BenchReport,
    BenchRow,
    Comparison,
    compare,
    compute_bound,
    new_report,
    outlier,
    read_json,
    write_csv,
    write_json,
)
from opforge.bench.results import busy_machine as busy_machine
from opforge.bench.results import cpu_contention as cpu_contention
from opforge.bench.results import device_name as device_name
from opforge.bench.timing import TARGET_SPREAD as TARGET_SPREAD
from opforge.bench.timing import Timer, Timing, input_sets, repeat_until_stable, time_fn, time_interleaved
from opforge.check.run import check_bad_inputs, check_reference, generator, run_reference
from opforge.opspec import OpSpec, Sample

BENCH_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)
IMPLS: tuple[str, ...] = ("opforge", "eager", "compiled")


def _compiled(spec: OpSpec) -> Callable[..., Any]:
    """The reference compiled for one case's shapes. Dynamo's caches are reset
    first: with one compiled function for every size, the second size
    recompiles it with dynamic shapes, whose generic kernels trailed eager by up
    to 2x at 2^28 elements (H200, a sweep of sizes), and past the recompile
    limit it falls back to eager. A static compile per case is the strongest
    torch.compile baseline, and the fair one."""
    torch._dynamo.reset()
    return torch.compile(spec.reference, dynamic=False)


def cases_of(
    spec: OpSpec, device: torch.device, dtype: torch.dtype, gen: torch.Generator, *, sweep: bool, only: Sequence[str] | None = None
) -> Iterable[Sample]:
    """The spec's benchmark cases (its sweep's with ``sweep``); ``only``: those of these names."""
    cases = spec.sweep_cases(device, dtype, gen) if sweep and spec.sweep_cases is not None else spec.bench_cases(device, dtype, gen)
    return cases if not only else (c for c in cases if c.desc in only)


def case_names(spec: OpSpec, device: torch.device, *, sweep: bool) -> list[str]:
    """The names of the spec's cases on ``device``. A GPU's are listed on the meta
    device, which allocates nothing (its sizes are a GPU's: only the CPU's differ);
    the CPU's cases are small enough to make."""
    where = device if device.type == "cpu" else torch.device("meta")
    gen = torch.Generator(device="cpu") if where.type == "cpu" else None
    return [c.desc for c in cases_of(spec, where, torch.float32, gen, sweep=sweep)]  # type: ignore[arg-type]


def count_cases(
    spec: OpSpec,
    device: torch.device,
    dtypes: Sequence[torch.dtype],
    *,
    sweep: bool,
    only: Sequence[str] | None = None,
    largest: bool = False,
) -> int:
    """How many rows bench_op will produce (for a progress bar)."""
    n_dtypes = sum(1 for d in dtypes if d in spec.dtypes)
    if largest and not only:
        return n_dtypes
    names = case_names(spec, device, sweep=sweep)
    return n_dtypes * sum(1 for n in names if not only or n in only)


def _size(spec: OpSpec, sample: Sample) -> tuple[int, int]:
    cost = spec.cost(*sample.args, **sample.kwargs)
    return cost.flops, cost.bytes


def largest_case(spec: OpSpec, cases: Iterable[Sample]) -> list[Sample]:
    """The case that moves the most by the op's cost model (FLOPs first, then
    bytes; the first of equals): where a kernel meets the machine's limit
    rather than its launch or call overhead. One case is held at a time."""
    best: tuple[tuple[int, int], Sample] | None = None
    for sample in cases:
        size = _size(spec, sample)
        if best is None or size > best[0]:
            best = (size, sample)
    return [best[1]] if best else []


def default_dtypes(spec: OpSpec, device: torch.device) -> list[torch.dtype]:
    """The dtypes that say most about an op on ``device``. On the CPU float32
    (the op's first dtype where it has no float32). On a GPU float32 for an op
    that streams memory, and the half types for one that computes more than
    one FLOP per byte moved (a matmul: the tensor cores' dtypes), as its
    largest CPU case does."""
    first = torch.float32 if torch.float32 in spec.dtypes else spec.dtypes[0]
    halves = [d for d in (torch.float16, torch.bfloat16) if d in spec.dtypes]
    if device.type == "cpu" or not halves:
        return [first]
    cpu = torch.device("cpu")
    (case,) = largest_case(spec, cases_of(spec, cpu, torch.float32, generator(cpu, 0), sweep=False))
    flops, nbytes = _size(spec, case)
    return halves if nbytes > 0 and flops >= nbytes else [first]


def bench_op(
    spec: OpSpec,
    device: torch.device,
    *,
    seed: int,
    dtypes: Sequence[torch.dtype] = BENCH_DTYPES,
    budget_s: float = 0.3,
    graph: bool = False,
    compile: bool = True,
    sweep: bool = False,
    only: Sequence[str] | None = None,
    largest: bool = False,
    ceilings: Ceilings | Roofline | None = None,
    progress: Callable[[str], None] = lambda _: None,
    verify: bool = True,
    compile_note: str = "not asked (--no-compile)",
    on_row: Callable[[BenchRow], None] = lambda _: None,
) -> list[BenchRow]:
    """Rows for every (dtype, case) of the op (the cases named in ``only``,
    when given; with ``largest``, the largest of them only, by the op's cost
    model): timed if right, refused if not. ``verify=False`` skips the
    check of every sample against the reference and of every bad input (for a
    caller that has just run them); each case's own output is still checked
    before it is timed.
    ``compile_note``: why there is no torch.compile timing when ``compile`` is
    False. ``on_row`` is called with each row as soon as it is measured.
    ``ceilings``: the roofline to divide by; a ``Roofline`` that can measure
    them again does so when a time beats them."""
    roof = Roofline(ceilings) if isinstance(ceilings, Ceilings) else ceilings
    if verify:
        progress(f"{spec.name}: verifying")
        verdict = check_reference(spec, device, seed)
        if not verdict.ok:
            row = BenchRow(spec.name, "-", "-", f"refused: fails its reference check ({verdict.failures[0]})")
            on_row(row)
            return [row]
        # A kernel that reads past a smaller input or takes an int32 one would
        # be timed on inputs it cannot refuse: not a number anyone should quote.
        verdict = check_bad_inputs(spec, device, seed)
        if not verdict.ok:
            row = BenchRow(spec.name, "-", "-", f"refused: fails its bad-input check ({verdict.failures[0]})")
            on_row(row)
            return [row]
    timer = Timer(device)
    gen = generator(device, seed + 1)
    rows = []
    for dtype in (d for d in dtypes if d in spec.dtypes):
        dname = str(dtype).removeprefix("torch.")
        cases = cases_of(spec, device, dtype, gen, sweep=sweep, only=only)
        for sample in largest_case(spec, cases) if largest else cases:
            progress(f"{spec.name} {dname} {sample.desc}")
            problem = run_reference(spec, sample, dtype)
            if problem:
                rows.append(BenchRow(spec.name, dname, sample.desc, f"refused: wrong at this size ({problem})"))
                on_row(rows[-1])
                continue
            cost = spec.cost(*sample.args, **sample.kwargs)
            numel = next(a.numel() for a in sample.args if isinstance(a, torch.Tensor))  # an optional first argument may be None
            row = BenchRow(spec.name, dname, sample.desc, "ok", numel=numel, bytes=cost.bytes, flops=cost.flops)
            if roof:
                roof.floor(row)
            sets = input_sets(sample, timer.l2_bytes, gen)
            compiled = _compiled(spec) if compile else None
            impls: dict[str, Callable[..., Any] | None] = {"opforge": spec.function, "eager": spec.reference, "compiled": compiled}
            impls.update(dict.fromkeys(spec.baselines))
            sides: dict[str, tuple[Callable[..., Any], Sequence[Sample]]] = {}
            for impl, fn in impls.items():
                impl_sets: Sequence[Sample] = sets
                if impl in spec.baselines:
                    made = [spec.baselines[impl](s) for s in sets]
                    fn, impl_sets = made[0][0], [m[1] for m in made]
                if fn is not None:
                    sides[impl] = (fn, impl_sets)
            on_graph = graph and device.type == "cuda"
            timed = time_interleaved(sides, timer, budget_s=budget_s, graph=on_graph)
            _check_ceilings(roof, row, timed)
            # An outlier is timed again (its sides in turns) and the steadier of its two timings kept.
            again = [n for n, t in timed.items() if isinstance(t, Timing) and outlier(t, row.floor_us)]
            if again:
                for name, t in time_interleaved({n: sides[n] for n in again}, timer, budget_s=budget_s, graph=on_graph).items():
                    timed[name] = _steadier(timed[name], t, row.floor_us)
                _check_ceilings(roof, row, timed)
            del sides
            for impl in impls:  # in this order in the row: opforge, eager, compiled, the spec's baselines
                result = timed.get(impl)
                if result is None:
                    row.timings[impl], row.notes[impl] = None, compile_note
                elif isinstance(result, Exception):
                    if impl == "opforge":
                        raise result
                    text = str(result).strip()
                    row.timings[impl] = None
                    row.notes[impl] = f"{type(result).__name__}: {text.splitlines()[0][:160] if text else ''}"
                else:
                    row.timings[impl] = result
            _doubt(row, roof, timed_twice=again)
            rows.append(row)
            on_row(row)
            del sets
    return rows


def _check_ceilings(roof: Roofline | None, row: BenchRow, timed: dict[str, Timing | Exception]) -> None:
    """Measure the ceilings again if a side of ``row`` beat its floor."""
    times = {n: t.median_us for n, t in timed.items() if isinstance(t, Timing) and t.median_us > 0}
    if not roof or not row.floor_us or not times:
        return
    fastest = min(times, key=times.__getitem__)
    if times[fastest] < row.floor_us:
        pct = 100 * row.floor_us / times[fastest]
        roof.beaten(f"{row.op} {row.dtype} {row.case} ({fastest}, {pct:,.0f} % of limit)")


def _steadier(first: Timing | Exception, second: Timing | Exception, floor_us: float | None) -> Timing | Exception:
    """Of an outlier's two timings, the second if it is no outlier, else the
    faster: a time slice lengthens a call, nothing shortens one."""
    if not isinstance(first, Timing) or not isinstance(second, Timing):
        return first
    if outlier(second, floor_us) is None:
        return second
    return min(first, second, key=lambda t: t.median_us)


def _doubt(row: BenchRow, roof: Roofline | None, *, timed_twice: Sequence[str]) -> None:
    """Record in ``row`` why a time is an outlier against its cost model, and why a
    % of limit is past what the machine allows: the figures to mark."""
    for impl, t in row.timings.items():
        if t is None:
            continue
        why = outlier(t, row.floor_us)
        if why:
            row.outliers[impl] = f"{impl} {'in both of two timings' if impl in timed_twice else 'timed once'}: {why}"
        beyond = roof.beyond(row, impl, t.median_us) if roof else None
        if beyond:
            row.beyond_limit[impl] = beyond


__all__ = [
    "BENCH_DTYPES",
    "IMPLS",
    "BenchReport",
    "BenchRow",
    "Comparison",
    "Timer",
    "Timing",
    "bench_op",
    "compare",
    "compute_bound",
    "count_cases",
    "default_dtypes",
    "input_sets",
    "largest_case",
    "new_report",
    "plot",
    "read_json",
    "repeat_until_stable",
    "time_fn",
    "time_interleaved",
    "write_csv",
    "write_json",
]
