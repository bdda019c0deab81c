"""``opforge bench``: time each operator against PyTorch, on the same inputs,
after checking that it is right, and against what the machine can do.

* Verification first: every sample of the op against the float64 reference
  and every bad input of its spec, then each benchmark case's own output. A
  wrong kernel, or one that takes bad inputs without a word, is refused, never timed.
* GPU: CUDA events around each call on the current stream, the L2 cache flushed
  before each timed call (a buffer twice the L2 size is read), warm-up first.
  The GPU does not wait for Python between a start event and the call it times:
  queuing a call costs the host less than the flush before it takes on the GPU
  (benchmarks/bench_timing.py: batched, synchronised after each call and queued
  behind a spin kernel agree within 0.4 us on an H200, down to 2^14-element adds).
  ``graph=True`` replays the call from a CUDA graph, removing launch overhead.
* CPU: ``time.perf_counter`` around each call, warm-up first.
* Stop rule: repetitions until the inter-quartile range is under 1 % of the
  median, or the time budget per case and side is spent; median and IQR kept.
* Inputs: fresh random data; when a case fits in L2 several input sets are
  rotated, so no call finds its inputs left in cache by the previous one.
* Baselines side by side: the op's PyTorch reference eager and under
  ``torch.compile`` (if it compiles; if not, the reason is in the row).
* Limits: achieved GB/s and TFLOP/s from the op's cost model, and the fraction
  of the roofline floor from the machine's measured ceilings (``ceilings.py``).
"""

from __future__ import annotations

import csv
import datetime
import json
import math
import os
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from opforge.ceilings import Ceilings
from opforge.check import check_bad_inputs, check_reference, generator, run_reference
from opforge.spec import OpSpec, Sample

BENCH_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)
IMPLS: tuple[str, ...] = ("opforge", "eager", "compiled")

# Stop when the IQR is under 1 % of the median (the stability rule).
TARGET_SPREAD = 0.01
# Input sets rotated when a case fits in L2: enough that the set a call reads
# was last touched several calls (and one flush) ago.
_MAX_INPUT_SETS = 8


@dataclass
class Timing:
    """Per-call times in microseconds and why the repetitions stopped."""

    median_us: float
    p25_us: float
    p75_us: float
    reps: int
    stop: str  # "stable", "budget" or "max reps"

    @property
    def spread(self) -> float:
        """The inter-quartile range relative to the median."""
        return (self.p75_us - self.p25_us) / self.median_us if self.median_us > 0 else math.inf

    @classmethod
    def of(cls, samples_us: Sequence[float], stop: str) -> Timing:
        q = statistics.quantiles(samples_us, n=4, method="inclusive") if len(samples_us) >= 2 else [samples_us[0]] * 3
        return cls(statistics.median(samples_us), q[0], q[2], len(samples_us), stop)


_MAX_REPS = 100_000  # the stop rule's cap on timed calls per side (as before the sides took turns)


def repeat_until_stable(
    batch: Callable[[int], list[float]],
    *,
    budget_s: float,
    min_reps: int = 10,
    max_reps: int = _MAX_REPS,
    target_spread: float = TARGET_SPREAD,
    clock: Callable[[], float] = time.perf_counter,
    chunk: int = 10,
) -> Timing:
    """Calls ``batch(k)`` (k <= ``chunk`` timed calls, their times in us) until the
    spread of all samples is under ``target_spread``, the budget is spent or
    ``max_reps`` reached."""
    samples: list[float] = []
    deadline = clock() + budget_s
    while True:
        samples += batch(min(chunk, max_reps - len(samples)))
        stop = _stop_reason(samples, min_reps=min_reps, max_reps=max_reps, out_of_time=clock() >= deadline, target_spread=target_spread)
        if stop:
            return Timing.of(samples, stop)


def _stop_reason(samples: Sequence[float], *, min_reps: int, max_reps: int, out_of_time: bool, target_spread: float = TARGET_SPREAD) -> str:
    """The stop rule: "stable" once the spread is under target (after ``min_reps``),
    "max reps", or "budget" once out of time (after ``min_reps``); "" to go on."""
    if len(samples) >= min_reps and Timing.of(samples, "").spread < target_spread:
        return "stable"
    if len(samples) >= max_reps:
        return "max reps"
    if out_of_time and len(samples) >= min_reps:
        return "budget"
    return ""


class Timer:
    """Times ``call(i)`` (i: the input set to use) on one device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        if device.type == "cuda":
            self.l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size
        else:
            self.l2_bytes = _cpu_last_level_cache()
        # Reading twice the last-level cache before each timed call evicts the
        # inputs: the op is timed from DRAM, as it runs inside a model. Read, not
        # written: zeroing the buffer (as this did until 2026-11-23) left the L2
        # full of dirty lines whose write-back the timed call then paid for,
        # several us for a call that reads ~32 MB (fp16 matmul at M=1, K=N=8192
        # on an H200: 46.6 us after a zeroing flush, 38.1 after a reading one;
        # benchmarks/qqq_flush.py).
        self._flush = torch.ones(max(2 * self.l2_bytes, 1 << 20) // 4, dtype=torch.float32, device=device)

    def batch(self, call: Callable[[int], Any]) -> Callable[[int], list[float]]:
        counter = [0]

        def next_index() -> int:
            counter[0] += 1
            return counter[0]

        if self.device.type == "cuda":

            def run(k: int) -> list[float]:
                events = []
                for _ in range(k):
                    self._flush.sum()
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    call(next_index())
                    end.record()
                    events.append((start, end))
                torch.cuda.synchronize(self.device)
                return [s.elapsed_time(e) * 1e3 for s, e in events]

            return run

        def run_cpu(k: int) -> list[float]:
            out = []
            for _ in range(k):
                i = next_index()
                self._flush.sum()
                t0 = time.perf_counter()
                call(i)
                out.append((time.perf_counter() - t0) * 1e6)
            return out

        return run_cpu

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _cpu_last_level_cache() -> int:
    """Bytes of the largest CPU cache (sysfs), 32 MiB if it cannot be read."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = f.read_text().strip()
            sizes.append(int(text[:-1]) * {"K": 1 << 10, "M": 1 << 20}[text[-1]] if text[-1] in "KM" else int(text))
        except (OSError, ValueError):
            continue
    return max(sizes, default=32 << 20)


def _input_bytes(sample: Sample) -> int:
    return sum(a.numel() * a.element_size() for a in sample.args if isinstance(a, torch.Tensor))


def input_sets(sample: Sample, l2_bytes: int, gen: torch.Generator) -> list[Sample]:
    """The sample and, when it fits in L2 several times over, fresh copies of it:
    each tensor's values permuted (same distribution, new arrangement)."""
    size = _input_bytes(sample)
    if size == 0 or l2_bytes == 0 or size > l2_bytes:
        return [sample]
    n = min(_MAX_INPUT_SETS, max(2, math.ceil(2 * l2_bytes / size)))
    sets = [sample]
    for _ in range(n - 1):
        args = []
        for a in sample.args:
            if isinstance(a, torch.Tensor) and a.is_contiguous() and a.numel() > 0:
                perm = torch.randperm(a.numel(), generator=gen, device=gen.device).to(a.device)
                a = a.reshape(-1)[perm].reshape(a.shape)
            args.append(a)
        sets.append(Sample(tuple(args), sample.kwargs, sample.desc))
    return sets


def _graphed(fn: Callable[..., Any], sets: Sequence[Sample]) -> Callable[[int], Any]:
    """One CUDA graph per input set, each replaying a single call."""
    graphs = []
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for s in sets:
            for _ in range(3):  # warm-up outside capture: allocator, compile, lazy init
                fn(*s.args, **s.kwargs)
    torch.cuda.current_stream().wait_stream(side)
    for s in sets:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn(*s.args, **s.kwargs)
        graphs.append(g)
    return lambda i: graphs[i % len(graphs)].replay()


def _prepared(
    fn: Callable[..., Any], sets: Sequence[Sample], timer: Timer, *, budget_s: float, graph: bool
) -> tuple[Callable[[int], list[float]], int]:
    """``fn`` warmed up and ready to time: its batch of timed calls, and the
    calls a batch makes."""
    if graph:
        call = _graphed(fn, sets)
    else:

        def call(i: int) -> Any:
            s = sets[i % len(sets)]
            return fn(*s.args, **s.kwargs)

    call(0)  # warm-up: allocator, compile, lazy init
    timer.sync()
    t0 = time.perf_counter()
    call(1)
    timer.sync()
    # A call longer than a tenth of the budget (a large matmul on the CPU): one
    # warm-up less and 5 timed calls at least, not 10; the median of a few long
    # calls is as steady as that of many short ones, and the budget holds.
    long_calls = time.perf_counter() - t0 > budget_s / 10
    if not long_calls:
        call(2)
        timer.sync()
    return timer.batch(call), 5 if long_calls else 10


def time_fn(fn: Callable[..., Any], sets: Sequence[Sample], timer: Timer, *, budget_s: float, graph: bool) -> Timing:
    batch, reps = _prepared(fn, sets, timer, budget_s=budget_s, graph=graph)
    return repeat_until_stable(batch, budget_s=budget_s, min_reps=reps, chunk=reps)


def time_interleaved(
    sides: dict[str, tuple[Callable[..., Any], Sequence[Sample]]], timer: Timer, *, budget_s: float, graph: bool
) -> dict[str, Timing | Exception]:
    """Times several implementations of one case in turns, a batch of each
    in rotation, each under ``repeat_until_stable``'s rule with a budget of
    its own: a machine that speeds up or slows down while they are timed (a
    shared CPU's neighbours, clocks) moves all of them, not the one that ran
    then. Timed one after the other on a 2-core VM, torch's and opforge's
    memory-bound float32 kernels at 2^20 came out 0.78-1.01x apart from run to
    run; in turns, 0.98-1.02x. A side whose warm-up or timing raises gets the
    exception instead of a Timing."""
    results: dict[str, Timing | Exception] = {}
    running: dict[str, tuple[Callable[[int], list[float]], int]] = {}
    for name, (fn, sets) in sides.items():
        try:
            running[name] = _prepared(fn, sets, timer, budget_s=budget_s, graph=graph)
        except Exception as exc:  # noqa: BLE001 - a baseline that fails is reported in its row; the caller re-raises opforge's
            results[name] = exc
    samples: dict[str, list[float]] = {name: [] for name in running}
    spent = dict.fromkeys(running, 0.0)
    while running:
        for name, (batch, reps) in list(running.items()):
            t0 = time.perf_counter()
            try:
                samples[name] += batch(reps)
            except Exception as exc:  # noqa: BLE001 - as above
                results[name] = exc
                del running[name]
                continue
            spent[name] += time.perf_counter() - t0
            stop = _stop_reason(samples[name], min_reps=reps, max_reps=_MAX_REPS, out_of_time=spent[name] >= budget_s)
            if stop:
                results[name] = Timing.of(samples[name], stop)
                del running[name]
    return results


@dataclass
class BenchRow:
    op: str
    dtype: str
    case: str
    status: str  # "ok" or why it was not timed
    numel: int = 0
    bytes: int = 0
    flops: int = 0
    timings: dict[str, Timing | None] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)  # impl -> why it has no timing
    floor_us: float | None = None

    def median(self, impl: str) -> float | None:
        t = self.timings.get(impl)
        return t.median_us if t else None

    def speedup(self, baseline: str) -> float | None:
        """How many times faster opforge is than ``baseline``."""
        ours, theirs = self.median("opforge"), self.median(baseline)
        return theirs / ours if ours and theirs else None

    def gbps(self, impl: str) -> float | None:
        m = self.median(impl)
        return self.bytes / (m * 1e3) if m else None

    def tflops(self, impl: str) -> float | None:
        m = self.median(impl)
        return self.flops / (m * 1e6) if m else None

    def pct_of_limit(self, impl: str) -> float | None:
        """Roofline floor over measured time: 100 % means at the machine's limit."""
        m = self.median(impl)
        return 100 * self.floor_us / m if m and self.floor_us else None


@dataclass
class BenchReport:
    device: str
    device_name: str
    driver: str | None
    torch_version: str
    cuda_version: str | None
    threads: int
    git_commit: str | None
    date: str
    graph: bool = False
    ceilings: dict[str, Any] | None = None
    rows: list[BenchRow] = field(default_factory=list)
    # Why the timings may not be the machine's (a busy CPU), said before them.
    warnings: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        for row, out in zip(self.rows, d["rows"], strict=True):
            out["derived"] = {
                impl: {
                    "gbps": row.gbps(impl),
                    "tflops": row.tflops(impl),
                    "pct_of_limit": row.pct_of_limit(impl),
                    "speedup_of_opforge": row.speedup(impl) if impl != "opforge" else None,
                }
                for impl in row.timings
            }
        return d


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    from opforge.machine import cpu_name

    return cpu_name()


def _driver_version(device: torch.device) -> str | None:
    if device.type != "cuda":
        return None
    from opforge import nvml

    found = nvml.query()
    return found[1] if found else None


def _git_commit() -> str | None:
    """The checkout's commit; OPFORGE_GIT_COMMIT where the tree is a copy without .git."""
    if os.environ.get("OPFORGE_GIT_COMMIT"):
        return os.environ["OPFORGE_GIT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, cwd=Path(__file__).parent, timeout=5)
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def busy_machine(load_1min: float, usable_cores: int, threads: int) -> str | None:
    """Why CPU timings taken now would measure waiting for the CPU, or None.

    torch running more threads than the process may use cores, or other work
    wanting the cores the bench's own threads need: the 1-minute load average
    above the usable cores less those threads, plus one for this process,
    which the load average counts while it probes. On a loaded 2-core machine
    every size then took ~8 ms per call, with an IQR under 1 %: a time slice,
    not the kernel."""
    if threads > usable_cores:
        return (
            f"torch runs {threads} threads on {usable_cores} usable cores: they take turns, so the CPU timings measure the "
            f"waiting (torch.set_num_threads({usable_cores}), or OMP_NUM_THREADS={usable_cores})"
        )
    if load_1min > usable_cores - threads + 1:
        return (
            f"the machine is busy: load average {load_1min:.1f} over the last minute on {usable_cores} usable cores, "
            f"and the bench runs {threads} threads of its own, so the CPU timings include waiting for a core; "
            "measure on an idle machine"
        )
    return None


def cpu_contention() -> str | None:
    """``busy_machine`` for this process now; None where the load average cannot be read."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return None
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return busy_machine(load, usable, torch.get_num_threads())


def new_report(device: torch.device, *, graph: bool = False, ceilings: Ceilings | None = None) -> BenchReport:
    busy = cpu_contention() if device.type == "cpu" else None
    return BenchReport(
        device=str(device),
        device_name=_device_name(device),
        driver=_driver_version(device),
        torch_version=torch.__version__,
        cuda_version=torch.version.cuda,
        threads=torch.get_num_threads(),
        git_commit=_git_commit(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        graph=graph,
        ceilings=asdict(ceilings) if ceilings else None,
        warnings=[busy] if busy else [],
    )


def _compiled(spec: OpSpec) -> Callable[..., Any]:
    """The reference compiled for one case's shapes. Dynamo's caches are reset
    first: with one compiled function for every size, the second size
    recompiles it with dynamic shapes, whose generic kernels trailed eager by up
    to 2x at 2^28 elements (H200, the issue-3 sweep), and past the recompile
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
    ceilings: Ceilings | None = None,
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
    False. ``on_row`` is called with each row as soon as it is measured."""
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
            if ceilings:
                row.floor_us = ceilings.floor_us(cost.bytes, cost.flops, dname)
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
            timed = time_interleaved(sides, timer, budget_s=budget_s, graph=graph and device.type == "cuda")
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
            rows.append(row)
            on_row(row)
            del sets
    return rows


# --- writers, readers, comparison, plot ---

CSV_FIELDS = ("op", "dtype", "case", "impl", "status", "numel", "bytes", "flops", "median_us", "p25_us", "p75_us", "reps", "stop",
              "gbps", "tflops", "pct_of_limit", "note")  # fmt: skip


def write_json(report: BenchReport, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report.to_json(), indent=1) + "\n")


def write_csv(report: BenchReport, path: Path) -> None:
    """One line per (row, implementation); the header comment carries the machine."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as fh:
        fh.write(f"# {report.device_name}, driver {report.driver}, torch {report.torch_version}, CUDA {report.cuda_version}, "
                 f"commit {report.git_commit}, {report.date}, graph={report.graph}\n")  # fmt: skip
        w = csv.DictWriter(fh, fieldnames=CSV_FIELDS)
        w.writeheader()
        for r in report.rows:
            for impl in r.timings or {"-": None}:
                t = r.timings.get(impl)
                w.writerow({
                    "op": r.op, "dtype": r.dtype, "case": r.case, "impl": impl, "status": r.status, "numel": r.numel,
                    "bytes": r.bytes, "flops": r.flops, "median_us": t.median_us if t else "", "p25_us": t.p25_us if t else "",
                    "p75_us": t.p75_us if t else "", "reps": t.reps if t else "", "stop": t.stop if t else "",
                    "gbps": r.gbps(impl) or "", "tflops": r.tflops(impl) or "", "pct_of_limit": r.pct_of_limit(impl) or "",
                    "note": r.notes.get(impl, ""),
                })  # fmt: skip


def read_json(path: Path) -> BenchReport:
    d = json.loads(path.read_text())
    rows = []
    for r in d.pop("rows"):
        r.pop("derived", None)
        r["timings"] = {k: Timing(**t) if t else None for k, t in r.get("timings", {}).items()}
        rows.append(BenchRow(**r))
    return BenchReport(**d, rows=rows)


@dataclass
class Comparison:
    op: str
    dtype: str
    case: str
    impl: str
    old_us: float
    new_us: float
    verdict: str  # "regression", "faster" or "same"

    @property
    def ratio(self) -> float:
        """New time over old: above 1 is slower."""
        return self.new_us / self.old_us


def compare(old: BenchReport, new: BenchReport, impls: Sequence[str] = ("opforge",)) -> list[Comparison]:
    """Matches rows by (op, dtype, case). A change counts only beyond the
    measured spread: the two inter-quartile ranges must not overlap."""
    before = {(r.op, r.dtype, r.case): r for r in old.rows if r.status == "ok"}
    out = []
    for r in new.rows:
        o = before.get((r.op, r.dtype, r.case))
        if r.status != "ok" or o is None:
            continue
        for impl in impls:
            a, b = o.timings.get(impl), r.timings.get(impl)
            if not a or not b:
                continue
            if b.p25_us > a.p75_us:
                verdict = "regression"
            elif b.p75_us < a.p25_us:
                verdict = "faster"
            else:
                verdict = "same"
            out.append(Comparison(r.op, r.dtype, r.case, impl, a.median_us, b.median_us, verdict))
    return out


def compute_bound(rows: Sequence[BenchRow]) -> bool:
    """More than one FLOP per byte moved (a matmul): measured in TFLOP/s, not GB/s."""
    return bool(rows) and all(r.bytes > 0 and r.flops >= r.bytes for r in rows)


def plot(report: BenchReport, path: Path) -> None:
    """Per op and dtype: bandwidth against size for streaming ops, with the
    measured copy bandwidth as the ceiling; TFLOP/s per case (bars) for
    compute-bound ops, with the measured matmul ceiling of the dtype."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report.rows if r.status == "ok"]
    ops = list(dict.fromkeys(r.op for r in rows))
    dtypes = list(dict.fromkeys(r.dtype for r in rows))
    if not ops:
        return
    bound = {op: compute_bound([r for r in rows if r.op == op]) for op in ops}
    # Streaming ops share one size axis; a compute-bound op's axis is its cases.
    share = not any(bound.values())
    fig, axes = plt.subplots(len(ops), len(dtypes), figsize=(4.2 * len(dtypes), 3.0 * len(ops)), squeeze=False, sharex=share)
    styles = {"opforge": ("tab:red", "o"), "eager": ("tab:blue", "s"), "compiled": ("tab:green", "^")}
    for i, op in enumerate(ops):
        flops_axis = bound[op]
        for j, dt in enumerate(dtypes):
            ax = axes[i][j]
            sel = [r for r in rows if r.op == op and r.dtype == dt]
            if flops_axis:
                _plot_tflops(ax, sel, styles, report.ceilings, dt)  # the spec's order of cases
            else:
                sel.sort(key=lambda r: r.numel)
                for impl, (colour, marker) in styles.items():
                    pts = [(r.numel, r.gbps(impl)) for r in sel if r.gbps(impl)]
                    if pts:
                        ax.plot(*zip(*pts, strict=True), color=colour, marker=marker, markersize=3, label=impl)
                if report.ceilings:
                    ax.axhline(report.ceilings["copy_gbps"], color="black", linestyle="--", linewidth=1, label="copy ceiling")
                ax.set_xscale("log", base=2)
                if j == 0:
                    ax.set_ylabel("GB/s")
                if i == len(ops) - 1:
                    ax.set_xlabel("elements")
            ax.set_title(f"{op} {dt}", fontsize=9)
            ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(
        f"opforge bench: {report.device_name}, torch {report.torch_version}, {report.date[:10]}" + (", CUDA graphs" if report.graph else "")
    )
    fig.tight_layout(rect=(0, 0, 1, 0.98))  # leave the suptitle its own band
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_tflops(
    ax: Any, rows: Sequence[BenchRow], styles: dict[str, tuple[str, str]], ceilings: dict[str, Any] | None, dtype: str
) -> None:
    """Grouped bars: one group per case, one bar per implementation."""
    width = 0.8 / len(styles)
    for k, (impl, (colour, _)) in enumerate(styles.items()):
        heights = [r.tflops(impl) or 0.0 for r in rows]
        ax.bar([x + (k - 1) * width for x in range(len(rows))], heights, width, color=colour, label=impl)
    rate = (ceilings or {}).get("matmul_tflops", {}).get(dtype)
    if rate:
        ax.axhline(rate, color="black", linestyle="--", linewidth=1, label="matmul ceiling")
    ax.set_xticks(range(len(rows)), [r.case for r in rows], rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("TFLOP/s")


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
