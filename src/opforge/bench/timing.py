"""How ``opforge bench`` times a call: the timer, the stop rule, the input sets.

* GPU: CUDA events around each call on the current stream, the L2 cache flushed
  before each timed call (a buffer twice the L2 size is read), warm-up first.
  The GPU does not wait for Python between a start event and the call it times:
  a spin kernel between the flush and the start event keeps it busy while the
  host queues the call. Without it a host thread that takes the GIL now and then
  (torch.compile's worker pool, tqdm's monitor, alive after the checks of
  ``opforge run``) put that wait into some samples: 30-84 % spreads on ~35 us calls.
  ``graph=True`` replays the call from a CUDA graph, removing launch overhead.
* CPU: ``time.perf_counter`` around each call, warm-up first, no flush: the
  input sets rotated through fill twice the last-level cache, so each call
  reads its inputs from DRAM while the code it runs (torch's dispatcher and
  allocator as much as the kernel) stays in cache, as it does in a model,
  where every operator runs that code. A flush by reading a buffer evicts the
  code too: torch.add of one float32 element took 1.4 us in the rotation and
  21.4 us after one, and the 2^16-element cases measured mostly that cold
  start (benchmarks/experiments/cpu_flush.py).
* Stop rule: repetitions until the inter-quartile range is under 1 % of the
  median, or the time budget per case and side is spent; median and IQR kept.
* Inputs: fresh random data; when a case fits in the cache several input sets
  are rotated, so no call finds its inputs left in cache by an earlier one.
  All the sides of a case share one rotation: the set a call reads is the one
  least recently read by any side.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from opforge.check.values import expanded
from opforge.opspec import Sample

# Stop when the IQR is under 1 % of the median (the stability rule).
TARGET_SPREAD = 0.01
# Cycles of the spin kernel queued before each start event: about 100 us at an H200's clock,
# longer than queuing one call takes the host (opforge run's lltm_forward and qqq_gemm cases
# on an H200: spreads 32-84 % without it, 2.8-4.6 % with it; benchmarks/experiments/bench_timing.py
# measured the spin's own cost at 0.3-0.4 us).
_SPIN_CYCLES = 200_000
# A call whose host side takes longer (an operator that launches several kernels and calls
# cuBLAS through the dispatcher: lltm_backward) gets a spin this many times its measured
# host time, so that jitter on the host (another thread taking the GIL) still finds the
# GPU busy: see spin_cycles.
_SPIN_HOST_MARGIN = 3.0


def spin_cycles(host_us: float, cycles_per_us: float) -> int:
    """Cycles of the spin kernel queued before a call whose host side took
    ``host_us`` to queue it: at least ``_SPIN_CYCLES``, and long enough for
    the host to queue the call ``_SPIN_HOST_MARGIN`` times over."""
    return max(_SPIN_CYCLES, int(_SPIN_HOST_MARGIN * host_us * cycles_per_us))


# Input sets rotated on a GPU when a case fits in L2: enough that the set a call
# reads was last touched several calls (and one flush) ago.
_MAX_INPUT_SETS = 8
# On the CPU, where the rotation alone evicts them: enough to fill twice the
# last-level cache down to 64 KB inputs (32 MB L3: 2^16 float32 add takes 128 sets).
_MAX_CPU_INPUT_SETS = 1024


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
        self._cycles_per_us: float | None = None
        self._calls = 0  # one count for every side timed, so that they share the rotation
        if device.type == "cuda":
            self.l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size
        else:
            self.l2_bytes = _cpu_last_level_cache()
        # On a GPU, reading twice the L2 before each timed call evicts the
        # inputs: the op is timed from DRAM, as it runs inside a model. Read, not
        # written: zeroing the buffer (as this did until 2026-11-23) left the L2
        # full of dirty lines whose write-back the timed call then paid for,
        # several us for a call that reads ~32 MB (fp16 matmul at M=1, K=N=8192
        # on an H200: 46.6 us after a zeroing flush, 38.1 after a reading one;
        # benchmarks/experiments/qqq_flush.py).
        # The CPU has no flush: the input sets' rotation evicts (see the module's docstring).
        self._flush: torch.Tensor | None = None
        if device.type == "cuda":
            self._flush = torch.ones(max(2 * self.l2_bytes, 1 << 20) // 4, dtype=torch.float32, device=device)

    def flush(self) -> None:
        """Evict the GPU's L2: read the whole flush buffer (nothing on the CPU)."""
        if self._flush is not None:
            self._flush.sum()

    def cycles_per_us(self) -> float:
        """The spin kernel's cycles per microsecond on this GPU, measured once."""
        if self._cycles_per_us is None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(10 * _SPIN_CYCLES)
            end.record()
            end.synchronize()
            self._cycles_per_us = 10 * _SPIN_CYCLES / max(start.elapsed_time(end) * 1e3, 1e-3)
        return self._cycles_per_us

    def batch(self, call: Callable[[int], Any], *, host_us: float = 0.0) -> Callable[[int], list[float]]:
        """Timed calls of ``call``; ``host_us``: how long the host takes to queue one
        (on a GPU the spin before each start event covers it)."""

        def next_index() -> int:
            self._calls += 1
            return self._calls

        if self.device.type == "cuda":
            spin = spin_cycles(host_us, self.cycles_per_us())

            def run(k: int) -> list[float]:
                events = []
                for _ in range(k):
                    self.flush()
                    torch.cuda._sleep(spin)
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
    """The sample and, when it fits in the cache (``l2_bytes``: a GPU's L2, the
    CPU's last level) several times over, fresh copies of it: each tensor in
    new memory of its own layout, a floating one's values rolled (same values,
    new arrangement), an integer or bool one's (indices, offsets, ids, masks)
    kept as they are: rolled, a CSR offsets array would stop being monotone and
    an index would point elsewhere, inputs the spec never declared. On a GPU up to ``_MAX_INPUT_SETS``; on the CPU as many as
    fill twice the cache, up to ``_MAX_CPU_INPUT_SETS``."""
    size = _input_bytes(sample)
    if size == 0 or l2_bytes == 0 or size > l2_bytes:
        return [sample]
    on_gpu = any(isinstance(a, torch.Tensor) and a.device.type != "cpu" for a in sample.args)
    n = min(_MAX_INPUT_SETS if on_gpu else _MAX_CPU_INPUT_SETS, max(2, math.ceil(2 * l2_bytes / size)))
    sets = [sample]
    for _ in range(n - 1):
        args = tuple(_rolled_copy(a, gen) if isinstance(a, torch.Tensor) else a for a in sample.args)
        sets.append(Sample(args, sample.kwargs, sample.desc))
    return sets


def _rolled_copy(a: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """``a`` in new memory with its strides (a transposed or channels_last input
    stays one), a floating or complex one's values rolled by a random shift, an
    integer or bool one's as they are. An expanded tensor, whose elements share
    memory, is returned as it is: a copy could not keep its layout."""
    if a.numel() < 2 or expanded(a):
        return a
    moves = a.is_floating_point() or a.is_complex()
    shift = int(torch.randint(1, a.numel(), (1,), generator=gen, device=gen.device)) if moves else 0
    with torch.no_grad():
        copy = a.new_empty_strided(a.shape, a.stride())
        copy.copy_(a.reshape(-1).roll(shift).reshape(a.shape) if shift else a)
    return copy.requires_grad_(a.requires_grad)  # a leaf, as the sample's own tensor is


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
    host_us = (time.perf_counter() - t0) * 1e6  # queued, not yet run (on a GPU)
    timer.sync()
    # A call longer than a tenth of the budget (a large matmul on the CPU): one
    # warm-up less and 5 timed calls at least, not 10; the median of a few long
    # calls is as steady as that of many short ones, and the budget holds.
    long_calls = time.perf_counter() - t0 > budget_s / 10
    if not long_calls:
        t0 = time.perf_counter()
        call(2)
        host_us = max(host_us, (time.perf_counter() - t0) * 1e6)
        timer.sync()
    return timer.batch(call, host_us=host_us), 5 if long_calls else 10


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
